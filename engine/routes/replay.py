"""Replaying a routing trace into a model: every MoE layer's top-k follows the trace (ids and weights) instead of
its router, so a file's speed can be measured under another model's routing (the random-weight 30B-geometry file
under the synthetic Qwen3-30B-A3B trace). Benchmarks only: it changes what the model computes.

A :class:`RouteReplayer` is a model's route tap (``DecoderModel.set_route_tap``): the model opens each forward
pass (:meth:`begin_pass`, T tokens), each MoE layer's routing is replaced (:meth:`route`), the model closes the
pass (:meth:`end_pass`). Token t of the run takes trace token ``t mod tokens``. Inside a decode graph the layers
read the replayed row from static buffers on the device that :meth:`begin_pass` fills before the step, so
captured graphs replay the trace too (``layerwise`` is False: the model keeps its graph and fast paths whose
routing goes through :meth:`route`).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.errors import UsageError
from engine.routes.trace import RouteTrace


class RouteReplayer:
    layerwise = False  # the decode graph stays (its route reads the static rows); the recorder's is True

    def __init__(self, trace: RouteTrace, moe_layers: list[int], n_expert: int, k: int):
        if trace.n_expert > n_expert or trace.k != k:
            raise UsageError(
                f"the trace routes top-{trace.k} of {trace.n_expert} experts; this model routes top-{k} of {n_expert}"
            )
        if trace.n_layers != len(moe_layers):
            raise UsageError(f"the trace has {trace.n_layers} MoE layers; this model has {len(moe_layers)}")
        self.trace = trace
        self.column = {int(i): j for j, i in enumerate(moe_layers)}  # model layer -> trace layer
        self.ids = torch.from_numpy(trace.ids.astype(np.int64))
        self.weights = torch.from_numpy(trace.weights.copy())
        self.cursor = 0  # the next token of the run
        self._rows = np.zeros(0, np.int64)  # this pass's trace tokens
        self._static: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # one token's rows, per device

    def begin_pass(self, n_tokens: int) -> None:
        self._rows = (self.cursor + np.arange(n_tokens)) % self.trace.n_tokens
        if n_tokens == 1:
            t = int(self._rows[0])
            for ids, w in self._static.values():
                ids.copy_(self.ids[t])
                w.copy_(self.weights[t])

    def end_pass(self, n_tokens: int) -> None:
        self.cursor += n_tokens

    def route(self, layer: int, r):
        """The pass's trace routes of ``layer`` in the form of ``r`` (a Route: numpy, or torch on its device)."""
        j = self.column[layer]
        if isinstance(r.ids, np.ndarray):
            return type(r)(self.ids[self._rows, j].numpy(), self.weights[self._rows, j].numpy())
        dev = r.ids.device
        if len(self._rows) == 1:  # a one-token step (perhaps being captured): the static rows
            ids, w = self._static_rows(dev)
            return type(r)(ids[j : j + 1], w[j : j + 1])
        return type(r)(self.ids[self._rows, j].to(dev), self.weights[self._rows, j].to(dev))

    def observe(self, layer: int, ids, weights) -> None:  # the tap's other half: nothing to record
        pass

    def _static_rows(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if dev not in self._static:  # first use on this device: eager (a capture warms up first)
            t = int(self._rows[0])
            self._static[dev] = (self.ids[t].to(dev).clone(), self.weights[t].to(dev).clone())
        return self._static[dev]
