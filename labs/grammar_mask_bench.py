"""Per-token cost of grammar-constrained sampling on a ~150k vocabulary: llguidance against xgrammar.

CPU only (runs anywhere). The vocabulary is a byte-level BPE of exactly 151,936 tokens (Qwen's size,
``qwen2`` pre-tokenizer) trained by ``engine.synth.tokenizer.train_bpe_vocab`` on the Python sources
of this interpreter's standard library and installed packages, and its docs (the repository holds no real Qwen vocabulary; trained
tokens of code and English are what a mask walk meets), written into a tiny GGUF so
the engine's own tokenizer reads it back. Cached under ``--cache``.

For each JSON schema, a valid document is tokenized and replayed token by token; each step times
(a) the library computing the allowed-token bitmask and (b) advancing past the token, and for
llguidance also (c) the engine's ``GrammarConstraint.mask`` (bitmask -> -inf logits on 151,936
floats, what the decode loop really pays). Reports grammar compile time and per-token µs (mean,
p50, p95, max).

    PYTHONPATH=. python3 labs/grammar_mask_bench.py [--cache /tmp/sharpi-qwen-vocab.gguf]

xgrammar is optional (``pip install xgrammar``; it pulls transformers): skipped when absent.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from engine.generate.grammar import GrammarConstraint, json_schema_grammar, ll_tokenizer
from engine.gguf import open_gguf
from engine.synth import write_model
from engine.synth.tokenizer import train_bpe_vocab
from engine.tokenizer import load_tokenizer

VOCAB = 151936

SCHEMAS = {
    "object (json_object)": ({"type": "object"}, {"name": "Ada Lovelace", "born": 1815, "tags": ["math", "poetry"]}),
    "person": (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0},
                "email": {"type": "string", "format": "email"},
                "languages": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age", "languages"],
            "additionalProperties": False,
        },
        {"name": "Grace Hopper", "age": 85, "email": "grace@navy.mil", "languages": ["COBOL", "FLOW-MATIC"]},
    ),
    "tool call (nested, enum)": (
        {
            "type": "object",
            "properties": {
                "name": {"const": "search"},
                "arguments": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string"},
                        "limit": {"type": "integer"},
                        "order": {"enum": ["relevance", "date"]},
                        "filters": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                    "required": ["query"],
                },
            },
            "required": ["name", "arguments"],
        },
        {"name": "search", "arguments": {"query": "mixture of experts on a small GPU", "limit": 10, "order": "date",
                                         "filters": {"lang": "en", "year": "2025"}}},
    ),
}


def corpus():
    paths = sysconfig.get_paths()
    files = sorted(Path(paths["stdlib"]).rglob("*.py")) + sorted(Path(paths["purelib"]).rglob("*.py"))
    for f in files:
        if "test" in f.parts or "tests" in f.parts:
            continue
        try:
            yield f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
    import pydoc_data.topics

    yield from pydoc_data.topics.topics.values()


def vocab_file(path: Path) -> Path:
    if not path.exists():
        t = time.perf_counter()
        v = train_bpe_vocab(corpus(), VOCAB, "qwen2")
        write_model(path, "qwen3", tokenizer=v, vocab=VOCAB, layers=1, hidden=64, ff=64, seed=0)
        print(f"trained and wrote {path} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return path


def stats(us: list[float]) -> str:
    a = np.asarray(us)
    return f"mean {a.mean():7.1f}  p50 {np.median(a):7.1f}  p95 {np.percentile(a, 95):7.1f}  max {a.max():8.1f}"


def bench_llguidance(tok, schema, ids):
    t = time.perf_counter()
    g = GrammarConstraint(tok, json_schema_grammar(schema))
    compile_ms = (time.perf_counter() - t) * 1000
    logits = np.zeros(tok.n_vocab, dtype=np.float32)
    lib_us, step_us = [], []
    for i in ids:
        t0 = time.perf_counter()
        g.matcher.compute_bitmask()
        t1 = time.perf_counter()
        masked = g.mask(logits)  # the decode loop's whole cost: bitmask + -inf logits
        t2 = time.perf_counter()
        assert np.isfinite(masked[i]), "the document's token was masked out"
        g.accept(i)
        t3 = time.perf_counter()
        lib_us.append((t1 - t0) * 1e6)
        step_us.append((t2 - t1 + t3 - t2) * 1e6)
    assert g.complete
    return compile_ms, lib_us, step_us


def bench_xgrammar(xgr, info, schema, ids):
    t = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
    compile_ms = (time.perf_counter() - t) * 1000
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    us = []
    for i in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        t1 = time.perf_counter()
        assert (int(bitmask[0, i // 32]) >> (i % 32)) & 1, "the document's token was masked out"
        assert m.accept_token(i)
        us.append((t1 - t0) * 1e6)
    return compile_ms, us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/sharpi-bench-vocab-151936.gguf"))
    a = ap.parse_args()
    with open_gguf(str(vocab_file(a.cache))) as gf:
        tok = load_tokenizer(gf)
    normal = sum(1 for i in range(tok.n_vocab) if tok.token_to_piece(i))
    print(f"vocabulary: {tok.n_vocab} tokens ({normal} with text)")
    t = time.perf_counter()
    ll_tokenizer(tok)
    print(f"llguidance tokenizer: {(time.perf_counter() - t) * 1000:.0f} ms (once per model)")
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
        print("xgrammar: not installed, skipped")
    if xgr is not None:
        t = time.perf_counter()
        pieces = [tok.token_to_piece(i) for i in range(tok.n_vocab)]
        info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=tok.n_vocab, stop_token_ids=sorted(tok.eog_ids))
        print(f"xgrammar tokenizer info: {(time.perf_counter() - t) * 1000:.0f} ms (once per model)")
    for name, (schema, doc) in SCHEMAS.items():
        text = json.dumps(doc, separators=(", ", ": "), ensure_ascii=False)
        ids = tok.encode(text, add_bos=False, parse_special=False)
        print(f"\n{name}: {len(ids)} tokens")
        for _ in range(2):  # the first pass warms caches; report the second
            c, lib, step = bench_llguidance(tok, schema, ids)
        print(f"  llguidance  compile {c:7.1f} ms | bitmask µs/token {stats(lib)}")
        print(f"  llguidance + engine mask (bitmask, -inf logits, advance) µs/token {stats(step)}")
        if xgr is not None:
            for _ in range(2):
                c, us = bench_xgrammar(xgr, info, schema, ids)
            print(f"  xgrammar    compile {c:7.1f} ms | bitmask µs/token {stats(us)}")


if __name__ == "__main__":
    main()
