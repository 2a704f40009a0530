"""Warming a loaded model up before its first question, and counting the kernels that compiles.

The CPU kernels are numba functions compiled on first use and cached on disk (``cache=True``): on a
machine that never ran them, the first answer waited minutes with nothing on screen, and after every
restart the first answer still paid for loading them from the cache. :func:`warm_up` runs the model
once the way a chat does — a prompt long enough for the prompt path (``engine.kernels.bf16``'s
MIN_TOKENS), a few decoded tokens, then a short follow-up continuing the same cache — so every kernel
the model needs is compiled or loaded before the user asks anything; then it forgets what it ran
(the KV state and the expert profiler's counters).

Progress: :class:`CompileCounter` listens to numba's ``numba:compile`` events (raised only when a
function is really compiled, never for a cache hit) and counts the outermost ones — the kernels
the engine calls, not the helpers compiled inside them. How many a model needs is recorded per
kernel key (architecture, weight types, numba and the kernels' code) the first time it is prepared
(:func:`expected_compiles`); for a key never prepared on this machine the total is an estimate
(:data:`TYPICAL_COMPILES`) that the caller labels as one.

    result = warm_up(session, lambda k, n, estimated: print(f"{k} of {'~' if estimated else ''}{n}"))
    result.compiled, result.seconds, result.decode_tok_s
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine import config
from engine.config import EngineOptions

# Outermost kernel compilations of the bundled demo model (qwen3moe, Q8_0 + F32) on a cold cache,
# counted on 2026-11-27: the total shown for a model never prepared on this machine, as an estimate.
TYPICAL_COMPILES = 14
WARMUP_PROMPT_TOKENS = 40  # ≥ engine.kernels.bf16.MIN_TOKENS: the prompt path a real question takes
WARMUP_FOLLOWUP_TOKENS = 8  # a short follow-up on the same cache: the small-prompt path
WARMUP_DECODE_TOKENS = 4

Progress = Callable[[int, int, bool], None]  # (kernels compiled, total expected, total is an estimate)


@dataclass(frozen=True)
class WarmUp:
    compiled: int  # kernels compiled now (0: all came from numba's cache)
    kernels: tuple[str, ...]  # their names, in order
    seconds: float
    decode_tok_s: float  # decode speed of the warm-up's last tokens (kernels ready by then)


class CompileCounter:
    """Counts outermost numba compilations on the calling thread while active (a context manager)."""

    def __init__(self, on_change: Callable[[int, bool], None] | None = None):
        self.started = 0  # outermost compilations begun
        self.done = 0  # outermost compilations finished
        self.names: list[str] = []  # the kernels compiled, in order
        self._depth = 0
        self._thread = threading.get_ident()
        self._on_change = on_change or (lambda done, busy: None)
        from numba.core import event

        counter = self

        class _Listener(event.Listener):
            def on_start(self, ev) -> None:
                if threading.get_ident() != counter._thread:
                    return
                counter._depth += 1
                if counter._depth == 1:
                    counter.started += 1
                    d = ev.data.get("dispatcher")
                    counter.names.append(getattr(getattr(d, "py_func", None), "__qualname__", str(d)))
                    counter._on_change(counter.done, True)

            def on_end(self, ev) -> None:
                if threading.get_ident() != counter._thread:
                    return
                counter._depth -= 1
                if counter._depth == 0:
                    counter.done += 1
                    counter._on_change(counter.done, False)

        self._listener = _Listener()

    def __enter__(self) -> CompileCounter:
        from numba.core import event

        event.register("numba:compile", self._listener)
        return self

    def __exit__(self, *exc) -> None:
        from numba.core import event

        event.unregister("numba:compile", self._listener)


def kernel_key(session) -> str:
    """What decides which kernels a model compiles: its architecture and weight types, the
    activation mode and numba's version. (A change of the engine's code may change the count a
    little; the count is a progress total, never a result.)"""
    import numba

    key = {
        "arch": session.info.architecture,
        "types": sorted(session.info.bytes_by_type),
        "q8_act": session.options.q8_act,
        "numba": numba.__version__,
    }
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _counts_path(options: EngineOptions | None) -> Path:
    """Beside the calibration cache: ``EngineOptions.calibration_dir``'s folder, else the user cache."""
    d = (options or config.current()).calibration_dir
    if d is not None:
        return Path(d).parent / "kernels.json"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("sharpi")) / "kernels.json"


def _read_counts(options: EngineOptions | None) -> dict:
    try:
        data = json.loads(_counts_path(options).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def expected_compiles(key: str, options: EngineOptions | None = None) -> int | None:
    """The kernels a model of ``key`` compiled when it was first prepared here, or None."""
    n = _read_counts(options).get(key)
    return n if isinstance(n, int) and n > 0 else None


def record_compiles(key: str, n: int, options: EngineOptions | None = None) -> None:
    counts = _read_counts(options)
    counts[key] = int(n)
    path = _counts_path(options)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(counts, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the next first run its exact total


def warmup_ids(session) -> tuple[list[int], list[int]]:
    """Token ids of the warm-up's prompt and follow-up: ordinary text, as long as the prompt path
    needs, within half the context."""
    words = "Explain how the for statement works in Python, with a short example of a loop. "
    room = max(2, session.n_ctx // 2 - WARMUP_DECODE_TOKENS * 2 - WARMUP_FOLLOWUP_TOKENS)
    ids: list[int] = []
    while len(ids) < WARMUP_PROMPT_TOKENS:
        ids += session.tokenize(words, add_bos=None if not ids else False, special=False)
    follow = session.tokenize(" And a while loop?", add_bos=False, special=False)
    return ids[: min(WARMUP_PROMPT_TOKENS, room)], (follow * WARMUP_FOLLOWUP_TOKENS)[:WARMUP_FOLLOWUP_TOKENS]


@contextmanager
def preparing(session, progress: Progress | None = None) -> Iterator[CompileCounter]:
    """Count, and report through ``progress(k, n, estimated)``, the kernels ``session``'s model compiles
    inside the block; the first time a model of its kernel key compiles here, the count is recorded
    as that key's total for later first runs (a cleared numba cache)."""
    options = session.engine_options
    key = kernel_key(session)
    known = expected_compiles(key, options)

    def on_change(done: int, busy: bool) -> None:
        if progress is not None:
            total = known if known is not None else TYPICAL_COMPILES
            progress(done, max(total, done + busy), known is None)

    with CompileCounter(on_change) as counter:
        yield counter
    if counter.done and known is None:
        record_compiles(key, counter.done, options)


def warm_up(session, progress: Progress | None = None) -> WarmUp:
    """Run ``session``'s model once as a chat would, so its kernels are compiled (first run) or
    loaded from numba's cache (later runs) now; then reset its KV state and profiler counters.
    ``progress(k, n, estimated)`` is called when a kernel compilation starts or ends (never when all
    come from the cache)."""
    from engine.generate import SamplingParams

    t0 = time.perf_counter()
    first, follow = warmup_ids(session)
    # The chat's sampler (top-k, top-p, min-p, penalties: numba kernels of its own) and the greedy one.
    sampled = SamplingParams(max_tokens=WARMUP_DECODE_TOKENS, seed=0)
    greedy = SamplingParams.greedy(max_tokens=WARMUP_DECODE_TOKENS)
    with preparing(session, progress) as counter, session.unsampled():  # made-up prompts: not the user's routing
        events = list(session.generate(prompt_ids=first, params=sampled))
        made = session.state.tokens[len(first) :]  # the decoded tokens the cache holds
        events += list(session.generate(prompt_ids=first + made + follow, params=greedy))
    last = events[-1] if events else None
    seconds = time.perf_counter() - t0
    session.reset()
    session.reset_stats()
    return WarmUp(counter.done, tuple(counter.names), seconds, last.decode_tok_s if last is not None else 0.0)
