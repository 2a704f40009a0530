"""Decode of one token as the replay of a captured CUDA graph (issue #7: Python off the token path).

Where every layer of a decode step sits on one device — the whole trunk, the KV cache and the
output there, and the routed experts ``resident`` (every expert of every layer in the slot pool,
pinned) or no routed experts at all — a token's step needs nothing from the host but its
embedded row and its position. :class:`GraphDecode` then runs the step as:

    one H2D copy (x row | position, one buffer) → graph replay → one D2H copy (logits | routes)

and everything else — attention with the K/V write at a device position, routing top-k, the
experts' slots looked up on the device, the fused MoE kernels — runs inside the graph
(``DecoderLayer.decode_static``: the same math as the eager path, written graph-friendly and
usable eagerly too). Attention runs over a static length, one graph per power-of-two bucket of
the context (positions past the token masked), all sharing one graph memory pool.

The routes (expert ids per MoE layer) leave the graph with the logits, so the profiler's calls,
hits and heat and ``MoE.last_ids`` stay true, recorded once per step.

``SHARPI_CUDA_GRAPH=0`` turns it off; ``SHARPI_CUDA_GRAPH=eager`` runs the same static step
without capturing, on any device (the CPU simulated device in CI: how the tests check it).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.models.blocks import MoE, StaticStep
from engine.models.layers import rope_tables
from engine.plan.costmodel import ENV_CUDA_GRAPH as ENV_CUDA_GRAPH  # re-exported (tests)
from engine.plan.costmodel import graph_setting
from engine.runtime import step_attention, step_kernels
from engine.runtime import triton_qblocks as qblocks

log = logging.getLogger(__name__)

MIN_BUCKET = 16  # the shortest static attention length


def graph_mode() -> str:
    """``off`` | ``graph`` (capture on CUDA; the default) | ``eager`` (the static step, not captured)."""
    return graph_setting()


def bucket(pos: int, n_ctx: int) -> int:
    """The static attention length for a token at ``pos``: the smallest power of two ≥ pos + 1
    (at least MIN_BUCKET), capped at the context."""
    return min(max(MIN_BUCKET, 1 << (pos).bit_length()), n_ctx)


def buckets(n_ctx: int) -> list[int]:
    """Every static length a context of ``n_ctx`` uses, shortest first."""
    out = [MIN_BUCKET << j for j in range(max(n_ctx - 1, 1).bit_length()) if MIN_BUCKET << j < n_ctx]
    return out + [n_ctx]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


def for_placement(model, placement, device: torch.device | str, experts=None) -> GraphDecode | None:
    """The graph decoder for an applied placement, or None where it does not apply: not every
    layer on the device, experts not resident (or some on the CPU), ``SHARPI_CUDA_GRAPH=0``, or a
    device other than CUDA unless ``SHARPI_CUDA_GRAPH=eager``."""
    mode = graph_mode()
    device = torch.device(device)
    if mode == "off" or (mode == "graph" and device.type != "cuda"):
        return None
    a = model.args
    if placement.n_gpu_layers < a.n_layer:
        return None
    moe = [i for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]
    if moe:
        if placement.moe_mode != "resident" or placement.n_cpu_moe or experts is None:
            return None
        if any(model.experts_of(i) is not experts for i in moe) or not experts.pin_static():
            return None
    return GraphDecode(model, device, capture=mode == "graph", moe_layers=moe, resident=bool(moe))


class GraphDecode:
    """Static buffers, rope tables and captured graphs for one model placement and KV cache."""

    def __init__(self, model, device: torch.device, *, capture: bool, moe_layers: list[int], resident: bool):
        a = model.args
        self.model, self.device, self.capture, self.resident = model, device, capture, resident
        self.moe_layers = np.asarray(moe_layers, np.int64)
        D, V, K = a.n_embd, model.output.out_features, max(a.n_expert_used, 1)
        self.D, self.V = D, V
        pin = device.type == "cuda"
        # One input buffer: the embedded row float32 [D], then the position int64 (8-aligned).
        self._xo = _align8(D * 4)
        self._in = torch.zeros(self._xo + 8, dtype=torch.uint8, device=device)
        self._in_h = torch.zeros(self._xo + 8, dtype=torch.uint8, pin_memory=pin)
        self.x = self._in[: D * 4].view(torch.float32).view(1, D)
        self.pos = self._in[self._xo :].view(torch.int64)  # [1]
        # One output buffer: logits float32 [V], then the routes int64 [n_moe, K] (8-aligned).
        self._ro = _align8(V * 4)
        n_out = self._ro + 8 * len(moe_layers) * K
        self._out = torch.zeros(n_out, dtype=torch.uint8, device=device)
        self._out_h = torch.zeros(n_out, dtype=torch.uint8, pin_memory=pin)
        self.logits = self._out[: V * 4].view(torch.float32).view(1, V)
        self.routes = self._out[self._ro :].view(torch.int64).view(len(moe_layers), K)
        self._x_h = self._in_h[: D * 4].view(torch.float32).view(1, D)
        self._pos_h = self._in_h[self._xo :].view(torch.int64)
        self._logits_h = self._out_h[: V * 4].view(torch.float32).view(1, V)
        self._routes_h = self._out_h[self._ro :].view(torch.int64).view(len(moe_layers), K)
        self._route_rows = {int(i): self.routes[j : j + 1] for j, i in enumerate(moe_layers)}  # [1, K] views
        fused = step_kernels.enabled(device)  # few, larger launches for the glue between matrices
        self._rope_kv = step_kernels.qk_rope_kv if fused else None
        self._add_norm = step_kernels.add_rms_norm if fused else None
        self._fused = fused
        self._attend = None  # step_attention.attend where it applies to the bound cache (bind)
        self.cache = None  # the KV cache the graphs write (bound on first use)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.steps = self.replays = 0  # counters (tests, diagnostics)

    # -- binding ----------------------------------------------------------------------------------
    def bind(self, cache) -> bool:
        """Use ``cache`` (its tensors are baked into the graphs): a new cache drops the graphs.
        False when some layer's K/V is not on this device (then the eager path serves)."""
        if cache is self.cache:
            return True
        self.graphs, self._pool, self.cache = {}, None, None
        stores = [*cache.k.values(), *cache.v.values()]
        if len(cache.k) < self.model.args.n_layer or not all(_same_device(s.q.device, self.device) for s in stores):
            return False
        a = self.model.args
        cos, sin = self.model._rope(np.arange(cache.n_ctx), self.device)  # [n_ctx, rope_dim/2]
        self.cos, self.sin, self.perm = rope_tables(cos, sin, a.head_dim, a.rope_neox)  # [n_ctx, hd] x2, [hd]
        self.kpos = torch.arange(cache.n_ctx, device=self.device)
        dtypes = {s.q.dtype for s in stores}
        ok = self._fused and len(dtypes) == 1 and step_attention.applies(a.head_dim, a.n_head, a.n_head_kv, *dtypes)
        self._attend = step_attention.attend if ok else None
        self.cache = cache
        return True

    # -- the step ---------------------------------------------------------------------------------
    def _body(self, length: int) -> None:
        """The whole token on the device: reads ``x``, ``pos``; writes ``logits``, ``routes``, K/V."""
        m, pos = self.model, self.pos
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)  # [1, hd]
        st = StaticStep(pos, length, cos, sin, self.perm, self.kpos, self.cache, self._rope_kv, self._add_norm,
                        self._attend)  # fmt: skip
        x, y = self.x, None
        for i, layer in enumerate(m.layers):
            x, y = layer.decode_static(x, y, st, self._route_rows.get(i))
        self.logits.copy_(m.output(st.add_rms_norm(x, y, m.out_norm, m.args.rms_eps)[1]))

    def _capture(self, length: int) -> None:
        """Capture the step for attention length ``length`` (a bucket) into a graph of the shared
        pool, after one eager warm-up of it on a side stream under ``triton_qblocks.graph_warmup``
        (the kernel variants the capture records — PDL, q8 activations — compiled and loaded, cuBLAS
        and lazy state created for these shapes; it computes exactly what the replay then does).
        Buckets are captured when a position first needs them, so the first token pays for one."""
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side), qblocks.graph_warmup():
            self._body(length)
        cur.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._body(length)
        self.graphs[length] = g

    def step(self, row: torch.Tensor, pos: int, cache) -> torch.Tensor | None:
        """Decode one token: row float32 [1, D] (the embedded token, host), at position ``pos``
        (< cache.n_ctx: the caller checks) -> logits float32 [1, V] on the host; None when this
        cache cannot be served here (the caller runs the eager path)."""
        if not self.bind(cache):
            return None
        self._x_h.copy_(row)
        self._pos_h[0] = pos
        self._in.copy_(self._in_h, non_blocking=True)
        L = bucket(pos, cache.n_ctx)
        if self.capture and L not in self.graphs:
            try:
                self._capture(L)
            except Exception as e:  # a failed capture must not stop decoding: stay eager
                log.warning("CUDA graph capture failed, decoding without graphs: %s", e)
                self.capture, self.graphs, self._pool = False, {}, None
                torch.cuda.synchronize(self.device)
        if self.capture:
            self.graphs[L].replay()
            self.replays += 1
        else:
            self._body(L)
        self._out_h.copy_(self._out, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.steps += 1
        self._record(self._routes_h.numpy().copy())
        return self._logits_h.clone()

    def _record(self, routes: np.ndarray) -> None:
        """The step's routes [n_moe, K] into the profiler (calls, heat; hits: the pool is resident)
        and each MoE layer's ``last_ids`` [1, K]."""
        if not len(self.moe_layers):
            return
        self.model.profiler.record_routes(self.moe_layers, routes, hits=self.resident)
        for j, i in enumerate(self.moe_layers):
            self.model.layers[i].ffn.last_ids = torch.from_numpy(routes[j : j + 1])
