"""Qwen2-MoE (``qwen2moe``): q/k/v biases, sigmoid-gated shared expert, top-k *not* renormalised."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import ModelArgs, _int, common_fields, moe_fields
from engine.models.base import DecoderModel
from engine.models.blocks import Attention, DecoderLayer, MoE
from engine.models.tensors import (
    TensorSpec,
    attention_specs,
    global_specs,
    moe_specs,
    shared_expert_specs,
)

ARCH = "qwen2moe"


@dataclass(frozen=True)
class Args(ModelArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        m = moe_fields(gf, ARCH, keys.EXPERT_FEED_FORWARD_LENGTH)
        shexp = _int(gf, keys.arch_key(keys.EXPERT_SHARED_FEED_FORWARD_LENGTH, ARCH), 0)
        return cls(**c, **m, n_ff_shexp=shexp, rope_neox=True, norm_topk=False)


def tensor_specs(a: Args) -> list[TensorSpec]:
    specs = global_specs(a, output_required=True)
    for i in range(a.n_layer):
        specs += attention_specs(i, a, qkv_bias=True) + moe_specs(i, a)
        if a.n_ff_shexp:
            specs += shared_expert_specs(i, a)
    return specs


class Model(DecoderModel):
    def make_layer(self, i: int) -> DecoderLayer:
        w = self.lw(i)
        return DecoderLayer(
            w,
            i,
            self.args,
            Attention(w, i, self.args, qkv_bias=True),
            MoE(w, i, self.args, self.experts_of(i), shared_expert=self.args.n_ff_shexp > 0),
        )
