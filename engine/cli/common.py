"""Options shared by the commands that load a model."""

from __future__ import annotations

import argparse
import sys

from engine.api import LoadOptions, Session
from engine.generate import SamplingParams
from engine.plan.sizing import KV_TYPES


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="GGUF model file")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--kv-type", choices=KV_TYPES, default=None, help="KV cache dtype (default $SHARPI_KV_DTYPE or f32)")
    p.add_argument(
        "--exact-float",
        action="store_true",
        help="multiply by exactly dequantized weights instead of quantizing activations like llama.cpp",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    p.add_argument("-n", "--n-predict", type=int, default=d.max_tokens, help="tokens to generate")
    p.add_argument("--temp", type=float, default=d.temperature, help="temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--min-p", type=float, default=d.min_p)
    p.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty)
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=a.temp,
        top_k=a.top_k,
        top_p=a.top_p,
        min_p=a.min_p,
        repeat_penalty=a.repeat_penalty,
        presence_penalty=a.presence_penalty,
        seed=a.seed,
        max_tokens=a.n_predict,
        stop=tuple(a.stop),
    )


def load_session(a: argparse.Namespace) -> Session:
    tty = sys.stderr.isatty() and not getattr(a, "quiet", False)

    def progress(done: int, total: int, what: str) -> None:
        if tty:
            end = "\n" if done == total else ""
            print(f"\rloading {a.model}: [{'#' * done}{'.' * (total - done)}] {what:<24}", end=end, file=sys.stderr)

    opts = LoadOptions(n_ctx=a.ctx_size, kv_type=a.kv_type, q8_act=not a.exact_float)
    return Session.load(a.model, opts, progress)
