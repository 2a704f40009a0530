"""Qwen3-Next (``qwen3next``): Gated DeltaNet hybrid with the fused ``ssm_in`` (per key head q | k | v | z)
and ``ssm_ba`` projections, key heads repeated interleaved over the value heads, NEOX RoPE on a partial
head, routed experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import HybridArgs, _int, common_fields, hybrid_fields, moe_fields
from engine.models.hybrid import HybridModel, hybrid_tensor_specs
from engine.models.tensors import TensorSpec

ARCH = "qwen3next"


@dataclass(frozen=True)
class Args(HybridArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        c.update(hybrid_fields(gf, ARCH, sections=False))
        used = gf.get(keys.arch_key(keys.EXPERT_USED_COUNT, ARCH)) or 1
        ff = gf.get(keys.arch_key(keys.FEED_FORWARD_LENGTH, ARCH))
        fallback = ff // used if isinstance(ff, int) and isinstance(used, int) and used > 0 else None
        m = moe_fields(gf, ARCH, keys.EXPERT_FEED_FORWARD_LENGTH, fallback)
        shexp = _int(gf, keys.arch_key(keys.EXPERT_SHARED_FEED_FORWARD_LENGTH, ARCH), ff if isinstance(ff, int) else 0)
        return cls(**c, **m, n_ff_shexp=shexp, rope_neox=True, norm_topk=True)


def tensor_specs(a: Args) -> list[TensorSpec]:
    return hybrid_tensor_specs(a, moe=True, fused_input=True)


class Model(HybridModel):
    grouping = "interleave"
    fused_input = True
