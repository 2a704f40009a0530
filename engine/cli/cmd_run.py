"""``sharpi run [-m FILE | --remote URL] (-p TEXT | --chat)``: stream a completion or chat in the terminal."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from contextlib import contextmanager

from engine.cli.common import (
    add_model_args,
    add_mtp_arg,
    add_placement_args,
    add_route_args,
    add_sampling_args,
    add_threads_arg,
    export_expert_stats,
    load_session,
    sampling_from_args,
    save_route_recording,
    start_route_recording,
)
from engine.errors import ChatTemplateError, UsageError
from engine.warmup import warm_up

log = logging.getLogger("sharpi.run")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="generate text from a prompt, or chat interactively")
    add_model_args(p)
    add_threads_arg(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("-p", "--prompt", help="raw prompt text (no chat template)")
    g.add_argument("-f", "--file", dest="prompt_file", help="raw prompt text read from a file (as -p)")
    g.add_argument("--chat", action="store_true", help="interactive chat using the model's chat template")
    p.add_argument("--system", default=None, help="system prompt for --chat")
    p.add_argument("--chatml", action="store_true", help="--chat with ChatML instead of the model's own template")
    r = p.add_argument_group("remote (chat through an OpenAI-compatible server instead of loading a file)")
    r.add_argument(
        "--remote",
        metavar="URL",
        default=None,
        help="base URL, e.g. http://gpu-box:8000/v1 (vLLM, SGLang, llama-server)",
    )
    r.add_argument("--api-key", default=None, help="the endpoint's key (sent as Authorization: Bearer)")
    r.add_argument("--remote-model", default=None, help="which of the endpoint's models (default: its first)")
    add_sampling_args(p)
    add_placement_args(p)
    add_route_args(p)
    add_mtp_arg(p)
    p.set_defaults(func=run)


def _stream(session, events) -> object:
    last = None
    for ev in events:
        _show(ev)
        last = ev
    return last


def _show(ev) -> None:
    """An event's text on stdout; its reasoning (engine.generate.reasoning) on stderr, dimmed on a terminal, so
    stdout carries the answer alone."""
    if ev.reasoning:
        dim = sys.stderr.isatty()
        sys.stderr.write(f"\x1b[2m{ev.reasoning}\x1b[0m" if dim else ev.reasoning)
        sys.stderr.flush()
    if ev.text:
        sys.stdout.write(ev.text)
        sys.stdout.flush()


def _report(ev) -> None:
    if ev is None:
        return
    note = f" ({ev.message})" if ev.message else ""
    print(
        f"\n[{ev.finish_reason}{note}] prompt {ev.n_prompt} tok at {ev.prompt_tok_s:.1f} tok/s, "
        f"decode {ev.n_generated} tok at {ev.decode_tok_s:.1f} tok/s, ttft {ev.ttft_s * 1000:.0f} ms",
        file=sys.stderr,
    )
    if ev.mtp_passes:
        print(
            f"[mtp] {ev.mtp_accepted}/{ev.mtp_drafted} drafts accepted ({ev.mtp_acceptance or 0.0:.0%}), "
            f"{(ev.mtp_accepted + ev.mtp_passes) / ev.mtp_passes:.2f} tokens a verify pass over {ev.mtp_passes} passes "
            "(sharpi bench --mtp 0 / --mtp K gives the speedup)",
            file=sys.stderr,
        )


def _open(a: argparse.Namespace):
    if a.remote is None:
        return load_session(a, refuse_unrunnable=True)
    from engine.remote import RemoteSession

    if a.model is not None:
        raise UsageError("give -m/--model or --remote, not both")
    session = RemoteSession(a.remote, a.api_key, a.remote_model)
    print(f"sharpi: {session.model} at {a.remote} (placement flags do not apply)", file=sys.stderr)
    return session


def _kernel_progress(k: int, n: int, estimated: bool) -> None:
    """``Preparing CPU kernels, first run only — k of N`` on stderr (one line, rewritten on a terminal)."""
    tty = sys.stderr.isatty()
    line = f"Preparing CPU kernels, first run only — {k} of {'about ' if estimated else ''}{n}"
    print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)


@contextmanager
def _ctrl_c_cancels(session, pressed: list):
    """While the model runs, Ctrl+C cancels it (the engine stops within a token) instead of raising
    KeyboardInterrupt inside a numba kernel, which surfaces as a SystemError traceback. Each press is
    appended to ``pressed``. Outside the block, Ctrl+C ends the program as usual."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame) -> None:
        pressed.append(signum)
        session.cancel()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run(a: argparse.Namespace) -> int:
    params = sampling_from_args(a)  # checked before the model loads
    if a.prompt_file is not None:
        try:
            with open(a.prompt_file, encoding="utf-8") as f:
                a.prompt = f.read()
        except OSError as e:
            raise UsageError(f"cannot read the prompt file: {e}") from None
    if a.remote is not None and (a.record_routes or a.replay_routes):
        raise UsageError("--record-routes and --replay-routes take a model run here, not a remote endpoint")
    session = _open(a)
    pressed: list = []
    recorder = None
    try:
        # The kernels ready before the first token, as in the app: compiled here on a first run (with
        # "k of N" on stderr), loaded from numba's cache after, so the reported speeds are the model's.
        compiled = 0
        if a.remote is None and a.replay_routes:  # before the warm-up: its graphs are captured replaying
            start_route_recording(a, session)
        if a.remote is None:  # a remote endpoint has no kernels here
            with _ctrl_c_cancels(session, pressed):
                compiled = warm_up(session, _kernel_progress).compiled
        if compiled and sys.stderr.isatty():
            print(file=sys.stderr)
        if pressed:
            return 130
        if not a.replay_routes:
            recorder = start_route_recording(a, session)  # after the warm-up: only what the user ran
        if a.prompt is not None:
            with _ctrl_c_cancels(session, pressed):
                _report(_stream(session, session.generate(a.prompt, params=params)))
            return 130 if pressed else 0
        if a.remote is None and a.chatml:
            session.use_chatml()
        elif a.remote is None and not session.chat_template.from_file:
            print("note: the model has no chat template; using ChatML", file=sys.stderr)
        messages = [{"role": "system", "content": a.system}] if a.system else []
        told = False  # the user hears once that old turns are left out
        while True:
            try:
                line = input("\n> ")
            except EOFError:
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            parts, thought = [], []
            try:
                last = None
                # Old turns leave the context (the system prompt and the latest stay) when it fills.
                messages, dropped = session.fit_messages(messages, params.max_tokens)
                if dropped and not told:
                    told = True
                    print(
                        f"sharpi: the context of {session.n_ctx} tokens is full: older turns are dropped",
                        file=sys.stderr,
                    )
                with _ctrl_c_cancels(session, pressed):  # Ctrl+C stops the reply; the chat goes on
                    for ev in session.generate(messages=messages, params=params):
                        _show(ev)
                        parts.append(ev.text)
                        thought.append(ev.reasoning)
                        last = ev
            except UsageError as e:
                print(f"\nsharpi: {e}", file=sys.stderr)
                messages.pop()
                continue
            except ChatTemplateError as e:
                if not session.chat_template.from_file:
                    raise
                print(f"\nsharpi: {e}; run again with --chatml to chat with ChatML instead", file=sys.stderr)
                return 1
            reply = {"role": "assistant", "content": "".join(parts)}
            if any(thought):  # the template keeps or drops it (engine.generate.reasoning.template_messages)
                reply["reasoning_content"] = "".join(thought)
            messages.append(reply)
            _report(last)
    except KeyboardInterrupt:
        session.cancel()
        return 130
    finally:
        if a.remote is None:
            export_expert_stats(a, session)
            save_route_recording(a, recorder)
        session.close()
