"""Tokenizer metadata of a GGUF file, read the way llama.cpp reads it.

:func:`read_vocab` follows ``llama_vocab::impl::load`` (``src/llama-vocab.cpp``): defaults per
tokenizer model, ``add_bos``/``add_eos`` flags, special-token ids, the text-based detection of
end-of-turn and end-of-generation tokens (which also turns such tokens into control tokens), and
the list of tokens that are split out of raw text before tokenization, longest first.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass

import numpy as np
from gguf import Keys

from engine.errors import MetadataError
from engine.gguf import keys
from engine.tokenizer.pretokenizers import PRE_NAMES, PreTokenizerSpec, pre_tokenizer_spec

log = logging.getLogger(__name__)

# Keys engine.gguf.keys does not name yet (same constants, from gguf's Keys).
ADD_SPACE_PREFIX = Keys.Tokenizer.ADD_PREFIX
EOM_ID = Keys.Tokenizer.EOM_ID
FIM_PAD_ID = Keys.Tokenizer.FIM_PAD_ID
FIM_REP_ID = Keys.Tokenizer.FIM_REP_ID
FIM_SEP_ID = Keys.Tokenizer.FIM_SEP_ID

BPE = "bpe"  # tokenizer.ggml.model == "gpt2": byte-level BPE
SPM = "spm"  # tokenizer.ggml.model == "llama": SentencePiece
_MODELS = {"gpt2": BPE, "llama": SPM}


class TokenAttr(enum.IntFlag):
    """llama.h's ``llama_token_attr`` bits."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# gguf token_type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) -> attribute.
_TYPE_ATTR = {
    1: int(TokenAttr.NORMAL),
    2: int(TokenAttr.UNKNOWN),
    3: int(TokenAttr.CONTROL),
    4: int(TokenAttr.USER_DEFINED),
    5: int(TokenAttr.UNUSED),
    6: int(TokenAttr.BYTE),
}
SPECIAL_ATTRS = int(TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN)

# Texts llama.cpp takes for end-of-turn when the file names none (first match in this order).
EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)
# Texts that end generation whatever the file says (llama.cpp's special_eog_ids).
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)  # fmt: skip
# gpt-oss: always rendered, so treated as user-defined.
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass(frozen=True, eq=False)
class Vocab:
    """Everything the tokenizer needs from the file.

    ``tokens[i]`` is the text of id ``i``; ``attrs[i]`` its :class:`TokenAttr` after llama.cpp's
    overrides; ``scores`` float32 ``[n_vocab]`` (SentencePiece; zeros if absent); ``merges`` the
    ``(left, right)`` pairs in rank order (BPE). ``special_ids`` are the tokens split out of raw
    text, in the order llama.cpp tries them (longest text first).
    """

    kind: str  # BPE | SPM
    model: str  # tokenizer.ggml.model as stored
    pre: str | None  # tokenizer.ggml.pre (BPE), "default" when absent
    pre_spec: PreTokenizerSpec | None
    tokens: tuple[str, ...]
    attrs: tuple[int, ...]
    scores: np.ndarray
    merges: tuple[tuple[str, str], ...]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: frozenset[int]
    special_ids: tuple[int, ...]

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)


def read_vocab(metadata: dict, path: str | None = None) -> Vocab:
    """Parse ``tokenizer.ggml.*`` metadata; :class:`MetadataError` for what llama.cpp rejects too, and for
    tables it would misread or abort on: a value of the wrong type in any table (tokens, token types,
    scores, merges, the pre-tokenizer name, the flags), a NaN score, a byte-typed token not of the form
    ``<0xXX>`` — each error names the key and the entry."""

    def fail(msg: str) -> MetadataError:
        return MetadataError(msg, path)

    model = metadata.get(keys.TOKENIZER_MODEL)
    if not isinstance(model, str) or not model:
        raise fail(f"missing {keys.TOKENIZER_MODEL}: the file has no tokenizer")
    if model not in _MODELS:
        raise fail(
            f"tokenizer model {model!r} is not supported (supported: gpt2 = byte-level BPE, llama = SentencePiece)"
        )
    kind = _MODELS[model]

    tokens = metadata.get(keys.TOKENIZER_TOKENS)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise fail(f"missing or invalid {keys.TOKENIZER_TOKENS}")
    n = len(tokens)
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # as llama.cpp renames them
    token_to_id: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if token_to_id.setdefault(t, i) != i:
            raise fail(f"duplicate token in vocabulary: {t!r} has ids {token_to_id[t]} and {i}")

    types = metadata.get(keys.TOKENIZER_TOKEN_TYPE)
    if types is None:
        attrs = [int(TokenAttr.NORMAL)] * n
    else:
        if not isinstance(types, list) or len(types) < n:
            raise fail(
                f"{keys.TOKENIZER_TOKEN_TYPE} has {len(types) if isinstance(types, list) else 0} entries for {n} tokens"
            )
        bad = next((i for i, t in enumerate(types[:n]) if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            raise fail(f"{keys.TOKENIZER_TOKEN_TYPE}[{bad}] = {types[bad]!r} is not a token type (a whole number)")
        attrs = [_TYPE_ATTR.get(t, 0) for t in types[:n]]
    for i, a in enumerate(attrs):
        if a & TokenAttr.BYTE and _BYTE_TOKEN.fullmatch(tokens[i]) is None:
            raise fail(f"token {i} is typed as a byte token but reads {tokens[i][:40]!r}, not <0xXX>")

    scores = np.zeros(n, dtype=np.float32)
    raw_scores = metadata.get(keys.TOKENIZER_SCORES)
    if raw_scores is not None:
        if not isinstance(raw_scores, list) or len(raw_scores) < n:
            raise fail(f"{keys.TOKENIZER_SCORES} has fewer entries than the {n} tokens")
        bad = next((i for i, x in enumerate(raw_scores[:n]) if not _is_number(x) or x != x), None)
        if bad is not None:
            raise fail(f"{keys.TOKENIZER_SCORES}[{bad}] = {raw_scores[bad]!r} is not a number")
        scores = np.asarray(raw_scores[:n], dtype=np.float32)

    pre, pre_spec, merges = None, None, ()
    add_space_prefix, add_bos, add_eos = False, False, False
    if kind == BPE:
        pre = metadata.get(keys.TOKENIZER_PRE)
        if pre is not None and not isinstance(pre, str):
            raise fail(f"{keys.TOKENIZER_PRE} = {pre!r} is not a string")
        if not pre:
            log.warning("%s: no %s; using llama.cpp's 'default' pre-tokenizer", path or "vocab", keys.TOKENIZER_PRE)
            pre = "default"
        pre_spec = pre_tokenizer_spec(pre)
        if pre_spec is None:
            raise fail(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_NAMES))})")
        add_bos = pre_spec.add_bos
        raw_merges = metadata.get(keys.TOKENIZER_MERGES)
        if not isinstance(raw_merges, list):
            raise fail(f"missing {keys.TOKENIZER_MERGES}: a gpt2 tokenizer needs its BPE merges")
        bad = next((i for i, m in enumerate(raw_merges) if not isinstance(m, str)), None)
        if bad is not None:
            raise fail(f"{keys.TOKENIZER_MERGES}[{bad}] = {raw_merges[bad]!r} is not a string 'left right'")
        merges = tuple(_split_merge(m) for m in raw_merges)
        bos_id, eos_id, unk_id = 11, 11, None  # llama.cpp's gpt2 defaults, overridden by the file
    else:
        add_space_prefix, add_bos = True, True
        bos_id, eos_id, unk_id = 1, 2, 0

    def flag(key: str, default: bool) -> bool:
        value = metadata.get(key, default)
        if not isinstance(value, (bool, int)):
            raise fail(f"{key} = {value!r} is not a boolean")
        return bool(value)

    add_space_prefix = flag(ADD_SPACE_PREFIX, add_space_prefix)

    def special(key: str, default: int | None) -> int | None:
        if default is not None and default >= n:
            default = None
        value = metadata.get(key)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n:
            log.warning("%s: bad special token %s = %r; using %r", path or "vocab", key, value, default)
            return default
        return value

    bos_id = special(keys.TOKENIZER_BOS_ID, bos_id)
    eos_id = special(keys.TOKENIZER_EOS_ID, eos_id)
    eot_id = special(keys.TOKENIZER_EOT_ID, None)
    eom_id = special(EOM_ID, None)
    unk_id = special(keys.TOKENIZER_UNK_ID, unk_id)
    pad_id = special(keys.TOKENIZER_PAD_ID, None)
    fim_ids = [special(k, None) for k in (FIM_PAD_ID, FIM_REP_ID, FIM_SEP_ID)]

    add_bos = flag(keys.TOKENIZER_ADD_BOS, add_bos)
    add_eos = flag(keys.TOKENIZER_ADD_EOS, add_eos)
    if add_bos and bos_id is None:
        raise fail(f"{keys.TOKENIZER_ADD_BOS} is true, but {keys.TOKENIZER_BOS_ID} is not set")
    if add_eos and eos_id is None:
        raise fail(f"{keys.TOKENIZER_ADD_EOS} is true, but {keys.TOKENIZER_EOS_ID} is not set")

    def first_present(texts: tuple[str, ...]) -> int | None:
        return next((token_to_id[t] for t in texts if t in token_to_id), None)

    def make_control(i: int | None) -> None:
        if i is not None:
            attrs[i] |= int(TokenAttr.CONTROL)

    # Text-based detection; a detected token that is not typed as control becomes one.
    if eot_id is None:
        eot_id = first_present(EOT_TEXTS)
        make_control(eot_id)
    if eom_id is None:
        eom_id = first_present(("<|eom_id|>",))
        make_control(eom_id)
    for i, texts in enumerate((FIM_PAD_TEXTS, FIM_REP_TEXTS, FIM_SEP_TEXTS)):
        if fim_ids[i] is None:
            fim_ids[i] = first_present(texts)
            make_control(fim_ids[i])

    eog = {i for i in fim_ids if i is not None}
    for t in EOG_TEXTS:
        if t in token_to_id:
            eog.add(token_to_id[t])
            make_control(token_to_id[t])
    for t in _ALWAYS_RENDERED:
        if t in token_to_id:
            attrs[token_to_id[t]] = int(TokenAttr.USER_DEFINED)
    eog |= {i for i in (eos_id, eot_id, eom_id) if i is not None}
    _apply_eog_workarounds(eog, attrs, tokens, token_to_id)

    special_ids = [i for i, a in enumerate(attrs) if a & SPECIAL_ATTRS]
    special_ids.sort(key=lambda i: -len(tokens[i].encode("utf-8")))  # stable: ties keep id order

    return Vocab(
        kind=kind,
        model=model,
        pre=pre,
        pre_spec=pre_spec,
        tokens=tuple(tokens),
        attrs=tuple(attrs),
        scores=scores,
        merges=merges,
        bos_id=bos_id,
        eos_id=eos_id,
        eot_id=eot_id,
        eom_id=eom_id,
        unk_id=unk_id,
        pad_id=pad_id,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        eog_ids=frozenset(eog),
        special_ids=tuple(special_ids),
    )


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _split_merge(s: str) -> tuple[str, str]:
    """``"a b"`` -> ``("a", "b")``, split at the first space after the first character (as llama.cpp)."""
    if s[:1] != " ":
        a, sep, b = s.partition(" ")
        return (a, b) if sep else ("", "")
    cut = s.find(" ", 1)
    return (s[:cut], s[cut + 1 :]) if cut >= 0 else ("", "")


def _apply_eog_workarounds(eog: set[int], attrs: list[int], tokens: list[str], token_to_id: dict[str, int]) -> None:
    """llama.cpp's two special cases: harmony/solar-open's ``<|end|>`` and gemma4's ``</s>`` do not end generation."""
    texts = {tokens[i] for i in eog}
    end = token_to_id.get("<|end|>")
    if end in eog and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        eog.discard(end)
        attrs[end] = int(TokenAttr.USER_DEFINED)
    s = token_to_id.get("</s>")
    if s in eog and "<|tool_response>" in texts:
        eog.discard(s)
        attrs[s] = int(TokenAttr.NORMAL)
