"""The Gated-DeltaNet demo model with an MTP head (``resources/models/sharpi-demo-gdn-q8_0.gguf``, trained by
``packaging/train_demo.py --arch qwen35moe``; issue #25).

The file is a small qwen35moe with one NextN block that loads in the engine; the training script's torch model
computes the engine's trunk and MTP-head logits on an exported F32 file and on the shipped file's dequantized
weights; greedy replies are the same tokens with MTP drafting on and off, over two turns, and the trained head's
drafts are mostly accepted; the answers to the demo's questions are on topic; llama.cpp continues a chat prompt
with the same greedy tokens.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
DEMO_SRC = ROOT / "packaging" / "demo"
SHIPPED = ROOT / "resources" / "models" / "sharpi-demo-gdn-q8_0.gguf"
MIN_ACCEPTANCE = 0.5  # the trained head's drafts accepted at --mtp 2 over the two-turn chat below
TURNS = ("Explain the for statement.", "What is a dictionary?")


def _gdn_module():
    if str(DEMO_SRC) not in sys.path:
        sys.path.insert(0, str(DEMO_SRC))
    import demo_torch_gdn

    return demo_torch_gdn


def _session(k: int, **kw):
    from engine.api import LoadOptions, Session
    from engine.config import EngineOptions

    return Session.load(str(SHIPPED), LoadOptions(n_ctx=512, engine=replace(EngineOptions(), mtp=k), **kw))


def _engine_mtp_logits(path, h: np.ndarray, next_tokens: list[int]) -> np.ndarray:
    """The engine's MTP head (engine.models.mtp.MTPHead, exact float activations) at positions 0 … on the trunk
    states h [T, D]."""
    from engine.gguf import open_gguf
    from engine.models import build_model
    from engine.models.mtp import MTPHead

    with open_gguf(str(path)) as gf:
        head = MTPHead(build_model(gf, q8_act=False))
        logits, _ = head.forward(torch.from_numpy(h), np.asarray(next_tokens), 0, head.new_cache(128))
    return logits.numpy()


def _torch_both(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(next-token logits [T, V], trunk h [T, D], MTP logits [T−1, V]) of the torch model."""
    with torch.no_grad():
        t = torch.tensor([ids])
        h, _ = model.trunk(t)
        mtp, _, _ = model.mtp_head(h[:, :-1], t[:, 1:])
        return (h @ model.output.T)[0].numpy(), h[0].numpy(), mtp[0].numpy()


# -- the file ----------------------------------------------------------------------------------
def test_shipped_file_is_small_and_a_qwen35moe_with_an_mtp_head():
    from engine.gguf import open_gguf

    assert SHIPPED.stat().st_size < 16 * 2**20
    assert (SHIPPED.parent / "MODEL_CARD_GDN.md").is_file()
    with open_gguf(str(SHIPPED)) as gf:
        assert gf.get("general.architecture") == "qwen35moe"
        assert gf.get("qwen35moe.nextn_predict_layers") == 1
        assert gf.get("qwen35moe.block_count") == 5 and "blk.4.nextn.eh_proj.weight" in gf.tensors
        assert "blk.0.ssm_conv1d.weight" in gf.tensors and "blk.3.attn_q.weight" in gf.tensors


# -- the training model is the engine's model --------------------------------------------------
def test_training_model_matches_engine_on_exported_f32(tmp_path):
    """A random small GdnDemoModel exported to F32: the engine's trunk logits and its MTP head's logits (fed the
    torch trunk's h) are the torch model's."""
    from engine.api import LoadOptions, Session
    from engine.synth import write_model
    from engine.synth.tokenizer import bpe_vocab

    g = _gdn_module()
    cfg = g.GdnConfig(hidden=64, heads=4, kv_heads=2, expert_ff=32, shared_ff=32, vocab=512)
    model = g.GdnDemoModel(cfg, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # non-trivial norms, shared-expert gates and routers with clear top-k margins
        for name, p in model.named_parameters():
            if name.endswith(("norm", "q_norm", "k_norm", "enorm", "hnorm", "post_norm", "attn_norm")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("router", "sh_gate_inp")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    path = tmp_path / "gdn-f32.gguf"
    write_model(path, "qwen35moe", weights=model.gguf_weights(), tokenizer=bpe_vocab(512), **cfg.geometry())
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 500, 90)]  # > one 64-token delta-rule chunk
    with Session.load(str(path), LoadOptions(n_ctx=128, kv_type="f32")) as s:
        ours = s.logits(ids)
    theirs, h, mtp = _torch_both(model, ids)
    assert np.abs(ours - theirs).max() < 1e-4 * max(1.0, np.abs(theirs).max())
    head = _engine_mtp_logits(path, h[:-1], ids[1:])
    assert np.abs(head - mtp).max() < 1e-4 * max(1.0, np.abs(mtp).max())


def test_shipped_weights_in_training_model_match_engine():
    """The shipped file's dequantized weights in the torch model = the engine on exact floats (trunk and head)."""
    import gguf

    g = _gdn_module()
    r = gguf.GGUFReader(SHIPPED)
    weights = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in r.tensors}
    model = g.GdnDemoModel(g.GdnConfig())
    model.load_gguf_weights(weights)
    with _session(0, q8_act=False, kv_type="f32") as s:
        ids = s.tokenize(s.render_chat([{"role": "user", "content": "Explain the for statement."}]))
        ids = ids + s.tokenize('The "for" statement is used to iterate over the elements of a sequence.')
        ours = s.logits(ids)
    theirs, h, mtp = _torch_both(model, ids)
    assert np.abs(ours - theirs).max() < 1e-3 * max(1.0, np.abs(theirs).max())
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    head = _engine_mtp_logits(SHIPPED, h[:-1], ids[1:])
    assert np.abs(head - mtp).max() < 1e-3 * max(1.0, np.abs(mtp).max())
    assert (head.argmax(-1) == mtp.argmax(-1)).all()


# -- MTP on the trained weights ----------------------------------------------------------------
def _chat(s, n: int = 40) -> tuple[list[list[int]], list]:
    """Two turns of greedy replies (the second continues the first's conversation) -> (tokens, last events)."""
    from engine.generate import SamplingParams

    s.reset()
    messages, replies, lasts = [], [], []
    for q in TURNS:
        messages.append({"role": "user", "content": q})
        evs = list(s.generate(messages=messages, params=SamplingParams.greedy(n)))
        replies.append([e.token_id for e in evs if e.token_id is not None])
        lasts.append(evs[-1])
        messages.append({"role": "assistant", "content": "".join(e.text for e in evs)})
    return replies, lasts


def test_greedy_replies_identical_with_mtp_on_and_off_and_drafts_mostly_accepted():
    outs = {}
    for k in (0, 2):
        with _session(k) as s:
            outs[k], lasts = _chat(s)
            if k:
                drafted = sum(e.mtp_drafted for e in lasts)
                accepted = sum(e.mtp_accepted for e in lasts)
                assert drafted > 0 and accepted / drafted >= MIN_ACCEPTANCE, (k, accepted, drafted)
            else:
                assert all(e.mtp_passes == 0 for e in lasts)
    assert outs[2] == outs[0]
    assert all(len(r) > 8 for r in outs[0])


@pytest.mark.slow
def test_answers_are_on_topic():
    """The demo's acceptance questions (tests/test_demo_model.py), greedy in the engine with MTP drafting."""
    from engine.generate import SamplingParams

    spec = importlib.util.spec_from_file_location("demo_acceptance", ROOT / "tests" / "test_demo_model.py")
    dm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dm)
    good, report = 0, []
    with _session(2) as s:
        for q, markers in dm.QUESTIONS:
            s.reset()
            evs = s.generate(messages=[{"role": "user", "content": q}], params=SamplingParams.greedy(dm.ANSWER_TOKENS))
            text = "".join(e.text for e in evs)
            good += dm.on_topic(text, markers)
            report.append(f"{q} -> {text}")
    assert good >= dm.MIN_ON_TOPIC, "\n".join(report)


# -- llama.cpp parity --------------------------------------------------------------------------
@pytest.mark.llama
def test_llama_cpp_greedy_equals_ours(open_llama):
    from engine.generate import greedy_continuation

    llm = open_llama(SHIPPED, n_ctx=256)
    with _session(0) as s:
        for q in TURNS:
            text = s.render_chat([{"role": "user", "content": q}])
            prompt = s.tokenize(text)
            assert prompt == llm.tokenize(text.encode(), add_bos=False, special=True)
            ours = greedy_continuation(s.model, s.model.new_cache(256), prompt, 32)
            llm.reset()
            llm.eval(prompt)
            theirs = []
            for _ in range(32):
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                theirs.append(tok)
                llm.eval([tok])
            assert ours == theirs, q
