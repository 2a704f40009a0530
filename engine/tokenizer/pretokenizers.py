"""Byte-level BPE pre-tokenizers, keyed by ``tokenizer.ggml.pre`` as llama.cpp names them.

Each family is the list of regexes llama.cpp's ``llm_tokenizer_bpe`` constructor
(``src/llama-vocab.cpp``) applies in sequence; every regex splits each piece left by the previous
one into matches and the text between them, both kept ("isolated"). The names that select a family,
and the per-family flags (``ignore_merges``, BOS added by default), follow ``llama_vocab::impl::load``.
The regexes are written out here again, not imported: llama.cpp evaluates them with its own
category tables and ``std::regex`` (or hand-written matchers for the GPT-2 and Llama-3 patterns);
the ``tokenizers`` library evaluates the same text with Oniguruma. The parity tests hold the two
together on a corpus.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

# Case-insensitive English contractions, spelled without (?i:) as llama.cpp rewrites them.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """One llama.cpp pre-tokenizer family.

    ``regexes`` are applied in order; ``ignore_merges`` looks a whole pre-token up in the
    vocabulary before merging (Llama-3); ``add_bos`` is the default of ``add_bos_token`` when the
    file does not set it.
    """

    family: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_FAMILIES = {
    "default": PreTokenizerSpec("default", (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]")),
    "gpt2": PreTokenizerSpec("gpt2", (GPT2_REGEX,)),
    "llama3": PreTokenizerSpec("llama3", (LLAMA3_REGEX,), ignore_merges=True, add_bos=True),
    "dbrx": PreTokenizerSpec("dbrx", (LLAMA3_REGEX,)),  # Llama-3 regex, merges always applied
    "qwen2": PreTokenizerSpec("qwen2", (QWEN2_REGEX,)),
    "qwen35": PreTokenizerSpec("qwen35", (QWEN35_REGEX,)),
    "starcoder": PreTokenizerSpec("starcoder", (r"\p{N}", GPT2_REGEX)),
    "falcon": PreTokenizerSpec("falcon", (r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, "[0-9][0-9][0-9]")),
}

# tokenizer.ggml.pre -> family, as llama_vocab::impl::load maps them (the subset we support).
PRE_NAMES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe"), "dbrx"),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "mpt", "olmo", "jais", "trillion"),
        "gpt2",
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), "qwen2"),
    "qwen35": "qwen35",
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), "starcoder"),
    "falcon": "falcon",
}


def pre_tokenizer_spec(pre: str) -> PreTokenizerSpec | None:
    """The family for ``tokenizer.ggml.pre = pre``; None if we do not know the name."""
    family = PRE_NAMES.get(pre)
    return _FAMILIES[family] if family else None


def build_pre_tokenizer(spec: PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer: the family's splits, then the GPT-2 byte-to-unicode map."""
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)
    return pre_tokenizers.Sequence([*splits, byte_level])
