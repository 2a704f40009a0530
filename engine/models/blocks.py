"""Decoder building blocks shared by the architectures: attention, FFNs, the decoder layer.

Each block's math is written once, in its ``step`` method, against the ops contract
(:class:`engine.models.ops.Ops`): T tokens or one, eager or captured in a CUDA graph, torch, numba or
the device step's fused kernels are implementations of those ops, chosen by the caller. Quirks are
constructor arguments named after what they are (``qk_norm="head"``), set by each architecture module
and read by the step as data.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.experts import ExpertBackend
from engine.kv_cache import KVCache
from engine.models.args import ModelArgs
from engine.models.host import HostMoEStep, HostOps
from engine.models.layers import Routing
from engine.models.ops import Ops, TorchOps, plus
from engine.models.weights import Linear, Weights


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
        return self.experts.step_plan(self.i).q8

    def note_route(self, ids: np.ndarray) -> None:
        """The fused host step (``engine.models.host``) routed one token to ``ids`` int64 [K]:
        record it as ``forward`` and the CPU expert backend would have."""
        self.last_ids = torch.from_numpy(ids)[None]
        if self.experts.profiler is not None:
            self.experts.profiler.record_route(self.i, self.last_ids.numpy())


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
