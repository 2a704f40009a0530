"""``sharpi serve [-m FILE] [--host H] [--port N] [-t N] [--record-routes FILE]``: the OpenAI-compatible HTTP server.

``-t N``: the CPU threads every generation's kernels run with (``EngineOptions.host_threads``: set in the thread
that runs each request, numba's count being per thread).

``--record-routes FILE`` records the routes of everything the server runs from the load on and writes the
trace when the server stops (Ctrl-C, SIGTERM)."""

from __future__ import annotations

import argparse
import sys

from engine.cli.common import (
    add_model_args,
    add_mtp_arg,
    add_placement_args,
    add_route_args,
    add_threads_arg,
    load_session,
    save_route_recording,
    set_threads,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every API route")
    p.add_argument("--model-id", default=None, help="the model's name in the API (default: the file name's stem)")
    p.add_argument("--max-queue", type=int, default=8, help="requests that may wait for the model (more get 429)")
    add_placement_args(p)
    add_threads_arg(p)
    add_route_args(p, replay=False)
    add_mtp_arg(p)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from engine.demo import demo_model_path
    from engine.errors import UsageError
    from engine.server import ModelHost, ServerOptions, serve

    if not 0 <= a.port <= 65535:
        raise UsageError(f"--port must be 0..65535, got {a.port}")
    if a.max_queue < 0:
        raise UsageError(f"--max-queue must be ≥ 0, got {a.max_queue}")
    set_threads(a.threads)  # checked here, before the model loads in the background
    if a.model is None:
        try:
            a.model = str(demo_model_path())
        except FileNotFoundError as e:
            raise UsageError(f"no -m/--model given and {e}") from None
    recording = []  # the route recorder, once the session has loaded (--record-routes)

    def load(progress):
        session = load_session(a)
        if a.record_routes:
            recording.append(session.record_routes())
            print(f"sharpi: recording routes into {a.record_routes} (written when the server stops)", file=sys.stderr)
        return session

    host = ModelHost.load_in_background(a.model, load, model_id=a.model_id, max_queue=a.max_queue)

    def listening(url: str) -> None:
        print(
            f"sharpi: serving {host.model_id} at {url} (the model loads meanwhile; /health says when)", file=sys.stderr
        )
        sys.stderr.flush()

    try:
        serve(host, a.host, a.port, ServerOptions(api_key=a.api_key), on_listening=listening)
    except OSError as e:
        raise UsageError(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}") from None
    finally:
        if recording:
            save_route_recording(a, recording[0])
    return 0
