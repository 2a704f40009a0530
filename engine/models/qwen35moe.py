"""Qwen3.5 / 3.6 MoE (``qwen35moe``): Gated DeltaNet hybrid, routed experts (softmax top-k renormalised)
plus a sigmoid-gated shared expert, interleaved M-RoPE on a partial head (text positions)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import HybridArgs, _int, common_fields, hybrid_fields, moe_fields
from engine.models.hybrid import HybridModel, hybrid_tensor_specs
from engine.models.tensors import TensorSpec

ARCH = "qwen35moe"


@dataclass(frozen=True)
class Args(HybridArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        c.update(hybrid_fields(gf, ARCH, sections=True))
        used = gf.get(keys.arch_key(keys.EXPERT_USED_COUNT, ARCH)) or 1
        ff = gf.get(keys.arch_key(keys.FEED_FORWARD_LENGTH, ARCH))
        fallback = ff // used if isinstance(ff, int) and isinstance(used, int) and used > 0 else None
        m = moe_fields(gf, ARCH, keys.EXPERT_FEED_FORWARD_LENGTH, fallback)
        shexp = _int(gf, keys.arch_key(keys.EXPERT_SHARED_FEED_FORWARD_LENGTH, ARCH), ff if isinstance(ff, int) else 0)
        return cls(**c, **m, n_ff_shexp=shexp, rope_neox=True, norm_topk=True)


def tensor_specs(a: Args) -> list[TensorSpec]:
    return hybrid_tensor_specs(a, moe=True)


class Model(HybridModel):
    grouping = "tile"
