"""Decoder building blocks shared by the architectures: attention, FFNs, the decoder layer.

Quirks are constructor arguments named after what they are (``qk_norm="head"``), set by each
architecture module; the math itself lives in :mod:`engine.models.layers`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from math import inf

import numpy as np
import torch

from engine import ops
from engine.errors import UsageError
from engine.experts import ExpertBackend
from engine.kv_cache import KVCache
from engine.models.args import ModelArgs
from engine.models.host import HostMoEStep, attention_rows, qk_norm_rope_rows, rms_norm_rows, route_rows
from engine.models.layers import (
    apply_rope,
    apply_rope_table,
    attention,
    attention_static,
    rms_norm,
    rms_norm_fused,
    route_softmax_topk,
    silu_mul,
)
from engine.models.weights import Linear, Weights

_QK_NORM = {None: 0, "head": 1, "proj": 2}
_EMPTY = np.zeros(0, np.float32)


def _np(t: torch.Tensor | None) -> np.ndarray:
    """A host float32 vector as numpy (no weight: an empty array)."""
    return _EMPTY if t is None else np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.float32)


def _host_kv(cache: KVCache, i: int, start: int, T: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Layer i's K and V stores [n_ctx, kv_dim] as numpy when they are float32 on the host
    (written in place by the host path), else None (then ``cache.update`` converts)."""
    if cache.kv_types.get(i) != "f32" or cache.k[i].q.device.type != "cpu":
        return None
    if start + T > cache.n_ctx:
        raise UsageError(f"context full: position {start + T} exceeds the context of {cache.n_ctx}")
    return cache.k[i].q.numpy(), cache.v[i].q.numpy()


@dataclass
class StaticStep:
    """What a one-token static step (``decode_static``) needs besides x, all on the device.

    pos int64 [1]: the token's position; length: the static attention length L (≥ pos + 1);
    cos, sin float32 [1, hd], perm int64 [hd]: rope rows (``layers.rope_tables``); kpos int64
    [≥ L]: 0, 1, 2, … (for :attr:`bias`); cache: the KV cache written at pos."""

    pos: torch.Tensor
    length: int
    cos: torch.Tensor
    sin: torch.Tensor
    perm: torch.Tensor
    kpos: torch.Tensor
    cache: KVCache
    # A fused q/k norm + rope + K/V write (``runtime.step_kernels.qk_rope_kv``'s signature), or None.
    rope_kv: Callable | None = None
    # (x, y | None, w, eps, q8=False) -> (x + y, rms_norm(x + y)·w[, its q8 copy]):
    # ``runtime.step_kernels.add_rms_norm``'s.
    add_norm: Callable | None = None
    # One token's attention over a float32/bfloat16 cache, optionally with its q8 copy
    # (``runtime.step_attention.attend``'s signature; set where it applies), or None: torch's four
    # kernels (``layers.attention_static``).
    attend: Callable | None = None

    @cached_property
    def bias(self) -> torch.Tensor:
        """float32 [L]: 0 up to pos, -inf after — the mask of torch's attention (``attention_static``),
        made on its first use in a step: where ``attend`` serves every layer, never."""
        return torch.zeros(self.length, dtype=torch.float32, device=self.pos.device).masked_fill(
            self.kpos[: self.length] > self.pos, -inf
        )

    def add_rms_norm(self, x, y, w, eps):
        if self.add_norm is not None:
            return self.add_norm(x, y, w, eps)
        x = x if y is None else x + y
        return x, rms_norm_fused(x, w, eps)

    def add_rms_norm_q8(self, x, y, w, eps, want: bool):
        """:meth:`add_rms_norm` plus, when ``want``, the normed row in ``triton_q8``'s activation format
        from the same launch where the fused kernel serves (``add_norm(..., q8=True)``); else None."""
        if want and self.add_norm is not None and x.shape[-1] % 32 == 0:
            return self.add_norm(x, y, w, eps, q8=True)
        return (*self.add_rms_norm(x, y, w, eps), None)


def _on_host(*linears) -> bool:
    """Whether every matrix is a host ``Linear`` (the numba host path applies)."""
    return all(isinstance(w, Linear) for w in linears)


class Attention:
    """Pre-normed GQA self-attention with RoPE and an optional q/k norm and q/k/v bias."""

    def __init__(self, w: Weights, i: int, a: ModelArgs, qk_norm: str | None = None, qkv_bias: bool = False):
        p = f"blk.{i}."
        self.i, self.a, self.qk_norm = i, a, qk_norm
        self.wq = w.linear(p + "attn_q.weight", p + "attn_q.bias" if qkv_bias else None)
        self.wk = w.linear(p + "attn_k.weight", p + "attn_k.bias" if qkv_bias else None)
        self.wv = w.linear(p + "attn_v.weight", p + "attn_v.bias" if qkv_bias else None)
        self.wo = w.linear(p + "attn_output.weight")
        self.q_norm = w.vector(p + "attn_q_norm.weight") if qk_norm else None
        self.k_norm = w.vector(p + "attn_k_norm.weight") if qk_norm else None
        self._qk_w: torch.Tensor | None = None  # [H + Hkv, hd] q and k norm weights (decode_static)
        self.host = _on_host(self.wq, self.wk, self.wv, self.wo) and a.head_dim % 16 == 0  # attention_rows
        if self.host:
            self._qkv = (self.wq.w, self.wk.w, self.wv.w)
            self._norms = (_np(self.q_norm), _np(self.k_norm))
            self._bias = tuple(_np(b.bias) if b.bias is not None else None for b in (self.wq, self.wk, self.wv))

    def __call__(self, x: torch.Tensor, start: int, cache: KVCache, cos, sin) -> torch.Tensor:
        a, T = self.a, x.shape[0]
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [T, H*hd], [T, Hkv*hd] x2
        if self.qk_norm == "proj":  # OLMoE: over the whole projection
            q, k = rms_norm(q, self.q_norm, a.rms_eps), rms_norm(k, self.k_norm, a.rms_eps)
        q = q.reshape(T, a.n_head, a.head_dim)
        k = k.reshape(T, a.n_head_kv, a.head_dim)
        if self.qk_norm == "head":  # Qwen3: per head
            q, k = rms_norm(q, self.q_norm, a.rms_eps), rms_norm(k, self.k_norm, a.rms_eps)
        q, k = apply_rope(q, cos, sin, a.rope_neox), apply_rope(k, cos, sin, a.rope_neox)
        K, V = cache.update(self.i, start, k.reshape(T, -1), v)
        o = attention(q, K.reshape(-1, a.n_head_kv, a.head_dim), V.reshape(-1, a.n_head_kv, a.head_dim), start)
        return self.wo(o)

    def wants_q8_input(self) -> bool:
        """Whether q, k and v would all multiply x on q8 activations now (``DeviceLinear.takes_q8``), so
        the norm before can write x̂ once for the three."""
        return all(getattr(w, "takes_q8", lambda: False)() for w in (self.wq, self.wk, self.wv))

    def decode_static(self, x: torch.Tensor, st: StaticStep, xq=None) -> torch.Tensor:
        """One token x [1, D] (normed) at the device position ``st.pos``, attending over the static
        ``st.length`` of the cache (later positions masked): no host sync, graph-capturable. q and
        k are normed and rotated together (rope tables, fused norms): few, larger kernels. xq: x in
        triton_q8's format from the norm's launch (:meth:`wants_q8_input`), else None."""
        a, H, Hkv, hd = self.a, self.a.n_head, self.a.n_head_kv, self.a.head_dim
        if xq is not None:
            q, k, v = self.wq(x, xq), self.wk(x, xq), self.wv(x, xq)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)  # [1, H*hd], [1, Hkv*hd] x2
        if self.qk_norm == "proj":  # OLMoE: over the whole projection
            q, k = rms_norm_fused(q, self.q_norm, a.rms_eps), rms_norm_fused(k, self.k_norm, a.rms_eps)
        sk, sv = st.cache.k[self.i], st.cache.v[self.i]
        if st.rope_kv is not None and sk.kv_type in ("f32", "bf16"):  # one launch
            norms = (self.q_norm, self.k_norm) if self.qk_norm == "head" else (None, None)
            q = st.rope_kv(q, k, v, *norms, a.rms_eps, st.cos, st.sin, st.perm, st.pos, sk.q, sv.q, H, Hkv, hd)
            if st.attend is not None:  # one or two launches
                if getattr(self.wo, "takes_q8", lambda: False)():  # o's x̂ from the attention launch
                    o, oq = st.attend(q, sk.q, sv.q, st.pos, st.length, H, Hkv, hd, q8=True)
                    return self.wo(o, oq)
                return self.wo(st.attend(q, sk.q, sv.q, st.pos, st.length, H, Hkv, hd))
            shape = (st.length, Hkv, hd)
            K, V = sk.read(st.length).reshape(shape), sv.read(st.length).reshape(shape)
            return self.wo(attention_static(q, K, V, st.bias))
        qk = torch.cat([q, k], dim=1).reshape(1, H + Hkv, hd)
        if self.qk_norm == "head":  # Qwen3: per head, q's and k's weights side by side
            if self._qk_w is None:
                self._qk_w = torch.cat([self.q_norm.expand(H, hd), self.k_norm.expand(Hkv, hd)]).contiguous()
            qk = rms_norm_fused(qk, None, a.rms_eps) * self._qk_w
        qk = apply_rope_table(qk, st.cos, st.sin, st.perm)
        q, k = qk[:, :H], qk[:, H:]
        K, V = st.cache.update_at(self.i, st.pos, k.reshape(1, -1), v, st.length)
        shape = (st.length, Hkv, hd)
        return self.wo(attention_static(q, K.reshape(shape), V.reshape(shape), st.bias))

    def forward_host(self, h: np.ndarray, start: int, cache: KVCache, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """The same on the host in numba: h float32 [T, D] (normed) -> float32 [T, D];
        cos, sin float32 [T, rope_dim/2]."""
        a, T = self.a, h.shape[0]
        q, k, v = ops.matmuls(self._qkv, h, q8_act=self.wq.q8_act)  # [T, H*hd], [T, Hkv*hd] x2
        for y, b in zip((q, k, v), self._bias):
            if b is not None:
                y += b
        mode = _QK_NORM[self.qk_norm]
        qk_norm_rope_rows(q, k, *self._norms, mode, a.rms_eps, cos, sin, a.rope_neox, a.n_head, a.n_head_kv, a.head_dim)
        kv = _host_kv(cache, self.i, start, T)
        if kv is not None:
            kv[0][start : start + T] = k
            kv[1][start : start + T] = v
        else:
            kv = tuple(t.numpy() for t in cache.update(self.i, start, torch.from_numpy(k), torch.from_numpy(v)))
        o = attention_rows(q, kv[0], kv[1], start, a.n_head, a.n_head_kv, a.head_dim)  # [T, H*hd]
        return ops.matmuls((self.wo.w,), o, q8_act=self.wo.q8_act)[0]


class DenseFFN:
    """SwiGLU feed-forward: down(silu(gate·x) ⊙ up·x)."""

    def __init__(self, w: Weights, i: int, suffix: str = ""):
        p = f"blk.{i}."
        self.gate = w.linear(f"{p}ffn_gate{suffix}.weight")
        self.up = w.linear(f"{p}ffn_up{suffix}.weight")
        self.down = w.linear(f"{p}ffn_down{suffix}.weight")

        self.host = _on_host(self.gate, self.up, self.down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu_mul(self.gate(x), self.up(x)))

    def forward_host(self, h: np.ndarray) -> np.ndarray:
        """On the host: h float32 [T, D] -> float32 [T, D]."""
        g, u = ops.matmuls((self.gate.w, self.up.w), h, q8_act=self.gate.q8_act)
        with np.errstate(over="ignore"):
            m = g / (np.float32(1.0) + np.exp(-g)) * u
        return ops.matmuls((self.down.w,), m, q8_act=self.down.q8_act)[0]


class MoE:
    """Softmax router → top-k → routed experts through the backend (+ optional gated shared expert)."""

    def __init__(self, w: Weights, i: int, a: ModelArgs, experts: ExpertBackend, shared_expert: bool = False):
        p = f"blk.{i}."
        self.i, self.k, self.renormalise = i, a.n_expert_used, a.norm_topk
        self.router = w.linear(p + "ffn_gate_inp.weight")  # [E, D]
        self.experts = experts
        self.shared = DenseFFN(w, i, "_shexp") if shared_expert else None
        # Qwen2-MoE: the shared expert's output is scaled by sigmoid(x · w), w [D] F32.
        self.shared_gate = w.optional_vector(p + "ffn_gate_inp_shexp.weight") if shared_expert else None
        self.last_ids: torch.Tensor | None = None  # [T, K], for tests and the profiler
        self.host = _on_host(self.router) and (self.shared is None or self.shared.host)
        self._shared_gate = _np(self.shared_gate) if self.shared_gate is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route_softmax_topk(self.router(x), self.k, self.renormalise)  # [T, K] x2
        self.last_ids = ids
        return self._plus_shared(x, self.experts.forward(self.i, x, ids, weights))  # [T, D]

    def wants_q8_input(self) -> bool:
        """Whether :meth:`decode_static` would take x's q8 copy now (the backend's routed experts run on
        q8 activations and can skip their own quantize launch: ``CachedExperts.static_q8``)."""
        f = getattr(self.experts, "static_q8", None)
        return bool(f is not None and f(self.i))

    def decode_static(self, x: torch.Tensor, route: torch.Tensor | None = None, xq=None) -> torch.Tensor:
        """One token x [1, D] with routing kept on the device (graph-capturable): the backend's
        ``forward_static`` (the resident pool: slots looked up on the device). ``route`` int64 [K]:
        [1, K] where to write the chosen ids (the graph's profiler record). xq: x in triton_q8's
        format when the norm's launch wrote it (:meth:`wants_q8_input`), else None."""
        logits = self.router(x)  # [1, E]
        fused = getattr(self.experts, "route_static", None)
        got = fused(self.i, logits, self.k, self.renormalise, route) if fused and route is not None else None
        if got is not None:  # one fused kernel: routing, the ids into ``route``, slot offsets
            weights, off = got
            return self._plus_shared(x, self.experts.forward_static(self.i, x, route, weights, off, xq))
        ids, weights = route_softmax_topk(logits, self.k, self.renormalise)  # [1, K] x2
        if route is not None:  # the graph's record of the routes
            route.copy_(ids)
        return self._plus_shared(x, self.experts.forward_static(self.i, x, ids, weights, xq=xq))

    def route_static(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Routing of one token on the device for routed experts that run outside the step (a decode
        graph's host segment boundary): x [1, D] (normed) -> (ids int64 [1, K], weights float32
        [1, K], the shared expert's output [1, D] or None). Graph-capturable."""
        ids, weights = route_softmax_topk(self.router(x), self.k, self.renormalise)
        return ids, weights, self._shared_out(x)

    def _shared_out(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared is None:
            return None
        s = self.shared(x)
        if self.shared_gate is not None:
            s = s * torch.sigmoid(x @ self.shared_gate)[:, None]
        return s

    def _plus_shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = self._shared_out(x)
        return y if s is None else y + s

    def note_route(self, ids: np.ndarray) -> None:
        """The fused host step (``engine.models.host``) routed one token to ``ids`` int64 [K]:
        record it as ``forward`` and the CPU expert backend would have."""
        self.last_ids = torch.from_numpy(ids)[None]
        if self.experts.profiler is not None:
            self.experts.profiler.record_route(self.i, self.last_ids.numpy())

    def forward_host(self, h: np.ndarray) -> np.ndarray:
        """On the host: h float32 [T, D] (normed) -> float32 [T, D]."""
        logits = ops.matmuls((self.router.w,), h, q8_act=self.router.q8_act)[0]  # [T, E]
        ids, w = route_rows(logits, self.k, self.renormalise)  # [T, K] x2
        ids_t = torch.from_numpy(ids)
        self.last_ids = ids_t
        y = self.experts.forward(self.i, torch.from_numpy(h), ids_t, torch.from_numpy(w)).numpy()
        if self.shared is not None:
            s = self.shared.forward_host(h)
            if self._shared_gate is not None:
                s = s * (np.float32(1.0) / (np.float32(1.0) + np.exp(-(h @ self._shared_gate))))[:, None]
            y = y + s
        return y


class DecoderLayer:
    """x += attn(norm(x)); x += ffn(norm(x))."""

    def __init__(self, w: Weights, i: int, a: ModelArgs, attn: Attention, ffn):
        p = f"blk.{i}."
        self.attn_norm = w.vector(p + "attn_norm.weight")
        self.ffn_norm = w.vector(p + "ffn_norm.weight")
        self.attn, self.ffn, self.eps = attn, ffn, a.rms_eps
        # On the host: numba twins instead of ~60 small torch ops per layer (selected here only).
        self.host = attn.host and ffn.host
        self._attn_norm, self._ffn_norm = _np(self.attn_norm), _np(self.ffn_norm)
        self.fused = HostMoEStep.build(self)  # the whole step in one numba call, where it applies

    def __call__(self, x: torch.Tensor, start: int, cache: KVCache, cos, sin) -> torch.Tensor:
        if self.host and x.device.type == "cpu":
            X, c, s = x.numpy(), cos.numpy(), sin.numpy()
            if X.shape[0] == 1 and self.fused is not None:
                kv = _host_kv(cache, self.attn.i, start, 1)
                if kv is not None:
                    return torch.from_numpy(self.fused(X[0], start, *kv, c, s)[None])
            return torch.from_numpy(self.forward_host(X, start, cache, c, s))
        x = x + self.attn(rms_norm(x, self.attn_norm, self.eps), start, cache, cos, sin)
        return x + self.ffn(rms_norm(x, self.ffn_norm, self.eps))

    def decode_static(
        self, x: torch.Tensor, y: torch.Tensor | None, st: StaticStep, route: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token whose residual stream is x + y ([1, D] each; y None: just x) at the device
        position ``st.pos`` over a static cache length, every step on x's device (no host sync):
        what a decode CUDA graph captures. Returns (x', y') whose sum is the layer's output — the
        last residual add is left to the next norm, so each add rides on a norm's launch.
        ``route`` int64 [1, K] receives a MoE layer's expert ids."""
        moe = isinstance(self.ffn, MoE)
        x, h, hq = self.decode_static_attn(x, y, st, q8_ffn=moe and self.ffn.wants_q8_input())
        return x, (self.ffn.decode_static(h, route, hq) if moe else self.ffn(h))

    def decode_static_attn(self, x: torch.Tensor, y: torch.Tensor | None, st: StaticStep, q8_ffn: bool = False):
        """The attention half of :meth:`decode_static`: (x + y + attn(norm(x + y)), the ffn norm of
        it, its q8 copy when ``q8_ffn`` and the fused norm serves, else None). x̂ (q8) rides on a
        norm's launch where the matrices after it take it: q, k, v; the routed experts."""
        x, h, hq = st.add_rms_norm_q8(x, y, self.attn_norm, self.eps, self.attn.wants_q8_input())
        a = self.attn.decode_static(h, st, hq)
        return st.add_rms_norm_q8(x, a, self.ffn_norm, self.eps, q8_ffn)

    def forward_host(self, x: np.ndarray, start: int, cache: KVCache, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x float32 [T, D] -> [T, D] through the numba host twins; cos, sin float32 [T, rope_dim/2]."""
        x = x + self.attn.forward_host(rms_norm_rows(x, self._attn_norm, self.eps), start, cache, cos, sin)
        return x + self.ffn.forward_host(rms_norm_rows(x, self._ffn_norm, self.eps))
