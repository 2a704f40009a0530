"""Qwen3.5 / 3.6 MoE (``qwen35moe``): Gated DeltaNet hybrid, routed experts (softmax top-k renormalised)
plus a sigmoid-gated shared expert, interleaved M-RoPE on a partial head (text positions)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf.reader import GGUFFile
from engine.models.args import HybridArgs, common_fields, hybrid_fields, hybrid_moe_fields
from engine.models.hybrid import HybridModel, hybrid_tensor_specs
from engine.models.tensors import TensorSpec

ARCH = "qwen35moe"


@dataclass(frozen=True)
class Args(HybridArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        c.update(hybrid_fields(gf, ARCH, sections=True))
        return cls(**c, **hybrid_moe_fields(gf, ARCH), rope_neox=True, norm_topk=True)


def tensor_specs(a: Args) -> list[TensorSpec]:
    return hybrid_tensor_specs(a, moe=True)


class Model(HybridModel):
    grouping = "tile"
