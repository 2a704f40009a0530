"""The layer step's ops on the host (:class:`HostOps`): numpy arrays through the numba twins of the
torch math (``engine.kernels.host_layers``), and the whole-layer fast path (:class:`HostMoEStep`).

A host layer — every matrix a host ``Linear`` — runs ``DecoderLayer.step`` on these ops instead of
:class:`~engine.models.ops.TorchOps`: torch's per-op dispatch (~60 small ops per layer) and a second
OpenMP pool beside numba's cost more than the arithmetic. tests/test_host_decode.py holds them to the
torch reference (≤ 1e-5), and :class:`HostMoEStep` bit for bit to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine import ops
from engine.errors import UsageError
from engine.kernels.host_layers import (
    QK_NORM,
    attention_rows,
    decode_moe_layer,
    qk_norm_rope_rows,
    rms_norm_rows,
    route_rows,
    store_kv_rows,
)
from engine.kernels.moe_fused import FUSED_TYPES
from engine.models.layers import gelu_mul, route
from engine.models.ops import Route
from engine.quant.formats import QType

if TYPE_CHECKING:
    from engine.kv_cache import KVCache

__all__ = ["HostMoEStep", "HostOps", "attention_rows", "qk_norm_rope_rows", "rms_norm_rows", "route_rows"]

_EMPTY = np.zeros(0, np.float32)


def host_array(t: torch.Tensor | None) -> np.ndarray:
    """A host float32 vector as numpy (no weight: an empty array, the numba kernels' "absent")."""
    return _EMPTY if t is None else np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.float32)


def host_kv(cache: KVCache, i: int, start: int, T: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Layer i's K and V stores [n_ctx, kv_dim] as numpy when they are float32 or bf16 on the host (bf16 as its
    bit patterns, uint16; the host kernels read and write both in place: ``store_kv_rows``, ``attention_rows``),
    else None (then the cache's own write and read convert)."""
    kind = cache.kv_types.get(i)
    if kind not in ("f32", "bf16") or cache.k[i].q.device.type != "cpu" or i in cache.rings:
        return None  # (a sliding-window ring is not indexed by position)
    if start + T > cache.n_ctx:
        raise UsageError(f"context full: position {start + T} exceeds the context of {cache.n_ctx}")
    if kind == "bf16":
        return cache.k[i].q.view(torch.int16).numpy().view(np.uint16), cache.v[i].q.view(torch.int16).numpy().view(
            np.uint16
        )
    return cache.k[i].q.numpy(), cache.v[i].q.numpy()


class HostOps:
    """:class:`~engine.models.ops.Ops` on numpy float32 rows [T, width] for host layers, at positions
    start … start+T−1 of ``cache``; cos, sin float32 [T, rope_dim/2]."""

    q8 = False
    taps_routes = False

    def __init__(self, start: int, cache: KVCache, cos: np.ndarray, sin: np.ndarray):
        self.start, self.cache, self.cos, self.sin = start, cache, cos, sin

    def add_norm(self, x, y, w, eps, q8=False):
        x = x if y is None else x + y
        return x, rms_norm_rows(x, host_array(w), eps), None

    def rms_norm(self, x, w, eps):
        return rms_norm_rows(x, host_array(w), eps)

    def linears(self, ws, x, xq=None):
        ys = ops.matmuls(tuple(w.w for w in ws), x, q8_act=ws[0].q8_act)  # x rounded once per weight type
        for y, w in zip(ys, ws):
            if w.bias is not None:
                y += host_array(w.bias)
        return ys

    def rope_store(self, attn, q, k, v, head_norms):
        a, T, i = attn.a, q.shape[0], attn.i
        qn, kn = (host_array(head_norms[0]), host_array(head_norms[1])) if head_norms is not None else (_EMPTY, _EMPTY)
        mode = QK_NORM["head" if head_norms is not None else None]
        qk_norm_rope_rows(
            q, k, qn, kn, mode, a.rms_eps, self.cos, self.sin, a.rope_neox, a.n_head, a.n_head_kv, a.head_dim
        )
        kv = host_kv(self.cache, i, self.start, T)
        if kv is not None:
            store_kv_rows(kv[0], self.start, np.ascontiguousarray(k))
            store_kv_rows(kv[1], self.start, np.ascontiguousarray(v))
        else:
            self.cache.write(i, self.start, torch.from_numpy(k), torch.from_numpy(v))
        return q

    def attend(self, attn, q, q8=False):
        a, T, i = attn.a, q.shape[0], attn.i
        kv = host_kv(self.cache, i, self.start, T)
        if kv is None or (T > 1 and kv[0].dtype != np.float32):
            # a prompt reuses each K/V row for many query rows: widened once (torch, all threads) rather than
            # at every load (measured: a 512-token prompt 8 % slower reading bf16 in the kernel)
            kv = tuple(t.numpy() for t in self.cache.read(i, self.start + T))
        return attention_rows(q, kv[0], kv[1], self.start, a.n_head, a.n_head_kv, a.head_dim), None  # [T, H·hd]

    def silu_mul(self, g, u):
        with np.errstate(over="ignore"):
            return g / (np.float32(1.0) + np.exp(-g)) * u

    def gelu_mul(self, g, u):
        return gelu_mul(torch.from_numpy(g), torch.from_numpy(u)).numpy()

    def sigmoid_gate(self, s, x, w):
        return s * (np.float32(1.0) / (np.float32(1.0) + np.exp(-(x @ host_array(w)))))[:, None]

    def route(self, moe, logits):
        r = moe.routing
        if r.kind == "softmax":  # the numba twin of layers.route_softmax_topk
            return Route(*route_rows(logits, r.k, r.renormalise))
        ids, w = route(torch.from_numpy(logits), r)
        return Route(ids.numpy(), w.numpy())

    def experts(self, moe, h, hq, r):
        ids = torch.from_numpy(r.ids)
        moe.last_ids = ids
        return moe.experts.forward(moe.i, torch.from_numpy(h), ids, torch.from_numpy(r.weights)).numpy()


class HostMoEStep:
    """The host implementation's fast path for one token: the arguments of
    :func:`~engine.kernels.host_layers.decode_moe_layer` for one layer, gathered once at build time."""

    def __init__(self, layer, attn, moe, stacks):
        a = attn.a
        f32 = np.float32
        lin = [attn.wq, attn.wk, attn.wv]
        biases = [host_array(w.bias) for w in lin]
        self.i = attn.i
        self.moe = moe
        self.head = (host_array(layer.attn_norm), host_array(layer.ffn_norm), f32(layer.eps))
        qkv = []
        for w in lin:
            qkv += [int(w.w.qtype), w.w.raw, w.w.scales]
        self.qkv = (*qkv, *biases)
        self.attn = (host_array(attn.q_norm), host_array(attn.k_norm), QK_NORM[attn.qk_norm])
        self.shape = (a.rope_neox, a.n_head, a.n_head_kv, a.head_dim)
        self.out = (int(attn.wo.w.qtype), attn.wo.w.raw, attn.wo.w.scales)
        self.route = (moe.router.w.raw, moe.routing.k, moe.routing.renormalise)
        g, u, d = stacks.gate, stacks.up, stacks.down
        self.experts = (int(g.qtype), g.raw, g.scales, u.raw, u.scales, int(d.qtype), d.raw, d.scales)

    @classmethod
    def build(cls, layer) -> HostMoEStep | None:
        """The fused step for ``layer`` (a ``DecoderLayer``), or None when it does not apply."""
        from engine.experts import CpuExperts
        from engine.kernels.grouped import fused_grouped

        attn, moe = layer.attn, layer.moe
        if not (layer.host and moe is not None and moe.shared is None and moe.routing.kind == "softmax"):
            return None
        # It inlines the CPU backend's expert kernels: only where that backend serves the layer.
        if not isinstance(moe.experts, CpuExperts) or moe.router.w.qtype != QType.F32 or moe.router.bias is not None:
            return None
        mats = [attn.wq, attn.wk, attn.wv, attn.wo]
        if not all(w.q8_act and w.w.qtype in FUSED_TYPES for w in mats):
            return None
        if (attn.wq.bias is None) != (attn.wk.bias is None) or (attn.wk.bias is None) != (attn.wv.bias is None):
            return None
        if attn.i not in moe.experts.stacks:
            return None
        stacks = moe.experts.host_stacks(attn.i)
        if not fused_grouped(stacks.gate, stacks.up, stacks.down, moe.experts.q8_act):
            return None
        return cls(layer, attn, moe, stacks)

    def __call__(self, x: np.ndarray, pos: int, cache: KVCache, cos: np.ndarray, sin: np.ndarray) -> np.ndarray | None:
        """x float32 [D] -> float32 [D]; writes the cache row ``pos``; records the routing. None where the
        layer's cache is not float32 on the host (then the step-by-step ops serve)."""
        kv = host_kv(cache, self.i, pos, 1)
        if kv is None:
            return None
        y, ids = self.run(x, pos, kv, cos, sin)
        self.moe.note_route(ids)
        return y

    def run(self, x: np.ndarray, pos: int, kv: tuple[np.ndarray, np.ndarray], cos: np.ndarray, sin: np.ndarray):
        """The layer on x float32 [D] with the cache rows ``kv`` (``host_kv``) -> (x' float32 [D], expert ids
        int64 [K]); records nothing (the caller notes the route)."""
        return decode_moe_layer(
            x, *self.head, *self.qkv, *self.attn, cos, sin, *self.shape, *kv, pos, *self.out, *self.route,
            *self.experts,
        )  # fmt: skip
