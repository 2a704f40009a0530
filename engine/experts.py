"""Routed-expert backends: the declared interface every MoE layer calls, and the CPU backend.

Models never see where experts live. :class:`ExpertBackend` is the whole interface:

- ``forward``: T tokens eagerly (prefill, eager decode), host syncs allowed — everything, with the
  bookkeeping (routes, cache hits and misses, uploads);
- a one-token step (a decode CUDA graph) in two halves, declared per layer by :meth:`step_plan`:
  ``device_part`` inside the step, with no host sync (the resident pool computes every expert, the
  cache its hits, the CPU nothing), and ``host_part`` on the host after it (the CPU every expert, the
  cache its misses, the resident pool nothing). A decode graph cuts its step wherever a host half can
  return work;
- ``end_step``: once after each forward pass (uploads).

:class:`CpuExperts` computes on the CPU from the memory-mapped quantized stacks; the hybrid runtime
adds the device slot pool behind the same interface (``engine.runtime.expert_cache.CachedExperts``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.kernels.moe import ExpertGLU
from engine.kernels.prepare import PreparedWeight
from engine.profiler import ExpertProfiler


@dataclass
class ExpertStacks:
    """One MoE layer's routed experts: gate, up [E, F, D] and down [E, D, F] prepared weights.

    ``resident``, when given, returns the same stacks with their bytes copied out of the memory
    map (``Weights.resident``): what the CPU backend computes from. ``glu``: the experts' biases and
    activation where they are not plain SwiGLU (gpt-oss), which every backend applies."""

    gate: PreparedWeight
    up: PreparedWeight
    down: PreparedWeight
    resident: Callable[[], ExpertStacks] | None = None
    glu: ExpertGLU | None = None


@dataclass(frozen=True)
class StepPlan:
    """How a one-token step runs one layer's routed experts (:meth:`ExpertBackend.step_plan`)."""

    device: bool  # device_part computes some of them (resident: all; cache: its hits)
    host: bool  # host_part can return work (CPU: all; cache: its misses): a decode graph cuts its step here
    q8: bool = False  # device_part takes x's q8 copy (x̂ from the norm kernel before it) now
    # int64 [E] on the device: each expert's slot byte offset, for a routing kernel that looks the chosen
    # experts' slots up as it routes (a pinned pool under the fused kernels), else None.
    slot_table: torch.Tensor | None = None
    # device_part computes every expert, the misses from the host's copy over the bus (``host`` is False): the
    # backend takes the step's routes afterwards (``routed``) to count and upload, as host_part would.
    bus: bool = False


class ExpertBackend(Protocol):
    """Routed-expert FFN of the MoE layers it serves. Every backend feeds ``profiler``.

    The experts' math: y_t = Σ_k weights[t, k] · down[e](silu(gate[e]·x_t) ⊙ up[e]·x_t), e = ids[t, k]."""

    profiler: ExpertProfiler | None

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every routed expert of T tokens, eagerly: x float32 [T, D]; ids int64 [T, K]; weights float32
        [T, K] (x's device) -> float32 [T, D]. Records the routes (and hits, misses, uploads)."""
        ...

    def step_plan(self, layer: int) -> StepPlan:
        """Which halves of a one-token step compute ``layer``'s experts now, and what the device half takes."""
        ...

    def device_part(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        xq: tuple | None = None,
        slot_off: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The device half of one token, no host sync (graph-capturable): x float32 [1, D], ids int64 [1, K],
        weights float32 [1, K] -> the weighted sum of the experts it serves [1, D] (None: none). xq: x's q8
        copy (``StepPlan.q8``); slot_off int64 [1, K]: the slots the routing looked up (``slot_table``)."""
        ...

    def host_part(self, layer: int, X: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
        """The host half of one token, after the device half: X float32 [1, D], ids int64 [1, K], weights
        float32 [1, K] (host arrays) -> the weighted sum of the experts the device half left [1, D], or None
        when it left none. Records hits and misses; the caller records the routes (a decode graph, once a step)."""
        ...

    def end_step(self) -> None:
        """Called once per forward pass after the last layer (uploads, prefetch)."""
        ...

    def settle(self) -> None:
        """Finish work running behind the steps (the cache's background uploads) — before a CUDA graph
        capture. Nothing by default."""


class CpuExperts(ExpertBackend):
    """Experts computed by the numba kernels straight from the quantized memory map: a one-token step's
    host half does everything."""

    profiler: ExpertProfiler | None = None

    def __init__(self, stacks: dict[int, ExpertStacks], q8_act: bool = True):
        self.stacks = stacks
        self.q8_act = q8_act
        self._host: dict[int, ExpertStacks] = {}

    def host_stacks(self, layer: int) -> ExpertStacks:
        """Layer ``layer``'s stacks as computed from: resident copies, made on first use."""
        s = self._host.get(layer)
        if s is None:
            s = self.stacks[layer]
            s = self._host[layer] = s.resident() if s.resident is not None else s
        return s

    def forward(self, layer, x, ids, weights):
        # A device layer's experts on the host: hidden state and routing cross here, explicitly.
        X = np.ascontiguousarray(x.detach().cpu().numpy(), dtype=np.float32)
        I = np.ascontiguousarray(ids.cpu().numpy(), dtype=np.int64)
        W = np.ascontiguousarray(weights.detach().cpu().numpy(), dtype=np.float32)
        if self.profiler is not None:
            self.profiler.record_route(layer, I)
        return torch.from_numpy(self.host_part(layer, X, I, W)).to(x.device)

    def step_plan(self, layer: int) -> StepPlan:
        return StepPlan(device=False, host=True)

    def device_part(self, layer, x, ids, weights, xq=None, slot_off=None):
        return None

    def host_part(self, layer, X, ids, weights):
        """Every expert of the rows X [T, D] (ids, weights [T, K], contiguous) on the CPU -> float32 [T, D]."""
        from engine import ops

        s = self.host_stacks(layer)
        return ops.moe_ffn(s.gate, s.up, s.down, X, ids, weights, q8_act=self.q8_act, glu=s.glu)

    def end_step(self) -> None:
        pass
