"""Tokenizers from GGUF metadata: byte-level BPE and SentencePiece, with llama.cpp's token ids.

Public API::

    load_tokenizer(gf) -> Tokenizer          # gf: engine.gguf.GGUFFile (or anything with .metadata)
    Tokenizer.encode(text, add_bos=None, parse_special=True) -> list[int]
    Tokenizer.decode(ids, special=True) -> str
    Tokenizer.detokenizer() -> Detokenizer   # push(id) -> str, flush() -> str
    Tokenizer.is_eog(id) -> bool
    engine.tokenizer.chat.ChatTemplate.from_gguf(gf, tokenizer).render(messages) -> str
"""

from __future__ import annotations

from engine.tokenizer.detok import Detokenizer
from engine.tokenizer.tokenizer import Tokenizer
from engine.tokenizer.vocab import BPE, SPM, Vocab, read_vocab


def load_tokenizer(gf) -> Tokenizer:
    """The tokenizer of an open GGUF file; :class:`~engine.errors.MetadataError` if it has none we support."""
    return Tokenizer(read_vocab(gf.metadata, getattr(gf, "path", None)))


__all__ = ["BPE", "SPM", "Detokenizer", "Tokenizer", "Vocab", "load_tokenizer", "read_vocab"]
