"""The math every architecture composes, written once in torch (any device).

Shapes: T tokens in the batch, D model width, H query heads, Hkv KV heads, hd head dim.
Each function says which llama.cpp graph op it must agree with.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from engine.kernels.simd import hsum_f32, load_f32x8, vadd, vfma, zero_f32


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., n] -> x / sqrt(mean(x²) + eps) * w  (ggml_rms_norm then ggml_mul)."""
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * w if w is not None else y


def rope_theta(positions: np.ndarray, rope_dim: int, base: float, scale: float = 1.0) -> np.ndarray:
    """Rotation angles float32 [T, rope_dim/2] for integer ``positions`` [T].

    As ggml_rope: theta_i = p · s^i computed by repeated float32 multiplication with
    s = base^(-2/rope_dim), positions divided by the linear scaling factor. Llama-3 frequency
    factors (``rope_freqs``) divide theta afterwards (see DecoderModel._rope).
    """
    half = rope_dim // 2
    s = np.float32(base) ** np.float32(-2.0 / rope_dim)
    p = np.asarray(positions, dtype=np.float32) * np.float32(1.0 / scale)  # [T]
    steps = np.concatenate([[np.float32(1)], np.full(half - 1, s, dtype=np.float32)])
    theta = np.cumprod(np.broadcast_to(steps, (len(p), half)).copy(), axis=1, dtype=np.float32)
    return theta * p[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x [T, heads, hd]; rotate the first rope_dim dims. NEOX pairs (i, i+rd/2); normal pairs (2i, 2i+1)."""
    rd = cos.shape[-1] * 2
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, rd/2]
    xr, rest = x[..., :rd], x[..., rd:]
    if neox:
        x0, x1 = xr[..., : rd // 2], xr[..., rd // 2 :]
        out = torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    else:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal GQA attention of T new queries over all cached positions.

    q [T, H, hd] at positions start..start+T-1; k, v [P, Hkv, hd] for positions 0..P-1
    (P = start + T). Returns [T, H*hd]. Softmax in float32 with scale 1/sqrt(hd)
    (llama.cpp's build_attn_mha with kq_scale).
    """
    T, H, hd = q.shape
    P, Hkv = k.shape[0], k.shape[1]
    g = H // Hkv
    qh = q.reshape(T, Hkv, g, hd).permute(1, 2, 0, 3)  # [Hkv, g, T, hd]
    kh = k.permute(1, 2, 0)[:, None]  # [Hkv, 1, hd, P]
    vh = v.permute(1, 0, 2)[:, None]  # [Hkv, 1, P, hd]
    scores = torch.matmul(qh, kh) * (1.0 / float(hd) ** 0.5)  # [Hkv, g, T, P]
    if T > 1 or start + T < P:
        qpos = torch.arange(start, start + T, device=q.device)[:, None]
        kpos = torch.arange(P, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vh)  # [Hkv, g, T, hd]
    return out.permute(2, 0, 1, 3).reshape(T, H * hd)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up (ggml_swiglu_split)."""
    return torch.nn.functional.silu(gate) * up


def route_softmax_topk(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (ids int64 [T, k], weights float32 [T, k]).

    softmax over all experts, top-k by probability, optionally renormalised to sum 1
    (llama.cpp build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX, norm_w).
    """
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


# --- host decode (T = 1) in numba: the same math with one call per step --------------------------
# The torch functions above are the reference for every device; these serve one token on the host,
# where per-op torch dispatch (~60 small ops per layer) would cost more than the weights' reading.
# Each follows the same ggml op as its torch twin; tests/test_host_decode.py holds them together.


@njit(cache=True, nogil=True)
def rms_norm_host(x, w, eps):
    """x float32 [n], w float32 [n] (or [0]: no weight) -> float32 [n] (ggml_rms_norm, ggml_mul).

    As ggml: the sum of squares in float64, mean and scale in float32."""
    n = x.shape[0]
    s = 0.0
    for i in range(n):
        s += np.float64(x[i] * x[i])
    scale = np.float32(1.0) / np.sqrt(np.float32(s / n) + np.float32(eps))
    y = np.empty(n, np.float32)
    if w.shape[0]:
        for i in range(n):
            y[i] = x[i] * scale * w[i]
    else:
        for i in range(n):
            y[i] = x[i] * scale
    return y


@njit(cache=True, nogil=True)
def _norm_heads(x, w, heads, hd, eps):
    """In place: RMS norm of each of ``heads`` slices of length hd (weights w [hd])."""
    for h in range(heads):
        x[h * hd : (h + 1) * hd] = rms_norm_host(x[h * hd : (h + 1) * hd], w, eps)


@njit(cache=True, nogil=True)
def _rope_heads(x, heads, hd, cos, sin, neox):
    """In place: rotate the first 2·len(cos) dims of each head (apply_rope for one position)."""
    half = cos.shape[0]
    for h in range(heads):
        o = h * hd
        for i in range(half):
            if neox:
                a, b = o + i, o + i + half
            else:
                a, b = o + 2 * i, o + 2 * i + 1
            x0, x1 = x[a], x[b]
            x[a] = x0 * cos[i] - x1 * sin[i]
            x[b] = x0 * sin[i] + x1 * cos[i]


@njit(cache=True, nogil=True)
def qk_norm_rope_host(q, k, q_norm, k_norm, qk_norm, eps, cos, sin, neox, H, Hkv, hd):
    """One position's q [H·hd] and k [Hkv·hd], in place: optional RMS norm (qk_norm 0 none,
    1 per head "head", 2 whole projection "proj"), then RoPE with cos, sin float32 [rope_dim/2]."""
    if qk_norm == 2:
        q[:] = rms_norm_host(q, q_norm, eps)
        k[:] = rms_norm_host(k, k_norm, eps)
    elif qk_norm == 1:
        _norm_heads(q, q_norm, H, hd, eps)
        _norm_heads(k, k_norm, Hkv, hd, eps)
    _rope_heads(q, H, hd, cos, sin, neox)
    _rope_heads(k, Hkv, hd, cos, sin, neox)


@njit(cache=True, nogil=True, inline="always")
def _dot_f32(a, ao, b, bo, n):
    """Σ a[ao:ao+n]·b[bo:bo+n] (n a multiple of 16) on two 8-lane accumulators."""
    a0 = zero_f32()
    a1 = zero_f32()
    for d in range(0, n, 16):
        a0 = vfma(load_f32x8(a, ao + d), load_f32x8(b, bo + d), a0)
        a1 = vfma(load_f32x8(a, ao + d + 8), load_f32x8(b, bo + d + 8), a1)
    return hsum_f32(vadd(a0, a1))


@njit(cache=True, nogil=True, parallel=True)
def attention_host(q, K, V, P, H, Hkv, hd):
    """One query over positions 0..P-1: q float32 [H·hd]; K, V float32 [≥P, Hkv·hd] (the cache)
    -> float32 [H·hd]. Softmax of q·k/sqrt(hd) in float32, as ``attention``. Each K/V row is read
    once for the g = H/Hkv query heads sharing it; KV heads run in parallel. hd % 16 == 0."""
    g = H // Hkv
    scale = np.float32(1.0 / np.sqrt(np.float64(hd)))
    out = np.empty(H * hd, np.float32)
    for kh in prange(Hkv):
        ko = kh * hd
        s = np.empty((g, P), np.float32)
        for p in range(P):
            krow = K[p]
            for j in range(g):
                s[j, p] = _dot_f32(q, (kh * g + j) * hd, krow, ko, hd) * scale
        for j in range(g):
            m = s[j, 0]
            for p in range(1, P):
                m = max(m, s[j, p])
            tot = np.float32(0.0)
            for p in range(P):
                e = np.exp(s[j, p] - m)
                s[j, p] = e
                tot += e
            inv = np.float32(1.0) / tot
            for p in range(P):
                s[j, p] *= inv
        acc = np.zeros((g, hd), np.float32)
        for p in range(P):
            vrow = V[p, ko : ko + hd]
            for j in range(g):
                w = s[j, p]
                a = acc[j]
                for d in range(hd):
                    a[d] += w * vrow[d]
        for j in range(g):
            out[(kh * g + j) * hd : (kh * g + j + 1) * hd] = acc[j]
    return out


@njit(cache=True, nogil=True)
def route_host(logits, k, renormalise):
    """Router logits float32 [E] -> (ids int64 [k], weights float32 [k]): softmax, top-k by
    probability (descending; lower id first on ties), optionally renormalised (route_softmax_topk)."""
    E = logits.shape[0]
    m = logits.max()
    p = np.empty(E, np.float32)
    tot = np.float32(0.0)
    for e in range(E):
        p[e] = np.exp(logits[e] - m)
        tot += p[e]
    for e in range(E):
        p[e] = p[e] / tot
    order = np.argsort(-p, kind="mergesort")  # stable: ties keep the lower id first
    ids = order[:k].astype(np.int64)
    w = np.empty(k, np.float32)
    for j in range(k):
        w[j] = p[ids[j]]
    if renormalise:
        sw = np.float32(0.0)
        for j in range(k):
            sw += w[j]
        for j in range(k):
            w[j] = w[j] / sw
    return ids, w
