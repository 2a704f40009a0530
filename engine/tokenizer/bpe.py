"""Byte-level BPE (``tokenizer.ggml.model = "gpt2"``) on the ``tokenizers`` library.

llama.cpp's ``llm_tokenizer_bpe_session``: split a raw-text fragment with the pre-tokenizer's
regexes, map every byte of a piece to its GPT-2 unicode stand-in, merge the adjacent pair with
the lowest merge rank (ties: leftmost) until none applies. That is exactly ``tokenizers``' BPE
model behind a ``Split``* + ``ByteLevel(use_regex=False)`` pre-tokenizer.
"""

from __future__ import annotations

import logging

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.tokenizer.pretokenizers import build_pre_tokenizer
from engine.tokenizer.vocab import Vocab

log = logging.getLogger(__name__)


def build_bpe(v: Vocab, vocab: dict[str, int]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` that encodes one raw-text fragment as llama.cpp does.

    ``vocab`` maps token text to id (``v.tokens`` inverted).
    """
    assert v.pre_spec is not None
    # tokenizers panics on merges whose parts or result are not tokens; llama.cpp keeps them, but
    # such a merge can only build a symbol that is then spelled out byte by byte. Drop them.
    merges = [(a, b) for a, b in v.merges if a in vocab and b in vocab and a + b in vocab]
    if len(merges) != len(v.merges):
        log.warning("dropped %d BPE merges whose parts or result are not tokens", len(v.merges) - len(merges))
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=v.pre_spec.ignore_merges)
    tok = Tokenizer(model)
    tok.pre_tokenizer = build_pre_tokenizer(v.pre_spec)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_decoder() -> dict[str, int]:
    """GPT-2's unicode stand-in -> byte (the inverse of ``ByteLevel.alphabet()`` order)."""
    # bytes_to_unicode: printable latin-1 bytes map to themselves, the other 68 to U+0100...
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    return table
