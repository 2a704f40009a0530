"""Weights as the model math sees them: quantized linear layers, small vectors, embeddings.

Matrices stay raw quantized bytes and are multiplied by the numba kernels (``engine.kernels``);
only 1-D tensors (norms, biases, gates) are copied into torch as float32.

Matrices the host computes with are *resident*: their bytes are copied once out of the memory
map into anonymous memory (2 MiB-aligned, huge pages where the kernel grants them) and the file
pages are dropped from this process's mapping, so the copy replaces them rather than doubling
them. Reading weights through page-cache pages was measured 1.3-1.8x slower than through the same
bytes in anonymous memory on this machine (and it varied with the page cache's history: a file
re-read from disk came back slower), while anonymous copies stream at the kernels' full rate.
Matrices used only to upload to a device stay mapped (``Weights.prepared``).
"""

from __future__ import annotations

import ctypes
import mmap
import weakref
from dataclasses import replace

import numpy as np
import torch

from engine.gguf.reader import GGUFFile, TensorRef
from engine.kernels.prepare import PreparedWeight, prepare_weight
from engine.ops import matmul
from engine.quant import dequantize


class Linear:
    """y = x·Wᵀ (+ b): x float32 [T, in] -> float32 [T, out]; W raw [out, in] in the map."""

    def __init__(self, w: PreparedWeight, bias: torch.Tensor | None = None, q8_act: bool = True, name: str = ""):
        self.name = name
        self.w = w
        self.bias = bias
        self.q8_act = q8_act

    @property
    def out_features(self) -> int:
        return self.w.rows

    def takes_q8(self) -> bool:
        """Whether a call would take x's q8 copy (``DeviceLinear.takes_q8``): never on the host."""
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        X = np.ascontiguousarray(x.detach().numpy(), dtype=np.float32)
        y = torch.from_numpy(matmul(self.w, X, q8_act=self.q8_act))
        return y + self.bias if self.bias is not None else y


def vector(ref: TensorRef) -> torch.Tensor:
    """A 1-D tensor (norm weight, bias, gate) as float32 torch, copied out of the map."""
    return torch.from_numpy(np.array(dequantize(ref.data, ref.qtype), dtype=np.float32, copy=True).reshape(-1))


class Embedding:
    """Row lookup in ``token_embd`` of any type: ids int [T] -> float32 [T, D] (ggml_get_rows)."""

    def __init__(self, ref: TensorRef):
        self.ref = ref

    def __call__(self, ids: np.ndarray) -> torch.Tensor:
        rows = self.ref.data[np.asarray(ids, dtype=np.int64)]
        return torch.from_numpy(np.ascontiguousarray(dequantize(rows, self.ref.qtype), dtype=np.float32))


HUGE_PAGE = 2 << 20
RESIDENT_MIN_BYTES = 1 << 20  # smaller matrices stay mapped (a copy would not pay for its page)


def _release(a: np.ndarray, lo: int, hi: int) -> None:
    """Drop the whole pages of ``a``'s bytes from this process's mapping [lo, hi) (a read-only
    shared file map: the page cache keeps the data, a later touch would fault it back)."""
    start = -(-a.ctypes.data // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (a.ctypes.data + a.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if lo <= start < end <= hi and hasattr(mmap, "MADV_DONTNEED"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_DONTNEED)


def anonymous_copy(a: np.ndarray) -> np.ndarray:
    """A read-only copy of ``a`` (same dtype and shape) in its own 2 MiB-aligned private
    anonymous mapping, advised for transparent huge pages except the last partial one (which
    would otherwise be resident in full)."""
    n = a.nbytes
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=flags) if flags else mmap.mmap(-1, n + HUGE_PAGE)
    buf = np.frombuffer(m, np.uint8)
    off = -buf.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        whole = n // HUGE_PAGE * HUGE_PAGE
        if whole:
            m.madvise(mmap.MADV_HUGEPAGE, off, whole)
    out = buf[off : off + n].view(a.dtype).reshape(a.shape)
    out[...] = a
    out.setflags(write=False)
    return out


class Weights:
    """Name → tensor access for one GGUF file, with the kernel settings of this load.

    resident: host matrices are copied out of the map (module docstring); False keeps every
    matrix in the map (tests of the mapped path, memory-starved machines)."""

    def __init__(self, gf: GGUFFile, q8_act: bool = True, resident: bool = True):
        self.gf = gf
        self.q8_act = q8_act
        self.copy_resident = resident
        self._prepared: dict[str, PreparedWeight] = {}  # re-placing reuses the decoded scales
        # Resident copies live as long as a host layer or expert backend holds them: a layer
        # moved to a device drops its host copy.
        self._resident: weakref.WeakValueDictionary[str, PreparedWeight] = weakref.WeakValueDictionary()

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def linear(self, name: str, bias: str | None = None) -> Linear:
        """A host linear layer (its matrix resident)."""
        b = vector(self.gf.tensor(bias)) if bias and self.has(bias) else None
        return Linear(self.resident(name), b, self.q8_act, name)

    def resident(self, name: str) -> PreparedWeight:
        """``prepared(name)`` with its bytes in anonymous memory (shares the decoded scales)."""
        w = self._resident.get(name)
        if w is None:
            mapped = self.prepared(name)
            if not self.copy_resident or mapped.raw.nbytes < RESIDENT_MIN_BYTES:
                return mapped
            w = replace(mapped, raw=anonymous_copy(mapped.raw))
            self._resident[name] = w
            _release(mapped.raw, *self._map_bounds())
        return w

    def _map_bounds(self) -> tuple[int, int]:
        """[lo, hi) addresses of the file mapping (0, 0 when unknown: nothing is released)."""
        data = getattr(getattr(self.gf, "_reader", None), "data", None)
        if not isinstance(data, np.ndarray):
            return 0, 0
        return data.ctypes.data, data.ctypes.data + data.nbytes

    def vector(self, name: str) -> torch.Tensor:
        return vector(self.gf.tensor(name))

    def optional_vector(self, name: str) -> torch.Tensor | None:
        return self.vector(name) if self.has(name) else None

    def prepared(self, name: str) -> PreparedWeight:
        w = self._prepared.get(name)
        if w is None:
            t = self.gf.tensor(name)
            w = self._prepared[name] = prepare_weight(t.qtype, t.data, t.shape[-1])
        return w
