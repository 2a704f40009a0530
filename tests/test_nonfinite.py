"""NaN or infinity in a model's weights is a ModelError naming where it first appeared (the token
embeddings, a layer, the output head), raised before the sampler sees a logit row — on the prompt's
batched pass, the fused one-token host step and the eager torch layers alike, with exact and
q8-rounded activations."""

from __future__ import annotations

import numpy as np
import pytest

from engine.api import LoadOptions, Session
from engine.errors import ModelError
from engine.generate import SamplingParams
from engine.gguf import open_gguf


def _damage(path, out, name: str, value: float, tmp_path) -> str:
    """A copy of ``path`` with the first float of tensor ``name`` set to ``value`` (its f16 scale for a
    quantized tensor: every K-quant and Q8_0 block starts with one; f32 tensors: the first value) — of
    every expert's matrix in an expert stack, so the routes cannot miss it."""
    with open_gguf(path) as gf:
        t = gf.tensor(name)
        start, qtype, parts = t.offset, t.qtype.name, t.shape[0] if len(t.shape) == 3 else 1
        step = t.nbytes // parts
    raw = bytearray(path.read_bytes())
    for at in range(start, start + parts * step, step):
        if qtype == "F32":
            raw[at : at + 4] = np.float32(value).tobytes()
        else:
            raw[at : at + 2] = np.float16(value).tobytes()
    dst = tmp_path / out
    dst.write_bytes(raw)
    return str(dst)


def _generate(path, **kw):
    with Session.load(path, LoadOptions(n_ctx=64, device="cpu", **kw)) as s:
        return list(s.generate(prompt="the cat sat on the", params=SamplingParams(seed=0, max_tokens=4)))


@pytest.mark.parametrize(
    "qtype, name, where",
    [
        ("F32", "blk.1.attn_output.weight", "layer 1"),
        ("F32", "output.weight", "the output"),
        ("Q4_K", "blk.0.ffn_gate_exps.weight", "layer 0"),  # an inf scale: was a ZeroDivisionError in q8_K
        ("Q4_K", "blk.1.attn_q.weight", "layer 1"),
        ("Q8_0", "blk.0.attn_v.weight", "layer 0"),
    ],
)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nonfinite_weights_are_a_model_error_naming_the_layer(synth_model, tmp_path, qtype, name, where, value):
    m = synth_model("qwen3moe", qtype, layers=2)
    bad = _damage(m.path, f"{qtype}-{name}-{value}.gguf", name, value, tmp_path)
    with pytest.raises(ModelError, match=f"first in {where}"):
        _generate(bad)
    one_token = pytest.raises(ModelError, match=f"first in {where}")  # the fused host step
    with Session.load(bad, LoadOptions(n_ctx=64, device="cpu")) as s, one_token:
        s.logits([5], batch=False)


def test_a_nan_embedding_row_is_named(synth_model, tmp_path):
    m = synth_model("qwen3moe", "F32", layers=2)
    with Session.load(m.path, LoadOptions(n_ctx=64, device="cpu")) as s:
        tok = s.tokenize("the", add_bos=False)[0]
        D = s.args.n_embd
    with open_gguf(m.path) as gf:
        at = gf.tensor("token_embd.weight").offset + tok * D * 4  # offsets are from the file start
    raw = bytearray(m.path.read_bytes())
    raw[at : at + 4] = np.float32(np.nan).tobytes()
    (tmp_path / "emb.gguf").write_bytes(raw)
    named = pytest.raises(ModelError, match=rf"embeddings of token\(s\) \[{tok}\]")
    with Session.load(str(tmp_path / "emb.gguf"), LoadOptions(n_ctx=64, device="cpu")) as s, named:
        s.logits([tok])


def test_exact_activations_also_stop_at_the_first_nan(synth_model, tmp_path):
    m = synth_model("qwen3moe", "Q4_K", layers=2)
    bad = _damage(m.path, "exact.gguf", "blk.1.ffn_down_exps.weight", np.nan, tmp_path)
    with pytest.raises(ModelError, match="first in layer 1"):
        _generate(bad, q8_act=False)
