"""Gemma 3 dense (``gemma3``): the decoder layer with Gemma's quirks as data.

As llama.cpp builds it (``src/models/gemma3.cpp``, ``llm_build_gemma3<iswa=true>``, with the hyperparameters of
``load_hparams`` for LLM_ARCH_GEMMA3):

- token embeddings multiplied by sqrt(n_embd);
- per-head q/k RMS norm, NEOX RoPE;
- norms after the attention and after the FFN as well as before them (``post_attention_norm``, ``post_ffw_norm``);
  the GGUF norm weights already hold Gemma's 1 + w (llama.cpp's converter adds the 1), so they are plain RMS
  norm weights here;
- GeGLU FFN (GELU, tanh form);
- five sliding-window layers to one global: layer i slides over ``attention.sliding_window`` positions unless
  i % 6 == 5 (``set_swa_pattern(6)``); sliding layers rotate with base 10000 and no scaling, global ones with
  ``rope.freq_base`` and the file's scaling;
- attention scale 1/sqrt(head_dim), or 1/sqrt(n_embd / n_head) for the 62-layer (27B) model
  (query_pre_attn_scalar);
- no final logit soft-capping: llama.cpp applies it only in the non-sliding build, which Gemma 3 never takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import MetadataError
from engine.gguf import keys
from engine.gguf.reader import GGUFFile
from engine.models.args import ModelArgs, _int, common_fields
from engine.models.base import DecoderModel
from engine.models.blocks import Attention, DecoderLayer, DenseFFN
from engine.models.tensors import TensorSpec, attention_specs, blk, dense_ffn_specs, global_specs

ARCH = "gemma3"
SWA_PATTERN = 6  # every sixth layer is global (llama.cpp's set_swa_pattern(6))
ROPE_BASE_LOCAL = 10000.0  # the sliding layers' RoPE base (llama.cpp's rope_freq_base_train_swa)


@dataclass(frozen=True)
class Args(ModelArgs):
    attn_scale: float = 0.0  # the attention score scale

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Args:
        c = common_fields(gf, ARCH)
        n_ff = _int(gf, keys.arch_key(keys.FEED_FORWARD_LENGTH, ARCH))
        window = _int(gf, keys.arch_key(keys.SLIDING_WINDOW, ARCH))
        if window <= 0:
            raise MetadataError(f"{ARCH} sliding window {window} must be positive", gf.path)
        per_head = c["n_embd"] // c["n_head"] if c["n_layer"] == 62 else c["head_dim"]
        return cls(
            **c,
            n_ff=n_ff,
            rope_neox=True,
            sliding_window=window,
            swa_pattern=SWA_PATTERN,
            attn_scale=1.0 / math.sqrt(per_head),
        )


def tensor_specs(a: Args) -> list[TensorSpec]:
    specs = global_specs(a)
    D = a.n_embd
    for i in range(a.n_layer):
        specs += attention_specs(i, a, qk_norm="head") + dense_ffn_specs(i, a)
        specs += [
            TensorSpec(blk(i, "post_attention_norm.weight"), (D,), layer=i),
            TensorSpec(blk(i, "post_ffw_norm.weight"), (D,), layer=i),
        ]
    return specs


class Model(DecoderModel):
    args: Args
    # Its sliding window, GeGLU and per-layer RoPE bases have no fused one-token device step (DeviceStepOps) yet:
    # device layers run the eager torch ops (TorchOps), prompt and decode.
    graph_step = False

    def __init__(self, w, args: Args, experts=None):
        self.embed_scale = math.sqrt(args.n_embd)
        super().__init__(w, args, experts)

    def layer_rope(self, i: int) -> tuple[float, float]:
        a = self.args
        return (ROPE_BASE_LOCAL, 1.0) if a.is_sliding(i) else (a.rope_base, a.rope_scale)

    def make_layer(self, i: int) -> DecoderLayer:
        w, a = self.lw(i), self.args
        window = a.layer_window(i)
        attn = Attention(w, i, a, qk_norm="head", window=window, scale=a.attn_scale)
        ffn = DenseFFN(w, i, act="gelu")
        return DecoderLayer(w, i, a, attn, ffn, post_norms=("post_attention_norm", "post_ffw_norm"))
