"""Qwen3.5 dense (``qwen35``): the Gated DeltaNet hybrid of ``qwen35moe`` with a dense SwiGLU FFN."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import HybridArgs, _int, common_fields, hybrid_fields
from engine.models.hybrid import HybridModel, hybrid_tensor_specs
from engine.models.tensors import TensorSpec

ARCH = "qwen35"


@dataclass(frozen=True)
class Args(HybridArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        c.update(hybrid_fields(gf, ARCH, sections=True))
        return cls(**c, n_ff=_int(gf, keys.arch_key(keys.FEED_FORWARD_LENGTH, ARCH)), rope_neox=True)


def tensor_specs(a: Args) -> list[TensorSpec]:
    return hybrid_tensor_specs(a, moe=False)


class Model(HybridModel):
    grouping = "tile"
    moe = False
