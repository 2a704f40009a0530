"""GGUF metadata key names, in one place.

Keys come from the ``gguf`` package's ``Keys`` where it has them; ``{arch}`` is filled with
``general.architecture``. Code reads metadata only through these constants.
"""

from __future__ import annotations

from gguf import Keys

ARCHITECTURE = Keys.General.ARCHITECTURE
NAME = Keys.General.NAME
ALIGNMENT = Keys.General.ALIGNMENT
FILE_TYPE = Keys.General.FILE_TYPE

# Per-architecture hyperparameters (format with arch=...).
CONTEXT_LENGTH = Keys.LLM.CONTEXT_LENGTH
EMBEDDING_LENGTH = Keys.LLM.EMBEDDING_LENGTH
BLOCK_COUNT = Keys.LLM.BLOCK_COUNT
FEED_FORWARD_LENGTH = Keys.LLM.FEED_FORWARD_LENGTH
EXPERT_FEED_FORWARD_LENGTH = Keys.LLM.EXPERT_FEED_FORWARD_LENGTH
EXPERT_SHARED_FEED_FORWARD_LENGTH = Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH
EXPERT_COUNT = Keys.LLM.EXPERT_COUNT
EXPERT_USED_COUNT = Keys.LLM.EXPERT_USED_COUNT
VOCAB_SIZE = Keys.LLM.VOCAB_SIZE
HEAD_COUNT = Keys.Attention.HEAD_COUNT
HEAD_COUNT_KV = Keys.Attention.HEAD_COUNT_KV
KEY_LENGTH = Keys.Attention.KEY_LENGTH
VALUE_LENGTH = Keys.Attention.VALUE_LENGTH
LAYERNORM_RMS_EPS = Keys.Attention.LAYERNORM_RMS_EPS
ROPE_FREQ_BASE = Keys.Rope.FREQ_BASE
ROPE_DIMENSION_COUNT = Keys.Rope.DIMENSION_COUNT
ROPE_SCALING_TYPE = Keys.Rope.SCALING_TYPE
ROPE_SCALING_FACTOR = Keys.Rope.SCALING_FACTOR
SLIDING_WINDOW = Keys.Attention.SLIDING_WINDOW

# Tokenizer.
TOKENIZER_MODEL = Keys.Tokenizer.MODEL
TOKENIZER_PRE = Keys.Tokenizer.PRE
TOKENIZER_TOKENS = Keys.Tokenizer.LIST
TOKENIZER_TOKEN_TYPE = Keys.Tokenizer.TOKEN_TYPE
TOKENIZER_SCORES = Keys.Tokenizer.SCORES
TOKENIZER_MERGES = Keys.Tokenizer.MERGES
TOKENIZER_BOS_ID = Keys.Tokenizer.BOS_ID
TOKENIZER_EOS_ID = Keys.Tokenizer.EOS_ID
TOKENIZER_EOT_ID = Keys.Tokenizer.EOT_ID
TOKENIZER_PAD_ID = Keys.Tokenizer.PAD_ID
TOKENIZER_UNK_ID = Keys.Tokenizer.UNK_ID
TOKENIZER_ADD_BOS = Keys.Tokenizer.ADD_BOS
TOKENIZER_ADD_EOS = Keys.Tokenizer.ADD_EOS
CHAT_TEMPLATE = Keys.Tokenizer.CHAT_TEMPLATE


def arch_key(template: str, arch: str) -> str:
    """``arch_key(BLOCK_COUNT, "qwen3moe") -> "qwen3moe.block_count"``."""
    return template.format(arch=arch)


# Linear-attention (Gated DeltaNet) hybrids.
SSM_CONV_KERNEL = Keys.SSM.CONV_KERNEL
SSM_INNER_SIZE = Keys.SSM.INNER_SIZE
SSM_STATE_SIZE = Keys.SSM.STATE_SIZE
SSM_TIME_STEP_RANK = Keys.SSM.TIME_STEP_RANK
SSM_GROUP_COUNT = Keys.SSM.GROUP_COUNT
FULL_ATTENTION_INTERVAL = Keys.LLM.FULL_ATTENTION_INTERVAL
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # per-layer flags (llama.cpp LLM_KV_ATTENTION_RECURRENT_LAYERS)
NEXTN_PREDICT_LAYERS = Keys.LLM.NEXTN_PREDICT_LAYERS
ROPE_DIMENSION_SECTIONS = Keys.Rope.DIMENSION_SECTIONS
