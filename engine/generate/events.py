"""What generation yields: frozen events consumed alike by the CLI, tests, the server and the GUI."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Why generation ended.
FINISH_EOS = "eos"  # the model produced an end-of-generation token
FINISH_STOP = "stop"  # a stop string appeared
FINISH_LENGTH = "length"  # max_tokens reached
FINISH_CONTEXT = "context"  # the context window is full
FINISH_CANCELLED = "cancelled"  # cancel() was called


@dataclass(frozen=True)
class GenerationEvent:
    text: str  # new answer text since the previous event (never half a UTF-8 character); may be ""
    token_id: int | None  # the token this event is about (None on the final event)
    n_prompt: int  # prompt tokens processed (only those not already in the KV cache)
    n_generated: int  # tokens generated so far
    n_ctx_used: int  # positions of the context in use after this token
    n_ctx: int  # context size
    ttft_s: float  # time to first token (prompt processing + first sample), seconds
    prompt_tok_s: float  # prompt processing speed, tokens per second
    decode_tok_s: float  # decode speed over the generated tokens so far (0 until the second token)
    finish_reason: str | None = None  # None while streaming; one of the FINISH_* values at the end
    message: str = ""  # a human-readable note with the finish reason (e.g. why the context is full)
    # the device expert cache's hit rate over the same tokens as decode_tok_s (None: no cache lookups);
    # both from the model profiler's decode window (engine.profiler.DecodeWindow), as the experts dock shows
    decode_hit_rate: float | None = None
    # new reasoning text since the previous event (engine.generate.reasoning: the model's thinking, kept out of
    # ``text``); "" for a model without a reasoning format or with the separation off (EngineOptions.reasoning)
    reasoning: str = ""
    # tool calls the model wrote in its reasoning format's own syntax since the previous event (harmony: a message to
    # ``functions.NAME``), (name, arguments text as written); () for other models (their calls are text: the server's
    # engine.server.tools parses it)
    calls: tuple[tuple[str, str], ...] = ()
    # MTP speculative decoding over the reply so far (engine.generate.speculative; all 0 without it): verify
    # passes, tokens the MTP head drafted, drafts the trunk accepted
    mtp_passes: int = 0
    mtp_drafted: int = 0
    mtp_accepted: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def mtp_acceptance(self) -> float | None:
        """Accepted drafts over drafted tokens (None: no drafts)."""
        return self.mtp_accepted / self.mtp_drafted if self.mtp_drafted else None


@dataclass(frozen=True)
class DecodeWindow:
    """The decode of one reply so far: ``tokens`` sampled after the first, ``seconds`` from the first to the
    latest, the expert cache's ``hits`` and ``misses`` between them — the one source of a reply's decode
    tok/s and hit rate (its events carry them; the model profiler's snapshots, which the experts dock draws,
    carry the same window)."""

    tokens: int = 0
    seconds: float = 0.0
    hits: int = 0
    misses: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else 0.0

    @property
    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None


class DecodeClock:
    """A :class:`DecodeWindow` kept up to date: :meth:`start` at a reply's first sampled token, :meth:`tick` at
    each next one (``now`` from time.perf_counter). ``lookups()``: the cache's (hits, misses) so far."""

    def __init__(self, lookups: Callable[[], tuple[int, int]] = lambda: (0, 0)):
        self.lookups = lookups
        self.window = DecodeWindow()
        self._t0 = 0.0
        self._mark = (0, 0)

    def start(self, now: float) -> DecodeWindow:
        self._t0, self._mark = now, self.lookups()
        self.window = DecodeWindow()
        return self.window

    def tick(self, now: float) -> DecodeWindow:
        h, m = self.lookups()
        self.window = DecodeWindow(self.window.tokens + 1, now - self._t0, h - self._mark[0], m - self._mark[1])
        return self.window

    # the generation loop's calls, as on engine.profiler.ExpertProfiler (a model without a profiler)
    decode_started = start
    decode_token = tick
