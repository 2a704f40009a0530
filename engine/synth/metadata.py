"""Hyperparameter metadata of a synthetic model, written through named key constants.

Which keys llama.cpp reads for each family (``llama_model::load_hparams``): the generic ones
(context/embedding length, block count, feed-forward length, head counts, key/value length, rope
base and dimension, expert counts), the RMS epsilon (required), and per family the expert width:
``expert_feed_forward_length`` for qwen3moe/qwen2moe (plus ``expert_shared_feed_forward_length``
for qwen2moe's shared expert), ``feed_forward_length`` for olmoe and Mixtral.
"""

from __future__ import annotations

import gguf
from gguf import GGUFWriter, Keys, LlamaFileType

from engine.gguf import keys
from engine.quant.formats import QType
from engine.synth.specs import SynthSpec

QUANTIZATION_VERSION = Keys.General.QUANTIZATION_VERSION

# general.file_type for a uniform weight type (mixes name their dominant type's "_M" variant).
FILE_TYPES: dict[QType, LlamaFileType] = {
    QType.F32: LlamaFileType.ALL_F32,
    QType.F16: LlamaFileType.MOSTLY_F16,
    QType.BF16: LlamaFileType.MOSTLY_BF16,
    QType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    QType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    QType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    QType.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    QType.Q3_K: LlamaFileType.MOSTLY_Q3_K_M,
    QType.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    QType.Q5_K: LlamaFileType.MOSTLY_Q5_K_M,
    QType.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    QType.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
    QType.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL,
    QType.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
    QType.IQ2_XXS: LlamaFileType.MOSTLY_IQ2_XXS,
    QType.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS,
    QType.IQ2_S: LlamaFileType.MOSTLY_IQ2_S,
    QType.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS,
    QType.IQ3_S: LlamaFileType.MOSTLY_IQ3_S,
}


def write_hparams(w: GGUFWriter, s: SynthSpec, *, name: str, file_type: QType) -> None:
    """Add ``general.*`` and ``{arch}.*`` hyperparameter keys for ``s`` to the writer."""

    def k(template: str) -> str:
        return keys.arch_key(template, s.arch)

    w.add_string(keys.NAME, name)
    w.add_uint32(keys.FILE_TYPE, int(FILE_TYPES.get(file_type, LlamaFileType.ALL_F32)))
    w.add_uint32(QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION)
    w.add_uint32(k(keys.CONTEXT_LENGTH), s.ctx)
    w.add_uint32(k(keys.EMBEDDING_LENGTH), s.hidden)
    w.add_uint32(k(keys.BLOCK_COUNT), s.blocks)
    w.add_uint32(k(keys.FEED_FORWARD_LENGTH), s.ff)
    w.add_uint32(k(keys.HEAD_COUNT), s.heads)
    w.add_uint32(k(keys.HEAD_COUNT_KV), s.kv_heads)
    w.add_uint32(k(keys.KEY_LENGTH), s.head_dim)
    w.add_uint32(k(keys.VALUE_LENGTH), s.head_dim)
    w.add_float32(k(keys.LAYERNORM_RMS_EPS), s.rms_eps)
    w.add_float32(k(keys.ROPE_FREQ_BASE), s.rope_base)
    w.add_uint32(k(keys.ROPE_DIMENSION_COUNT), s.n_rot)
    w.add_uint32(k(keys.VOCAB_SIZE), s.vocab)
    if s.is_moe:
        w.add_uint32(k(keys.EXPERT_COUNT), s.experts)
        w.add_uint32(k(keys.EXPERT_USED_COUNT), s.experts_used)
        if s.arch in ("qwen3moe", "qwen2moe", "qwen35moe", "qwen3next", "glm4moe", "gpt-oss"):
            w.add_uint32(k(keys.EXPERT_FEED_FORWARD_LENGTH), s.expert_ff)
        if s.arch == "glm4moe":  # the shared expert as a count of expert widths, sigmoid routing
            w.add_uint32(k(keys.EXPERT_SHARED_COUNT), s.shared_ff // s.expert_ff)
            w.add_uint32(k(keys.LEADING_DENSE_BLOCK_COUNT), s.dense_lead)
            w.add_float32(k(keys.EXPERT_WEIGHTS_SCALE), s.expert_scale)
            w.add_bool(k(keys.EXPERT_WEIGHTS_NORM), True)
            w.add_uint32(k(keys.EXPERT_GATING_FUNC), int(gguf.ExpertGatingFuncType.SIGMOID))
            w.add_uint32(k(keys.NEXTN_PREDICT_LAYERS), s.nextn)
        elif s.shared_ff:
            w.add_uint32(k(keys.EXPERT_SHARED_FEED_FORWARD_LENGTH), s.shared_ff)
    if s.sliding_window:
        w.add_uint32(k(keys.SLIDING_WINDOW), s.sliding_window)
    if s.yarn_factor:  # gpt-oss: what llama.cpp's converter writes of the HF rope_scaling
        w.add_string(k(keys.ROPE_SCALING_TYPE), "yarn")
        w.add_float32(k(keys.ROPE_SCALING_FACTOR), s.yarn_factor)
        w.add_uint32(k(keys.ROPE_SCALING_ORIG_CTX_LEN), s.yarn_orig_ctx or s.ctx)
    if s.is_hybrid:
        w.add_uint32(k(keys.SSM_CONV_KERNEL), s.ssm_conv)
        w.add_uint32(k(keys.SSM_STATE_SIZE), s.ssm_state)
        w.add_uint32(k(keys.SSM_GROUP_COUNT), s.ssm_groups)
        w.add_uint32(k(keys.SSM_TIME_STEP_RANK), s.ssm_v_heads)
        w.add_uint32(k(keys.SSM_INNER_SIZE), s.ssm_v_heads * s.ssm_state)
        w.add_uint32(k(keys.FULL_ATTENTION_INTERVAL), s.full_attn_interval)
        if s.nextn:
            w.add_uint32(k(keys.NEXTN_PREDICT_LAYERS), s.nextn)
        if s.arch != "qwen3next":  # interleaved M-RoPE (text positions in every section)
            w.add_array(k(keys.ROPE_DIMENSION_SECTIONS), s.rope_sections)
