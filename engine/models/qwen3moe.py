"""Qwen3-MoE (``qwen3moe``): per-head q/k RMS norm, NEOX RoPE, softmax top-k renormalised."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import ModelArgs, common_fields, moe_fields
from engine.models.base import DecoderModel
from engine.models.blocks import Attention, DecoderLayer, MoE
from engine.models.tensors import TensorSpec, attention_specs, global_specs, moe_specs

ARCH = "qwen3moe"


@dataclass(frozen=True)
class Args(ModelArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        k = keys.arch_key
        used = gf.get(k(keys.EXPERT_USED_COUNT, ARCH)) or 1
        ff = gf.get(k(keys.FEED_FORWARD_LENGTH, ARCH))
        # Expert width: expert_feed_forward_length, else feed_forward_length / experts used.
        fallback = ff // used if isinstance(ff, int) and isinstance(used, int) and used > 0 else None
        m = moe_fields(gf, ARCH, keys.EXPERT_FEED_FORWARD_LENGTH, fallback)
        return cls(**c, **m, rope_neox=True, norm_topk=True)


def tensor_specs(a: Args) -> list[TensorSpec]:
    specs = global_specs(a)
    for i in range(a.n_layer):
        specs += attention_specs(i, a, qk_norm="head") + moe_specs(i, a)
    return specs


class Model(DecoderModel):
    def make_layer(self, i: int) -> DecoderLayer:
        w = self.lw(i)
        return DecoderLayer(
            w,
            i,
            self.args,
            Attention(w, i, self.args, qk_norm="head"),
            MoE(w, i, self.args, self.experts_of(i)),
        )
