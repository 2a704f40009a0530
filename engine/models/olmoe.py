"""OLMoE (``olmoe``): q/k RMS norm over the whole projection, NEOX RoPE, top-k *not* renormalised."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import ModelArgs, common_fields, moe_fields
from engine.models.base import DecoderModel
from engine.models.blocks import Attention, DecoderLayer, MoE
from engine.models.tensors import TensorSpec, attention_specs, global_specs, moe_specs

ARCH = "olmoe"


@dataclass(frozen=True)
class Args(ModelArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        # OLMoE: the expert width is feed_forward_length; no top-k renormalisation.
        m = moe_fields(gf, ARCH, keys.FEED_FORWARD_LENGTH)
        return cls(**c, **m, rope_neox=True, norm_topk=False)


def tensor_specs(a: Args) -> list[TensorSpec]:
    specs = global_specs(a, output_required=True)
    for i in range(a.n_layer):
        specs += attention_specs(i, a, qk_norm="proj") + moe_specs(i, a)
    return specs


class Model(DecoderModel):
    def make_layer(self, i: int) -> DecoderLayer:
        w = self.lw(i)
        return DecoderLayer(
            w,
            i,
            self.args,
            Attention(w, i, self.args, qk_norm="proj"),
            MoE(w, i, self.args, self.experts_of(i)),
        )
