"""Qwen3 dense (``qwen3``): per-head q/k RMS norm, NEOX RoPE, SwiGLU FFN."""

from __future__ import annotations

from dataclasses import dataclass

from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import ModelArgs, _int, common_fields
from engine.models.base import DecoderModel
from engine.models.blocks import Attention, DecoderLayer, DenseFFN
from engine.models.tensors import TensorSpec, attention_specs, dense_ffn_specs, global_specs

ARCH = "qwen3"


@dataclass(frozen=True)
class Args(ModelArgs):
    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        n_ff = _int(gf, keys.arch_key(keys.FEED_FORWARD_LENGTH, ARCH))
        return cls(**c, n_ff=n_ff, rope_neox=True)


def tensor_specs(a: Args) -> list[TensorSpec]:
    specs = global_specs(a)
    for i in range(a.n_layer):
        specs += attention_specs(i, a, qk_norm="head") + dense_ffn_specs(i, a)
    return specs


class Model(DecoderModel):
    def make_layer(self, i: int) -> DecoderLayer:
        w = self.lw(i)
        return DecoderLayer(w, i, self.args, Attention(w, i, self.args, qk_norm="head"), DenseFFN(w, i))
