"""Weights as the model math sees them: quantized linear layers, small vectors, embeddings.

Matrices stay in the memory map as raw quantized bytes and are multiplied by the numba kernels
(``engine.kernels``); only 1-D tensors (norms, biases, gates) are copied into torch as float32.
"""

from __future__ import annotations

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


class Weights:
    """Name → tensor access for one GGUF file, with the kernel settings of this load."""

    def __init__(self, gf: GGUFFile, q8_act: bool = True):
        self.gf = gf
        self.q8_act = q8_act
        self._prepared: dict[str, PreparedWeight] = {}  # re-placing reuses the decoded scales

    def has(self, name: str) -> bool:
        return name in self.gf.tensors

    def linear(self, name: str, bias: str | None = None) -> Linear:
        b = vector(self.gf.tensor(bias)) if bias and self.has(bias) else None
        return Linear(self.prepared(name), b, self.q8_act, name)

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
