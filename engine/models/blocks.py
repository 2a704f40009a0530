"""Decoder building blocks shared by the architectures: attention, FFNs, the decoder layer.

Quirks are constructor arguments named after what they are (``qk_norm="head"``), set by each
architecture module; the math itself lives in :mod:`engine.models.layers`.
"""

from __future__ import annotations

import torch

from engine.experts import ExpertBackend
from engine.kv_cache import KVCache
from engine.models.args import ModelArgs
from engine.models.layers import apply_rope, attention, rms_norm, route_softmax_topk, silu_mul
from engine.models.weights import Weights


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


class DenseFFN:
    """SwiGLU feed-forward: down(silu(gate·x) ⊙ up·x)."""

    def __init__(self, w: Weights, i: int, suffix: str = ""):
        p = f"blk.{i}."
        self.gate = w.linear(f"{p}ffn_gate{suffix}.weight")
        self.up = w.linear(f"{p}ffn_up{suffix}.weight")
        self.down = w.linear(f"{p}ffn_down{suffix}.weight")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(silu_mul(self.gate(x), self.up(x)))


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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route_softmax_topk(self.router(x), self.k, self.renormalise)  # [T, K] x2
        self.last_ids = ids
        y = self.experts.forward(self.i, x, ids, weights)  # [T, D]
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = s * torch.sigmoid(x @ self.shared_gate)[:, None]
            y = y + s
        return y


class DecoderLayer:
    """x += attn(norm(x)); x += ffn(norm(x))."""

    def __init__(self, w: Weights, i: int, a: ModelArgs, attn: Attention, ffn):
        p = f"blk.{i}."
        self.attn_norm = w.vector(p + "attn_norm.weight")
        self.ffn_norm = w.vector(p + "ffn_norm.weight")
        self.attn, self.ffn, self.eps = attn, ffn, a.rms_eps

    def __call__(self, x: torch.Tensor, start: int, cache: KVCache, cos, sin) -> torch.Tensor:
        x = x + self.attn(rms_norm(x, self.attn_norm, self.eps), start, cache, cos, sin)
        return x + self.ffn(rms_norm(x, self.ffn_norm, self.eps))
