"""A model that writes a scripted reply: for tests of what generation does with the text (reasoning, stops)."""

from __future__ import annotations

import torch


class ScriptedModel:
    """Emits ``script`` token by token, whatever the prompt (then its last token forever); :meth:`restart`
    begins it again (a new request). ``base``: a real model whose other attributes (its profiler, ...) this one
    lends, for a session that reads them."""

    def __init__(self, script: list[int], n_vocab: int, base=None):
        self.script, self.n_vocab, self.i, self._base = list(script), n_vocab, 0, base

    def __getattr__(self, name):
        if name.startswith("_") or self._base is None:
            raise AttributeError(name)
        return getattr(self._base, name)

    def restart(self, script: list[int] | None = None) -> None:
        self.script, self.i = list(script if script is not None else self.script), 0

    def forward(self, ids, pos, cache, all_logits=False):
        row = torch.full((1, self.n_vocab), -1e9)
        row[0, self.script[min(self.i, len(self.script) - 1)]] = 0.0
        self.i += 1
        return row


class FlatCache:
    """What the decode loop asks of a cache that holds only K/V."""

    n_ctx = 4096
    recurrent = {}

    def reusable_prefix(self, keep, held):
        return keep
