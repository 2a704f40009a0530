"""Decode of one token as replays of captured CUDA graphs (issue #7: Python off the token path).

Where every layer's trunk sits on one device — attention, norms, routers, the KV cache and the
output there — a token's step needs nothing from the host but its id and its position.
With the routed experts ``resident`` (every expert in the pinned slot pool) or no routed experts,
:class:`GraphDecode` runs the step as:

    one H2D copy (position | the token's stored row of token_embd) → graph replay → D2H copies (logits,
    routes, the logits' sum)

and everything else — the token's embedding, attention with the K/V write at a device position, routing top-k, the
experts' slots looked up on the device, the fused MoE kernels — runs inside the graph: the layers'
one ``step`` on :class:`~engine.runtime.step_ops.DeviceStepOps` (the same math as the eager path, on
ops that need no host sync; usable uncaptured too). Attention runs over a static length, one set of graphs per power-of-two
bucket of the context (positions past the token masked), all sharing one graph memory pool.

Routed experts whose backend has a host half (``ExpertBackend.step_plan``) — on the CPU (``cpu`` mode,
layers below ``n_cpu_moe``) or in the expert cache — cut the step into :class:`Segment`s, one graph
each: a segment ends with such a MoE layer, whose device half ran inside it (the cache's hits, from a
device expert → slot table; the CPU's: nothing); its graph copies the normed row, weights and ids to
pinned memory, the host half runs between the replays (the CPU kernels: every expert, or the cache's
misses), and the next segment's graph copies its output back in.
The product's 12 GiB placement decodes this way (docs/benchmarks-gpu.md, "The 12 GiB placement as
CUDA-graph segments").

Gated DeltaNet layers (qwen35moe, qwen35, qwen3next) run in the graph too: their recurrent state is updated
in place (``RecurrentState.assign``), so each replay advances the live state; a capture's eager warm-up has
its update undone (:meth:`GraphDecode._state_kept`).

The routes (expert ids per MoE layer) leave the graph with the logits, so the profiler's calls,
hits and heat and ``MoE.last_ids`` stay true, recorded once per step.

``EngineOptions.cuda_graph`` (``SHARPI_CUDA_GRAPH``): ``off`` turns it off; ``eager`` runs the same
static step without capturing, on any device (the CPU simulated device in CI: how the tests check it).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from engine import config
from engine.config import EngineOptions
from engine.models.layers import rope_tables
from engine.runtime import kernel_select, step_attention
from engine.runtime import triton_qblocks as qblocks
from engine.runtime.references import dequantize
from engine.runtime.step_ops import DeviceStepOps

log = logging.getLogger(__name__)

MIN_BUCKET = 16  # the shortest static attention length


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


@dataclass(frozen=True)
class Segment:
    """One captured graph of a step: layers [first, stop), then — ``moe`` None — the output norm and
    matrix (the step's last segment); or — ``moe`` set, its last layer — the hand-over of that MoE
    layer, whose routed experts' host half runs after the replay."""

    first: int
    stop: int
    moe: int | None


def segments(n_layer: int, host_moe: list[int]) -> list[Segment]:
    """The step cut after each MoE layer whose experts have a host half (ascending)."""
    out, first = [], 0
    for m in host_moe:
        out.append(Segment(first, m + 1, m))
        first = m + 1
    return out + [Segment(first, n_layer, None)]


def for_placement(
    model, placement, device: torch.device | str, options: EngineOptions | None = None
) -> GraphDecode | None:
    """The graph decoder for an applied placement, or None where it does not apply: not every
    layer's trunk on the device, ``options.cuda_graph`` "off" (default options: ``config.current()``),
    or a device other than CUDA unless it is "eager", ``cache`` mode with prefetch on, or an architecture the device step does not compute
    (``model.graph_step``). Routed experts wholly on the device (a pinned
    pool) run inside the graph; any with a host half (``cpu`` and ``cache`` modes, layers below
    ``n_cpu_moe``) cut the step into segments and that half runs between the replays."""
    options = options if options is not None else config.current()
    mode = options.cuda_graph
    device = torch.device(device)
    if mode == "off" or (mode == "graph" and device.type != "cuda") or not model.graph_step:
        return None
    a = model.args
    if placement.n_gpu_layers < a.n_layer:
        return None
    if options.cache_prefetch and placement.moe_mode == "cache":
        return None  # prefetch changes the expert table inside a step, which a graph reads as captured
    moe = [i for i, layer in enumerate(model.layers) if layer.moe is not None]
    host = [i for i in moe if model.experts_of(i).step_plan(i).host]
    inside = [i for i in moe if i not in host]
    return GraphDecode(model, device, capture=mode == "graph", moe_layers=inside, host_moe=host, options=options)


class GraphDecode:
    """Static buffers, rope tables and captured graphs for one model placement and KV cache."""

    def __init__(self, model, device: torch.device, *, capture: bool, moe_layers: list[int], host_moe: list[int] = (),
                 options: EngineOptions | None = None):  # fmt: skip
        """moe_layers: the MoE layers whose experts run wholly inside the graph (the resident pool's);
        host_moe: those whose experts have a host half, run between replays (each cuts the step);
        options: the engine options the step kernels' choice follows (default ``config.current()``)."""
        a = model.args
        self.model, self.device, self.capture = model, device, capture
        self.moe_layers = np.asarray(moe_layers, np.int64)
        self.segments = segments(a.n_layer, list(host_moe))
        D, V, K = a.n_embd, model.output.out_features, max(a.n_expert_used, 1)
        self.D, self.V = D, V
        pin = self._pin = device.type == "cuda"
        # One input buffer: the position int64, then the token's row of token_embd as stored (16-aligned), which
        # the graph decodes (embedding_rows' arithmetic: the host's values) — no host dequantizing a token.
        emb = model.embed.ref
        self._embed_type, self._embed_scale = emb.qtype, model.embed_scale
        self._table = emb.data.view(np.uint8).reshape(emb.shape[0], -1)  # [n_vocab, row bytes], the mapped file
        rb = self._table.shape[1]
        self._in = torch.zeros(16 + rb, dtype=torch.uint8, device=device)
        self._in_h = torch.zeros(16 + rb, dtype=torch.uint8, pin_memory=pin)
        self.pos = self._in[:8].view(torch.int64)  # [1]
        self.row = self._in[16:].view(1, rb)
        self._pos_h = self._in_h[:8].view(torch.int64)
        self._row_h = self._in_h[16:].numpy()
        # The sum of the logits, made in the graph (NaN and infinities carry into it: the model's finiteness
        # test reads one number, not the vocabulary)
        self.total = torch.zeros(1, dtype=torch.float32, device=device)
        self._total_h = torch.zeros(1, dtype=torch.float32, pin_memory=pin)
        self.last_total = float("nan")  # the last step's, on the host
        # The graph's outputs: logits float32 [1, V] and the routes int64 [n_moe, K] (copied out each step).
        self.logits = torch.zeros((1, V), dtype=torch.float32, device=device)
        self.routes = torch.zeros((len(moe_layers), K), dtype=torch.int64, device=device)
        self._routes_h = torch.zeros((len(moe_layers), K), dtype=torch.int64, pin_memory=pin)
        self._route_rows = {int(i): self.routes[j : j + 1] for j, i in enumerate(moe_layers)}  # [1, K] views
        if len(self.segments) > 1:  # experts on the host between segments
            # What a segment hands over: the normed row h float32 [D] | weights float32 [K] | ids int64
            # [K] (one D2H copy); the residual stays on the device, in two buffers taken in turn so
            # that a segment never writes what it reads (its capture's warm-up and its replay then
            # compute the same); the experts' output y comes back into ``y_in`` [1, D].
            # Each cut hands over into a pinned row of its own (its ids stay there for the step's record).
            self._io = _align8(D * 4 + K * 4)
            n_cut = len(self.segments) - 1
            self._hand = torch.zeros(self._io + 8 * K, dtype=torch.uint8, device=device)
            self._hand_h = torch.zeros((n_cut, self._io + 8 * K), dtype=torch.uint8, pin_memory=pin)
            self.h, self.weights, self.ids = self._views(self._hand, D, K)
            self._carry = torch.zeros((2, 1, D), dtype=torch.float32, device=device)
            self.y_in = torch.zeros((1, D), dtype=torch.float32, device=device)
            self._y_h = torch.zeros((1, D), dtype=torch.float32, pin_memory=pin)
            self._np = [
                (*(v.numpy() for v in self._views(self._hand_h[j], D, K)), self._y_h.numpy()) for j in range(n_cut)
            ]
        # How each cut's experts run: "cache" (a device half inside the graph — the pool's hits — and the
        # host half — the misses — between the replays) or "cpu" (the host half does them all).
        cut = [g.moe for g in self.segments[:-1]]
        self._kind = {j: "cache" if model.experts_of(i).step_plan(i).device else "cpu" for j, i in enumerate(cut)}
        # The cuts' routes of the step, recorded in one profiler call at its end (as the graph's own are).
        self._cut_moe = np.asarray(cut, np.int64)
        self._cut_routes = np.zeros((len(cut), K), np.int64)
        self._cut_backends = list({id(b): b for b in (model.experts_of(i) for i in cut)}.values())
        # Layers inside the graph whose misses were read over the bus: their routes go to their backend after the
        # step (counted, the misses queued for upload), not recorded as the resident pool's all-hits.
        bus = np.array([model.experts_of(int(i)).step_plan(int(i)).bus for i in self.moe_layers], bool)
        self._bus = bus if bus.any() else None
        owners = {id(model.experts_of(int(i))): model.experts_of(int(i)) for i in self.moe_layers[bus]}
        self._bus_backends = [  # (backend, the rows of the step's routes that are its layers')
            (b, np.array([id(model.experts_of(int(i))) == k for i in self.moe_layers], bool) & bus)
            for k, b in owners.items()
        ]
        self._stream = None  # the stream a step runs on (looked up once a step: the lookup costs ~50 µs)
        self._fused = kernel_select.step_kernels(device, options)  # few, larger launches for the glue between matrices
        self._consts: dict = {}  # DeviceStepOps' values made once (outside any capture)
        self._attend = None  # step_attention.attend where it applies to the bound cache (bind)
        self.cache = None  # the KV cache the graphs write (bound on first use)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket -> a graph per segment
        self._pool = None
        self._side = None  # the stream the captures warm up on
        self.steps = self.replays = 0  # counters (tests, diagnostics)

    def _views(self, buf: torch.Tensor, D: int, K: int):
        """(h [1, D], weights [1, K], ids [1, K]) over a hand-over buffer."""
        h = buf[: D * 4].view(torch.float32).view(1, D)
        w = buf[D * 4 : D * 4 + K * 4].view(torch.float32).view(1, K)
        return h, w, buf[self._io :].view(torch.int64).view(1, K)

    @property
    def cuts(self) -> list[str]:
        """How the experts of each MoE layer that cuts the step run: "cpu" (all by the host half, between
        the replays) or "cache" (hits inside the graph, misses on the CPU)."""
        return [self._kind[j] for j in range(len(self.segments) - 1)]

    def describe(self) -> str:
        n = len(self.segments)
        how = "CUDA graphs" if self.capture else "static, not captured"
        if self._bus is not None:
            how += ", expert-cache misses read from host memory over the bus inside them"
        if n == 1:
            return how
        where = {"cpu": "routed experts on the CPU between them",
                 "cache": "expert-cache hits inside them, misses on the CPU between them"}  # fmt: skip
        return f"{how}, {n} a token ({'; '.join(where[k] for k in dict.fromkeys(self.cuts))})"

    # -- binding ----------------------------------------------------------------------------------
    def bind(self, cache) -> bool:
        """Use ``cache`` (its tensors are baked into the graphs): a new cache drops the graphs.
        False when some layer's K/V or recurrent state is not on this device (then the eager path serves).
        A Gated DeltaNet layer's state (``RecurrentState``) is updated in place by the step, so the graphs
        follow it; the cache's ``enter`` still runs per token (``HybridModel.forward``) to keep its position."""
        if cache is self.cache:
            return True
        self.graphs, self._pool, self.cache = {}, None, None
        stores = [*cache.k.values(), *cache.v.values()]
        states = [t for st in cache.recurrent.values() for t in (st.conv, st.ssm)]  # written in place by the step
        every_layer = len(cache.k) + len(cache.recurrent) >= self.model.args.n_layer
        if not every_layer or not all(_same_device(t.device, self.device) for t in [*(s.q for s in stores), *states]):
            return False
        a = self.model.args
        cos, sin = self.model._rope(np.arange(cache.n_ctx), self.device)  # [n_ctx, rope_dim/2]
        self.cos, self.sin, self.perm = rope_tables(cos, sin, a.head_dim, a.rope_neox)  # [n_ctx, hd] x2, [hd]
        self._cs = torch.zeros((2, 1, self.cos.shape[1]), dtype=self.cos.dtype, device=self.device)  # this step's rows
        self.kpos = torch.arange(cache.n_ctx, device=self.device)
        dtypes = {s.q.dtype for s in stores}
        ok = self._fused and len(dtypes) == 1 and step_attention.applies(a.head_dim, a.n_head, a.n_head_kv, *dtypes)
        self._attend = step_attention.attend if ok else None
        self.cache = cache
        return True

    # -- the step ---------------------------------------------------------------------------------
    def _segment(self, length: int, s: int) -> None:
        """Segment ``s`` of the token on the device. The first reads ``x``, ``pos`` (and writes this
        step's rope rows); the last writes ``logits``; every MoE layer of the graph writes its
        ``routes`` row, every layer its K/V. A segment that ends at a MoE layer with a host half writes
        the hand-over (h, weights, ids) and the residual; the next one reads that residual and ``y_in``."""
        m, seg = self.model, self.segments[s]
        if s == 0:
            torch.index_select(self.cos, 0, self.pos, out=self._cs[0])
            torch.index_select(self.sin, 0, self.pos, out=self._cs[1])
        ops = DeviceStepOps(self.pos, length, self._cs[0], self._cs[1], self.perm, self.kpos, self.cache,
                            routes=self._route_rows, consts=self._consts, fused=self._fused, attend=self._attend)  # fmt: skip
        if s:  # the host half's output, from pinned memory: a copy in the graph
            self.y_in.copy_(self._y_h, non_blocking=True)
        x, y = (self._embedded(), None) if s == 0 else (self._carry[(s - 1) % 2], self.y_in)
        for i in range(seg.first, seg.stop):
            x, y = m.layers[i].step(ops, x, y)
        if seg.moe is None:
            self.logits.copy_(m.output(ops.add_norm(x, y, m.out_norm, m.args.rms_eps)[1]))
            self.total.copy_(self.logits.sum().view(1))
            return
        cut = ops.cut  # layer seg.moe's: the device half (and any shared expert) is in y
        self._carry[s % 2].copy_(x if y is None else x + y)
        self.h.copy_(cut.h)
        self.weights.copy_(cut.weights)
        self.ids.copy_(cut.ids)
        self._hand_h[s].copy_(self._hand, non_blocking=True)  # the hand-over to pinned memory for the host half

    def _embedded(self) -> torch.Tensor:
        """The step's token embedded, float32 [1, D]: its stored row decoded on the device, scaled as
        ``DecoderModel.embed_tokens`` scales it."""
        x = dequantize(self.row, self._embed_type, self.D)
        return x if self._embed_scale is None else x * np.float32(self._embed_scale)

    def _capture(self, length: int, s: int = 0) -> None:
        """Capture segment ``s`` for attention length ``length`` (a bucket) into a graph of the shared
        pool, after one eager warm-up of it on a side stream under ``triton_qblocks.graph_warmup``
        (the kernel variants the capture records — PDL, q8 activations — compiled and loaded, cuBLAS
        and lazy state created for these shapes; it computes exactly what the replay then does: a
        segment never writes what it reads). Buckets are captured when a position first needs them,
        so the first token of a bucket pays for its segments."""
        for b in self._cut_backends:  # background uploads land first (the capture then runs alone)
            b.settle()
        cur = torch.cuda.current_stream(self.device)
        if self._side is None:  # one warm-up stream for every capture: the caching allocator and cuBLAS keep
            self._side = torch.cuda.Stream(self.device)  # memory per stream (a 32 MiB workspace each)
        side = self._side
        with self._state_kept(cur):
            side.wait_stream(cur)
            with torch.cuda.stream(side), qblocks.graph_warmup():
                self._segment(length, s)
            cur.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (the cache's upload worker) do not invalidate the capture
        with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
            self._segment(length, s)
        self.graphs.setdefault(length, []).append(g)

    @contextmanager
    def _state_kept(self, stream):
        """The linear-attention layers' states as they were before a capture's warm-up: K/V writes repeat
        harmlessly (the same rows again), but a recurrent state updated in place would advance twice — by the
        warm-up and by the replay — so the warm-up's update is undone (copies on ``stream``, ordered with it)."""
        saved = [(st, st.conv.clone(), st.ssm.clone()) for st in self.cache.recurrent.values()]
        yield
        with torch.cuda.stream(stream):
            for st, conv, ssm in saved:
                st.assign(conv, ssm)

    def _run(self, length: int, s: int) -> None:
        """Segment ``s``: replayed (captured first when this bucket reaches it), or run eagerly."""
        if self.capture and len(self.graphs.get(length, ())) <= s:
            try:
                self._capture(length, s)
            except Exception as e:  # a failed capture must not stop decoding: stay eager
                log.warning("CUDA graph capture failed, decoding without graphs: %s", e)
                self.capture, self.graphs, self._pool = False, {}, None
                torch.cuda.synchronize(self.device)
        if self.capture:
            self.graphs[length][s].replay()
        else:
            self._segment(length, s)

    def replay(self, length: int) -> None:
        """Replay a captured bucket's segments in order, nothing on the host between them: a step's GPU
        time where no experts run on the host (``labs/step_replay.py`` times it)."""
        for g in self.graphs[length]:
            g.replay()

    def step(self, token: int, pos: int, cache) -> torch.Tensor | None:
        """Decode one token id at position ``pos`` (< cache.n_ctx: the caller checks) -> logits float32
        [1, V] on the host (their sum in :attr:`last_total`); None when this cache cannot be served here
        (the caller runs the eager path)."""
        if not self.bind(cache):
            return None
        self._row_h[:] = self._table[token]
        self._pos_h[0] = pos
        self._in.copy_(self._in_h, non_blocking=True)
        L = bucket(pos, cache.n_ctx)
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for s, seg in enumerate(self.segments):
            self._run(L, s)
            if seg.moe is not None:
                self._host_experts(s, seg.moe)
        if self.capture:
            self.replays += 1
        # The logits straight into a tensor of the caller's (page-locked where the device is CUDA: torch's
        # caching host allocator hands a freed one back), the routes into the step's own buffer.
        logits = torch.empty((1, self.V), dtype=torch.float32, pin_memory=self._pin)
        logits.copy_(self.logits, non_blocking=True)
        self._routes_h.copy_(self.routes, non_blocking=True)
        self._total_h.copy_(self.total, non_blocking=True)
        self._sync()
        self.last_total = float(self._total_h[0])
        self.steps += 1
        self._stream = None
        routes = self._routes_h.numpy().copy()
        if self._bus is None:
            self._record(routes, self.moe_layers, hits=True)  # the resident pool: all hits
        else:
            self._record(routes[~self._bus], self.moe_layers[~self._bus], hits=True)
            self._record(routes[self._bus], self.moe_layers[self._bus], hits=False)
            for b, rows in self._bus_backends:
                b.routed(self.moe_layers[rows], routes[rows])
        self._record(self._cut_routes.copy(), self._cut_moe, hits=False)
        for b in {id(b): b for b in (*self._cut_backends, *(b for b, _ in self._bus_backends))}.values():
            b.end_step()
        return logits

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _host_experts(self, s: int, i: int) -> None:
        """Layer ``i``'s host half after segment ``s``, on the hand-over the segment's graph copied to pinned
        memory; its output goes where the next segment's graph copies it in (its routes: recorded at the
        step's end)."""
        self._sync()
        h, weights, ids_h, y = self._np[s]
        ids = self._cut_routes[s]
        ids[:] = ids_h[0]
        got = self.model.experts_of(i).host_part(i, h, ids[None], weights)
        y[:] = 0.0 if got is None else got

    def _record(self, routes: np.ndarray, layers: np.ndarray, hits: bool) -> None:
        """A step's routes [n, K] of MoE ``layers`` into the profiler (calls, heat; ``hits``: each was
        served from the pool) and each layer's ``last_ids`` [1, K]."""
        if not len(layers):
            return
        self.model.profiler.record_routes(layers, routes, hits=hits)
        for j, i in enumerate(layers):
            self.model.layers[i].ffn.set_last_row(routes, j)
