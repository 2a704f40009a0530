"""The warm-up on load: the first question after it needs no kernel the warm-up did not already
compile or load (what makes the first answer as fast as the tenth), it leaves nothing behind, and
kernel compilations are counted for the "k of N" progress line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numba

from engine.api import AUTO_CTX, LoadOptions, Session
from engine.config import EngineOptions
from engine.warmup import CompileCounter, expected_compiles, record_compiles, warm_up

ROOT = Path(__file__).resolve().parents[1]

# In a fresh interpreter (kernels compiled or loaded earlier in this process would hide the point):
# how many numba specialisations of the engine's kernels a chat answer adds, after the warm-up or not.
_CHILD = """
import json, sys, importlib, pkgutil
import numba
from numba.core.registry import CPUDispatcher
import engine
from engine.api import LoadOptions, Session
from engine.generate import SamplingParams
from engine.warmup import warm_up

def overloads():
    out = {}
    for m in pkgutil.walk_packages(engine.__path__, "engine."):
        if not m.name.startswith(("engine.kernels", "engine.generate", "engine.models", "engine.ops")):
            continue
        mod = importlib.import_module(m.name)
        for k, v in vars(mod).items():
            if isinstance(v, CPUDispatcher):
                out[f"{m.name}.{k}"] = len(v.overloads)
    return out

s = Session.load(sys.argv[1], LoadOptions(n_ctx=0))
if sys.argv[2] == "warm":
    warm_up(s)
before = overloads()
for params in (SamplingParams(max_tokens=6, seed=1), SamplingParams.greedy(max_tokens=6)):
    for _ in s.generate(messages=[{"role": "user", "content": "What is a decorator?"}], params=params):
        pass
    s.reset()
after = overloads()
print(json.dumps({k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}))
"""


def _added(path, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), mode], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_after_the_warm_up_a_chat_answer_needs_no_new_kernel(synth_model):
    path = synth_model("qwen3moe", "Q8_0", vocab=1024).path
    assert _added(path, "cold"), "without the warm-up the first answer loads kernels (the control)"
    assert _added(path, "warm") == {}


def test_warm_up_leaves_nothing_behind(synth_model):
    path = synth_model("qwen3moe", "Q8_0", vocab=1024).path
    with Session.load(str(path), LoadOptions(n_ctx=AUTO_CTX)) as s:
        w = warm_up(s)
        assert s.state.tokens == [] and s.stats().tokens_total == 0
        assert w.decode_tok_s > 0 and w.seconds > 0


def test_compile_counter_counts_outermost_compilations():
    @numba.njit  # fresh functions, never cached: each call below compiles
    def inner(x):
        return x + 1

    @numba.njit
    def outer(x):
        return inner(x) * 2

    seen = []
    with CompileCounter(lambda done, busy: seen.append((done, busy))) as c:
        outer(1)  # compiles outer, and inner inside it: one outermost compilation
        inner(1.5)  # a new specialisation: a second
    assert (c.started, c.done) == (2, 2) and seen == [(0, True), (1, False), (1, True), (2, False)]
    outer(2)
    assert c.done == 2  # counting stops with the block


def test_kernel_counts_are_recorded_per_key(tmp_path):
    opts = EngineOptions(calibration_dir=tmp_path / "calibration")
    assert expected_compiles("k1", opts) is None
    record_compiles("k1", 13, opts)
    record_compiles("k2", 7, opts)
    assert expected_compiles("k1", opts) == 13 and expected_compiles("k2", opts) == 7
