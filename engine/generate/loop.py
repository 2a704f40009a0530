"""The decode loop: prefill what the cache lacks, then sample token by token, yielding events.

Plain functions over a model, a KV cache and a tokenizer (gpt-fast style): no hidden state
beyond the ``CacheState`` that records which token ids the cache holds, so a chat's next turn
reuses the common prefix instead of recomputing it. A cache with recurrent states (Gated DeltaNet
layers) cannot step back, so the state keeps checkpoints of them at the end of every turn: a
regenerate or an edited message restarts from the last checkpoint at or before where it branches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.errors import UsageError
from engine.generate.events import (
    FINISH_CANCELLED,
    FINISH_CONTEXT,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    DecodeClock,
    GenerationEvent,
)
from engine.generate.reasoning import ReasoningSplitter, start_state
from engine.generate.sampling import Sampler, SamplingParams
from engine.generate.speculative import DraftJudge, SpecStats, Speculator, speculate

PREFILL_CHUNK = 512  # prompt tokens per forward pass (cancel is checked between chunks)


class TokenConstraint(Protocol):
    """What may come next (a grammar): the decode loop's one hook for constrained sampling. A constraint with a
    true ``split`` attribute forces text in the model's reasoning format (a harmony tool call), which the loop
    splits as it would an unconstrained reply's; without one its text is all answer (JSON, a ``<tool_call>``)."""

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """float32 [V] logits -> the same with every forbidden token at -inf (a copy; the input is kept).
        When the constraint is complete only end-of-generation tokens are allowed."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past the sampled ``token_id`` (one :meth:`mask` allowed)."""
        ...


@dataclass
class CacheState:
    """The token ids whose K/V are in the cache, position by position; and, for a cache with recurrent
    states, ``checkpoints``: position → a snapshot of those states there (``KVCache.snapshot``, host
    memory), the newest ``checkpoint_limit`` kept (``EngineOptions.state_checkpoints``; each costs the
    states' bytes, ``ModelSpec`` layers' ``state_bytes`` summed)."""

    tokens: list[int] = field(default_factory=list)
    checkpoint_limit: int = 0
    checkpoints: dict[int, list] = field(default_factory=dict)
    # the MTP head's cache and position beside this cache (engine.generate.speculative), made by the first
    # reply run with MTP
    speculator: Speculator | None = None

    def checkpoint(self, cache) -> None:
        """Keep a snapshot of ``cache``'s recurrent states where they stand, if it has any and they are at
        the end of :attr:`tokens` (the oldest checkpoint goes beyond the limit)."""
        pos = len(self.tokens)
        if not cache.recurrent or self.checkpoint_limit <= 0 or cache.state_pos != pos or pos in self.checkpoints:
            return
        self.checkpoints[pos] = cache.snapshot()
        while len(self.checkpoints) > self.checkpoint_limit:
            del self.checkpoints[min(self.checkpoints)]

    def rewind(self, cache, keep: int, want: int) -> int:
        """The positions a new prompt keeps: ``keep`` (what the cache itself can reuse, ``reusable_prefix``)
        or, where the recurrent states would have to step back to ``want`` (the common prefix), the latest
        checkpoint at or before it, restored into ``cache``. :attr:`tokens` and the checkpoints are cut there."""
        if keep < want:
            best = max((p for p in self.checkpoints if keep < p <= want), default=None)
            if best is not None:
                cache.restore(self.checkpoints[best], best)
                keep = best
        self.tokens = self.tokens[:keep]
        for p in [p for p in self.checkpoints if p > keep]:
            del self.checkpoints[p]
        return keep

    def common_prefix(self, ids: list[int]) -> int:
        n = 0
        for a, b in zip(self.tokens, ids):
            if a != b:
                break
            n += 1
        # Keep at least one token to feed: the last prompt token's logits are needed.
        return min(n, len(ids) - 1)


class StopMatcher:
    """Holds back text that could still become a stop string; cuts at the first full match."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """New text -> (text safe to emit, stopped)."""
        self.pending += text
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0:
                out, self.pending = self.pending[:i], ""
                return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def generate(
    model,
    tokenizer,
    cache,
    state: CacheState,
    prompt_ids: list[int],
    params: SamplingParams,
    cancel: threading.Event | None = None,
    constraint: TokenConstraint | None = None,
    reasoning: str | None = None,
    mtp: int = 0,
    only_calls: bool = False,
    mtp_judge: DraftJudge | None = None,
) -> Iterator[GenerationEvent]:
    """Stream a completion of ``prompt_ids``. ``cancel`` is checked between tokens and chunks.

    ``constraint`` (structured output): its :meth:`~TokenConstraint.mask` removes the tokens it forbids
    from each step's logits before sampling, and every sampled token is handed to its
    :meth:`~TokenConstraint.accept`.

    ``reasoning``: the model's reasoning format (:mod:`engine.generate.reasoning`; None: none): the events'
    ``text`` is then the answer and their ``reasoning`` the rest (a constrained generation is all answer unless
    the constraint says ``split``: :class:`TokenConstraint`). ``only_calls``: the splitter takes out only the
    tool calls (:class:`~engine.generate.reasoning.ReasoningSplitter`): the rest of the text is answer as written.

    ``mtp``: draft this many tokens per step with the model's MTP head and verify them in one pass
    (:mod:`engine.generate.speculative`; 0, a model without a head, or a ``constraint``: one token per pass).
    The output is the same (greedy) or follows the same distribution (sampled). ``mtp_judge``: MTP was chosen
    automatically, not asked for: this :class:`~engine.generate.speculative.DraftJudge` (the session's, kept across
    replies and conversations) times the steps and turns drafting off where it does not make tokens faster."""
    cancel = cancel or threading.Event()
    n_ctx = cache.n_ctx
    if not prompt_ids:
        raise UsageError("the prompt is empty: nothing to continue from")
    if len(prompt_ids) >= n_ctx:
        raise UsageError(
            f"the prompt has {len(prompt_ids)} tokens but the context holds {n_ctx}: "
            "shorten it or raise the context size (-c)"
        )
    t0 = time.perf_counter()
    common = state.common_prefix(prompt_ids)
    keep = state.rewind(cache, cache.reusable_prefix(common, len(state.tokens)), common)
    todo = prompt_ids[keep:]
    spec = None
    head = model.mtp_head() if mtp > 0 and constraint is None and hasattr(model, "mtp_head") else None
    if head is not None:
        spec = state.speculator
        if spec is None or spec.head is not head or spec.n_ctx != n_ctx:
            spec = state.speculator = Speculator(head, mtp, n_ctx)
        spec.judge = mtp_judge
        spec.k, spec.stats = mtp, SpecStats()
        spec.sync(keep)
        model.keep_hidden = True
    try:
        splitter = None
        if reasoning and (constraint is None or getattr(constraint, "split", False)):
            where = start_state(reasoning, tokenizer.decode(prompt_ids[-16:]))[0]
            splitter = ReasoningSplitter(reasoning, where, only_calls=only_calls)
        yield from _run(
            model, tokenizer, cache, state, prompt_ids, todo, keep, params, cancel, constraint, t0, splitter, spec
        )
    finally:  # the end of the turn, however it ended: the recurrent states' checkpoint
        if spec is not None:
            model.keep_hidden = False
            if cache.recurrent and cache.state_pos > len(state.tokens):
                # a verify pass fed drafts the reply did not reach (it stopped or was cancelled before them)
                cache.rollback(len(state.tokens))
        state.checkpoint(cache)


def _run(
    model, tokenizer, cache, state, prompt_ids, todo, keep, params, cancel, constraint, t0, splitter=None, spec=None
):
    """:func:`generate` from the first position the cache lacks (``keep``; ``todo`` the prompt from there);
    ``splitter`` parts the text into reasoning and answer; ``spec`` the MTP drafter (None: none)."""

    calls: list[tuple[str, str]] = []  # tool calls the splitter found since the last event

    def split(text: str, last: bool = False) -> tuple[str, str, bool]:
        """(answer, reasoning, the turn ended) of new ``text`` (its tool calls into ``calls``); ``last``: the reply
        ends here."""
        if splitter is None:
            return text, "", False
        s = splitter.feed(text)
        answer, thought = s.answer, s.reasoning
        calls.extend(s.calls)
        if last or s.ended:
            f = splitter.flush()
            answer, thought = answer + f.answer, thought + f.reasoning
            calls.extend(f.calls)
        return answer, thought, s.ended

    def _event(*a, **kw):
        ev = _make_event(*a, **kw, calls=tuple(calls))
        calls.clear()
        return ev

    n_ctx = cache.n_ctx
    logits = None
    pos = keep
    for c in range(0, len(todo), PREFILL_CHUNK):
        if cancel.is_set():
            yield _final(
                state, n_ctx, len(todo), 0, t0, None, None, FINISH_CANCELLED, "cancelled during prompt processing"
            )
            return
        chunk = todo[c : c + PREFILL_CHUNK]
        logits = model.forward(chunk, pos, cache, all_logits=False)
        if spec is not None:
            spec.observe(pos, model.last_hidden)
        state.tokens.extend(chunk)
        pos += len(chunk)
    t_prompt = time.perf_counter() - t0
    prompt_tps = len(todo) / t_prompt if t_prompt > 0 else 0.0

    sampler = Sampler(params)
    stops = StopMatcher(params.stop)
    detok = tokenizer.detokenizer()
    history = list(prompt_ids)
    n_gen, ttft, t_first = 0, 0.0, None
    # The decode speed and hit rate come from the model's profiler (one window, what the experts dock reads).
    meter = getattr(model, "profiler", None) or DecodeClock()
    stats = spec.stats if spec is not None else None
    queue: list[int] = []  # tokens a verify pass decided: its accepted drafts (in the cache), then the next one
    while True:
        if queue:
            tok = queue.pop(0)
        else:
            row = logits[-1].numpy()
            tok = sampler(constraint.mask(row) if constraint is not None else row, history)
        if constraint is not None:
            constraint.accept(tok)
        now = time.perf_counter()
        if t_first is None:
            t_first, ttft = now, now - t0
            window = meter.decode_started(now)
        else:
            window = meter.decode_token(now)
        n_gen += 1
        history.append(tok)
        decode_tps = window.tok_s
        hit = window.hit_rate
        ev = (n_ctx, len(todo), n_gen, ttft, prompt_tps, decode_tps)
        if tokenizer.is_eog(tok):
            text, thought, _ = split(stops.flush(), last=True)
            yield _event(text, tok, state, *ev, FINISH_EOS, hit=hit, reasoning=thought, spec=stats)
            return
        raw, stopped = stops.feed(detok.push(tok))
        text, thought, ended = split(raw, last=stopped)
        if stopped or ended:
            yield _event(
                text, tok, state, *ev, FINISH_STOP if stopped else FINISH_EOS, hit=hit, reasoning=thought, spec=stats
            )
            return
        finish, msg = None, ""
        if n_gen >= params.max_tokens:
            finish = FINISH_LENGTH
        elif len(state.tokens) + 1 >= n_ctx:
            finish, msg = FINISH_CONTEXT, f"the context of {n_ctx} tokens is full"
        elif cancel.is_set():
            finish = FINISH_CANCELLED
        if finish:
            more, more_thought, _ = split(stops.feed(detok.flush())[0] + stops.flush(), last=True)
            yield _event(
                text + more, tok, state, *ev, finish, msg, hit=hit, reasoning=thought + more_thought, spec=stats
            )
            return
        yield _event(text, tok, state, *ev, hit=hit, reasoning=thought, spec=stats)
        if queue:  # an accepted draft: the verify pass put it in the cache
            state.tokens.append(tok)
            continue
        pos = len(state.tokens)
        judge = spec.judge if spec is not None else None
        k = min(spec.k, n_ctx - pos - 2, params.max_tokens - n_gen - 1) if spec is not None else 0
        probe = k > 0 and judge is not None and judge.wants_plain()  # drafting is off, or a timed plain step's turn
        if probe:
            k = 0
        step_t0 = time.perf_counter()
        if k > 0:
            accepted, nxt, logits = speculate(model, cache, spec, tok, pos, k, sampler, history)
            queue = [*accepted, nxt]
            if judge is not None:
                judge.record_pass(time.perf_counter() - step_t0, len(queue))
        else:
            logits = model.forward([tok], pos, cache, all_logits=False)
            if spec is not None:
                spec.observe(pos, model.last_hidden)
            if probe:
                judge.record_plain(time.perf_counter() - step_t0)
        state.tokens.append(tok)


def _make_event(
    text, tok, state, n_ctx, n_prompt, n_gen, ttft, ptps, dtps, finish=None, msg="", hit=None, reasoning="", spec=None,
    calls=(),
):  # fmt: skip
    return GenerationEvent(
        text=text,
        token_id=tok,
        n_prompt=n_prompt,
        n_generated=n_gen,
        n_ctx_used=len(state.tokens) + 1,
        n_ctx=n_ctx,
        ttft_s=ttft,
        prompt_tok_s=ptps,
        decode_tok_s=dtps,
        finish_reason=finish,
        message=msg,
        decode_hit_rate=hit,
        reasoning=reasoning,
        calls=calls,
        mtp_passes=spec.passes if spec is not None else 0,
        mtp_drafted=spec.drafted if spec is not None else 0,
        mtp_accepted=spec.accepted if spec is not None else 0,
    )


def _final(state, n_ctx, n_prompt, n_gen, t0, ttft, tps, finish, msg):
    return GenerationEvent("", None, n_prompt, n_gen, len(state.tokens), n_ctx, 0.0, 0.0, 0.0, finish, msg)


def greedy_continuation(model, cache, prompt_ids: list[int], n: int) -> list[int]:
    """The ``n`` greedy tokens after ``prompt_ids`` (no tokenizer, no stopping): for parity tests."""
    logits = model.forward(prompt_ids, 0, cache, all_logits=False)
    out = []
    pos = len(prompt_ids)
    for _ in range(n):
        tok = int(np.argmax(logits[-1].numpy()))
        out.append(tok)
        logits = model.forward([tok], pos, cache, all_logits=False)
        pos += 1
    return out
