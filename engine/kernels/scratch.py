"""Reusable float32 scratch buffers for prompt-sized kernel work, one set per thread.

A fresh 32 MB numpy array costs ~8,000 page faults (each page zeroed by the kernel) every time;
prompt passes need several per layer. ``buffer(name, n)`` hands out the same memory again until
:func:`release` (called after a prompt: decoding does not need it).
"""

from __future__ import annotations

import threading

import numpy as np

_local = threading.local()


def buffer(name: str, n: int) -> np.ndarray:
    """A float32 [n] buffer of this thread's named ``name``, grown on demand (contents undefined)."""
    bufs = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get(name)
    if buf is None or buf.size < n:
        buf = bufs[name] = np.empty(n, np.float32)
    return buf[:n]


def release() -> None:
    """Free this thread's buffers."""
    _local.__dict__.pop("bufs", None)
