"""The tokenizer a GGUF file describes: text -> ids and back, as llama.cpp does it.

Encoding follows ``llama_vocab::impl::tokenize``: special tokens are split out of the raw text
first (``tokenizer_st_partition``: each special token in turn, longest text first, cuts every
raw fragment where it occurs), then every raw fragment is tokenized on its own by the model
(byte-level BPE or SentencePiece, see :mod:`engine.tokenizer.bpe` and :mod:`engine.tokenizer.spm`),
with BOS/EOS added as the file asks.
"""

from __future__ import annotations

import logging

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import UsageError
from engine.tokenizer.bpe import build_bpe
from engine.tokenizer.detok import Detokenizer, Pieces
from engine.tokenizer.spm import build_spm, escape, score_ties, spm_encode_reference, token_splits
from engine.tokenizer.vocab import BPE, SPM, TokenAttr, Vocab

log = logging.getLogger(__name__)


class Tokenizer:
    """Encode/decode for one vocabulary. Build with :func:`engine.tokenizer.load_tokenizer`.

    ``hf`` is the ``tokenizers.Tokenizer`` that encodes one raw fragment (specials registered as
    added tokens, with ``encode_special_tokens`` on: the splitting is done here, as llama.cpp does it).
    """

    def __init__(self, vocab: Vocab, *, spm_reference: bool | None = None):
        self.vocab = vocab
        self._token_to_id = {t: i for i, t in enumerate(vocab.tokens)}
        self._pieces = Pieces(vocab)
        self.uses_reference = False
        if vocab.kind == BPE:
            self.hf: HFTokenizer = build_bpe(vocab, self._token_to_id)
        else:
            unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
            splits = token_splits(vocab.tokens)
            self.hf = build_spm(vocab.tokens, vocab.scores, vocab.add_space_prefix, unk, splits)
            if spm_reference is None:
                spm_reference = score_ties(vocab.tokens, vocab.scores, splits)
                if spm_reference:
                    log.info("SentencePiece scores have ties: using the exact (slower) merge loop")
            self.uses_reference = spm_reference
            self._byte_ids = [self._byte_token(b) for b in range(256)]
        added = []
        for i in vocab.special_ids:
            control = bool(vocab.attrs[i] & (TokenAttr.CONTROL | TokenAttr.UNKNOWN))
            added.append(AddedToken(vocab.tokens[i], special=control, normalized=False))
        self.hf.add_special_tokens(added)
        self.hf.encode_special_tokens = True

    # -- facts ---------------------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def kind(self) -> str:
        """``"bpe"`` (byte-level BPE) or ``"spm"`` (SentencePiece)."""
        return self.vocab.kind

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def eot_id(self) -> int | None:
        return self.vocab.eot_id

    @property
    def pad_id(self) -> int | None:
        return self.vocab.pad_id

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.vocab.eog_ids

    def is_eog(self, token_id: int) -> bool:
        """True for tokens that end generation (EOS, EOT, ``<|im_end|>``, ``<|endoftext|>``, ...)."""
        return token_id in self.vocab.eog_ids

    def is_special(self, token_id: int) -> bool:
        """Control, user-defined or unknown: split out of raw text rather than tokenized."""
        return bool(self.vocab.attrs[token_id] & (TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN))

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry (byte-level or "▁"-escaped form, as stored)."""
        return self.vocab.tokens[token_id]

    def token_id(self, text: str) -> int | None:
        """The id of a vocabulary entry, or None."""
        return self._token_to_id.get(text)

    # -- encoding ------------------------------------------------------------------------------
    def encode(
        self,
        text: str,
        add_bos: bool | None = None,
        parse_special: bool = True,
        add_eos: bool | None = None,
        plain_spans: tuple[tuple[int, int], ...] = (),
    ) -> list[int]:
        """Token ids of ``text``, equal to llama.cpp's ``llama_tokenize``.

        ``add_bos``/``add_eos``: None follows the file (``tokenizer.ggml.add_bos_token``...),
        True/False force. ``parse_special``: control tokens written in the text (``<|im_end|>``)
        become their ids; user-defined tokens (``<think>``) always do, as in llama.cpp.
        ``plain_spans``: ``(start, end)`` character ranges of ``text`` where control tokens are not
        parsed (a chat's user content inside the template's markup); text is still tokenized as one
        piece across their edges, so without control-token text in them the ids are unchanged.
        """
        v = self.vocab
        bos = v.add_bos if add_bos is None else add_bos
        eos = v.add_eos if add_eos is None else add_eos
        out: list[int] = []
        if bos:
            if v.bos_id is None:
                raise UsageError("add_bos was asked for, but the vocabulary has no BOS token")
            out.append(v.bos_id)
        for frag in self.partition(text, parse_special, plain_spans):
            if isinstance(frag, int):
                out.append(frag)
            else:
                out.extend(self._encode_fragment(frag))
        if eos:
            if v.eos_id is None:
                raise UsageError("add_eos was asked for, but the vocabulary has no EOS token")
            out.append(v.eos_id)
        return out

    def partition(
        self, text: str, parse_special: bool = True, plain_spans: tuple[tuple[int, int], ...] = ()
    ) -> list[str | int]:
        """Raw text fragments and special-token ids, in order (llama.cpp's ``tokenizer_st_partition``).

        Each special token, longest first, cuts every remaining raw fragment at each occurrence.
        With ``parse_special=False`` only user-defined tokens are cut out; a control token's occurrence
        that overlaps one of ``plain_spans`` stays text.
        """
        frags: list[tuple[str, int] | int] = [(text, 0)] if text else []
        v = self.vocab
        for sid in v.special_ids:
            control = bool(v.attrs[sid] & (TokenAttr.CONTROL | TokenAttr.UNKNOWN))
            if not parse_special and control:
                continue
            s = v.tokens[sid]
            if not any(not isinstance(f, int) and s in f[0] for f in frags):
                continue
            cut: list[tuple[str, int] | int] = []
            for f in frags:
                if isinstance(f, int) or s not in f[0]:
                    cut.append(f)
                    continue
                t, off = f
                pos, k = 0, t.find(s)
                while k >= 0:  # non-overlapping, left to right (str.split's occurrences)
                    a, b = off + k, off + k + len(s)
                    if not (control and any(lo < b and a < hi for lo, hi in plain_spans)):
                        if k > pos:
                            cut.append((t[pos:k], off + pos))
                        cut.append(sid)
                        pos = k + len(s)
                    k = t.find(s, k + len(s))
                if pos < len(t):
                    cut.append((t[pos:], off + pos))
            frags = cut
        return [f if isinstance(f, int) else f[0] for f in frags]

    def _encode_fragment(self, frag: str) -> list[int]:
        if self.vocab.kind == SPM and self.uses_reference:
            esc = escape(frag, self.vocab.add_space_prefix)
            return spm_encode_reference(esc, self._token_to_id, self.vocab.scores, self._byte_ids)
        return self.hf.encode(frag, add_special_tokens=False).ids

    def _byte_token(self, b: int) -> int | None:
        """llama_vocab::byte_to_token for SentencePiece: ``<0xXX>``, else the 1-character token."""
        tid = self._token_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = self._token_to_id.get(chr(b))
        return tid

    # -- decoding ------------------------------------------------------------------------------
    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token stands for (llama.cpp's ``token_to_piece`` with lstrip 0)."""
        return self._pieces.piece(token_id, special)

    def detokenizer(self, special: bool = True, strip_leading_space: bool = False) -> Detokenizer:
        """A streaming decoder for generated ids (see :class:`~engine.tokenizer.detok.Detokenizer`)."""
        skip = (self.vocab.bos_id,) if self.vocab.bos_id is not None else ()
        return Detokenizer(self._pieces.piece, special=special, strip_leading_space=strip_leading_space, skip_ids=skip)

    def decode(self, ids, special: bool = True) -> str:
        """Text of ``ids``. ``special=False`` hides control tokens (user-defined ones always show).

        For SentencePiece the space that encoding put before the text is removed again (from the
        first token after any leading BOS), so ``decode(encode(s)) == s`` for text without specials.
        """
        strip = self.vocab.kind == SPM and self.vocab.add_space_prefix
        d = self.detokenizer(special=special, strip_leading_space=strip)
        return "".join(d.push(i) for i in ids) + d.flush()
