"""Llama (``llama``), dense or Mixtral-style MoE: adjacent-pair RoPE, top-k renormalised."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import ModelArgs, _int, common_fields, moe_fields
from engine.models.base import DecoderModel
from engine.models.blocks import Attention, DecoderLayer, DenseFFN, MoE
from engine.models.tensors import TensorSpec, attention_specs, dense_ffn_specs, global_specs, moe_specs

ARCH = "llama"


@dataclass(frozen=True)
class Args(ModelArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        n_ff = _int(gf, keys.arch_key(keys.FEED_FORWARD_LENGTH, ARCH))
        if gf.get(keys.arch_key(keys.EXPERT_COUNT, ARCH), 0):
            # Mixtral: the expert width is feed_forward_length.
            m = moe_fields(gf, ARCH, keys.FEED_FORWARD_LENGTH)
            return cls(**c, **m, rope_neox=False, norm_topk=True)
        return cls(**c, n_ff=n_ff, rope_neox=False)


def tensor_specs(a: Args) -> list[TensorSpec]:
    specs = global_specs(a)
    specs.append(TensorSpec("rope_freqs.weight", (a.rope_dim // 2,), required=False))
    for i in range(a.n_layer):
        specs += attention_specs(i, a) + (moe_specs(i, a) if a.is_moe else dense_ffn_specs(i, a))
    return specs


class Model(DecoderModel):
    def make_layer(self, i: int) -> DecoderLayer:
        w = self.lw(i)
        return DecoderLayer(
            w,
            i,
            self.args,
            Attention(w, i, self.args),
            (MoE(w, i, self.args, self.experts_of(i)) if self.args.is_moe else DenseFFN(w, i)),
        )
