"""MTP self-speculative decoding: the file's MTP head drafts k tokens, one trunk pass verifies them.

One step, the sampled token ``tok`` at position n not yet in the cache:

1. **draft** (:meth:`Speculator.draft`): the MTP head catches up on the positions it has not seen (row p reads
   the trunk's normed hidden state h_p and token t_{p+1}: :mod:`engine.models.mtp`), then proposes d_1 … d_k,
   each step feeding its own normed output back as the next ``h`` — greedily, or drawn from the sampler's
   distribution over the head's logits where the reply samples;
2. **verify** (:func:`speculate`): one forward pass of the trunk over [tok, d_1 … d_k] at n … n+k. Its routed
   experts run grouped by expert (``engine.kernels.grouped``: each selected expert read once for all k+1
   positions, bit-identical to the per-token kernel), and the cache keeps every position's recurrent state
   (``KVCache.keep_steps``);
3. **accept**: greedy — the longest prefix of drafts equal to the trunk's argmax at the position before each,
   then the trunk's own token after it (so the output is the plain loop's); sampled — standard speculative
   sampling (accept d_i with probability min(1, p(d_i)/q(d_i)), else draw from max(p − q, 0) normalised; after
   k accepted drafts one more token from p), which keeps the sampler's distribution exactly;
4. **roll back** what was rejected: ``KVCache.rollback`` returns the Gated-DeltaNet conv and recurrent states to
   the last accepted token from the states the verify pass kept per position (no second pass over the accepted
   tokens, where a snapshot before the verify would have to recompute them); K/V rows past it are written over
   by position.

:class:`SpecStats` counts verify passes, drafted and accepted tokens (the events carry them). Where MTP was not
asked for but chosen automatically, a :class:`DraftJudge` times the drafting steps against plain steps and turns
drafting off for the conversation when it does not make tokens faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.generate.sampling import Sampler

HEAD_CHUNK = 512  # head rows per forward pass while it catches up on a prompt


@dataclass
class SpecStats:
    """One reply's speculative decoding: verify ``passes``, tokens ``drafted`` and ``accepted``."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens each verify pass produced (accepted drafts + the trunk's own token)."""
        return (self.accepted + self.passes) / self.passes if self.passes else 0.0


@dataclass
class DraftJudge:
    """Whether drafting pays, from a session's own step times: every ``probe_every`` speculative steps one plain
    one-token step is timed instead; once ``min_passes`` speculative steps and ``min_probes`` plain ones are in,
    drafting stops for good (:attr:`off`) if its time a token is not below the plain step's. Pays on memory-bound
    models, where a verify pass of k+1 positions costs little more than one step; not on a model so small that the
    loop's own work is a step's size (the GDN demo on 2 cores)."""

    probe_every: int = 16
    min_passes: int = 32
    min_probes: int = 2
    spec_s: float = 0.0
    spec_tokens: int = 0
    spec_passes: int = 0
    plain_s: float = 0.0
    plain_steps: int = 0
    since_probe: int = 0
    off: bool = False

    def wants_plain(self) -> bool:
        """Whether the next step should be a plain one: drafting is off, or it is a probe's turn."""
        return self.off or self.since_probe >= self.probe_every

    def record_pass(self, seconds: float, tokens: int) -> None:
        """A speculative step took ``seconds`` for ``tokens`` tokens (its accepted drafts and the next)."""
        self.spec_s += seconds
        self.spec_tokens += tokens
        self.spec_passes += 1
        self.since_probe += 1

    def record_plain(self, seconds: float) -> None:
        """A plain one-token step took ``seconds``; decides once enough of both are in."""
        if self.off:
            return
        self.plain_s += seconds
        self.plain_steps += 1
        self.since_probe = 0
        if self.spec_passes >= self.min_passes and self.plain_steps >= self.min_probes:
            self.off = self.spec_s / self.spec_tokens >= self.plain_s / self.plain_steps

    @property
    def speedup(self) -> float | None:
        """Plain step time over drafting's time a token (None until both were measured)."""
        if not (self.spec_tokens and self.plain_steps) or self.spec_s <= 0:
            return None
        return (self.plain_s / self.plain_steps) / (self.spec_s / self.spec_tokens)


class Speculator:
    """The MTP head's side of a session: its K/V cache (``head.new_cache``), the positions it has processed
    (rows 0 … :attr:`pos`−1) and the trunk's hidden states it has not consumed yet (positions :attr:`pos` …)."""

    def __init__(self, head, k: int, n_ctx: int):
        self.head, self.k, self.n_ctx = head, k, n_ctx
        self.judge: DraftJudge | None = None  # the session's (generate sets it); None: draft every step
        self.cache = head.new_cache(n_ctx)
        self.pos = 0
        self.pending: torch.Tensor | None = None  # [n, D] for positions pos … pos+n−1
        self.stats = SpecStats()  # the current reply's (engine.generate.loop resets it per reply)

    @property
    def end(self) -> int:
        """The first position whose trunk hidden state the head has not been given."""
        return self.pos + (0 if self.pending is None else len(self.pending))

    def sync(self, keep: int) -> None:
        """The trunk keeps positions below ``keep`` (a new turn): what the head holds past it is dropped."""
        if keep <= self.pos:
            self.pos, self.pending = keep, None
        elif keep < self.end:
            self.pending = self.pending[: keep - self.pos]

    def observe(self, start: int, hidden: torch.Tensor) -> None:
        """The trunk's normed hidden states [T, D] of positions start … start+T−1. Where positions before
        ``start`` were never given (a turn run without MTP) the head skips them: its rows there stay as they
        were — the drafts may be worse, the output is not changed (the trunk verifies every draft)."""
        if start != self.end:
            self.pos, self.pending = start, None
        h = hidden.detach().to("cpu", torch.float32)
        self.pending = h if self.pending is None else torch.cat([self.pending, h])

    def draft(self, tokens: list[int], k: int, sampler: Sampler | None = None, history: list[int] | None = None):
        """``tokens``: the trunk's tokens t_0 … t_n (t_n sampled, not yet in the trunk's cache), every hidden
        state up to position n−1 observed -> (drafts [k], their draft distributions [k] (float64 [V], None when
        greedy)). ``sampler``: draw from its distribution (None: greedy)."""
        n = len(tokens) - 1
        if self.end != n:
            raise ValueError(f"the MTP head holds hidden states up to {self.end}, the trunk is at {n}")
        head = self.head
        logits = h = None
        while self.pending is not None and len(self.pending):
            c = self.pending[:HEAD_CHUNK]
            logits, h = head.forward(c, tokens[self.pos + 1 : self.pos + 1 + len(c)], self.pos, self.cache)
            self.pos += len(c)
            self.pending = self.pending[len(c) :] if len(self.pending) > len(c) else None
        if logits is None:  # nothing new since the last draft: nothing to draft from
            return [], []
        drafts, dists = [], []
        hist = list(history or [])
        row, h = logits[-1].numpy(), h[-1:]
        for j in range(k):
            if sampler is None:
                d, q = int(np.argmax(row)), None
            else:
                q = sampler.distribution(row, hist)
                d = int(sampler.rng.choice(len(q), p=q))
            drafts.append(d)
            dists.append(q)
            hist.append(d)
            if j + 1 < k:  # speculative rows n, n+1, …: written over when the trunk's states come
                logits, h = head.forward(h, [d], n + j, self.cache)
                row = logits[-1].numpy()
        return drafts, dists


def speculate(model, cache, spec: Speculator, tok: int, pos: int, k: int, sampler: Sampler, history: list[int]):
    """One draft + verify + accept step after ``tok`` (sampled, at position ``pos``, not in the cache; ``history``
    ends with it): -> (accepted drafts, the next token, its verify logits row). The cache then holds tok and the
    accepted drafts (positions pos … pos+j), the recurrent states rolled back to there."""
    greedy = sampler.p.temperature <= 0
    if len(history) != pos + 1:
        raise ValueError(f"the history holds {len(history)} tokens, the step is at position {pos}")
    drafts, qs = spec.draft(history, k, None if greedy else sampler, history)
    stats = spec.stats
    cache.keep_steps = True
    try:
        logits = model.forward([tok, *drafts], pos, cache, all_logits=True)
    finally:
        cache.keep_steps = False
    hidden = model.last_hidden
    accepted: list[int] = []
    hist = list(history)
    nxt = None
    for i, d in enumerate(drafts):
        row = logits[i].numpy()
        if greedy:
            t = sampler(row, hist)
            if t == d:
                accepted.append(d)
                hist.append(d)
                continue
            nxt = t
        else:
            ok, t = accept_sampled(sampler.distribution(row, hist), qs[i], d, sampler.rng)
            if ok:
                accepted.append(d)
                hist.append(d)
                continue
            nxt = t
        break
    j = len(accepted)
    if nxt is None:  # every draft accepted: the trunk's token after them
        nxt = sampler(logits[j].numpy(), hist)
    if drafts:
        cache.rollback(pos + 1 + j)
    spec.observe(pos, hidden[: j + 1])
    stats.passes += 1
    stats.drafted += len(drafts)
    stats.accepted += j
    return accepted, nxt, logits[j : j + 1]


def accept_sampled(p: np.ndarray, q: np.ndarray, d: int, rng: np.random.Generator) -> tuple[bool, int]:
    """Standard speculative sampling of one position: the draft ``d`` drawn from ``q`` (float64 [V]) against
    the trunk's distribution ``p`` -> (accepted, the token: ``d``, or a draw from max(p − q, 0) normalised).
    The token so chosen is distributed as ``p`` exactly."""
    if rng.random() * q[d] < p[d]:  # u < p(d) / q(d)
        return True, d
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return False, int(rng.choice(len(r), p=r / s)) if s > 0 else int(rng.choice(len(p), p=p))
