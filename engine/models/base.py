"""The decoder model skeleton shared by every architecture: embed → layers → norm → logits.

Where each layer runs is configuration, not a different model: :meth:`DecoderModel.configure`
gives every layer its weights source (host memory map or a device) and its expert backend, then
rebuilds the layers from the same architecture code. The runtime calls it to apply a placement.
"""

from __future__ import annotations

import numpy as np
import torch

from engine import ops
from engine.errors import ModelError, UsageError
from engine.experts import CpuExperts, ExpertBackend, ExpertStacks
from engine.kernels.moe import ExpertGLU
from engine.kv_cache import KVCache
from engine.models.args import ModelArgs
from engine.models.host import host_kv
from engine.models.layers import rms_norm, rope_theta
from engine.models.weights import Embedding, Weights
from engine.profiler import ExpertProfiler

HOST = torch.device("cpu")


def _probe(x: torch.Tensor) -> torch.Tensor | None:
    """What a forward pass keeps of a layer's output for :meth:`DecoderModel._finite`: one token's row as
    is, a batch's sum (NaN and infinities carry into it; the batch itself is not held), nothing of a device
    tensor (no sync, no device memory held)."""
    if x.device.type != "cpu":
        return None
    return x if x.shape[0] == 1 else x.sum()


class DecoderModel:
    """A loaded model. Architecture modules subclass it and implement :meth:`make_layer`."""

    def __init__(self, w: Weights, args: ModelArgs, experts: ExpertBackend | None = None):
        self.w, self.args = w, args
        self.profiler = ExpertProfiler(args.n_layer, args.n_expert)
        self.embed = Embedding(w.gf.tensor("token_embd.weight"))
        host_experts = experts or (CpuExperts(self.expert_stacks(), q8_act=w.q8_act) if args.is_moe else None)
        L = args.n_layer
        # The one-token step as a CUDA graph (engine.runtime.graph_decode.GraphDecode), set by the
        # runtime for placements wholly on one device; dropped by every configure.
        self.decode_graph = None
        # The expert cache's page-locked host copy of the experts (engine.runtime.expert_pool.HostMirror), kept by
        # the runtime across placements so that a re-plan reuses it instead of copying again; None: none made.
        self.host_mirror = None
        # Rows of token_embd decoded on a device, (ref, ids, device) -> float32 [T, D] equal to the host's (the
        # runtime's ``embedding_rows``, set when a placement is applied; used where the first layer is on CUDA)
        self.device_embed = None
        # engine.routes.RouteRecorder (or None): every MoE layer's routes, see set_route_tap.
        self.route_tap = None
        self.configure([w] * L, [HOST] * L, {i: host_experts for i in range(L)} if host_experts else {}, w)

    # Architecture quirks the skeleton reads (set by a subclass): the token embeddings are multiplied by
    # ``embed_scale`` where it is not None (Gemma: sqrt(n_embd)).
    embed_scale: float | None = None
    # YaRN RoPE scaling (``layers.YaRN``) of every layer's rotation, or None (gpt-oss sets it).
    yarn = None
    # Whether a forward pass keeps every position's last hidden state after ``output_norm`` in ``last_hidden``
    # (float32 [T, D] on the host): what the MTP head drafts from (engine.generate.speculative). While set, a
    # one-token step runs eagerly (the CUDA-graph step does not hand its hidden state back).
    keep_hidden: bool = False
    last_hidden: torch.Tensor | None = None
    # Whether the one-token device step (``runtime.step_ops.DeviceStepOps``, CUDA-graph decode) computes this
    # architecture; where not, device layers decode on the eager torch ops as they run a prompt.
    graph_step: bool = True

    def make_layer(self, i: int):
        raise NotImplementedError

    def layer_rope(self, i: int) -> tuple[float, float]:
        """Layer i's RoPE (base, linear scale): the model's unless an architecture gives layers their own
        (Gemma 3's sliding-window layers)."""
        return self.args.rope_base, self.args.rope_scale

    def embed_tokens(self, tokens: np.ndarray, device: torch.device | None = None) -> torch.Tensor:
        """The rows of ``token_embd`` for ``tokens`` [T], scaled by :attr:`embed_scale` -> float32 [T, D] on the
        host, or made on ``device`` where one is given (the same values: :attr:`device_embed`)."""
        x = self.embed(tokens) if device is None else self.device_embed(self.embed.ref, tokens, device)
        if self.embed_scale is not None:
            x = x * np.float32(self.embed_scale)
        return x

    # -- placement ------------------------------------------------------------------------------
    def lw(self, i: int):
        """The weights source of layer ``i`` (host ``Weights`` or a device's ``DeviceWeights``)."""
        return self._layer_w[i]

    def experts_of(self, i: int) -> ExpertBackend:
        return self._backends[i]

    def settle(self) -> None:
        """Finish the expert backends' background work (uploads reading the memory map): before the
        backends are replaced or the file is closed."""
        for b in {id(b): b for b in getattr(self, "_backends", {}).values()}.values():
            b.settle()

    def configure(
        self, layer_weights: list, devices: list[torch.device], backends: dict, out_weights, rope_weights=None
    ) -> None:
        """(Re)build every layer from its weights source, device and expert backend.

        out_weights: where the output norm and matrix live; rope_weights: the device weights
        source for ``rope_freqs`` when any layer is on a device."""
        self.decode_graph = None  # its buffers and graphs belong to the previous layers
        self.settle()  # the previous backends' background work ends before they are dropped
        self._layer_w, self.devices, self._backends = list(layer_weights), list(devices), dict(backends)
        for b in {id(b): b for b in self._backends.values()}.values():
            b.profiler = self.profiler
        self.layers = [self.make_layer(i) for i in range(self.args.n_layer)]
        self.set_route_tap(self.route_tap)
        self._route_layers = np.arange(self.args.n_layer)
        self.out_device = self.devices[-1]
        self.out_norm = out_weights.vector("output_norm.weight")
        self.output = out_weights.linear("output.weight" if self.w.has("output.weight") else "token_embd.weight")
        self._freq_factors = {HOST: self.w.optional_vector("rope_freqs.weight")}
        dev = next((d for d in self.devices if d != HOST), None)
        if dev is not None and rope_weights is not None:
            self._freq_factors[dev] = rope_weights.optional_vector("rope_freqs.weight")

    def set_route_tap(self, tap, keep_graphs: bool = False) -> None:
        """Hand every MoE layer's routing (ids and weights, each forward pass) to ``tap``, or stop (None). A tap
        (:class:`engine.routes.RouteRecorder`, :class:`engine.routes.replay.RouteReplayer`) has ``begin_pass(T)``,
        ``route(layer, route) -> route`` (the routing the layer then uses: its own, or a trace's) and
        ``end_pass(T)``. While one is set no layer runs its fused host step (whose routing stays inside the
        kernel), and a ``layerwise`` tap (the recorder) runs each token layer by layer, without the decode
        graph; the others keep the graph, whose step routes through the tap. ``keep_graphs``: the decode graphs
        captured so far stay (for a tap that routes a one-token pass as the tap it replaces does:
        ``engine.routes.sample.RoutingSample``)."""
        self.route_tap = tap
        graph = self.decode_graph
        if not keep_graphs and graph is not None and getattr(graph, "graphs", None):
            graph.graphs.clear()  # captured with the previous routing: captured again on the next step
        for layer in getattr(self, "layers", []):
            if getattr(layer, "moe", None) is not None:
                layer.moe.tap = tap

    def expert_stacks(self) -> dict[int, ExpertStacks]:
        """Every MoE layer's stacks, mapped; ``.resident()`` gives the host copies (CpuExperts)."""
        w = self.w
        glus = {i: self.expert_glu(i) for i in self.moe_layers()}

        def stacks(i: int, resident: bool) -> ExpertStacks:
            names = [f"blk.{i}.ffn_{r}_exps.weight" for r in ("gate", "up", "down")]
            if resident:
                return ExpertStacks(*(w.resident(n) for n in names), glu=glus[i])
            return ExpertStacks(*(w.prepared(n) for n in names), resident=lambda: stacks(i, True), glu=glus[i])

        return {i: stacks(i, False) for i in self.moe_layers()}

    def expert_glu(self, i: int) -> ExpertGLU | None:
        """Layer i's routed experts' biases and activation where they are not plain SwiGLU (gpt-oss), else None."""
        return None

    def moe_layers(self) -> list[int]:
        """The layers with routed experts: every layer of a MoE model unless an architecture says otherwise
        (GLM-4.5's leading dense layers)."""
        return list(range(self.args.n_layer)) if self.args.is_moe else []

    def new_cache(self, n_ctx: int, kv_type: str | None = None) -> KVCache:
        """A KV cache with every layer on the host (the CPU engine's); a placed session's is ``Session.cache``."""
        return self.make_cache(dict.fromkeys(range(self.args.n_layer), HOST), n_ctx, kv_type)

    def make_cache(self, devices: dict[int, torch.device], n_ctx: int, kv_type, charge=None) -> KVCache:
        """The cache of every layer (layer → device; kv_type one dtype or per layer); charge(layer, nbytes) before
        each layer's part is allocated (the runtime's device arena). Here: K and V for every layer."""
        return KVCache(devices, n_ctx, self.args.kv_dim, kv_type, charge=charge, windows=self.args.kv_windows())

    def _rope(
        self, positions: np.ndarray, device: torch.device, base: float | None = None, scale: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        base = a.rope_base if base is None else base
        scale = a.rope_scale if scale is None else scale
        if self.yarn is not None:  # ggml's rope_yarn: the mixed angles, cos and sin scaled
            theta, mscale = self.yarn.angles(positions, a.rope_dim, base)
            theta = torch.from_numpy(theta).to(device)
            return torch.cos(theta) * float(mscale), torch.sin(theta) * float(mscale)
        theta = torch.from_numpy(rope_theta(positions, a.rope_dim, base, scale)).to(device)
        ff = self._freq_factors.get(device, self._freq_factors[HOST])
        if ff is not None:
            theta = theta / ff.to(device)[None, : theta.shape[1]]
        return torch.cos(theta), torch.sin(theta)

    @torch.inference_mode()
    def forward(self, tokens, start: int, cache: KVCache, all_logits: bool = True) -> torch.Tensor:
        """tokens int [T] at positions start..start+T-1 -> logits float32 [T, V] on the host (or
        [1, V] for the last position when ``all_logits`` is False). Writes K/V into ``cache``."""
        a = self.args
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        self.profiler.begin_step()
        tap = self.route_tap
        if tap is not None:
            tap.begin_pass(T)
        self.last_hidden = None
        if T == 1 and self.decode_graph is not None and (tap is None or not tap.layerwise) and not self.keep_hidden:
            if start + 1 > cache.n_ctx:
                raise UsageError(f"context full: position {start + 1} exceeds the context of {cache.n_ctx}")
            logits = self.decode_graph.step(int(tokens[0]), start, cache)
            if logits is not None:  # None: this cache is not the device's (the eager path serves)
                self.profiler.end_step(1)
                if tap is not None:
                    tap.end_pass(1)
                return self._finite(logits, tokens, None, total=self.decode_graph.last_total)
        positions = np.arange(start, start + T)
        if T == 1 and tap is None:
            trace: list = []
            logits = self._host_decode(tokens, positions, cache, trace)
            if logits is not None:
                return self._finite(logits, tokens, trace)
        first = self.devices[0] if self.devices else HOST
        on = first.type == "cuda" and T > 1 and self.device_embed is not None
        x = self.embed_tokens(tokens, first if on else None)  # [T, D]
        trace = [_probe(x)]  # each layer's output (or its sum), only to name where a NaN/Inf first appeared
        ropes: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (layer, dev) in enumerate(zip(self.layers, self.devices)):
            key = (dev, *self.layer_rope(i))
            if key not in ropes:
                ropes[key] = self._rope(positions, dev, *key[1:])
            x = layer(x.to(dev), start, cache, *ropes[key])
            trace.append(_probe(x))
        for b in {id(b): b for b in self._backends.values()}.values():
            b.end_step()
        x = x.to(self.out_device)
        if self.keep_hidden:  # every position's normed hidden state, for the MTP head
            hn = rms_norm(x, self.out_norm, a.rms_eps)
            self.last_hidden = hn.to(HOST)
            x = hn if all_logits else hn[-1:]
            logits = self.output(x).to(HOST)
        else:
            if not all_logits:
                x = x[-1:]
            logits = self.output(rms_norm(x, self.out_norm, a.rms_eps)).to(HOST)
        self.profiler.end_step(T)
        if tap is not None:
            tap.end_pass(T)
        ops.end_of_prompt(T)
        return self._finite(logits, tokens, trace)

    def _finite(
        self, logits: torch.Tensor, tokens: np.ndarray, trace: list | None, total: float | None = None
    ) -> torch.Tensor:
        """``logits``, if every value is finite; else a :class:`ModelError` naming where the first NaN or
        infinity appeared: the token embeddings, a layer's output (``trace``: the embeddings, then each
        layer's output, of this forward pass) or the output head. One pass over the logits; the trace is
        read only when they are broken (a device graph step has none: the error names no layer).

        The test is the sum's (NaN and infinities carry into it): 14 us on a 151936-token row against 290 for
        ``isfinite(...).all()``, one thread; a sum that overflows from finite values is checked element-wise.
        ``total``: that sum where the pass made it already (a decode graph's, on the device)."""
        if total is None:
            total = float(logits.sum())
        if np.isfinite(total) or bool(torch.isfinite(logits).all()):
            return logits
        where = "the output (output_norm.weight / output.weight)"
        if trace is None or any(x is None for x in trace):
            where = "a layer on the device (run on the CPU to find which)"
        if trace is not None:
            for i, x in enumerate(trace):
                if x is None:
                    continue
                finite = bool(torch.isfinite(x).all()) if isinstance(x, torch.Tensor) else bool(np.isfinite(x).all())
                if not finite:
                    where = (
                        f"the embeddings of token(s) {sorted({int(t) for t in tokens})[:8]} (token_embd.weight)"
                        if i == 0
                        else f"layer {i - 1} (blk.{i - 1}.*)"
                    )
                    break
        raise ModelError(
            f"{self.w.gf.path}: the model computed NaN or infinity, first in {where}: its weights are damaged "
            "or overflow float32, so it cannot generate"
        )

    def _host_decode(
        self, tokens: np.ndarray, positions: np.ndarray, cache: KVCache, trace: list
    ) -> torch.Tensor | None:
        """One token through every layer's fused host step (``HostMoEStep``), or None where that does not
        apply (a layer or the output off the host, a layer without the fused step, a K/V store not
        float32 on the host). The same calls as the layers' own ``__call__`` in turn, without their
        torch wrapping between layers; the routes go to the profiler once for the token."""
        steps = self._host_steps
        if steps is None or self.out_device != HOST:
            return None
        start = int(positions[0])
        kvs = [host_kv(cache, f.i, start, 1) for f in steps]
        if any(kv is None for kv in kvs):
            return None
        a = self.args
        x = self.embed_tokens(tokens).numpy()[0]
        trace.append(x)  # the embeddings, then each layer's output (for _finite's message)
        cos, sin = (t.numpy() for t in self._rope(positions, HOST))
        routes = np.empty((len(steps), a.n_expert_used), np.int64)
        for j, (f, kv) in enumerate(zip(steps, kvs)):
            x, routes[j] = f.run(x, start, kv, cos, sin)
            trace.append(x)
        self.profiler.record_routes(self._route_layers, routes)
        for j, f in enumerate(steps):
            f.moe.set_last_row(routes, j)
        for b in {id(b): b for b in self._backends.values()}.values():
            b.end_step()
        hn = rms_norm(torch.from_numpy(x[None]), self.out_norm, a.rms_eps)
        if self.keep_hidden:
            self.last_hidden = hn
        logits = self.output(hn).to(HOST)
        self.profiler.end_step(1)
        return logits

    @property
    def _host_steps(self) -> list | None:
        """Every layer's fused host step when all layers are on the host and have one, else None
        (read each call: tests and the runtime may drop a layer's ``fused``)."""
        steps = [layer.fused for layer in self.layers]
        if any(f is None for f in steps) or any(d != HOST for d in self.devices):
            return None
        return steps
