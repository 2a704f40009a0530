"""Helpers for comparing SharpI with llama.cpp (the ``llama_cpp`` package) on the same file."""

from __future__ import annotations

import numpy as np
import pytest


def llama_logits(path, tokens: list[int], n_ctx: int = 256) -> np.ndarray:
    """llama.cpp's float32 logits [T, V] for every position, F32 KV cache, one batch."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, type_k=0, type_v=0, logits_all=True, verbose=False)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


def llama_greedy(path, prompt: list[int], n: int, n_ctx: int = 256) -> list[int]:
    """llama.cpp's greedy continuation (token ids) of ``prompt``."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, type_k=0, type_v=0, logits_all=True, verbose=False)
    try:
        llm.eval(prompt)
        out = []
        for _ in range(n):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(tok)
            llm.eval([tok])
        return out
    finally:
        llm.close()


def random_tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(8, vocab, n)]
