"""``sharpi inspect FILE [--json]``: architecture, hyperparameters, tokenizer, bytes by role and type."""

from __future__ import annotations

import argparse
import json

from engine.errors import UsageError
from engine.gguf import open_gguf
from engine.modelinfo import describe, human_bytes
from engine.preflight import is_weightless


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a GGUF model file")
    p.add_argument("file", nargs="?", help="path to a .gguf file (or -m FILE, as the other commands)")
    p.add_argument("-m", "--model", dest="model", default=None, help="the same: the GGUF file")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.model is None):
        raise UsageError("give the GGUF file once: sharpi inspect FILE, or sharpi inspect -m FILE")
    args.file = args.file or args.model
    with open_gguf(args.file) as gf:
        info = describe(gf)
    weightless = is_weightless(args.file, info.trunk_bytes + info.expert_bytes)
    if args.json:
        print(json.dumps({**info.to_dict(), "weightless": weightless}, indent=2))
        return 0
    print(f"file          {info.path}  ({human_bytes(info.file_size)}, GGUF v{info.gguf_version})")
    print(
        f"architecture  {info.architecture}" + ("" if info.supported else f"  [unsupported: {info.unsupported_reason}]")
    )
    if info.name:
        print(f"name          {info.name}")
    print(f"parameters    {info.n_parameters / 1e9:.3f} B in {info.tensor_count} tensors")
    tmpl = "chat template" if info.has_chat_template else "no chat template"
    print(
        f"tokenizer     {info.tokenizer_model or '?'} (pre: {info.tokenizer_pre or '-'}), {info.vocab_size} tokens, {tmpl}"
    )
    if info.hparams:
        print("hyperparameters")
        for k, v in info.hparams.items():
            print(f"  {k:<14}{v}")
    print("bytes by type")
    for t, n in info.bytes_by_type.items():
        print(f"  {t:<8}{human_bytes(n):>12}")
    print(f"trunk         {human_bytes(info.trunk_bytes)}")
    print(f"routed experts {human_bytes(info.expert_bytes)}")
    if info.per_expert_bytes:
        roles = ", ".join(f"{r} {human_bytes(b)}" for r, b in info.per_expert_role_bytes.items())
        print(f"per expert    {human_bytes(info.per_expert_bytes)} ({roles})")
    if weightless:
        print("weights       none: a geometry-only file (its data region is a hole on disk); not runnable")
    return 0
