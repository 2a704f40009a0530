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
from engine.models.ops import FusedTorchOps, Ops, plus
from engine.models.weights import Linear, Weights


def _on_host(*linears) -> bool:
    """Whether every matrix is a host ``Linear`` (the numba host path applies)."""
    return all(isinstance(w, Linear) for w in linears)


class Attention:
    """Pre-normed GQA self-attention with RoPE and an optional q/k norm and q/k/v bias; ``q_gate``: the q
    projection gives each head its query and an output gate ([q_h | gate_h] per head), and the attention
    output is multiplied by sigmoid(gate) before the output projection (Qwen3.5, Qwen3-Next); ``window`` > 0:
    sliding-window attention over the last ``window`` positions; ``scale``: the score scale (None: 1/sqrt(hd));
    ``o_bias``: the output projection has a bias; ``sinks``: each head has a learned sink logit in its softmax
    (``attn_sinks``, gpt-oss)."""

    def __init__(
        self,
        w: Weights,
        i: int,
        a: ModelArgs,
        qk_norm: str | None = None,
        qkv_bias: bool = False,
        q_gate: bool = False,
        window: int = 0,
        scale: float | None = None,
        o_bias: bool = False,
        sinks: bool = False,
    ):
        p = f"blk.{i}."
        self.i, self.a, self.qk_norm, self.q_gate = i, a, qk_norm, q_gate
        self.window, self.scale = window, scale
        self.sinks = w.vector(p + "attn_sinks.weight") if sinks else None  # float32 [H]
        self.wq = w.linear(p + "attn_q.weight", p + "attn_q.bias" if qkv_bias else None)
        self.wk = w.linear(p + "attn_k.weight", p + "attn_k.bias" if qkv_bias else None)
        self.wv = w.linear(p + "attn_v.weight", p + "attn_v.bias" if qkv_bias else None)
        self.wo = w.linear(p + "attn_output.weight", p + "attn_output.bias" if o_bias else None)
        self.q_norm = w.vector(p + "attn_q_norm.weight") if qk_norm else None
        self.k_norm = w.vector(p + "attn_k_norm.weight") if qk_norm else None
        # HostOps.attend; the host ops have no output gate (sigmoid_mul), window, other scale or sinks yet.
        host_ok = a.head_dim % 16 == 0 and not q_gate and not window and scale is None and not sinks
        self.host = _on_host(self.wq, self.wk, self.wv, self.wo) and host_ok

    def step(self, ops: Ops, h, hq=None):
        """h [T, D] (normed; hq its q8 copy or None) -> attn(h) [T, D]; writes K/V of the step's positions."""
        a = self.a
        q, k, v = ops.linears((self.wq, self.wk, self.wv), h, hq)  # [T, H·hd], [T, Hkv·hd] x2
        gate = None
        if self.q_gate:  # [T, H·2·hd]: per head its query, then its gate
            qg = q.reshape(q.shape[0], a.n_head, 2, a.head_dim)
            q, gate = qg[:, :, 0].reshape(q.shape[0], -1), qg[:, :, 1].reshape(q.shape[0], -1)
        if self.qk_norm == "proj":  # OLMoE: over the whole projection
            q, k = ops.rms_norm(q, self.q_norm, a.rms_eps), ops.rms_norm(k, self.k_norm, a.rms_eps)
        head = (self.q_norm, self.k_norm) if self.qk_norm == "head" else None  # Qwen3: per head
        q = ops.rope_store(self, q, k, v, head)
        o, oq = ops.attend(self, q, q8=ops.q8 and self.wo.takes_q8() and gate is None)  # [T, H·hd]
        if gate is not None:
            o = ops.sigmoid_mul(o, gate)
        return ops.linears((self.wo,), o, oq)[0]

    def wants_q8_input(self) -> bool:
        """Whether q, k and v would all multiply x on q8 activations now (``DeviceLinear.takes_q8``), so
        the norm before can write x̂ once for the three."""
        return all(w.takes_q8() for w in (self.wq, self.wk, self.wv))


class DenseFFN:
    """Gated feed-forward: down(act(gate·x) ⊙ up·x); ``act`` "silu" (SwiGLU) or "gelu" (GeGLU, Gemma)."""

    def __init__(self, w: Weights, i: int, suffix: str = "", act: str = "silu"):
        p = f"blk.{i}."
        self.act = act
        self.gate = w.linear(f"{p}ffn_gate{suffix}.weight")
        self.up = w.linear(f"{p}ffn_up{suffix}.weight")
        self.down = w.linear(f"{p}ffn_down{suffix}.weight")
        self.host = _on_host(self.gate, self.up, self.down)

    def step(self, ops: Ops, h, hq=None):
        """h [T, D] (normed) -> [T, D]."""
        g, u = ops.linears((self.gate, self.up), h)  # [T, F] x2
        a = ops.gelu_mul(g, u) if self.act == "gelu" else ops.silu_mul(g, u)
        return ops.linears((self.down,), a)[0]

    def wants_q8_input(self) -> bool:
        return False


class MoE:
    """Router → the layer's routing (``routing``: softmax top-k unless the architecture gives its own, e.g.
    GLM-4.5's biased sigmoid) → routed experts through the backend (+ optional shared expert, gated where the
    file has ``ffn_gate_inp_shexp``). The experts' own biases and activation, where not plain SwiGLU, are the
    backend's data (``ExpertStacks.glu``, from ``DecoderModel.expert_glu``)."""

    def __init__(
        self,
        w: Weights,
        i: int,
        a: ModelArgs,
        experts: ExpertBackend,
        shared_expert: bool = False,
        routing: Routing | None = None,
        router_bias: bool = False,
    ):
        p = f"blk.{i}."
        self.i = i
        self.routing = routing or Routing(k=a.n_expert_used, renormalise=a.norm_topk)
        # [E, D], with a bias [E] where the file has one (gpt-oss's ffn_gate_inp.bias)
        self.router = w.linear(p + "ffn_gate_inp.weight", p + "ffn_gate_inp.bias" if router_bias else None)
        self.experts = experts
        self.shared = DenseFFN(w, i, "_shexp") if shared_expert else None
        # Qwen2-MoE: the shared expert's output is scaled by sigmoid(x · w), w [D] F32.
        self.shared_gate = w.optional_vector(p + "ffn_gate_inp_shexp.weight") if shared_expert else None
        self._last_ids: torch.Tensor | None = None  # [T, K], for tests and the profiler
        self._last_row: tuple[np.ndarray, int] | None = None  # (routes [n, K], row): last_ids, not yet made
        # The model's route tap (DecoderModel.set_route_tap: engine.routes' recorder or replayer), or None; while
        # set, the layer's routing goes through tap.route and the layer never runs its fused host step.
        self.tap = None
        self.host = _on_host(self.router) and (self.shared is None or self.shared.host)

    def step(self, ops: Ops, h, hq=None):
        """h [T, D] (normed; hq its q8 copy or None) -> [T, D], or None where this step computes nothing of
        it (the routed experts' host half runs after a decode graph's replay)."""
        logits = ops.linears((self.router,), h)[0]  # [T, E]
        r = ops.route(self, logits)  # ids, weights [T, K]
        if self.tap is not None and not ops.taps_routes:
            r = self.tap.route(self.i, r)  # recorded, or replaced by a trace's
        y = ops.experts(self, h, hq, r)  # Σ_k weights · expert(h) [T, D]
        if self.shared is not None:
            s = self.shared.step(ops, h)
            if self.shared_gate is not None:
                s = ops.sigmoid_gate(s, h, self.shared_gate)
            y = plus(y, s)
        return y

    @property
    def last_ids(self) -> torch.Tensor | None:
        """The experts the last pass chose, int [T, K] (None before any pass)."""
        if self._last_row is not None:
            routes, j = self._last_row
            self._last_ids, self._last_row = torch.from_numpy(routes[j : j + 1]), None
        return self._last_ids

    @last_ids.setter
    def last_ids(self, ids: torch.Tensor | None) -> None:
        self._last_ids, self._last_row = ids, None

    def set_last_row(self, routes: np.ndarray, j: int) -> None:
        """``last_ids`` = routes[j : j + 1] (routes int [n, K], one row a layer of a one-token step, not
        written again), made only when read: a decode step records every layer's routes without a
        tensor a layer."""
        self._last_row = (routes, j)

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


class GatedDeltaNet:
    """Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): the input projections give qkv (rows q | k | v),
    the output gate z and the per-head b, a; the recurrent core (:meth:`Ops.delta_net`: causal conv with its
    rolling state, silu, L2-normed q and k, the gated delta rule with its state) gives o; then
    rms_norm(o)·w ⊙ silu(z) per value head and the output projection. Its state lives in the cache
    (``KVCache.recurrent[i]``), a fixed size whatever the context.

    fused_input: the Qwen3-Next legacy projections ``ssm_in`` (per key head [q | k | v | z]) and ``ssm_ba``
    (per key head [b | a]) instead of ``attn_qkv``, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``; their outputs
    are reordered to the split layout. grouping: how Hk key heads serve Hv value heads (``expand_heads``)."""

    def __init__(self, w: Weights, i: int, a, grouping: str, fused_input: bool = False):
        p = f"blk.{i}."
        self.i, self.eps, self.grouping, self.fused_input = i, a.rms_eps, grouping, fused_input
        Hk, dk, Hv = a.ssm_n_group, a.ssm_d_state, a.ssm_dt_rank
        dv = a.ssm_d_inner // Hv
        self.n_k_heads, self.head_k, self.n_v_heads, self.head_v = Hk, dk, Hv, dv
        self.conv_dim = C = 2 * Hk * dk + Hv * dv
        if fused_input:
            self.w_in = (w.linear(p + "ssm_in.weight"), w.linear(p + "ssm_ba.weight"))
            r = Hv // Hk
            G = 2 * dk + 2 * r * dv  # one key head's group of ssm_in rows
            g = np.arange(Hk)[:, None] * G
            parts = [(0, dk), (dk, dk), (2 * dk, r * dv), (2 * dk + r * dv, r * dv)]  # q, k, v, z
            self.qkvz_order = np.concatenate([(g + o + np.arange(n)).reshape(-1) for o, n in parts])
            gb = np.arange(Hk)[:, None] * 2 * r
            self.ba_order = np.concatenate([(gb + np.arange(r)).reshape(-1), (gb + r + np.arange(r)).reshape(-1)])
        else:
            names = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")
            self.w_in = tuple(w.linear(p + n) for n in names)
        self.conv_w = w.vector(p + "ssm_conv1d.weight").reshape(C, a.ssm_d_conv)  # [C, K]
        self.dt_bias = w.vector(p + "ssm_dt.bias")  # [Hv]
        self.A = w.vector(p + "ssm_a")  # [Hv] = −exp(A_log)
        self.norm = w.vector(p + "ssm_norm.weight")  # [dv]
        self.out = w.linear(p + "ssm_out.weight")  # [D, Hv·dv]
        self.host = False  # no numba twin yet: TorchOps

    def step(self, ops: Ops, h, hq=None):
        """h [T, D] (normed) -> [T, D]; advances the layer's conv and delta-rule states by T tokens."""
        if self.fused_input:
            qkvz, ba = ops.linears(self.w_in, h, hq)
            qkvz, ba = qkvz[:, self._order("qkvz_order", qkvz)], ba[:, self._order("ba_order", ba)]
            C, Hv = self.conv_dim, self.n_v_heads
            qkv, z, b, a = qkvz[:, :C], qkvz[:, C:], ba[:, :Hv], ba[:, Hv:]
        else:
            qkv, z, b, a = ops.linears(self.w_in, h, hq)
        o = ops.delta_net(self, qkv, b, a)  # [T, Hv·dv]
        return ops.linears((self.out,), ops.gated_norm(self, o, z))[0]

    def _order(self, name: str, x):
        """The column order ``name`` as an index on x's device, made once a device (a numpy index would be
        copied from the host at every call, which a CUDA graph capture refuses); numpy rows index with it as is."""
        order = getattr(self, name)
        if isinstance(x, np.ndarray):
            return order
        cache = self.__dict__.setdefault("_orders", {})
        key = (name, x.device)
        if key not in cache:
            cache[key] = torch.from_numpy(order).to(x.device)
        return cache[key]

    def wants_q8_input(self) -> bool:
        return False


class DecoderLayer:
    """x += attn(norm(x)); x += ffn(norm(x)). ``attn`` is the layer's mixer (:class:`Attention` or
    :class:`GatedDeltaNet`); ``ffn_norm`` the name of the second norm (``post_attention_norm`` in Qwen3.5);
    ``post_norms``: the names of norms applied to the mixer's and the FFN's outputs before their residual adds
    (Gemma: x += norm(attn(norm(x))); x += norm(ffn(norm(x))))."""

    def __init__(
        self,
        w: Weights,
        i: int,
        a: ModelArgs,
        attn,
        ffn,
        ffn_norm: str = "ffn_norm",
        post_norms: tuple[str, str] | None = None,
    ):
        p = f"blk.{i}."
        self.attn_norm = w.vector(p + "attn_norm.weight")
        self.ffn_norm = w.vector(p + ffn_norm + ".weight")
        self.post_attn_norm, self.post_ffn_norm = (
            (w.vector(p + post_norms[0] + ".weight"), w.vector(p + post_norms[1] + ".weight"))
            if post_norms
            else (None, None)
        )
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
        if self.post_attn_norm is not None:
            a = ops.rms_norm(a, self.post_attn_norm, self.eps)
        x, h, hq = ops.add_norm(x, a, self.ffn_norm, self.eps, q8=ops.q8 and self.ffn.wants_q8_input())
        f = self.ffn.step(ops, h, hq)
        if self.post_ffn_norm is not None:
            f = ops.rms_norm(f, self.post_ffn_norm, self.eps)
        return x, f

    def __call__(self, x: torch.Tensor, start: int, cache: KVCache, cos, sin) -> torch.Tensor:
        """x float32 [T, D] at positions start … start+T−1 -> the layer's output [T, D]; cos, sin [T, rope_dim/2]
        on x's device. Host layers run the numba ops (one numba call for a token where it applies), others torch."""
        if self.host and x.device.type == "cpu":
            X, c, s = x.numpy(), cos.numpy(), sin.numpy()
            if X.shape[0] == 1 and self.fused is not None and (self.moe is None or self.moe.tap is None):
                out = self.fused(X[0], start, cache, c, s)
                if out is not None:
                    return torch.from_numpy(out[None])
            x, y = self.step(HostOps(start, cache, c, s), X)
            return torch.from_numpy(x + y)
        x, y = self.step(FusedTorchOps(start, cache, cos, sin), x)
        return x + y
