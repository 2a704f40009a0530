"""GLM-4.5 / GLM-4.5-Air (``glm4moe``): the decoder layer with GLM's quirks as data.

As llama.cpp builds it (``src/models/glm4-moe.cpp`` and its ``load_arch_hparams``):

- the first ``leading_dense_block_count`` layers have a dense SwiGLU FFN (``ffn_gate/up/down``), the others
  routed experts plus a shared expert of ``expert_shared_count`` × the expert width, added ungated;
- routing (``engine.models.layers.route_sigmoid_bias``): sigmoid scores (``expert_gating_func`` must say sigmoid or
  be absent), the per-expert correction bias ``exp_probs_b`` added only to choose the top k, the weights the
  chosen unbiased scores, renormalised when ``expert_weights_norm`` is set, times ``expert_weights_scale``;
- attention with q/k/v biases and, where the file has them (GLM-4.5 355B), per-head q/k RMS norms; NEOX RoPE
  over the first ``rope.dimension_count`` dims of each head (half of them in GLM-4.5-Air);
- the second norm is ``post_attention_norm`` (before the FFN, despite the name);
- the ``nextn_predict_layers`` NextN/MTP blocks stored after the trunk are counted in ``block_count`` but not
  run: ``n_layer`` is the trunk, as llama.cpp's ``n_layer()``; their tensors are left in the file.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import MetadataError
from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import ModelArgs, _float, _int, common_fields, moe_fields
from engine.models.base import DecoderModel
from engine.models.blocks import Attention, DecoderLayer, DenseFFN, MoE
from engine.models.layers import Routing
from engine.models.tensors import (
    TensorSpec,
    attention_specs,
    blk,
    dense_ffn_specs,
    global_specs,
    moe_specs,
    shared_expert_specs,
)

ARCH = "glm4moe"
GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
NORM = "post_attention_norm"  # the norm before the FFN


@dataclass(frozen=True)
class Args(ModelArgs):
    n_layer_dense_lead: int = 0  # the first layers with a dense FFN
    n_expert_shared: int = 0
    expert_weights_scale: float = 1.0  # the routed scaling factor
    qk_norm: bool = False  # per-head q/k RMS norms (GLM-4.5 355B)
    n_layer_nextn: int = 0  # NextN/MTP blocks stored after the trunk (not run by the trunk)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.n_layer_dense_lead

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        def k(template: str) -> str:
            return keys.arch_key(template, ARCH)

        c = common_fields(gf, ARCH)
        m = moe_fields(gf, ARCH, keys.EXPERT_FEED_FORWARD_LENGTH)
        n_all = c["n_layer"]
        nextn = _int(gf, k(keys.NEXTN_PREDICT_LAYERS), 0)
        lead = _int(gf, k(keys.LEADING_DENSE_BLOCK_COUNT), 0)
        shared = _int(gf, k(keys.EXPERT_SHARED_COUNT))
        n_ff = _int(gf, k(keys.FEED_FORWARD_LENGTH), 0)
        scale = _float(gf, k(keys.EXPERT_WEIGHTS_SCALE), 0.0)
        norm = gf.get(k(keys.EXPERT_WEIGHTS_NORM), False)
        gating = _int(gf, k(keys.EXPERT_GATING_FUNC), 0) or GATING_SIGMOID  # llama.cpp: none means sigmoid
        n_layer = n_all - nextn
        checks = [
            (0 <= nextn < n_all, f"nextn_predict_layers {nextn} must be below the block count {n_all}"),
            (0 <= lead <= n_layer, f"leading_dense_block_count {lead} exceeds the {n_layer} trunk layers"),
            (lead == 0 or n_ff > 0, "leading dense layers need feed_forward_length > 0"),
            (shared >= 0, f"expert_shared_count {shared} must not be negative"),
            # softmax gating would add exp_probs_b to the softmax probabilities, which no routing kind does yet
            (gating == GATING_SIGMOID, f"expert_gating_func {gating} is not sigmoid (the only one supported)"),
            (isinstance(norm, bool), f"expert_weights_norm {norm!r} is not a boolean"),
        ]
        for ok, msg in checks:
            if not ok:
                raise MetadataError(msg, gf.path)
        c["n_layer"] = n_layer
        return cls(
            **c,
            **m,
            n_ff=n_ff,
            n_ff_shexp=shared * m["n_ff_exp"],
            rope_neox=True,
            norm_topk=bool(norm),
            n_layer_dense_lead=lead,
            n_expert_shared=shared,
            # llama.cpp scales the weights only by a factor other than 0 and 1
            expert_weights_scale=scale if scale not in (0.0, 1.0) else 1.0,
            qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
            n_layer_nextn=nextn,
        )


def tensor_specs(a: Args) -> list[TensorSpec]:
    specs = global_specs(a)
    for i in range(a.n_layer):
        specs += attention_specs(i, a, qk_norm="head" if a.qk_norm else None, qkv_bias=True)
        if not a.is_moe_layer(i):
            specs += dense_ffn_specs(i, a, norm=NORM)
            continue
        specs += moe_specs(i, a, norm=NORM) + [TensorSpec(blk(i, "exp_probs_b.bias"), (a.n_expert,), layer=i)]
        if a.n_ff_shexp:
            specs += shared_expert_specs(i, a, gated=False)
    return specs


class Model(DecoderModel):
    args: Args

    def moe_layers(self) -> list[int]:
        return [i for i in range(self.args.n_layer) if self.args.is_moe_layer(i)]

    def make_layer(self, i: int) -> DecoderLayer:
        w, a = self.lw(i), self.args
        attn = Attention(w, i, a, qk_norm="head" if a.qk_norm else None, qkv_bias=True)
        if not a.is_moe_layer(i):
            return DecoderLayer(w, i, a, attn, DenseFFN(w, i), ffn_norm=NORM)
        routing = Routing(
            k=a.n_expert_used,
            renormalise=a.norm_topk,
            kind="sigmoid",
            bias=w.vector(blk(i, "exp_probs_b.bias")),
            scale=a.expert_weights_scale,
        )
        moe = MoE(w, i, a, self.experts_of(i), shared_expert=a.n_ff_shexp > 0, routing=routing)
        return DecoderLayer(w, i, a, attn, moe, ffn_norm=NORM)
