"""Synthetic files against llama.cpp: every architecture x weight type loads and generates, the
quantized files track their F32 twin, and our tokenizers give llama.cpp's token ids."""

from __future__ import annotations

import numpy as np
import pytest

from engine.quant import WEIGHT_TYPES, QType

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp")

# Tiny but K-quant-able (every row a multiple of 256): 2 layers, 4 experts.
TINY = dict(layers=2, hidden=256, vocab=512)
VARIANTS = {
    "qwen3moe": ("qwen3moe", dict(experts=4, expert_ff=256)),
    "qwen2moe": ("qwen2moe", dict(experts=4, expert_ff=256, shared_ff=256)),
    "olmoe": ("olmoe", dict(experts=4, expert_ff=256)),
    "llama": ("llama", dict(ff=256, rope_freqs=True)),
    "mixtral": ("llama", dict(experts=4, experts_used=2, expert_ff=256)),
    "qwen3": ("qwen3", dict(ff=256, tied_output=True)),
}
PROMPT = "The quick brown fox jumps over the lazy dog. 12345"

# Mean |logit - F32 twin's logit| over the prompt (logits have std ~1). Measured on these files
# (worst variant, the tied qwen3): F16 9e-4, BF16 7e-3, Q8_0 0.02, Q6_K 0.06, Q5_K 0.12, Q5_0 0.15,
# Q4_K 0.24, Q4_0 0.29 (the other variants ~0.6x that). Bounds leave ~2x headroom; unrelated
# logits (a wrong layout or scale) differ by ~1.1.
MEAN_DIFF = {
    QType.F16: 0.005,
    QType.BF16: 0.02,
    QType.Q8_0: 0.05,
    QType.Q6_K: 0.12,
    QType.Q5_K: 0.25,
    QType.Q5_0: 0.3,
    QType.Q4_K: 0.45,
    QType.Q4_0: 0.5,
    QType.MXFP4: 0.6,
    QType.Q2_K: 0.95,  # measured 0.48-0.52, the tied qwen3 0.76: 2 bits sit near the ~1.1 of unrelated logits
    QType.Q3_K: 0.8,  # measured 0.28-0.31, the tied qwen3 0.49 (test-data quantizer: a simple scale fit)
    QType.IQ4_NL: 0.5,  # measured 0.15-0.16, the tied qwen3 0.25 (Q4_0 on these files: 0.16-0.17, 0.29)
    QType.IQ4_XS: 0.5,  # measured 0.15-0.16, the tied qwen3 0.245
    # the IQ grid types' test-data quantizer (engine.quant.iquants; Q2_K on these files: 0.48-0.52, tied qwen3 0.76)
    QType.IQ2_XXS: 1.0,  # measured 0.56-0.58, the tied qwen3 0.81 (2.06 bits)
    QType.IQ2_XS: 0.95,  # measured 0.48-0.51, the tied qwen3 0.74
    QType.IQ2_S: 0.85,  # measured 0.43-0.45, the tied qwen3 0.67
    QType.IQ3_XXS: 0.7,  # measured 0.32-0.35, the tied qwen3 0.52
    QType.IQ3_S: 0.55,  # measured 0.25-0.27, the tied qwen3 0.41
}


_F32_LOGITS: dict[str, np.ndarray] = {}  # F32 twin's logits per variant, filled by the F32 case


def _model(synth_model, vid, qtype):
    arch, geo = VARIANTS[vid]
    return synth_model(arch, qtype.name, **TINY, **geo)


def _logits(llm, text: str) -> np.ndarray:
    """llama.cpp's logits [T, V] for every position of ``text``."""
    llm.reset()
    ids = llm.tokenize(text.encode(), add_bos=False)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


@pytest.mark.parametrize("qtype", WEIGHT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("vid", VARIANTS)
def test_loads_generates_and_tracks_f32(synth_model, open_llama, vid, qtype):
    m = _model(synth_model, vid, qtype)
    assert not m.fallbacks
    llm = open_llama(m.path, n_ctx=128)
    assert llm.n_vocab() == m.spec.vocab
    assert llm.metadata["general.architecture"] == m.arch
    got = _logits(llm, PROMPT)
    assert np.isfinite(got).all() and 0.3 < got.std() < 10
    out = llm.create_completion(PROMPT, max_tokens=3, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1
    if qtype == QType.F32:
        _F32_LOGITS[vid] = got
    else:
        ref = _F32_LOGITS.get(vid)
        if ref is None:  # the F32 case did not run first (e.g. -k selection)
            ref = _logits(open_llama(_model(synth_model, vid, QType.F32).path, n_ctx=128), PROMPT)
        assert np.abs(got - ref).mean() < MEAN_DIFF[qtype]


TEXTS = [
    "Hello world, this is a test.",
    "  leading spaces and   runs\n\n\ttabs\r\n trailing  ",
    "digits 1234567 3.14159 and 42nd, 1,000,000",
    "unicode: café naïve 日本語 Ελληνικά 🙂 emoji Ünïcödé",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "It's, they'll, WE'VE, I'M don't",
    "def f(x):\n    return x**2  # comment\n",
    "a\u00a0b  \u3000c",
    "x" * 40,
    " ",
]


@pytest.mark.parametrize(
    "arch, tok", [("qwen3", dict(pre=p)) for p in ("qwen2", "llama-bpe", "olmo", "default")] + [("llama", {})]
)
@pytest.mark.parametrize("vocab", [512, 4096])
def test_token_ids_equal_llama_cpp(synth_model, open_llama, arch, tok, vocab):
    m = synth_model(arch, layers=1, vocab=vocab, **tok)
    llm = open_llama(m.path, vocab_only=True)
    hf = m.hf_tokenizer()
    for text in TEXTS:
        ours = hf.encode(text, add_special_tokens=False).ids
        assert ours == llm.tokenize(text.encode(), add_bos=False, special=True), text
    # Byte-level BPE round-trips any text through its tokens.
    if m.vocab.model == "gpt2":
        for text in TEXTS[:4]:
            assert llm.detokenize(llm.tokenize(text.encode(), add_bos=False)).decode() == text


@pytest.mark.parametrize("name", ["olmoe-1b-7b", "mixtral-8x7b", "qwen3.6-35b-a3b"])
def test_geometry_vocabulary_loads_in_llama_cpp(synth_geometry, open_llama, name):
    """Header and tokenizer of a geometry file are accepted (vocab only: no data pages touched)."""
    g = synth_geometry(name)
    llm = open_llama(g.path, vocab_only=True)
    assert llm.n_vocab() == g.spec.vocab
    text = "Hello world"
    assert (
        llm.tokenize(text.encode(), add_bos=False) == g.vocab.hf_tokenizer().encode(text, add_special_tokens=False).ids
    )
