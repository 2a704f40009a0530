"""Tokenizers for synthetic GGUFs, trained with the ``tokenizers`` library on a built-in corpus.

Two kinds, as llama.cpp knows them (``tokenizer.ggml.model``):

* ``"gpt2"``: byte-level BPE. The corpus is pre-split with the very regexes llama.cpp uses for
  the chosen ``tokenizer.ggml.pre`` (``llm_tokenizer_bpe`` in ``src/llama-vocab.cpp``), so the
  ``tokenizers`` object from :meth:`Vocab.hf_tokenizer` and llama.cpp produce the same ids.
  Specials ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` follow the trained tokens (as in
  Qwen files), then ``[PADn]`` rows (token type UNUSED) fill the vocab up to the requested size.
* ``"llama"``: SentencePiece style: ``<unk>``, ``<s>``, ``</s>``, byte-fallback ``<0x00>`` ..
  ``<0xFF>``, then "▁"-marked pieces with scores. llama.cpp's SPM tokenizer repeatedly merges the
  adjacent pair whose concatenation is the best-scoring token; pieces come from a BPE trained on
  the corpus and a piece's score falls with its merge rank.

The corpus is Python's own ``pydoc_data.topics`` text (deterministic for a Python version).
Training takes ~0.1-0.3 s and is cached per (kind, size, pre) for the process.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass

from gguf import GGUFWriter, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from engine.errors import UsageError
from engine.gguf import keys

GPT2 = "gpt2"
SPM = "llama"
BPE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# gpt-oss's o200k_harmony specials (the real file's order; BOS <|startoftext|>, EOS <|return|>, padding <|endoftext|>)
HARMONY_SPECIALS = (
    "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
    "<|message|>", "<|call|>",
)  # fmt: skip
HARMONY = "harmony"  # a build_vocab kind: byte-level BPE with HARMONY_SPECIALS and HARMONY_TEMPLATE
SPM_SPECIALS = ("<unk>", "<s>", "</s>")
SPACE = "\u2581"  # "▁", SentencePiece's word marker

# llama.cpp's pre-tokenizer regexes, applied in sequence, each match isolated.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
PRE_REGEXES: dict[str, tuple[str, ...]] = {
    "qwen2": (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
    "llama-bpe": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "olmo": (_GPT2_REGEX,),
    "qwen35": (  # qwen2's with combining marks (\p{M}) inside letter runs
        _CONTRACTIONS
        + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"),
}
# llama.cpp looks whole words up in the vocabulary before merging for these (``ignore_merges``).
_IGNORE_MERGES = frozenset({"llama-bpe"})

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The harmony format as gpt-oss's template writes it, cut down: a system message, the system prompt as the
# developer's instructions, the tools (as a ``functions`` namespace in a developer message; each tool's parameters
# as JSON where the real template writes TypeScript), user turns, earlier replies in the final channel — their
# reasoning (``thinking``) only for a last assistant message with no generation prompt (a training render), so
# a new prompt never carries earlier turns' analysis — their tool calls as messages to ``functions.NAME`` ended by
# ``<|call|>``, a tool's result as a message from ``functions.NAME`` (the last call's name); the generation prompt
# ``<|start|>assistant``.
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>Reasoning: ' + (reasoning_effort or 'medium') + "
    "'\\n\\n# Valid channels: analysis, commentary, final.<|end|>' }}"
    "{%- if tools %}{{- '<|start|>developer<|message|># Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{%- for t in tools %}{%- set f = t['function'] if 'function' in t else t %}"
    "{{- '\\n// ' + (f['description'] or '') + '\\ntype ' + f['name'] + ' = (_: ' + tojson(f['parameters'] or {}) + ') => any;\\n' }}"
    "{%- endfor %}{{- '\\n} // namespace functions<|end|>' }}{%- endif %}"
    "{%- set ns = namespace(last='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + message['content'] + '<|end|>' }}"
    "{%- elif message['role'] == 'user' %}{{- '<|start|>user<|message|>' + message['content'] + '<|end|>' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- set closing = loop.last and not add_generation_prompt %}"
    "{%- if closing and 'thinking' in message %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message['thinking'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- for tc in message['tool_calls'] or [] %}{%- set ns.last = tc['function']['name'] %}"
    "{%- set a = tc['function']['arguments'] %}"
    "{{- '<|start|>assistant to=functions.' + ns.last + '<|channel|>commentary json<|message|>' }}"
    "{{- (a if a is string else tojson(a)) + '<|call|>' }}"
    "{%- endfor %}"
    "{%- if message['content'] or not message['tool_calls'] %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + (message['content'] or '') }}"
    "{{- '<|return|>' if closing else '<|end|>' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|start|>functions.' + (message['name'] or ns.last) + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{- message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- message['content'] + eos_token }}{%- endif %}{%- endfor %}"
)


@dataclass(frozen=True)
class Vocab:
    """Tokenizer metadata of one file. ``tokens[i]`` is token id ``i``; all strings unique.

    ``merges`` are ``"left right"`` strings in rank order (gpt2 only); ``scores`` are per token
    (SentencePiece only). Token types follow gguf's ``TokenType`` (1 normal, 2 unknown,
    3 control, 5 unused, 6 byte).
    """

    model: str
    pre: str | None
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...] = ()
    scores: tuple[float, ...] | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    unk_id: int | None = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def specials(self) -> list[str]:
        return [t for t, k in zip(self.tokens, self.token_types) if k in (TokenType.CONTROL, TokenType.UNKNOWN)]

    def hf_tokenizer(self) -> Tokenizer:
        """A ``tokenizers.Tokenizer`` giving the ids llama.cpp gives for this vocabulary.

        Encode with ``add_special_tokens=False`` and compare with ``Llama.tokenize(text,
        add_bos=False, special=True)`` (the ``tokenizers`` object always splits out specials).
        """
        vocab = {t: i for i, t in enumerate(self.tokens)}
        if self.model == GPT2:
            merges = [tuple(m.split(" ")) for m in self.merges]
            tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=self.pre in _IGNORE_MERGES))
            tok.pre_tokenizer = _bpe_pre_tokenizer(self.pre or "default")
            tok.decoder = decoders.ByteLevel()
        else:
            scores = self.scores or tuple(0.0 for _ in self.tokens)
            normal = [i for i, k in enumerate(self.token_types) if k in (TokenType.NORMAL, TokenType.UNUSED)]
            model = models.BPE(
                vocab=vocab, merges=_merges_by_score(self.tokens, scores, normal), byte_fallback=True, fuse_unk=True
            )
            tok = Tokenizer(model)
            tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
            tok.decoder = decoders.Sequence(
                [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
            )
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.specials()])
        return tok


def build_vocab(model: str, size: int, pre: str | None = None) -> Vocab:
    """``"bpe"``/``"gpt2"`` -> :func:`bpe_vocab`; ``"spm"``/``"llama"`` -> :func:`spm_vocab`."""
    if model in ("bpe", GPT2):
        return bpe_vocab(size, pre or "qwen2")
    if model == HARMONY:
        return harmony_vocab(size, pre or "qwen2")
    if model in ("spm", SPM):
        if pre is not None:
            raise UsageError("a SentencePiece vocabulary has no pre-tokenizer setting")
        return spm_vocab(size)
    raise UsageError(f"unknown tokenizer kind {model!r} (use 'bpe', 'harmony' or 'spm')")


def corpus() -> list[str]:
    """The training text: Python's pydoc topics, in sorted-key order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def _bpe_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_REGEXES[pre]]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _trained(tok: Tokenizer) -> tuple[list[str], list[str]]:
    """(tokens in id order, merges as "a b") of a trained BPE tokenizer."""
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


@functools.lru_cache(maxsize=16)
def bpe_vocab(size: int, pre: str = "qwen2") -> Vocab:
    """Byte-level BPE vocabulary of exactly ``size`` tokens for ``tokenizer.ggml.pre = pre``,
    trained on :func:`corpus`; see :func:`train_bpe_vocab`."""
    return train_bpe_vocab(corpus(), size, pre)


@functools.lru_cache(maxsize=16)
def harmony_vocab(size: int, pre: str = "qwen2") -> Vocab:
    """gpt-oss's layout: byte-level BPE of ``size`` tokens trained on :func:`corpus`, then the harmony specials
    (:data:`HARMONY_SPECIALS`: BOS ``<|startoftext|>``, EOS ``<|return|>``, padding ``<|endoftext|>``) and the
    harmony chat template (:data:`HARMONY_TEMPLATE`)."""
    return train_bpe_vocab(
        corpus(), size, pre, specials=HARMONY_SPECIALS, roles=(0, 2, 1), chat_template=HARMONY_TEMPLATE
    )


def train_bpe_vocab(
    texts: Iterable[str],
    size: int,
    pre: str = "qwen2",
    *,
    specials: tuple[str, ...] = BPE_SPECIALS,
    roles: tuple[int, int, int] = (0, 2, 0),
    chat_template: str = CHATML_TEMPLATE,
) -> Vocab:
    """Byte-level BPE vocabulary of exactly ``size`` tokens trained on ``texts``.

    The texts are pre-split as llama.cpp's ``pre`` pre-tokenizer splits them. ``specials`` (control tokens)
    follow the trained tokens; ``roles``: which of them are BOS, EOS and padding — by default BOS and padding
    are ``<|endoftext|>``, EOS is ``<|im_end|>``; no BOS is added (Qwen's convention); the chat template is
    ChatML.
    """
    if pre not in PRE_REGEXES:
        raise UsageError(f"unknown pre-tokenizer {pre!r} (supported: {', '.join(PRE_REGEXES)})")
    n_train = size - len(specials)
    if n_train < 257:
        raise UsageError(f"a byte-level BPE vocabulary needs at least {257 + len(specials)} tokens, got {size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _bpe_pre_tokenizer(pre)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=n_train, initial_alphabet=alphabet, show_progress=False)
    )
    tokens, merges = _trained(tok)
    types = [int(TokenType.NORMAL)] * len(tokens)
    first_special = len(tokens)
    tokens += specials
    types += [int(TokenType.CONTROL)] * len(specials)
    _pad(tokens, types, size)
    bos, eos, pad = (first_special + r for r in roles)
    return Vocab(
        model=GPT2,
        pre=pre,
        tokens=tuple(tokens),
        token_types=tuple(types),
        merges=tuple(merges),
        bos_id=bos,
        eos_id=eos,
        pad_id=pad,
        add_bos=False,
        chat_template=chat_template,
    )


@functools.lru_cache(maxsize=16)
def spm_vocab(size: int) -> Vocab:
    """SentencePiece-style vocabulary of exactly ``size`` tokens (Llama/Mixtral layout).

    Ids: 0 ``<unk>``, 1 ``<s>`` (BOS, added), 2 ``</s>`` (EOS), 3..258 byte tokens, then pieces.
    """
    n_fixed = len(SPM_SPECIALS) + 256
    n_pieces = size - n_fixed
    if n_pieces < 64:
        raise UsageError(f"a SentencePiece vocabulary needs at least {n_fixed + 64} tokens, got {size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=n_pieces, limit_alphabet=min(96, n_pieces // 2), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    pieces, merges = _trained(tok)
    n_chars = len(pieces) - len(merges)  # the trainer lists the alphabet first, then one token per merge
    tokens = list(SPM_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)] + [int(TokenType.BYTE)] * 256
    scores = [0.0] * n_fixed
    # Merged pieces score by merge rank (earlier = higher); single characters below all of them.
    scores += [-float(n_chars + len(merges) + j) for j in range(n_chars)]
    scores += [-float(r) for r in range(len(merges))]
    tokens += pieces
    types += [int(TokenType.NORMAL)] * len(pieces)
    n_real = len(tokens)
    _pad(tokens, types, size)
    scores += [-1e9] * (len(tokens) - n_real)
    return Vocab(
        model=SPM,
        pre=None,
        tokens=tuple(tokens),
        token_types=tuple(types),
        scores=tuple(scores),
        bos_id=1,
        eos_id=2,
        unk_id=0,
        add_bos=True,
        chat_template=MISTRAL_TEMPLATE,
    )


def _pad(tokens: list[str], types: list[int], size: int) -> None:
    """Fill to ``size`` with unreachable ``[PADn]`` tokens of type UNUSED (as converted Qwen files do)."""
    present = set(tokens)
    i = len(tokens)
    while len(tokens) < size:
        t = f"[PAD{i}]"
        i += 1
        if t not in present:
            tokens.append(t)
            types.append(int(TokenType.UNUSED))
    del tokens[size:], types[size:]


def _merges_by_score(tokens: tuple[str, ...], scores: tuple[float, ...], normal: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's "merge the best-scoring pair" rule.

    Every split (left, right) of a piece where both halves are pieces becomes a merge, ranked by
    the piece's score (best first), then by position of the split.
    """
    ids = {tokens[i]: i for i in normal}
    found = []
    for i in normal:
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], ids[left], ids[right], left, right))
    found.sort()
    return [(f[3], f[4]) for f in found]


def write_tokenizer(w: GGUFWriter, v: Vocab) -> None:
    """Add the ``tokenizer.ggml.*`` keys (and chat template) of ``v`` to the writer."""
    w.add_string(keys.TOKENIZER_MODEL, v.model)
    if v.pre is not None:
        w.add_string(keys.TOKENIZER_PRE, v.pre)
    w.add_array(keys.TOKENIZER_TOKENS, list(v.tokens))
    w.add_array(keys.TOKENIZER_TOKEN_TYPE, list(v.token_types))
    if v.scores is not None:
        w.add_array(keys.TOKENIZER_SCORES, list(v.scores))
    if v.merges:
        w.add_array(keys.TOKENIZER_MERGES, list(v.merges))
    for key, value in (
        (keys.TOKENIZER_BOS_ID, v.bos_id),
        (keys.TOKENIZER_EOS_ID, v.eos_id),
        (keys.TOKENIZER_PAD_ID, v.pad_id),
        (keys.TOKENIZER_UNK_ID, v.unk_id),
    ):
        if value is not None:
            w.add_uint32(key, value)
    w.add_bool(keys.TOKENIZER_ADD_BOS, v.add_bos)
    w.add_bool(keys.TOKENIZER_ADD_EOS, v.add_eos)
    if v.chat_template:
        w.add_string(keys.CHAT_TEMPLATE, v.chat_template)
