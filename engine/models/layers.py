"""The math every architecture composes, written once in torch (any device).

Shapes: T tokens in the batch, D model width, H query heads, Hkv KV heads, hd head dim.
Each function says which llama.cpp graph op it must agree with. Their numba twins for the
host (``*_host`` / ``*_rows`` in :mod:`engine.kernels.host_layers`) follow the same ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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


@dataclass(frozen=True)
class YaRN:
    """YaRN RoPE scaling as ggml's ``rope_yarn`` applies it (``ggml_rope_ext`` with ext_factor ≠ 0): each pair's
    angle mixes the interpolated p·θ_i/factor and the extrapolated p·θ_i by a ramp over the pairs between the
    correction dims of ``beta_fast`` and ``beta_slow`` (``ggml_rope_yarn_corr_dims`` for the original
    context ``n_ctx_orig``), and cos and sin are scaled by ``attn_factor``·(1 + 0.1·ln factor)."""

    factor: float  # 1 / freq_scale
    n_ctx_orig: int
    ext_factor: float = 1.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def corr_dims(self, rope_dim: int, base: float) -> tuple[float, float]:
        """ggml_rope_yarn_corr_dims: the first and last pair index of the ramp (float32 as ggml)."""

        def dim(n_rot: float) -> float:
            num = np.float32(rope_dim) * np.log(np.float32(self.n_ctx_orig / (n_rot * 2 * np.pi)), dtype=np.float32)
            return float(num / (np.float32(2) * np.log(np.float32(base), dtype=np.float32)))

        start, end = np.floor(dim(self.beta_fast)), np.ceil(dim(self.beta_slow))
        return max(0.0, float(start)), min(rope_dim - 1.0, float(end))

    def angles(self, positions: np.ndarray, rope_dim: int, base: float) -> tuple[np.ndarray, np.float32]:
        """(θ float32 [T, rope_dim/2], the cos/sin scale) for integer ``positions``."""
        theta_extrap = rope_theta(positions, rope_dim, base, 1.0)  # [T, half]
        freq_scale = np.float32(1.0 / self.factor)
        theta_interp = freq_scale * theta_extrap
        mscale = np.float32(self.attn_factor)
        if self.ext_factor == 0.0:
            return theta_interp, mscale
        low, high = self.corr_dims(rope_dim, base)
        i = np.arange(rope_dim // 2, dtype=np.float32)
        y = (i - np.float32(low)) / np.float32(max(0.001, high - low))
        ramp = (np.float32(1) - np.minimum(np.float32(1), np.maximum(np.float32(0), y))) * np.float32(self.ext_factor)
        theta = theta_interp * (np.float32(1) - ramp) + theta_extrap * ramp
        mscale = mscale * (np.float32(1) + np.float32(0.1) * np.log(np.float32(1) / freq_scale, dtype=np.float32))
        return theta.astype(np.float32), np.float32(mscale)


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


# Bytes of float32 attention scores one pass of :func:`attention` materialises at most: a long prompt's
# queries are taken in row blocks so that its scores never need n_head × T × P floats at once (a
# 512-token chunk at position 32k would be 2 GiB). engine.plan.sizing prices 3× this (scores, masked
# scores, probabilities) in the device scratch.
ATTN_SCORE_BYTES = 32 << 20


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int = 0,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    k_start: int = 0,
) -> torch.Tensor:
    """Causal GQA attention of T new queries over all cached positions.

    q [T, H, hd] at positions start..start+T-1; k, v [P, Hkv, hd] for positions k_start..k_start+P-1
    (k_start + P = start + T; k_start > 0: a sliding window's ring gave only the positions it sees). Returns [T, H*hd]. Softmax in float32 with scale 1/sqrt(hd), or ``scale``
    (llama.cpp's build_attn_mha with kq_scale). ``window`` > 0: a sliding window, the query at p
    sees the keys at p − window < p' ≤ p (llama.cpp's LLAMA_SWA_TYPE_STANDARD masks p − p' ≥ window).
    Queries go in row blocks whose scores fit :data:`ATTN_SCORE_BYTES` (each row's softmax is its
    own, so the blocks change nothing). ``sinks`` float32 [H]: each head's learned sink logit, a column in the
    softmax that takes probability but adds no value (gpt-oss: ggml_soft_max_add_sinks).
    """
    T, H, hd = q.shape
    P = k.shape[0]
    rows = max(1, ATTN_SCORE_BYTES // (4 * H * P))
    if rows >= T:
        return _attention_rows(q, k, v, start, window, scale, sinks, k_start)
    return torch.cat(
        [_attention_rows(q[i : i + rows], k, v, start + i, window, scale, sinks, k_start) for i in range(0, T, rows)]
    )


def _unseen(start: int, T: int, P: int, window: int, device, k_start: int = 0) -> torch.Tensor:
    """bool [T, P]: which keys (positions k_start … k_start+P−1) the queries at start … start+T−1 may not see —
    later positions, and with a ``window`` those window or more behind (llama.cpp's causal and
    LLAMA_SWA_TYPE_STANDARD masks)."""
    qpos = torch.arange(start, start + T, device=device)[:, None]
    kpos = torch.arange(k_start, k_start + P, device=device)[None, :]
    masked = kpos > qpos
    if window:
        masked = masked | (qpos - kpos >= window)
    return masked


def _attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int = 0,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    k_start: int = 0,
) -> torch.Tensor:
    """:func:`attention` of one block of queries (positions start.. start+T-1) over k, v [P, Hkv, hd] of
    positions k_start … k_start+P−1."""
    T, H, hd = q.shape
    P, Hkv = k.shape[0], k.shape[1]
    g = H // Hkv
    qh = q.reshape(T, Hkv, g, hd).permute(1, 2, 0, 3)  # [Hkv, g, T, hd]
    kh = k.permute(1, 2, 0)[:, None]  # [Hkv, 1, hd, P]
    vh = v.permute(1, 0, 2)[:, None]  # [Hkv, 1, P, hd]
    scores = torch.matmul(qh, kh) * (1.0 / float(hd) ** 0.5 if scale is None else scale)  # [Hkv, g, T, P]
    if T > 1 or start + T < k_start + P or (window and window < P):
        scores = scores.masked_fill(_unseen(start, T, P, window, q.device, k_start), float("-inf"))
    probs = softmax_sinks(scores, sinks)
    out = torch.matmul(probs, vh)  # [Hkv, g, T, hd]
    return out.permute(2, 0, 1, 3).reshape(T, H * hd)


def attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int = 0,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    k_start: int = 0,
) -> torch.Tensor:
    """:func:`attention` in torch's ``scaled_dot_product_attention`` (float32 in, float32 softmax: on CUDA
    its memory-efficient kernel, no scores materialised; on the CPU its flash kernel): equal up to float32
    rounding. K and V are widened to the H query heads first (the kernels' GQA needs half precision); where
    those copies would outgrow the scratch priced for :func:`attention`'s scores (3 × :data:`ATTN_SCORE_BYTES`,
    a long context), and where the heads have ``sinks`` (torch's kernels have no sink column), :func:`attention`
    serves."""
    T, H, hd = q.shape
    P, Hkv = k.shape[0], k.shape[1]
    if sinks is not None or 2 * H * P * hd * k.element_size() > 3 * ATTN_SCORE_BYTES:
        return attention(q, k, v, start, window, scale, sinks, k_start)
    g = H // Hkv
    kh = k.permute(1, 0, 2)[:, None].expand(Hkv, g, P, hd).reshape(1, H, P, hd)
    vh = v.permute(1, 0, 2)[:, None].expand(Hkv, g, P, hd).reshape(1, H, P, hd)
    qh = q.permute(1, 0, 2)[None]  # [1, H, T, hd]
    s = 1.0 / float(hd) ** 0.5 if scale is None else scale
    if start == 0 and T == P and not (window and window < P):
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=s)
    else:
        seen = ~_unseen(start, T, P, window, q.device, k_start)
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen, scale=s)
    return out[0].permute(1, 0, 2).reshape(T, H * hd)


def rms_norm_fused(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:func:`rms_norm` as torch's one fused op (one kernel on CUDA instead of six): the static
    decode step's norm; equal to :func:`rms_norm` up to float32 rounding."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps)


def rope_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int, neox: bool):
    """Full-width rotation tables for :func:`apply_rope_table` from cos, sin [P, rope_dim/2]:
    (COS [P, hd], SIN [P, hd] signed, perm int64 [hd]) such that x·COS + x[..., perm]·SIN is
    :func:`apply_rope` exactly (the same products, sums commuted); dims past rope_dim pass
    through (COS 1, SIN 0, perm identity)."""
    P, half = cos.shape
    rd, dev = 2 * half, cos.device
    one = torch.ones(P, head_dim - rd, dtype=cos.dtype, device=dev)
    zero = torch.zeros_like(one)
    rest = torch.arange(rd, head_dim, device=dev)
    i = torch.arange(half, device=dev)
    if neox:  # pairs (i, i + rd/2): out_i = x_i c - x_{i+h} s, out_{i+h} = x_{i+h} c + x_i s
        C, S = torch.cat([cos, cos, one], 1), torch.cat([-sin, sin, zero], 1)
        perm = torch.cat([i + half, i, rest])
    else:  # pairs (2i, 2i+1)
        C = torch.cat([torch.stack([cos, cos], -1).flatten(1), one], 1)
        S = torch.cat([torch.stack([-sin, sin], -1).flatten(1), zero], 1)
        perm = torch.cat([torch.stack([2 * i + 1, 2 * i], -1).flatten(), rest])
    return C.contiguous(), S.contiguous(), perm


def apply_rope_table(x: torch.Tensor, C: torch.Tensor, S: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd] rotated with :func:`rope_tables` rows C, S [T, hd] (four kernels)."""
    return x * C[:, None, :] + x.index_select(-1, perm) * S[:, None, :]


def attention_static(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`attention` for one query over a static length (CUDA graphs): positions masked by
    ``bias`` float32 [L] (0 where a position is attended, -inf where not: past the query, outside its window).

    q [1, H, hd]; k, v [L, Hkv, hd] (rows masked may hold anything finite, in any order: a sliding window's
    ring). Returns [1, H*hd]. The masked positions add exact zeros to the softmax and to probs·V, so this
    equals :func:`attention` over the attended positions up to the order of float32 sums. Scale (None:
    1/sqrt(hd)) and mask ride on the score GEMM (baddbmm): four kernels in all; ``sinks`` float32 [H]: each
    head's sink logit joins the softmax as a column and takes no value (:func:`attention`'s).
    """
    T, H, hd = q.shape
    L, Hkv = k.shape[0], k.shape[1]
    g = H // Hkv
    qh = q.reshape(Hkv, g, hd)  # T = 1
    alpha = 1.0 / float(hd) ** 0.5 if scale is None else scale
    scores = torch.baddbmm(bias.expand(Hkv, g, L), qh, k.permute(1, 2, 0), alpha=alpha)
    probs = softmax_sinks(scores, sinks)  # [Hkv, g, L]
    return torch.bmm(probs, v.permute(1, 0, 2)).reshape(T, H * hd)  # [Hkv, g, hd] -> [1, H*hd]


def softmax_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax of scores [Hkv, g, ..., P] over the last dimension; with ``sinks`` float32 [H = Hkv·g] each head's
    sink logit joins its softmax as a column, then is dropped: it only takes probability away
    (ggml_soft_max_add_sinks)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    Hkv, g, P = scores.shape[0], scores.shape[1], scores.shape[-1]
    sink = sinks.to(scores.dtype).reshape(Hkv, g, *[1] * (scores.dim() - 2)).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :P]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up (ggml_swiglu_split)."""
    return torch.nn.functional.silu(gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai): x = min(gate, limit), y = clamp(up, ±limit),
    x·sigmoid(alpha·x)·(y + 1)."""
    x = gate.clamp(max=limit)
    y = up.clamp(-limit, limit)
    return x / (1.0 + torch.exp(-alpha * x)) * (y + 1.0)


def expert_glu(glu, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The routed experts' gated activation: ``glu`` (an ``engine.kernels.moe.ExpertGLU``) names it; None is
    SwiGLU. Its biases are the caller's (they are per expert)."""
    if glu is None or glu.act == "silu":
        return silu_mul(gate, up)
    if glu.act == "swiglu_oai":
        return swiglu_oai(gate, up, glu.alpha, glu.limit)
    raise ValueError(f"unknown expert activation {glu.act!r}")


def gelu_tanh_ggml(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh form, as ggml's CPU op computes it (``ggml_vec_gelu_f32`` under ``GGML_GELU_FP16``): 0 at
    x ≤ −10, x at x ≥ 10, else the float32 tanh form of x rounded to float16, itself rounded to float16 (the
    op's table of 65536 values)."""
    h = x.to(torch.float16).to(torch.float32)
    c = 0.7978845608028654  # sqrt(2/pi)
    y = (0.5 * h * (1.0 + torch.tanh(c * h * (1.0 + 0.044715 * h * h)))).to(torch.float16).to(torch.float32)
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU: gelu(gate) * up with :func:`gelu_tanh_ggml` (ggml_geglu_split)."""
    return gelu_tanh_ggml(gate) * up


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


@dataclass(frozen=True)
class Routing:
    """How a MoE layer picks its experts: data on the layer, read by :func:`route`. Fast paths (the numba
    host step, the fused Triton route kernel) serve the kinds they name and leave the others to it."""

    k: int  # experts per token
    renormalise: bool  # the k weights rescaled to sum 1 (Qwen3, Mixtral) or not (OLMoE, Qwen2-MoE)
    kind: str = "softmax"  # a key of ROUTERS
    bias: torch.Tensor | None = None  # "sigmoid": float32 [E] added to the scores to choose, never to weigh
    scale: float = 1.0  # "sigmoid": the routed scaling factor multiplying the (renormalised) weights


def route_sigmoid_bias(logits: torch.Tensor, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (ids int64 [T, k], weights float32 [T, k]): sigmoid scores, the k largest of
    scores + ``r.bias`` chosen, weighted by their unbiased scores, optionally renormalised, then multiplied by
    ``r.scale`` (GLM-4.5, DeepSeek-V3: llama.cpp build_moe_ffn with LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID,
    exp_probs_b and the expert_weights_scale w_scale)."""
    scores = torch.sigmoid(logits)  # [T, E]
    ids = torch.topk(scores if r.bias is None else scores + r.bias, r.k, dim=-1).indices  # [T, k]
    w = scores.gather(-1, ids)
    if r.renormalise:
        w = w / w.sum(dim=-1, keepdim=True)
    if r.scale != 1.0:
        w = w * r.scale
    return ids, w


def route_topk_softmax(logits: torch.Tensor, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (ids int64 [T, k], weights float32 [T, k]): the k largest logits chosen, their
    weights the softmax over those k alone (gpt-oss: llama.cpp build_moe_ffn with
    LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT)."""
    top, ids = torch.topk(logits, r.k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


# One function per routing kind: (logits [T, E], routing) -> (ids int64 [T, k], weights float32 [T, k]).
ROUTERS = {
    "softmax": lambda logits, r: route_softmax_topk(logits, r.k, r.renormalise),
    "sigmoid": route_sigmoid_bias,
    "topk_softmax": route_topk_softmax,
}


def route(logits: torch.Tensor, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (ids int64 [T, k], weights float32 [T, k]) by ``r``'s kind: the reference
    every placement routes with (or equals, where a fast path serves the kind)."""
    return ROUTERS[r.kind](logits, r)


# -- Gated DeltaNet (Qwen3.5 / Qwen3-Next linear-attention layers) -------------------------------------


def causal_conv1d(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [T, C] with kernels w [C, K] after the K−1 previous inputs ``state``
    [K−1, C] -> (y [T, C], the new state: the last K−1 inputs). y_t = Σ_j xp[t+j]·w[:, j] over
    xp = [state; x], summed in j order (llama.cpp build_conv_state + ggml_ssm_conv)."""
    T, K = x.shape[0], w.shape[1]
    xp = torch.cat([state, x])  # [K-1+T, C]
    y = xp[0:T] * w[:, 0]
    for j in range(1, K):
        y = y + xp[j : j + T] * w[:, j]
    return y, xp[xp.shape[0] - (K - 1) :].clone()


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] / max(‖x‖₂, eps) over the last dimension (ggml_l2_norm)."""
    return x / torch.clamp(torch.linalg.vector_norm(x, dim=-1, keepdim=True), min=eps)


def expand_heads(x: torch.Tensor, n: int, grouping: str) -> torch.Tensor:
    """x [T, Hk, d] -> [T, n, d] for n value heads: ``"tile"`` gives value head h key head h mod Hk
    (Qwen3.5: ggml_repeat_4d), ``"interleave"`` key head h // (n/Hk) (Qwen3-Next: repeat interleave)."""
    r = n // x.shape[1]
    if r == 1:
        return x
    if grouping == "tile":
        return x.repeat(1, r, 1)
    T, Hk, d = x.shape  # repeat_interleave with an int copies its repeats from the host: not capturable
    return x.unsqueeze(2).expand(T, Hk, r, d).reshape(T, n, d)


def delta_gates(b: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor):
    """Beta and log-decay [T, H] from the projections b, a [T, H]: β = sigmoid(b), g = softplus(a + dt_bias)·A
    where A = −exp(A_log) is the file's ``ssm_a`` (ggml_sigmoid, ggml_softplus, ggml_mul)."""
    return torch.sigmoid(b), torch.nn.functional.softplus(a + dt_bias) * A


def gated_delta_rule(q, k, v, g, beta, S, states: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, token by token: q, k [T, H, dk] (L2-normed), v [T, H, dv], g, beta [T, H],
    state S [H, dv, dk] -> (o [T, H, dv], S'). Per token: S ← S·exp(g); d = β(v − S k); S ← S + d kᵀ;
    o = S q / sqrt(dk) (llama.cpp build_delta_net_autoregressive; its chunked and fused forms equal it).
    states: a list that receives the state after each token (a verify pass's roll-back points)."""
    T = q.shape[0]
    q = q * (1.0 / float(q.shape[-1]) ** 0.5)
    decay = torch.exp(g)
    out = []
    for t in range(T):
        S = S * decay[t][:, None, None]
        kt = k[t][:, None, :]  # [H, 1, dk]
        d = (v[t] - (S * kt).sum(-1)) * beta[t][:, None]  # [H, dv]
        S = S + d[:, :, None] * kt
        out.append((S * q[t][:, None, :]).sum(-1))
        if states is not None:
            states.append(S)
    return torch.stack(out), S


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(o)·w ⊙ silu(z) per head: o, z [T, H, dv], w [dv] (llama.cpp build_norm_gated)."""
    return rms_norm(o, w, eps) * torch.nn.functional.silu(z)


def delta_net_reference(p: dict, x: np.ndarray, conv: np.ndarray, S: np.ndarray, eps: float, grouping: str):
    """The whole Gated DeltaNet mixer in float64 numpy, one token at a time: the plain reference the layer
    (``engine.models.blocks.GatedDeltaNet`` on any ops) is held to.

    p: float arrays ``qkv`` [Ck, D] (rows q | k | v), ``z`` [Hv·dv, D], ``b``, ``a`` [Hv, D], ``conv`` [C, K],
    ``dt_bias``, ``A`` [Hv], ``norm`` [dv], ``out`` [D, Hv·dv]; and ints ``Hk``, ``dk``, ``Hv``, ``dv``.
    x [T, D] (normed input); conv [K−1, C] and S [Hv, dv, dk] the state before. Returns (y [T, D], conv', S').
    """
    f = np.float64
    x, conv, S = x.astype(f), conv.astype(f).copy(), S.astype(f).copy()
    Hk, dk, Hv, dv = p["Hk"], p["dk"], p["Hv"], p["dv"]
    W = {n: np.asarray(p[n], f) for n in ("qkv", "z", "b", "a", "conv", "dt_bias", "A", "norm", "out")}
    ys = []
    for t in range(x.shape[0]):
        h = x[t]
        mixed, z = W["qkv"] @ h, W["z"] @ h
        window = np.concatenate([conv, mixed[None]])  # [K, C]: the last K inputs
        conv = window[1:]
        c = (window * W["conv"].T).sum(0)
        c = c / (1 + np.exp(-c))  # silu
        q, k, v = c[: Hk * dk].reshape(Hk, dk), c[Hk * dk : 2 * Hk * dk].reshape(Hk, dk), c[2 * Hk * dk :]
        v = v.reshape(Hv, dv)
        q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), eps)
        k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), eps)
        r = Hv // Hk
        kh = [(j % Hk) if grouping == "tile" else (j // r) for j in range(Hv)]
        beta = 1 / (1 + np.exp(-(W["b"] @ h)))
        g = np.log1p(np.exp(W["a"] @ h + W["dt_bias"])) * W["A"]
        o = np.empty((Hv, dv))
        for j in range(Hv):
            qj, kj = q[kh[j]] / np.sqrt(dk), k[kh[j]]
            S[j] = S[j] * np.exp(g[j])
            d = beta[j] * (v[j] - S[j] @ kj)
            S[j] = S[j] + np.outer(d, kj)
            o[j] = S[j] @ qj
        zz = z.reshape(Hv, dv)
        o = o / np.sqrt((o * o).mean(-1, keepdims=True) + eps) * W["norm"] * (zz / (1 + np.exp(-zz)))
        ys.append(W["out"] @ o.reshape(-1))
    return np.stack(ys), conv, S


DELTA_CHUNK = 64  # tokens per chunk of the chunked delta rule (llama.cpp's build_delta_net_chunking uses 64)


def gated_delta_chunked(q, k, v, g, beta, S, chunk: int = DELTA_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_rule` over T tokens in chunks (the WY form of llama.cpp's build_delta_net_chunking and
    flash-linear-attention's chunk_gated_delta_rule): within a chunk, with G the cumulative log-decay,
    U = (I + tril₋₁((β⊙K)Kᵀ ⊙ e^{Gᵢ−Gⱼ}))⁻¹ gives the chunk's pseudo-values U(β⊙V) and decayed keys
    U(β⊙K⊙e^G); each chunk then reads the state once and updates it once. Equal to the recurrence up to
    float32 rounding (tests/test_gdn.py). Same arguments and result as :func:`gated_delta_rule`."""
    T, H, dk = q.shape
    pad = (-T) % chunk
    n = (T + pad) // chunk

    def blocks(x):  # [T, H, d] -> [H, n, C, d], zero-padded (padded tokens neither decay nor update)
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(n, chunk, H, x.shape[-1]).permute(2, 0, 1, 3)

    q = q * (1.0 / float(dk) ** 0.5)
    qc, kc, vc = blocks(q), blocks(k), blocks(v)  # [H, n, C, d]
    gc = torch.nn.functional.pad(g, (0, 0, 0, pad)).reshape(n, chunk, H).permute(2, 0, 1)  # [H, n, C]
    bc = torch.nn.functional.pad(beta, (0, 0, 0, pad)).reshape(n, chunk, H).permute(2, 0, 1)
    G = gc.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, G[..., :, None] - G[..., None, :], float("-inf")).exp()  # [H, n, C, C]
    kb, vb = kc * bc[..., None], vc * bc[..., None]
    M = ((kb @ kc.transpose(-1, -2)) * decay).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    U = torch.linalg.solve_triangular(eye + M, eye.expand_as(M), upper=False, unitriangular=True)
    u, w = U @ vb, U @ (kb * G.exp()[..., None])  # [H, n, C, dv], [H, n, C, dk]
    out = []
    for c in range(n):
        St = S.transpose(-1, -2)  # [H, dk, dv]
        v_new = u[:, c] - w[:, c] @ St  # [H, C, dv]
        o = (qc[:, c] * G[:, c].exp()[..., None]) @ St + ((qc[:, c] @ kc[:, c].transpose(-1, -2)) * decay[:, c]) @ v_new
        last = G[:, c, -1]  # [H]
        kd = kc[:, c] * (last[:, None] - G[:, c]).exp()[..., None]  # [H, C, dk]
        S = S * last.exp()[:, None, None] + v_new.transpose(-1, -2) @ kd
        out.append(o)
    o = torch.cat(out, dim=1)[:, :T]  # [H, T, dv]
    return o.transpose(0, 1).contiguous(), S
