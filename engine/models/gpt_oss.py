"""OpenAI gpt-oss (``gpt-oss``, llama.cpp's LLM_ARCH_OPENAI_MOE): the decoder layer with gpt-oss's quirks as data.

As llama.cpp builds it (``src/models/openai-moe-iswa.cpp``, ``llm_build_openai_moe_iswa``, and the
hyperparameters it loads for the architecture):

- attention with q/k/v and output biases, NEOX RoPE, scale 1/sqrt(head_dim), and per head a learned sink logit
  (``attn_sinks``) in the softmax that takes probability but adds no value;
- alternating attention: layer i slides over ``attention.sliding_window`` positions when i is even, the odd
  layers attend to everything (``set_swa_pattern(2)``); every layer rotates with the same base and scaling;
- YaRN RoPE from ``rope.scaling.{type, factor, original_context_length}`` (ext factor 1, beta fast 32, slow 1,
  attention factor 1 unless the file says otherwise), as ggml's rope_yarn computes it;
- the second norm is ``post_attention_norm`` (before the FFN);
- every layer MoE: the router has a bias; the k largest logits are chosen and their weights are the softmax over
  those k (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT); each expert has gate, up and down biases and the clamped
  SwiGLU (``swiglu_oai``, alpha 1.702, limit 7), its down bias added before the routing weight multiplies it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.errors import MetadataError
from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.kernels.moe import ExpertGLU
from engine.models.args import ModelArgs, _float, _int, common_fields, moe_fields
from engine.models.base import DecoderModel
from engine.models.blocks import Attention, DecoderLayer, MoE
from engine.models.layers import Routing, YaRN
from engine.models.tensors import TensorSpec, attention_specs, blk, global_specs, moe_specs

ARCH = "gpt-oss"
SWA_PATTERN = 2  # llama.cpp's set_swa_pattern(2): even layers slide, odd ones are global
NORM = "post_attention_norm"  # the norm before the FFN
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants


@dataclass(frozen=True)
class Args(ModelArgs):
    yarn: YaRN | None = None  # the YaRN scaling of every layer's RoPE, or None (no scaling)

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        def k(template: str) -> str:
            return keys.arch_key(template, ARCH)

        c = common_fields(gf, ARCH)
        m = moe_fields(gf, ARCH, keys.EXPERT_FEED_FORWARD_LENGTH)
        window = _int(gf, k(keys.SLIDING_WINDOW))
        if window <= 0:
            raise MetadataError(f"{ARCH} sliding window {window} must be positive", gf.path)
        yarn = None
        kind = gf.get(k(keys.ROPE_SCALING_TYPE))
        if kind not in (None, "none", "yarn"):
            raise MetadataError(f"{ARCH} rope scaling {kind!r} is not supported (yarn or none)", gf.path)
        factor = _float(gf, k(keys.ROPE_SCALING_FACTOR), 0.0)
        if kind == "yarn" and factor not in (0.0, 1.0):
            if factor < 0:
                raise MetadataError(f"rope scaling factor {factor} must be positive", gf.path)
            yarn = YaRN(
                factor=factor,
                n_ctx_orig=_int(gf, k(keys.ROPE_SCALING_ORIG_CTX_LEN), c["n_ctx_train"]),
                ext_factor=_float(gf, k(keys.ROPE_SCALING_YARN_EXT_FACTOR), 1.0),
                attn_factor=_float(gf, k(keys.ROPE_SCALING_YARN_ATTN_FACTOR), 1.0),
                beta_fast=_float(gf, k(keys.ROPE_SCALING_YARN_BETA_FAST), 32.0),
                beta_slow=_float(gf, k(keys.ROPE_SCALING_YARN_BETA_SLOW), 1.0),
            )
        return cls(**c, **m, rope_neox=True, sliding_window=window, swa_pattern=SWA_PATTERN, yarn=yarn)


def tensor_specs(a: Args) -> list[TensorSpec]:
    specs = global_specs(a)
    D, Q, KV, E, F = a.n_embd, a.q_dim, a.kv_dim, a.n_expert, a.n_ff_exp
    for i in range(a.n_layer):
        specs += attention_specs(i, a) + moe_specs(i, a, norm=NORM)
        specs += [
            TensorSpec(blk(i, "attn_q.bias"), (Q,), layer=i),
            TensorSpec(blk(i, "attn_k.bias"), (KV,), layer=i),
            TensorSpec(blk(i, "attn_v.bias"), (KV,), layer=i),
            TensorSpec(blk(i, "attn_output.bias"), (D,), layer=i),
            TensorSpec(blk(i, "attn_sinks.weight"), (a.n_head,), layer=i),
            TensorSpec(blk(i, "ffn_gate_inp.bias"), (E,), layer=i),
            TensorSpec(blk(i, "ffn_gate_exps.bias"), (E, F), layer=i),
            TensorSpec(blk(i, "ffn_up_exps.bias"), (E, F), layer=i),
            TensorSpec(blk(i, "ffn_down_exps.bias"), (E, D), layer=i),
        ]
    return specs


class Model(DecoderModel):
    args: Args
    # The one-token device step (DeviceStepOps) computes its layers: sinks and windows (a ring's rows masked by
    # position) in torch's attention ops, YaRN in the step's rope tables, the experts' biases and clamped SwiGLU
    # around a GEMV a role (PoolCompute.gemv_pairs) or on the host between the graph's segments.

    def __init__(self, w, args: Args, experts=None):
        self.yarn = args.yarn
        self._glus: dict[int, ExpertGLU] = {}
        super().__init__(w, args, experts)

    def expert_glu(self, i: int) -> ExpertGLU:
        """Layer i's expert biases (host arrays) and clamped SwiGLU, one object per layer."""
        if i not in self._glus:

            def bias(role: str) -> np.ndarray:
                v = self.w.vector(blk(i, f"ffn_{role}_exps.bias")).numpy()  # [E·n]
                return np.ascontiguousarray(v.reshape(self.args.n_expert, -1), dtype=np.float32)

            biases = (bias("gate"), bias("up"), bias("down"))
            self._glus[i] = ExpertGLU(*biases, "swiglu_oai", SWIGLU_ALPHA, SWIGLU_LIMIT)
        return self._glus[i]

    def make_layer(self, i: int) -> DecoderLayer:
        w, a = self.lw(i), self.args
        glu = self.expert_glu(i)
        glu.on_device.clear()
        if w is not self.w:  # a device layer: its experts' biases on the device with its trunk (priced there)
            t = [w.vector(blk(i, f"ffn_{r}_exps.bias")).reshape(a.n_expert, -1) for r in ("gate", "up", "down")]
            glu.on_device[t[0].device.type] = tuple(t)
        window = a.layer_window(i)
        attn = Attention(w, i, a, qkv_bias=True, window=window, o_bias=True, sinks=True)
        routing = Routing(k=a.n_expert_used, renormalise=False, kind="topk_softmax")
        moe = MoE(w, i, a, self.experts_of(i), routing=routing, router_bias=True)
        return DecoderLayer(w, i, a, attn, moe, ffn_norm=NORM)
