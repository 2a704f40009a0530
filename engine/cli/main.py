"""Entry point of the ``sharpi`` command.

Each subcommand lives in ``engine/cli/cmd_<name>.py`` and exposes
``register(subparsers) -> None``, which adds its parser and sets ``func(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import engine
from engine import config
from engine.errors import SharpIError

# Subcommand modules, in the order ``sharpi --help`` lists them.
COMMANDS = ["inspect", "run", "serve", "logits", "tokenize", "synth", "plan", "bench"]

log = logging.getLogger("sharpi")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sharpi", description="SharpI: MoE GGUF inference on a small GPU.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    parser.add_argument("--version", action="version", version=f"sharpi {engine.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"engine.cli.cmd_{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # the environment's options, read once (engine.config): a malformed variable is a usage error
        config.current()
    except SharpIError as e:
        print(f"sharpi: error: {e}", file=sys.stderr)
        return 2
    config.apply_process_settings()
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except SharpIError as e:
        print(f"sharpi: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sharpi: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
