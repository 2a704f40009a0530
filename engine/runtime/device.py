"""Device memory and device-resident weights.

:class:`DeviceArena` charges every allocation on the device to a kind — ``reserve``, ``scratch``,
``trunk``, ``kv``, ``globals``, ``experts``, ``stream``, the planner's ``DeviceBytes`` fields — against the
placement's byte budget, so a test can pin what the runtime allocates to what the planner priced.
``device="cpu"`` is the simulated device: the same code, tensors in RAM, the budget enforced.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from engine import config
from engine.config import EngineOptions
from engine.errors import DeviceMemoryError
from engine.gguf.reader import TensorRef
from engine.kernels.prepare import PreparedWeight
from engine.models.weights import Weights
from engine.quant.formats import QType
from engine.runtime import kernel_select as ks
from engine.runtime import triton_gemv, triton_moe, triton_q4k_gemv
from engine.runtime.kernel_select import TRITON_MAX_T as TRITON_MAX_T  # (expert_cache imports it from here)
from engine.runtime.references import dequantize


def fused_kernels(device: torch.device, qtype: QType, options: EngineOptions | None = None) -> bool:
    """Whether the Triton GEMV serves ``qtype`` on ``device`` (``kernel_select.fused``:
    ``SHARPI_DEVICE_KERNELS=reference`` forces the torch reference; ``TRITON_INTERPRET=1`` runs Triton on
    the CPU, for tests)."""
    return ks.fused(device, qtype, options)


KINDS = ("reserve", "scratch", "trunk", "kv", "globals", "experts", "stream")

# What the driver's count of a CUDA process holds beyond torch's tensors, besides the context measured at
# start (:func:`cuda_overhead`): modules loaded later (Triton kernels, cuBLAS/cuBLASLt handles) ...
MODULE_ALLOWANCE = 160 << 20
# ... and what torch's allocator holds beyond the arena's tensors and the planned scratch: cuBLAS workspaces,
# the CUDA-graph pool's buffers, rounding and cached free blocks.
ALLOCATOR_ALLOWANCE = 160 << 20


def cuda_overhead(device: torch.device) -> int:
    """Bytes of ``device`` in use outside torch's allocator now — the CUDA context, its loaded modules,
    any other process's memory (a card shared with a desktop has that much less) — by the driver's
    count (``cudaMemGetInfo``): total − free − torch's reserved bytes. Initialises CUDA and cuBLAS first
    so that their fixed costs are counted."""
    device = torch.device(device)
    a = torch.ones((64, 64), device=device)
    (a @ a).sum().item()  # cuBLAS handle and workspace
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def cuda_reserve(device: torch.device) -> int:
    """The planner's ``reserve_bytes`` on a CUDA device: :func:`cuda_overhead` plus the allowances for
    modules loaded later and the allocator's own holdings (:data:`MODULE_ALLOWANCE`,
    :data:`ALLOCATOR_ALLOWANCE`)."""
    return cuda_overhead(device) + MODULE_ALLOWANCE + ALLOCATOR_ALLOWANCE


class DeviceArena:
    """Byte-budgeted allocations on one torch device."""

    def __init__(self, device: torch.device, budget: int | None):
        self.device = torch.device(device)
        self.budget = budget
        self.by_kind: dict[str, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def charge(self, kind: str, nbytes: int) -> None:
        if kind not in KINDS:
            raise ValueError(kind)
        if self.budget is not None and self.total + nbytes > self.budget:
            raise DeviceMemoryError(
                f"device memory budget exceeded: {kind} needs {nbytes / 2**20:.1f} MiB more, "
                f"{self.total / 2**20:.1f} of {self.budget / 2**20:.1f} MiB already in use"
            )
        self.by_kind[kind] += int(nbytes)

    def _guard(self, fn):
        try:
            return fn()
        except torch.OutOfMemoryError as e:
            raise DeviceMemoryError(f"the device ran out of memory: {str(e).splitlines()[0]}") from None

    def upload(self, kind: str, array: np.ndarray) -> torch.Tensor:
        """Copy a host array to the device, charged to ``kind``."""
        a = np.ascontiguousarray(array)
        self.charge(kind, a.nbytes)
        host = torch.from_numpy(a.copy() if not a.flags.writeable else a)
        return self._guard(lambda: host.to(self.device, copy=True))

    def empty(self, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        self.charge(kind, nbytes)
        return self._guard(lambda: torch.zeros(shape, dtype=dtype, device=self.device))


def raw_bytes(w: PreparedWeight) -> np.ndarray:
    """The weight's file bytes as uint8 [R, row_bytes] (F32/F16/BF16 rows viewed as bytes)."""
    return np.ascontiguousarray(w.raw).view(np.uint8).reshape(w.raw.shape[0], -1)


def embedding_rows(ref: TensorRef, ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """``Embedding(ref)(ids)`` made on ``device``: float32 [T, n], bit-equal to the host's (the torch reference
    dequantizer does the host's float operations in its order). Only the rows' stored bytes cross, and a
    prompt's hundreds of rows are decoded by a few device kernels instead of NumPy on one core."""
    rows = np.ascontiguousarray(ref.data[np.asarray(ids, dtype=np.int64)])
    raw = torch.from_numpy(rows.view(np.uint8).reshape(len(rows), -1))
    if device.type == "cuda":
        raw = raw.pin_memory().to(device, non_blocking=True)
    return dequantize(raw.to(device), ref.qtype, ref.shape[-1])


class DeviceLinear:
    """y = x·Wᵀ (+ b) with W's raw quantized bytes on the device: Triton kernels straight from the
    blocks where :func:`fused_kernels` allows (GEMV up to TRITON_MAX_T rows of x, tiled beyond),
    else the torch reference (dequantize, then matmul). ``options``: the engine options the kernel
    choice follows (``kernel_select``; default ``config.current()``)."""

    def __init__(
        self,
        w: PreparedWeight,
        arena: DeviceArena,
        kind: str,
        bias: torch.Tensor | None = None,
        q8_act: bool = False,
        options: EngineOptions | None = None,
    ):
        self.qtype, self.rows, self.n = w.qtype, w.rows, w.n
        self.raw = arena.upload(kind, raw_bytes(w))  # uint8 [rows, row_bytes]
        self.bias = bias
        self.q8_act = q8_act  # the model rounds its activations like llama.cpp (kernel_select.trunk_act)
        self.options = options if options is not None else config.current()
        self.fused = fused_kernels(self.raw.device, self.qtype, self.options)

    @property
    def out_features(self) -> int:
        return self.rows

    def takes_q8(self) -> bool:
        """Whether a call now would multiply one token on q8 activations with the Q4_K kernel, so x̂
        made by the norm before it saves a launch (``Attention.wants_q8_input``)."""
        dev = self.raw.device
        if not self.fused or not triton_q4k_gemv.applies(self.qtype, self.n, 1):
            return False
        return ks.trunk_act(dev, self.q8_act, self.qtype, self.n, options=self.options) == "q8"

    def __call__(self, x: torch.Tensor, xq: tuple | None = None) -> torch.Tensor:
        """y = x·Wᵀ (+ b); xq: x in triton_q8's format when the caller has it (:meth:`takes_q8`)."""
        x = x.to(self.raw.device)
        if self.fused:
            o = self.options
            if ks.decode_kernels(x.shape[0]):
                own = self.raw.numel() if xq is None else None  # x̂ to be made by the call itself
                act = ks.trunk_act(self.raw.device, self.q8_act, self.qtype, self.n, own_quant_bytes=own, options=o)
                y = triton_gemv.matmul(self.raw, x.float(), self.qtype, self.rows, self.n, act=act, xq=xq, options=o)
            else:  # prefill: weight tiles read once per tile of tokens, never a float copy of W
                y = triton_moe.one_matrix(self.raw, x.float(), self.qtype, self.rows, self.n, options=o)
        else:
            y = x @ dequantize(self.raw, self.qtype, self.n).T  # reference: [rows, n] f32, then matmul
        return y + self.bias if self.bias is not None else y


class DeviceWeights:
    """The ``Weights`` interface for tensors that live on a device, allocated through an arena;
    its matrices choose their kernels by ``options`` (default ``config.current()``)."""

    def __init__(self, host: Weights, arena: DeviceArena, kind: str = "trunk", options: EngineOptions | None = None):
        self.host, self.arena, self.kind = host, arena, kind
        self.options = options
        self.q8_act = host.q8_act
        self.gf = host.gf

    def has(self, name: str) -> bool:
        return self.host.has(name)

    def vector(self, name: str) -> torch.Tensor:
        return self.arena.upload(self.kind, self.host.vector(name).numpy())

    def optional_vector(self, name: str) -> torch.Tensor | None:
        return self.vector(name) if self.has(name) else None

    def linear(self, name: str, bias: str | None = None) -> DeviceLinear:
        b = self.vector(bias) if bias and self.has(bias) else None
        return DeviceLinear(self.host.prepared(name), self.arena, self.kind, b, self.q8_act, self.options)

    def prepared(self, name: str) -> PreparedWeight:
        return self.host.prepared(name)
