"""Prompt logits against an exact reference: every arithmetic SharpI may pick for a prompt stays as
close to exact products as llama.cpp's own (× 1.25), on every quantized type.

The exact reference is the engine with its numpy reference kernels in exact-float mode: weights
dequantized exactly (``engine.quant.dequantize``), activations unrounded, products summed in
float64 (``engine.kernels.reference``). llama.cpp rounds activations to q8 blocks; SharpI's default
does the same for short inputs and, for prompts, may use the bf16 units (``engine.kernels.bf16``:
FPMATH where oneDNN rounds to bf16 on AMX, BF16 on AVX512-BF16 without AMX, or OFF). Each mode is
forced here in turn, so all of them are checked on whichever processor runs the suite; the
default (``bf16.detect_mode()``) is what this processor would use.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine import ops
from engine.gguf import open_gguf
from engine.kernels import bf16
from engine.models import build_model
from engine.synth.writer import write_model
from tests.oracle import llama_logits, random_tokens

pytestmark = [pytest.mark.llama, pytest.mark.slow]
pytest.importorskip("llama_cpp")

TYPES = ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K", "mix"]
SLACK = 1.25  # how much further from exact than llama.cpp a prompt's logits may be


# Nine models per type, compared by the median of their mean |Δ|. One model's mean swings up to 2x with a routing
# flip: a token whose router top-k is a near tie takes another expert under any rounding, and through attention that
# moves every later token. Which model flips is luck, not arithmetic (llama.cpp's own means over nine seeds of Q5_0
# run 0.0082-0.0126); the median over nine measures the arithmetic. Three models and a mean failed Q5_0 in FPMATH at
# 1.38x where twelve gave 1.04x.
SEEDS = tuple(range(11, 20))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """{type: [(path, tokens, exact logits, llama.cpp's logits) per seed]}, built once."""
    d = tmp_path_factory.mktemp("accuracy")
    tokens = random_tokens(64, 1024, seed=9)
    out = {}
    for q in TYPES:
        if q == "mix":  # a Q4_K_M-like mix
            kw = {"weight_type": "Q4_K", "type_overrides": {"*ffn_down*": "Q6_K", "output.weight": "Q6_K"}}
        else:
            kw = {"weight_type": q}
        out[q] = []
        for seed in SEEDS:
            path = write_model(d / f"{q}-{seed}.gguf", "qwen3moe", seed=seed, layers=2, vocab=1024, **kw).path
            ops.use_reference(True)
            try:
                exact = _logits(path, tokens, q8_act=False)
            finally:
                ops.use_reference(False)
            out[q].append((path, tokens, exact, llama_logits(path, tokens)))
    return out


def _logits(path, tokens, *, q8_act: bool = True) -> np.ndarray:
    with open_gguf(path) as gf:
        m = build_model(gf, q8_act=q8_act)
        return m.forward(tokens, 0, m.new_cache(128)).numpy()


@pytest.mark.parametrize("mode", ["default", bf16.OFF, bf16.FPMATH, bf16.BF16])
@pytest.mark.parametrize("q", TYPES)
def test_prompt_logits_no_further_from_exact_than_llama_cpp(case, q, mode, monkeypatch):
    """Median over the type's models of the mean |Δ| from the exact logits: ours ≤ SLACK × llama.cpp's."""
    monkeypatch.setattr(bf16, "MODE", bf16.detect_mode() if mode == "default" else mode)
    if mode != "default":
        monkeypatch.setattr(bf16, "MIN_TOKENS", 4)  # the routed experts' few tokens take it too
    ours = np.median([np.abs(_logits(path, tokens) - exact).mean() for path, tokens, exact, _ in case[q]])
    llama = np.median([np.abs(ll - exact).mean() for _, _, exact, ll in case[q]])
    assert llama > 0
    assert ours <= SLACK * llama, (q, bf16.MODE, ours, llama)
