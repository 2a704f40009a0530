"""``sharpi logits -m FILE --tokens 1,2,3 --out OUT.npy``: float32 logits [n_tokens, vocab]."""

from __future__ import annotations

import argparse

import numpy as np

from engine.cli.common import add_model_args, add_placement_args, add_threads_arg, export_expert_stats, load_session
from engine.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logits", help="write the logits of every position of a token sequence")
    add_model_args(p)
    add_threads_arg(p)
    p.add_argument("--tokens", required=True, help="comma-separated token ids")
    p.add_argument("--out", required=True, help="output .npy file")
    p.add_argument("--decode", action="store_true", help="feed tokens one at a time instead of one batch")
    add_placement_args(p)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    try:
        ids = [int(t) for t in a.tokens.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--tokens must be comma-separated integers, got {a.tokens!r}") from None
    if not ids:
        raise UsageError("--tokens is empty")
    with load_session(a) as s:
        bad = [t for t in ids if not 0 <= t < s.args.n_vocab]
        if bad:
            raise UsageError(f"token ids out of range 0..{s.args.n_vocab - 1}: {bad[:5]}")
        out = s.logits(ids, batch=not a.decode)
        export_expert_stats(a, s)
    np.save(a.out, out.astype(np.float32))
    print(f"wrote {a.out}: float32 {list(out.shape)}")
    return 0
