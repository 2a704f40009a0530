"""Decoder building blocks shared by the architectures: attention, FFNs, the decoder layer.

Each block's math is written once, in its ``step`` method, against the ops contract
(:class:`engine.models.ops.Ops`): T tokens or one, eager or captured in a CUDA graph, torch, numba or
the device step's fused kernels are implementations of those ops, chosen by the caller. Quirks are
constructor arguments named after what they are (``qk_norm="head"``), set by each architecture module
and read by the step as data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from math import inf

import numpy as np
import torch

from engine.experts import ExpertBackend
from engine.kv_cache import KVCache
from engine.models.args import ModelArgs
from engine.models.host import HostMoEStep, HostOps
from engine.models.layers import (
    Routing,
    apply_rope_table,
    attention_static,
    rms_norm_fused,
    route_softmax_topk,
    silu_mul,
)
from engine.models.ops import Ops, TorchOps, plus
from engine.models.weights import Linear, Weights


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
        self.host = _on_host(self.wq, self.wk, self.wv, self.wo) and a.head_dim % 16 == 0  # HostOps.attend

    def step(self, ops: Ops, h, hq=None):
        """h [T, D] (normed; hq its q8 copy or None) -> attn(h) [T, D]; writes K/V of the step's positions."""
        a = self.a
        q, k, v = ops.linears((self.wq, self.wk, self.wv), h, hq)  # [T, H·hd], [T, Hkv·hd] x2
        if self.qk_norm == "proj":  # OLMoE: over the whole projection
            q, k = ops.rms_norm(q, self.q_norm, a.rms_eps), ops.rms_norm(k, self.k_norm, a.rms_eps)
        head = (self.q_norm, self.k_norm) if self.qk_norm == "head" else None  # Qwen3: per head
        q = ops.rope_store(self, q, k, v, head)
        o, oq = ops.attend(self, q, q8=ops.q8 and self.wo.takes_q8())  # [T, H·hd]
        return ops.linears((self.wo,), o, oq)[0]

    def wants_q8_input(self) -> bool:
        """Whether q, k and v would all multiply x on q8 activations now (``DeviceLinear.takes_q8``), so
        the norm before can write x̂ once for the three."""
        return all(w.takes_q8() for w in (self.wq, self.wk, self.wv))

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


class DenseFFN:
    """SwiGLU feed-forward: down(silu(gate·x) ⊙ up·x)."""

    def __init__(self, w: Weights, i: int, suffix: str = ""):
        p = f"blk.{i}."
        self.gate = w.linear(f"{p}ffn_gate{suffix}.weight")
        self.up = w.linear(f"{p}ffn_up{suffix}.weight")
        self.down = w.linear(f"{p}ffn_down{suffix}.weight")
        self.host = _on_host(self.gate, self.up, self.down)

    def step(self, ops: Ops, h, hq=None):
        """h [T, D] (normed) -> [T, D]."""
        g, u = ops.linears((self.gate, self.up), h)  # [T, F] x2
        return ops.linears((self.down,), ops.silu_mul(g, u))[0]

    def wants_q8_input(self) -> bool:
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu_mul(self.gate(x), self.up(x)))


class MoE:
    """Router → the layer's routing (``routing``: softmax top-k today) → routed experts through the backend
    (+ optional gated shared expert)."""

    def __init__(self, w: Weights, i: int, a: ModelArgs, experts: ExpertBackend, shared_expert: bool = False):
        p = f"blk.{i}."
        self.i = i
        self.routing = Routing(k=a.n_expert_used, renormalise=a.norm_topk)
        self.router = w.linear(p + "ffn_gate_inp.weight")  # [E, D]
        self.experts = experts
        self.shared = DenseFFN(w, i, "_shexp") if shared_expert else None
        # Qwen2-MoE: the shared expert's output is scaled by sigmoid(x · w), w [D] F32.
        self.shared_gate = w.optional_vector(p + "ffn_gate_inp_shexp.weight") if shared_expert else None
        self.last_ids: torch.Tensor | None = None  # [T, K], for tests and the profiler
        self.host = _on_host(self.router) and (self.shared is None or self.shared.host)

    def step(self, ops: Ops, h, hq=None):
        """h [T, D] (normed; hq its q8 copy or None) -> [T, D], or None where this step computes nothing of
        it (the routed experts' host half runs after a decode graph's replay)."""
        logits = ops.linears((self.router,), h)[0]  # [T, E]
        r = ops.route(self, logits)  # ids, weights [T, K]
        y = ops.experts(self, h, hq, r)  # Σ_k weights · expert(h) [T, D]
        if self.shared is not None:
            s = self.shared.step(ops, h)
            if self.shared_gate is not None:
                s = ops.sigmoid_gate(s, h, self.shared_gate)
            y = plus(y, s)
        return y

    def wants_q8_input(self) -> bool:
        """Whether the backend's device half takes x's q8 copy now (the lean Q4_K kernels on q8
        activations, skipping their own quantize launch)."""
        f = getattr(self.experts, "static_q8", None)
        return bool(f is not None and f(self.i))

    def note_route(self, ids: np.ndarray) -> None:
        """The fused host step (``engine.models.host``) routed one token to ``ids`` int64 [K]:
        record it as ``forward`` and the CPU expert backend would have."""
        self.last_ids = torch.from_numpy(ids)[None]
        if self.experts.profiler is not None:
            self.experts.profiler.record_route(self.i, self.last_ids.numpy())

    def decode_static(self, x: torch.Tensor, route: torch.Tensor | None = None, xq=None) -> torch.Tensor:
        """One token x [1, D] with routing kept on the device (graph-capturable): the backend's
        ``forward_static`` (the resident pool: slots looked up on the device). ``route`` int64 [K]:
        [1, K] where to write the chosen ids (the graph's profiler record). xq: x in triton_q8's
        format when the norm's launch wrote it (:meth:`wants_q8_input`), else None."""
        logits = self.router(x)  # [1, E]
        fused = getattr(self.experts, "route_static", None)
        got = (
            fused(self.i, logits, self.routing.k, self.routing.renormalise, route)
            if fused and route is not None
            else None
        )
        if got is not None:  # one fused kernel: routing, the ids into ``route``, slot offsets
            weights, off = got
            return self._plus_shared(x, self.experts.forward_static(self.i, x, route, weights, off, xq))
        ids, weights = route_softmax_topk(logits, self.routing.k, self.routing.renormalise)  # [1, K] x2
        if route is not None:  # the graph's record of the routes
            route.copy_(ids)
        return self._plus_shared(x, self.experts.forward_static(self.i, x, ids, weights, xq=xq))

    def route_static(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Routing of one token on the device for routed experts that run outside the step (a decode
        graph's host segment boundary): x [1, D] (normed) -> (ids int64 [1, K], weights float32
        [1, K], the shared expert's output [1, D] or None). Graph-capturable."""
        ids, weights = route_softmax_topk(self.router(x), self.routing.k, self.routing.renormalise)
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


class DecoderLayer:
    """x += attn(norm(x)); x += ffn(norm(x))."""

    def __init__(self, w: Weights, i: int, a: ModelArgs, attn: Attention, ffn):
        p = f"blk.{i}."
        self.attn_norm = w.vector(p + "attn_norm.weight")
        self.ffn_norm = w.vector(p + "ffn_norm.weight")
        self.attn, self.ffn, self.eps = attn, ffn, a.rms_eps
        self.moe: MoE | None = ffn if isinstance(ffn, MoE) else None
        # On the host: the numba ops instead of ~60 small torch ops per layer (selected here only).
        self.host = attn.host and ffn.host
        self.fused = HostMoEStep.build(self)  # the host ops' one-token fast path, where it applies

    def step(self, ops: Ops, x, y=None):
        """The layer on ``ops``: its input x + y ([T, D]; y None: just x) -> (x', y') whose sum is its output
        — the last residual add is left to the next norm, so on the device it rides on that norm's launch."""
        x, h, hq = ops.add_norm(x, y, self.attn_norm, self.eps, q8=ops.q8 and self.attn.wants_q8_input())
        a = self.attn.step(ops, h, hq)
        x, h, hq = ops.add_norm(x, a, self.ffn_norm, self.eps, q8=ops.q8 and self.ffn.wants_q8_input())
        return x, self.ffn.step(ops, h, hq)

    def __call__(self, x: torch.Tensor, start: int, cache: KVCache, cos, sin) -> torch.Tensor:
        """x float32 [T, D] at positions start … start+T−1 -> the layer's output [T, D]; cos, sin [T, rope_dim/2]
        on x's device. Host layers run the numba ops (one numba call for a token where it applies), others torch."""
        if self.host and x.device.type == "cpu":
            X, c, s = x.numpy(), cos.numpy(), sin.numpy()
            if X.shape[0] == 1 and self.fused is not None:
                out = self.fused(X[0], start, cache, c, s)
                if out is not None:
                    return torch.from_numpy(out[None])
            x, y = self.step(HostOps(start, cache, c, s), X)
            return torch.from_numpy(x + y)
        x, y = self.step(TorchOps(start, cache, cos, sin), x)
        return x + y

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
