"""Logits, token ids and greedy continuations equal to llama.cpp on the same synthetic GGUF."""

from __future__ import annotations

import numpy as np
import pytest

from engine.generate import greedy_continuation
from engine.gguf import open_gguf
from engine.models import build_model
from engine.synth.writer import write_model
from tests.oracle import llama_greedy, llama_logits, random_tokens

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp")

# (id, arch, geometry) — every architecture, plus the variants llama.cpp treats differently.
F32_MODELS = [
    ("qwen3moe", "qwen3moe", {}),
    ("qwen3moe-tied", "qwen3moe", {"tied_output": True}),
    ("olmoe", "olmoe", {}),
    ("qwen2moe", "qwen2moe", {}),
    ("mixtral", "llama", {"experts": 4, "experts_used": 2}),
    ("llama-dense", "llama", {"rope_freqs": True}),
    ("qwen3-dense", "qwen3", {}),
    # Gated DeltaNet hybrids: 3 GDN layers and 1 gated full-attention layer each
    ("qwen35moe", "qwen35moe", {}),
    ("qwen35moe-tied-mha", "qwen35moe", {"tied_output": True, "ssm_groups": 4, "full_attn_interval": 2}),
    ("qwen35-dense", "qwen35", {}),
    ("qwen3next", "qwen3next", {}),
    # ... with an MTP (NextN) block after the trunk: loaded by both, run by neither in the trunk's pass
    ("qwen35moe-mtp", "qwen35moe", {"nextn": 1}),
    ("qwen3next-mtp", "qwen3next", {"nextn": 1}),
    # GLM-4.5: a dense layer, two MoE layers (sigmoid scores, selection bias, shared expert), a NextN block not run
    ("glm4moe", "glm4moe", {}),
    ("glm4moe-qknorm-scaled-tied", "glm4moe", {"qk_norm": True, "expert_scale": 2.5, "tied_output": True}),
    # gpt-oss: a sliding layer (window 8) and a global one, sinks, YaRN, biased router and experts, clamped SwiGLU
    ("gpt-oss", "gpt-oss", {}),
]
N_POS = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("parity")
    return {mid: write_model(d / f"{mid}.gguf", arch, seed=7, **geo).path for mid, arch, geo in F32_MODELS}


def _ours(path, tokens, *, batch: bool, q8_act: bool = True) -> np.ndarray:
    with open_gguf(path) as gf:
        m = build_model(gf, q8_act=q8_act)
        cache = m.new_cache(256)
        if batch:
            return m.forward(tokens, 0, cache).numpy()
        return np.concatenate([m.forward([t], i, cache).numpy() for i, t in enumerate(tokens)])


@pytest.mark.parametrize("mid", [m[0] for m in F32_MODELS])
def test_f32_logits_match_llama_cpp(models, mid):
    path = models[mid]
    with open_gguf(path) as gf:
        vocab = gf.tensors["token_embd.weight"].shape[0]
    tokens = random_tokens(N_POS, vocab, seed=3)
    ref = llama_logits(path, tokens)
    prefill = _ours(path, tokens, batch=True)
    decode = _ours(path, tokens, batch=False)
    assert prefill.shape == ref.shape == (N_POS, vocab)
    assert np.abs(prefill - ref).max() <= 1e-4, np.abs(prefill - ref).max()
    assert np.abs(decode - ref).max() <= 1e-4, np.abs(decode - ref).max()


@pytest.mark.parametrize("mid", [m[0] for m in F32_MODELS])
def test_greedy_continuation_matches_llama_cpp(models, mid):
    path = models[mid]
    with open_gguf(path) as gf:
        m = build_model(gf)
        prompt = random_tokens(8, m.args.n_vocab, seed=5)
        ours = greedy_continuation(m, m.new_cache(128), prompt, 64)
    assert ours == llama_greedy(path, prompt, 64)


QUANT_CASES = [
    "Q8_0",
    "Q4_0",
    "Q5_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "MXFP4",
    "IQ4_NL",
    "IQ4_XS",
    "IQ2_XXS",
    "IQ3_XXS",
    "IQ3_S",
    "IQ2_XS",
    "IQ2_S",
    "F16",
    "BF16",
    "mix",
]


def _stats(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    return float(np.abs(ours - ref).mean()), float((ours.argmax(-1) == ref.argmax(-1)).mean())


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    out = {}
    for q in QUANT_CASES:
        if q == "mix":  # a Q4_K_M-like mix: Q6_K for down projections and the output
            kw = {"weight_type": "Q4_K", "type_overrides": {"*ffn_down*": "Q6_K", "output.weight": "Q6_K"}}
        else:
            kw = {"weight_type": q}
        out[q] = write_model(d / f"{q}.gguf", "qwen3moe", seed=11, layers=2, vocab=1024, **kw).path
    return out


@pytest.mark.parametrize("q", QUANT_CASES)
def test_quantized_logits_statistically_equal(quant_models, q, monkeypatch):
    """llama.cpp's q8 arithmetic on every product (the bf16 prompt path is held to its own bounds
    below and in tests/test_prompt_accuracy.py), and the exact-float mode."""
    from engine.kernels import bf16

    monkeypatch.setattr(bf16, "MODE", bf16.OFF)
    _assert_statistically_equal(quant_models[q], q)


def _assert_statistically_equal(path, q, decode: bool = False) -> None:
    """Our logits of a 64-token prompt against llama.cpp's: q8 activations (mean |Δ| < 0.05, argmax ≥ 95 %) and
    exact float (< 0.1, ≥ 90 %), as a batch; with ``decode`` also q8 token by token (< 0.05, ≥ 95 %)."""
    tokens = random_tokens(64, 1024, seed=9)
    ref = llama_logits(path, tokens)
    mean_q8, agree_q8 = _stats(_ours(path, tokens, batch=True, q8_act=True), ref)
    assert mean_q8 < 0.05 and agree_q8 >= 0.95, (q, mean_q8, agree_q8)
    mean_f, agree_f = _stats(_ours(path, tokens, batch=True, q8_act=False), ref)
    assert mean_f < 0.1 and agree_f >= 0.90, (q, mean_f, agree_f)
    if decode:
        mean_d, agree_d = _stats(_ours(path, tokens, batch=False, q8_act=True), ref)
        assert mean_d < 0.05 and agree_d >= 0.95, (q, mean_d, agree_d)


@pytest.mark.parametrize("q", ["Q8_0", "Q4_K"])
def test_glm4moe_quantized_logits_statistically_equal(tmp_path, q, monkeypatch):
    """GLM-4.5's routing (sigmoid scores, the selection bias, the scaling factor) on quantized weights: within
    the thresholds of test_quantized_logits_statistically_equal, both activation modes."""
    from engine.kernels import bf16

    monkeypatch.setattr(bf16, "MODE", bf16.OFF)
    path = write_model(tmp_path / f"glm4moe-{q}.gguf", "glm4moe", seed=11, weight_type=q, expert_scale=2.5).path
    _assert_statistically_equal(path, q, decode=True)


@pytest.mark.parametrize("q", ["Q8_0"])
def test_qwen35moe_with_mtp_quantized_logits_statistically_equal(tmp_path, q, monkeypatch):
    """A quantized qwen35moe file with an MTP block: llama.cpp loads it and both trunks agree within the
    thresholds of test_quantized_logits_statistically_equal."""
    from engine.kernels import bf16

    monkeypatch.setattr(bf16, "MODE", bf16.OFF)
    path = write_model(tmp_path / f"qwen35moe-mtp-{q}.gguf", "qwen35moe", seed=11, weight_type=q, nextn=1).path
    _assert_statistically_equal(path, q, decode=True)


@pytest.mark.parametrize("group", ["*attn_q.weight", "*ffn_up_exps*", "output.weight"])
def test_one_quantized_group_is_close(tmp_path, group, monkeypatch):
    """The q8 kernels do llama.cpp's arithmetic: one Q4_K group in an F32 model stays within 1e-3.
    (Prompts on the bf16 units round differently: test_bf16_prefill_statistically_equal.)"""
    from engine.kernels import bf16

    monkeypatch.setattr(bf16, "MODE", bf16.OFF)
    path = write_model(tmp_path / "one.gguf", "qwen3moe", seed=13, type_overrides={group: "Q4_K"}).path
    tokens = random_tokens(48, 1024, seed=2)
    ref = llama_logits(path, tokens)
    mean, _ = _stats(_ours(path, tokens, batch=True), ref)
    assert mean <= 1e-3, (group, mean)


@pytest.mark.parametrize("mode", ["fpmath", "bf16"])
@pytest.mark.parametrize("q", ["Q4_0", "Q5_0", "Q4_K", "Q5_K", "mix"])
def test_bf16_prefill_statistically_equal(quant_models, q, mode, monkeypatch):
    """Prompt products on the bf16 units (engine.kernels.bf16, each mode forced on here with a low
    token threshold so every matrix of the 4/5-bit types takes it). Their activations are rounded
    to bf16, not to llama.cpp's q8 blocks, so they sit as far from llama.cpp as the exact-float
    mode does (mean |Δ| ~0.012, argmax 94-100 % here) and are held to its bounds."""
    from engine.kernels import bf16

    monkeypatch.setattr(bf16, "MODE", mode)
    monkeypatch.setattr(bf16, "MIN_TOKENS", 8)
    path = quant_models[q]
    tokens = random_tokens(64, 1024, seed=9)
    ref = llama_logits(path, tokens)
    mean, agree = _stats(_ours(path, tokens, batch=True, q8_act=True), ref)
    assert mean < 0.1 and agree >= 0.90, (q, mean, agree)
