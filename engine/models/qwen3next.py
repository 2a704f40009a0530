"""Qwen3-Next (``qwen3next``): Gated DeltaNet hybrid with the fused ``ssm_in`` (per key head q | k | v | z)
and ``ssm_ba`` projections, key heads repeated interleaved over the value heads, NEOX RoPE on a partial
head, routed experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf.reader import GGUFFile
from engine.models.args import HybridArgs, common_fields, hybrid_fields, hybrid_moe_fields
from engine.models.hybrid import HybridModel, hybrid_tensor_specs
from engine.models.tensors import TensorSpec

ARCH = "qwen3next"


@dataclass(frozen=True)
class Args(HybridArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        c.update(hybrid_fields(gf, ARCH, sections=False))
        return cls(**c, **hybrid_moe_fields(gf, ARCH), rope_neox=True, norm_topk=True)


def tensor_specs(a: Args) -> list[TensorSpec]:
    return hybrid_tensor_specs(a, moe=True, fused_input=True)


class Model(HybridModel):
    grouping = "interleave"
    fused_input = True
