"""Token ids back to text: per-token bytes, and a streaming decoder that never splits a character.

:class:`Pieces` gives each token's bytes as llama.cpp's ``token_to_piece`` does: a byte-level BPE
token maps its GPT-2 stand-ins back to bytes, a SentencePiece token turns "▁" into a space, a
byte token ``<0xXX>`` is that one byte, control and unknown tokens are their text (or nothing
when specials are hidden), user-defined tokens are always their text, unused ones nothing.
"""

from __future__ import annotations

import codecs

from engine.errors import UsageError
from engine.tokenizer.bpe import byte_decoder
from engine.tokenizer.spm import SPACE
from engine.tokenizer.vocab import BPE, TokenAttr, Vocab

_HIDDEN = TokenAttr.CONTROL | TokenAttr.UNKNOWN


class Pieces:
    """``piece(id, special) -> bytes`` with a per-id cache (a big vocabulary is never converted whole)."""

    def __init__(self, v: Vocab):
        self._v = v
        self._byte_of = byte_decoder() if v.kind == BPE else None
        self._cache: dict[int, bytes] = {}

    def piece(self, token_id: int, special: bool = True) -> bytes:
        if not 0 <= token_id < len(self._v.attrs):
            raise UsageError(f"token id {token_id} is outside the vocabulary (0..{len(self._v.attrs) - 1})")
        attr = self._v.attrs[token_id]
        if attr & _HIDDEN and not special:
            return b""
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._compute(token_id, attr)
        return out

    def _compute(self, token_id: int, attr: int) -> bytes:
        text = self._v.tokens[token_id]
        if attr & (_HIDDEN | TokenAttr.USER_DEFINED):
            return text.encode("utf-8")
        if attr & TokenAttr.NORMAL:
            if self._byte_of is None:
                return text.replace(SPACE, " ").encode("utf-8")
            return b"".join(self._bpe_char(c, text) for c in text)
        if attr & TokenAttr.BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # unused / undefined: llama.cpp renders nothing

    def _bpe_char(self, c: str, text: str) -> bytes:
        b = self._byte_of.get(c)  # type: ignore[union-attr]
        if b is not None:
            return bytes([b])
        # A character outside GPT-2's byte alphabet: llama.cpp's llama_decode_text marker.
        return f"[UNK_BYTE_0x{c.encode('utf-8').hex()}{text}]".encode()


class Detokenizer:
    """Streaming ids -> text. ``push(id)`` returns the new complete characters (maybe "").

    Bytes of an unfinished UTF-8 sequence (a multi-byte character split over byte-level BPE
    tokens or ``<0xXX>`` tokens) are held until the sequence completes; invalid bytes come out as
    U+FFFD. ``flush()`` ends the stream (an unfinished tail becomes U+FFFD). With
    ``strip_leading_space`` one space is removed from the start of the stream (SentencePiece's
    prefix space when decoding from the first token of a text).
    """

    def __init__(self, piece, *, special: bool = True, strip_leading_space: bool = False, skip_ids=()):
        self._piece = piece
        self._special = special
        self._strip = strip_leading_space
        self._skip = frozenset(skip_ids)  # ids that do not end the leading-space window (BOS)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        data = self._piece(int(token_id), self._special)
        if self._strip and int(token_id) not in self._skip:
            self._strip = False
            if data.startswith(b" "):
                data = data[1:]
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)

    @property
    def pending(self) -> int:
        """Bytes held back because they do not complete a character yet."""
        return len(self._decoder.getstate()[0])
