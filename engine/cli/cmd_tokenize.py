"""``sharpi tokenize -m FILE --text TEXT [--no-special] [--no-bos] [--json]``: the token ids of a text.

Reads only the file's tokenizer metadata (no weights). ``--json`` prints the list of ids; otherwise
one line per token, ``id -> 'piece'``, as llama.cpp's ``llama-tokenize`` does.
"""

from __future__ import annotations

import argparse
import json

from engine.gguf import open_gguf
from engine.tokenizer import load_tokenizer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("-m", "--model", required=True, help="GGUF model file")
    p.add_argument("--text", required=True, help="text to tokenize")
    p.add_argument("--no-special", action="store_true", help="treat control tokens in the text as plain text")
    p.add_argument("--no-bos", action="store_true", help="never add BOS (default: as the file says)")
    p.add_argument("--json", action="store_true", help="print a JSON list of token ids")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    with open_gguf(a.model) as gf:
        tok = load_tokenizer(gf)
    ids = tok.encode(a.text, add_bos=False if a.no_bos else None, parse_special=not a.no_special)
    if a.json:
        print(json.dumps(ids))
        return 0
    for i in ids:
        piece = tok.token_to_piece(i).decode("utf-8", errors="backslashreplace")
        print(f"{i:6d} -> {piece!r}")
    return 0
