"""Routed-expert backends: the one call models make, ``forward(layer, x, ids, weights) -> y``.

Models never see where experts live. ``CpuExperts`` computes on the CPU from the memory-mapped
quantized stacks; the hybrid runtime adds device-resident and cached backends behind the same call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.prepare import PreparedWeight
from engine.profiler import ExpertProfiler


@dataclass
class ExpertStacks:
    """One MoE layer's routed experts: gate, up [E, F, D] and down [E, D, F] prepared weights.

    ``resident``, when given, returns the same stacks with their bytes copied out of the memory
    map (``Weights.resident``): what the CPU backend computes from."""

    gate: PreparedWeight
    up: PreparedWeight
    down: PreparedWeight
    resident: Callable[[], ExpertStacks] | None = None


class ExpertBackend:
    """Interface: routed-expert FFN for a batch of tokens. Every backend feeds ``profiler``."""

    profiler: ExpertProfiler | None = None

    def forward(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x float32 [T, D]; ids int64 [T, K]; weights float32 [T, K] -> float32 [T, D]:
        Σ_k weights[t,k] · down[e](silu(gate[e]·x_t) ⊙ up[e]·x_t) with e = ids[t,k]."""
        raise NotImplementedError

    def end_step(self) -> None:
        """Called once per forward pass after the last layer (uploads, prefetch)."""


class CpuExperts(ExpertBackend):
    """Experts computed by the numba kernels straight from the quantized memory map."""

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
        return torch.from_numpy(self.forward_rows(layer, X, I, W)).to(x.device)

    def forward_rows(
        self, layer: int, X: np.ndarray, ids: np.ndarray, weights: np.ndarray, record: bool = True
    ) -> np.ndarray:
        """:meth:`forward` on host arrays: X float32 [T, D], ids int64 [T, K], weights float32 [T, K]
        (contiguous) -> float32 [T, D]; the route goes to the profiler unless the caller records it
        (``record=False``: a decode graph records a token's routes in one call)."""
        from engine import ops

        s = self.host_stacks(layer)
        if record and self.profiler is not None:
            self.profiler.record_route(layer, ids)
        return ops.moe_ffn(s.gate, s.up, s.down, X, ids, weights, q8_act=self.q8_act)
