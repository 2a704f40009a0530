"""SentencePiece (``tokenizer.ggml.model = "llama"``) as llama.cpp tokenizes it.

llama.cpp's ``llm_tokenizer_spm_session`` splits the text into UTF-8 characters and repeatedly
merges the adjacent pair whose concatenation is a vocabulary token with the highest score (ties:
the leftmost pair); a character that never merged and is not a token becomes its byte tokens
``<0xXX>``. That is a BPE whose merge ranks are the scores of the merged tokens, so
:func:`build_spm` hands it to the ``tokenizers`` library with merges derived from the scores.

Equal scores are where the two can part: a BPE rank is unique per pair, while llama.cpp breaks a
tie by position. :func:`score_ties` finds vocabularies where that can matter; for them the
tokenizer uses :func:`spm_encode_reference`, a direct transcription of llama.cpp's loop (also the
reference the fast path is tested against).
"""

from __future__ import annotations

import heapq

import numpy as np
from tokenizers import Tokenizer, models, normalizers

SPACE = "\u2581"  # "▁", SentencePiece's escaped space


def token_splits(tokens: tuple[str, ...]) -> list[tuple[int, int]]:
    """Every ``(token id, cut)`` where ``token[:cut]`` and ``token[cut:]`` are both tokens.

    A cut is only tried where both halves have the length of some token, so a long token costs the
    number of distinct token lengths below its own, not its length squared (a 1 MiB entry in a
    SentencePiece table took minutes with every cut tried)."""
    ids = {t: i for i, t in enumerate(tokens)}
    lengths = sorted({len(t) for t in tokens})
    found = []
    for i, t in enumerate(tokens):
        n = len(t)
        if n <= 64:  # short tokens (nearly all): every cut, as cheap as the length check
            cuts = range(1, n)
        else:
            have = set(lengths)
            cuts = [c for c in lengths if c < n and (n - c) in have]
        for cut in cuts:
            if t[:cut] in ids and t[cut:] in ids:
                found.append((i, cut))
    return found


def derive_merges(tokens: tuple[str, ...], scores: np.ndarray, splits: list[tuple[int, int]] | None = None):
    """BPE merges equivalent to "merge the best-scoring pair".

    Every split ``(left, right)`` of a token where both halves are tokens is a merge, ranked by
    the token's score (best first), then by token id and split position (to be deterministic).
    Every token type takes part, as in llama.cpp (any vocabulary entry can be a merge result).
    ``splits``: :func:`token_splits` of ``tokens`` when the caller has them.
    """
    splits = token_splits(tokens) if splits is None else splits
    order = sorted(splits, key=lambda ic: (-float(scores[ic[0]]), ic[0], ic[1]))
    return [(tokens[i][:cut], tokens[i][cut:]) for i, cut in order]


def score_ties(tokens: tuple[str, ...], scores: np.ndarray, splits: list[tuple[int, int]] | None = None) -> bool:
    """True if two different merge results share a score (then the BPE form may differ from llama.cpp)."""
    splits = token_splits(tokens) if splits is None else splits
    results = sorted({i for i, _ in splits})
    s = scores[results]
    return len(np.unique(s)) != len(s)


def build_spm(
    tokens: tuple[str, ...], scores: np.ndarray, add_space_prefix: bool, unk: str | None, splits=None
) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` for one raw-text fragment: escape spaces, optional leading "▁", BPE."""
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab, merges=derive_merges(tokens, scores, splits), byte_fallback=True, unk_token=unk, fuse_unk=False
    )
    tok = Tokenizer(model)
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    return tok


def escape(fragment: str, add_space_prefix: bool) -> str:
    """llama.cpp's text for one fragment: a leading space if asked, then spaces as "▁"."""
    return ((" " + fragment) if add_space_prefix else fragment).replace(" ", SPACE)


def spm_encode_reference(
    text: str, token_to_id: dict[str, int], scores: np.ndarray, byte_ids: list[int | None]
) -> list[int]:
    """llm_tokenizer_spm_session::tokenize on an already escaped fragment.

    ``byte_ids[b]`` is the id of ``<0xXX>`` for byte ``b`` (None if absent: that byte is dropped).
    """
    chars = list(text)
    n = len(chars)
    sym_text = chars[:]  # text of each live symbol ("" once merged away)
    prev = list(range(-1, n - 1))
    nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
    heap: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length)

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        merged = sym_text[left] + sym_text[right]
        tid = token_to_id.get(merged)
        if tid is not None:
            heapq.heappush(heap, (-float(scores[tid]), left, right, len(merged)))

    for i in range(1, n):
        push(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym_text[left] or not sym_text[right] or len(sym_text[left]) + len(sym_text[right]) != size:
            continue  # stale: one side was merged since this pair was queued
        sym_text[left] += sym_text[right]
        sym_text[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])

    out: list[int] = []
    i = 0 if n else -1
    while i != -1:
        tid = token_to_id.get(sym_text[i])
        if tid is not None:
            out.append(tid)
        else:
            out.extend(b for b in (byte_ids[x] for x in sym_text[i].encode("utf-8")) if b is not None)
        i = nxt[i]
    return out
