"""engine.synth without llama.cpp: layouts, metadata, types, determinism, tokenizers, geometry files."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from engine.cli.main import main as cli_main
from engine.errors import UsageError
from engine.quant import QType, dequantize, quantize, tensor_bytes
from engine.synth import make_spec, write_model
from engine.synth.encode import fit_row, plan_types
from engine.synth.geometry import GEOMETRIES, use_more_bits
from engine.synth.specs import tensor_layout
from engine.synth.tokenizer import bpe_vocab, spm_vocab

VARIANTS = {
    "qwen3moe": ("qwen3moe", {}),
    "qwen2moe": ("qwen2moe", {}),
    "olmoe": ("olmoe", {}),
    "llama": ("llama", {"rope_freqs": True}),
    "mixtral": ("llama", {"experts": 4, "experts_used": 2}),
    "qwen3": ("qwen3", {"tied_output": True}),
    "gpt-oss": ("gpt-oss", {}),
}


def _reader(path) -> gguf.GGUFReader:
    return gguf.GGUFReader(path)


def _field(r: gguf.GGUFReader, key: str):
    return r.fields[key].contents()


@pytest.mark.parametrize("vid", VARIANTS)
def test_file_matches_layout_and_metadata(synth_model, vid):
    arch, geo = VARIANTS[vid]
    m = synth_model(arch, **geo)
    r = _reader(m.path)
    got = {t.name: (tuple(int(x) for x in reversed(t.shape)), QType(t.tensor_type)) for t in r.tensors}
    assert got == {p.name: (p.shape, p.qtype) for p in m.tensors}
    s = m.spec
    assert _field(r, "general.architecture") == arch
    assert _field(r, f"{arch}.block_count") == s.layers
    assert _field(r, f"{arch}.embedding_length") == s.hidden
    assert _field(r, f"{arch}.attention.head_count_kv") == s.kv_heads
    assert _field(r, f"{arch}.attention.key_length") == s.head_dim
    assert _field(r, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(s.rms_eps, rel=1e-6)
    if s.is_moe:
        assert _field(r, f"{arch}.expert_count") == s.experts
        assert _field(r, f"{arch}.expert_used_count") == s.experts_used
    else:
        assert f"{arch}.expert_count" not in r.fields
    tokens = _field(r, "tokenizer.ggml.tokens")
    assert len(tokens) == len(set(tokens)) == s.vocab == got["token_embd.weight"][0][0]
    assert ("output.weight" in got) == (not s.tied_output)


def test_layout_follows_the_architecture_rules():
    """Spot checks of llama.cpp's per-family tensors (src/llama-model.cpp load_tensors)."""
    names = lambda spec: {d.name: d.shape for d in tensor_layout(spec)}  # noqa: E731
    q3 = names(make_spec("qwen3moe", hidden=256, heads=4, kv_heads=2, head_dim=96, experts=8, expert_ff=128))
    assert q3["blk.0.attn_q.weight"] == (384, 256) and q3["blk.0.attn_q_norm.weight"] == (96,)
    assert q3["blk.1.ffn_gate_inp.weight"] == (8, 256) and q3["blk.1.ffn_down_exps.weight"] == (8, 256, 128)
    ol = names(make_spec("olmoe"))
    assert ol["blk.0.attn_q_norm.weight"] == (256,) and ol["blk.0.attn_k_norm.weight"] == (256,)
    q2 = names(make_spec("qwen2moe", shared_ff=384))
    assert q2["blk.0.attn_k.bias"] == (128,) and q2["blk.0.ffn_gate_inp_shexp.weight"] == (256,)
    assert q2["blk.0.ffn_down_shexp.weight"] == (256, 384)
    assert "rope_freqs.weight" in names(make_spec("llama", rope_freqs=True))
    assert "blk.0.ffn_up.weight" in names(make_spec("qwen3"))


@pytest.mark.parametrize(
    "arch, geo",
    [
        ("olmoe", {"kv_heads": 2}),  # llama.cpp's OLMoE k-norm is [D]
        ("qwen2moe", {"head_dim": 32}),  # attn_q is [D, D] there
        ("qwen2moe", {"tied_output": True}),  # output.weight required
        ("qwen3moe", {"experts": 0}),
        ("qwen3", {"experts": 4}),
        ("qwen3moe", {"heads": 6, "kv_heads": 4}),
        ("qwen3moe", {"bogus": 1}),
        ("mamba", {}),
    ],
)
def test_impossible_geometry_is_rejected(arch, geo):
    with pytest.raises(UsageError):
        make_spec(arch, **geo)


def test_type_plan_fallbacks_and_overrides():
    decls = tensor_layout(make_spec("qwen3moe", expert_ff=128, vocab=512))
    plans = {p.name: p for p in plan_types(decls, "Q4_K", {"ffn_down*": "Q6_K", "output": "Q6_K"})}
    assert plans["blk.0.ffn_gate_exps.weight"].qtype == QType.Q4_K  # rows of 256
    assert plans["blk.0.ffn_down_exps.weight"].requested == QType.Q6_K
    assert plans["blk.0.ffn_down_exps.weight"].qtype == QType.Q8_0  # rows of 128
    assert plans["output.weight"].qtype == QType.Q6_K
    assert plans["output_norm.weight"].qtype == QType.F32
    assert plans["blk.1.ffn_gate_inp.weight"].qtype == QType.F32
    assert plans["blk.0.attn_q_norm.weight"].qtype == QType.F32
    assert fit_row(QType.Q4_K, 128) == QType.Q5_0 and fit_row(QType.Q5_K, 96) == QType.Q5_0
    assert fit_row(QType.Q4_0, 48) == QType.F16 and fit_row(QType.Q4_K, 512) == QType.Q4_K
    # llama.cpp's IQ4_NL for Q2_K/Q3_K is not supported: Q4_0, the same 4.5 bits
    assert fit_row(QType.Q3_K, 128) == fit_row(QType.Q2_K, 128) == QType.Q4_0
    assert fit_row(QType.IQ4_XS, 128) == QType.IQ4_NL and fit_row(QType.IQ4_XS, 48) == QType.F16  # as llama.cpp
    for q in (QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S, QType.IQ3_XXS, QType.IQ3_S):  # as llama.cpp
        assert fit_row(q, 128) == QType.IQ4_NL and fit_row(q, 512) == q
    with pytest.raises(UsageError):
        plan_types(decls, "Q4_1")


def test_fallback_is_recorded_in_the_file(synth_model):
    m = synth_model("qwen3moe", "Q4_K", expert_ff=128, layers=1)
    assert m.fallbacks == {"blk.0.ffn_down_exps.weight": (QType.Q4_K, QType.Q5_0)}
    r = _reader(m.path)
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_down_exps.weight")
    assert QType(t.tensor_type) == QType.Q5_0


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = write_model(tmp_path / "a.gguf", "qwen3moe", seed=3, weight_type="Q8_0", layers=1)
    b = write_model(tmp_path / "b.gguf", "qwen3moe", seed=3, weight_type="Q8_0", layers=1)
    c = write_model(tmp_path / "c.gguf", "qwen3moe", seed=4, weight_type="Q8_0", layers=1)
    assert a.path.read_bytes() == b.path.read_bytes()
    assert a.path.read_bytes() != c.path.read_bytes()


def test_given_weights_are_written_and_others_stay_random(tmp_path):
    rng = np.random.default_rng(1)
    D = 256
    given = {
        "blk.0.attn_q.weight": rng.standard_normal((256, D), dtype=np.float32),
        "blk.0.ffn_up_exps.weight": rng.standard_normal((4, 256, D), dtype=np.float32),
    }
    f32 = write_model(tmp_path / "f.gguf", "qwen3moe", layers=1, experts=4, weights=given)
    q8 = write_model(tmp_path / "q.gguf", "qwen3moe", layers=1, experts=4, weights=given, weight_type="Q8_0")
    rand = write_model(tmp_path / "r.gguf", "qwen3moe", layers=1, experts=4)
    tf = {t.name: t for t in _reader(f32.path).tensors}
    tq = {t.name: t for t in _reader(q8.path).tensors}
    tr = {t.name: t for t in _reader(rand.path).tensors}
    for name, x in given.items():
        np.testing.assert_array_equal(np.asarray(tf[name].data).reshape(x.shape), x)
        raw = np.asarray(tq[name].data)
        np.testing.assert_array_equal(raw.reshape(quantize(x, QType.Q8_0).shape), quantize(x, QType.Q8_0))
        assert np.abs(dequantize(raw, QType.Q8_0).reshape(x.shape) - x).max() < 0.05
    np.testing.assert_array_equal(tf["blk.0.attn_k.weight"].data, tr["blk.0.attn_k.weight"].data)
    with pytest.raises(UsageError):
        write_model(tmp_path / "x.gguf", "qwen3moe", weights={"blk.0.attn_q.weight": np.zeros((3, 3))})
    with pytest.raises(UsageError):
        write_model(tmp_path / "x.gguf", "qwen3moe", weights={"blk.9.nope.weight": np.zeros(3)})


def test_random_weights_have_the_documented_scales(synth_model):
    m = synth_model("qwen3moe", layers=1, experts=8, hidden=512, expert_ff=256)
    t = {x.name: np.asarray(x.data) for x in _reader(m.path).tensors}
    assert abs(t["blk.0.attn_q.weight"].std() * np.sqrt(512) - 1) < 0.05
    assert abs(t["blk.0.ffn_down_exps.weight"].std() * np.sqrt(256) - 1) < 0.05
    assert abs(t["token_embd.weight"].std() - 1) < 0.05
    assert abs(t["blk.0.attn_norm.weight"].mean() - 1) < 0.02 and t["blk.0.attn_norm.weight"].std() < 0.1
    # Router logits for unit-RMS inputs spread over several units: top-k gaps are not razor-thin.
    x = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    logits = np.sort(x @ t["blk.0.ffn_gate_inp.weight"].T, axis=1)
    assert np.median(logits[:, -2] - logits[:, -3]) > 0.3


@pytest.mark.parametrize("size", [300, 512, 4096, 20000])
def test_bpe_vocab_has_exact_size_unique_tokens_and_specials(size):
    v = bpe_vocab(size, "qwen2")
    assert len(v.tokens) == len(v.token_types) == size == len(set(v.tokens))
    assert v.tokens[v.bos_id] == "<|endoftext|>" and v.tokens[v.eos_id] == "<|im_end|>"
    assert [v.token_types[v.tokens.index(s)] for s in ("<|im_start|>", "<|im_end|>")] == [3, 3]
    assert all(len(m.split(" ")) == 2 for m in v.merges) and "Ġ t" in v.merges
    assert len(v.hf_tokenizer().get_vocab()) == size


@pytest.mark.parametrize("size", [512, 32000])
def test_spm_vocab_layout(size):
    v = spm_vocab(size)
    assert len(v.tokens) == size == len(set(v.tokens)) == len(v.scores)
    assert v.tokens[:3] == ("<unk>", "<s>", "</s>") and v.tokens[3] == "<0x00>" and v.tokens[258] == "<0xFF>"
    assert set(v.token_types[3:259]) == {6} and any(t.startswith("\u2581") for t in v.tokens[259:])


def test_tokenizer_training_is_deterministic():
    a = bpe_vocab.__wrapped__(4096, "llama-bpe")
    b = spm_vocab.__wrapped__(4096)
    assert a == bpe_vocab.__wrapped__(4096, "llama-bpe") and b == spm_vocab.__wrapped__(4096)


# Published shapes (numpy order) and Q4_K_M types that the geometry files must reproduce.
REAL = {
    "qwen3-30b-a3b": {
        "token_embd.weight": ((151936, 2048), QType.Q4_K),
        "blk.0.attn_q.weight": ((4096, 2048), QType.Q4_K),
        "blk.0.attn_k.weight": ((512, 2048), QType.Q4_K),
        "blk.0.attn_v.weight": ((512, 2048), QType.Q6_K),
        "blk.0.attn_q_norm.weight": ((128,), QType.F32),
        "blk.47.ffn_gate_inp.weight": ((128, 2048), QType.F32),
        "blk.47.ffn_gate_exps.weight": ((128, 768, 2048), QType.Q4_K),
        "blk.47.ffn_down_exps.weight": ((128, 2048, 768), QType.Q6_K),
        "blk.10.ffn_down_exps.weight": ((128, 2048, 768), QType.Q4_K),
        "output.weight": ((151936, 2048), QType.Q6_K),
    },
    "olmoe-1b-7b": {
        "blk.0.attn_k_norm.weight": ((2048,), QType.F32),
        "blk.15.ffn_up_exps.weight": ((64, 1024, 2048), QType.Q4_K),
        "output.weight": ((50304, 2048), QType.Q6_K),
    },
    "qwen1.5-moe-a2.7b": {
        "blk.0.attn_q.bias": ((2048,), QType.F32),
        "blk.0.ffn_gate_exps.weight": ((60, 1408, 2048), QType.Q4_K),
        "blk.0.ffn_down_exps.weight": ((60, 2048, 1408), QType.Q8_0),  # Q6_K layer, 1408 % 256 != 0
        "blk.4.ffn_down_exps.weight": ((60, 2048, 1408), QType.Q5_0),  # Q4_K layer
        "blk.0.ffn_gate_inp_shexp.weight": ((2048,), QType.F32),
        "blk.0.ffn_down_shexp.weight": ((2048, 5632), QType.Q6_K),
    },
    "glm-4.5-air": {
        "token_embd.weight": ((151552, 4096), QType.Q4_K),
        "blk.0.attn_q.weight": ((12288, 4096), QType.Q4_K),
        "blk.0.attn_q.bias": ((12288,), QType.F32),
        "blk.0.post_attention_norm.weight": ((4096,), QType.F32),
        "blk.0.ffn_gate.weight": ((10944, 4096), QType.Q4_K),
        "blk.1.exp_probs_b.bias": ((128,), QType.F32),
        "blk.1.ffn_gate_inp.weight": ((128, 4096), QType.F32),
        "blk.1.ffn_gate_exps.weight": ((128, 1408, 4096), QType.Q4_K),
        "blk.1.ffn_down_exps.weight": ((128, 4096, 1408), QType.Q8_0),  # Q6_K layer, 1408 % 256 != 0
        "blk.6.ffn_down_exps.weight": ((128, 4096, 1408), QType.Q5_0),  # Q4_K layer
        "blk.1.ffn_up_shexp.weight": ((1408, 4096), QType.Q4_K),
        "blk.46.nextn.eh_proj.weight": ((4096, 8192), QType.Q4_K),  # the NextN block after the 46 layers
        "output.weight": ((151552, 4096), QType.Q6_K),
    },
    # OpenAI's MXFP4 experts (and their biases), the sinks, q/k/v/o biases; other matrices Q8_0 here
    "gpt-oss-20b": {
        "token_embd.weight": ((201088, 2880), QType.Q8_0),
        "blk.0.attn_q.weight": ((4096, 2880), QType.Q8_0),
        "blk.0.attn_k.weight": ((512, 2880), QType.Q8_0),
        "blk.0.attn_output.weight": ((2880, 4096), QType.Q8_0),
        "blk.0.attn_output.bias": ((2880,), QType.F32),
        "blk.0.attn_sinks.weight": ((64,), QType.F32),
        "blk.0.ffn_gate_inp.bias": ((32,), QType.F32),
        "blk.23.ffn_gate_exps.weight": ((32, 2880, 2880), QType.MXFP4),
        "blk.23.ffn_down_exps.weight": ((32, 2880, 2880), QType.MXFP4),
        "blk.23.ffn_up_exps.bias": ((32, 2880), QType.F32),
        "output.weight": ((201088, 2880), QType.Q8_0),
    },
    "gpt-oss-120b": {
        "blk.35.ffn_up_exps.weight": ((128, 2880, 2880), QType.MXFP4),
        "blk.35.ffn_down_exps.bias": ((128, 2880), QType.F32),
        "blk.35.post_attention_norm.weight": ((2880,), QType.F32),
    },
    # 30 Gated DeltaNet layers (fused q/k/v 2·16·128 + 32·128 wide, the z gate, conv taps, β and decay per value head),
    # a gated full-attention layer every fourth (q and its gate 2·16·256 wide), the MTP block as blk.40
    "qwen3.6-35b-a3b": {
        "token_embd.weight": ((248320, 2048), QType.Q4_K),
        "blk.0.attn_qkv.weight": ((8192, 2048), QType.Q4_K),
        "blk.0.attn_gate.weight": ((4096, 2048), QType.Q4_K),
        "blk.0.ssm_conv1d.weight": ((8192, 4), QType.F32),
        "blk.0.ssm_a": ((32,), QType.F32),
        "blk.0.ssm_out.weight": ((2048, 4096), QType.Q4_K),
        "blk.3.attn_q.weight": ((8192, 2048), QType.Q4_K),
        "blk.3.attn_k.weight": ((512, 2048), QType.Q4_K),
        "blk.3.attn_q_norm.weight": ((256,), QType.F32),
        "blk.39.ffn_gate_exps.weight": ((256, 512, 2048), QType.Q4_K),
        "blk.39.ffn_down_exps.weight": ((256, 2048, 512), QType.Q6_K),
        "blk.39.ffn_gate_inp_shexp.weight": ((2048,), QType.F32),
        "blk.40.nextn.eh_proj.weight": ((2048, 4096), QType.Q4_K),
        "output.weight": ((248320, 2048), QType.Q6_K),
    },
    "qwen3-next-80b-a3b": {
        "blk.0.ssm_in.weight": ((12288, 2048), QType.Q4_K),
        "blk.0.ssm_ba.weight": ((64, 2048), QType.Q4_K),
        "blk.47.attn_q.weight": ((8192, 2048), QType.Q4_K),
        "blk.47.ffn_up_exps.weight": ((512, 512, 2048), QType.Q4_K),
        "output.weight": ((151936, 2048), QType.Q6_K),
    },
    "mixtral-8x7b": {
        "token_embd.weight": ((32000, 4096), QType.Q4_K),
        "blk.3.attn_k.weight": ((1024, 4096), QType.Q8_0),
        "blk.3.ffn_gate_exps.weight": ((8, 14336, 4096), QType.Q4_K),
        "blk.31.ffn_down_exps.weight": ((8, 4096, 14336), QType.Q6_K),
    },
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_geometry_file_is_real_sized_sparse_and_parses(synth_geometry, name):
    g = synth_geometry(name)
    st = os.stat(g.path)
    r = _reader(g.path)
    tensors = {x.name: (tuple(int(d) for d in reversed(x.shape)), QType(x.tensor_type)) for x in r.tensors}
    for tname, expected in REAL[name].items():
        assert tensors[tname] == expected, tname
    data_bytes = sum(tensor_bytes(q, shape) for shape, q in tensors.values())
    assert data_bytes == sum(int(x.n_bytes) for x in r.tensors) == g.tensor_bytes
    assert st.st_size == g.file_size >= data_bytes + r.tensors[0].data_offset
    assert st.st_blocks * 512 < 16 << 20 < st.st_size // 100  # a hole, not data on disk
    assert len(r.fields["tokenizer.ggml.tokens"].data) == g.spec.vocab == tensors["token_embd.weight"][0][0]


def test_qwen3_geometry_matches_published_size(synth_geometry):
    g = synth_geometry("qwen3-30b-a3b")
    assert 17.0e9 < g.file_size < 18.7e9  # Q4_K_M files are 17-18.6 GB
    down = [p for p in g.tensors if p.name.endswith("ffn_down_exps.weight")]
    assert sum(p.qtype == QType.Q6_K for p in down) == sum(use_more_bits(i, 48) for i in range(48)) == 24


@pytest.mark.parametrize("name, low, high", [("gpt-oss-20b", 11.8e9, 12.4e9), ("gpt-oss-120b", 62.0e9, 65.0e9)])
def test_gpt_oss_geometry_matches_published_size(synth_geometry, name, low, high):
    """The MXFP4 files OpenAI's models are published as (ggml-org's gpt-oss-20b / 120b GGUFs: about 12.1 and
    63.4 GB), from their geometry: experts MXFP4, the rest Q8_0 here."""
    g = synth_geometry(name)
    assert low < g.file_size < high, g.file_size


@pytest.mark.parametrize(
    "name, low, high", [("qwen3.6-35b-a3b", 20.5e9, 22.5e9), ("qwen3-next-80b-a3b", 45.0e9, 49.0e9)]
)
def test_hybrid_geometry_matches_published_size(synth_geometry, name, low, high):
    """Q4_K_M files of the Gated-DeltaNet hybrids as published (Qwen3.6-35B-A3B about 20.6 GiB, Qwen3-Next-80B-A3B
    about 45 GiB), every GDN layer recurrent and every fourth layer attention."""
    g = synth_geometry(name)
    assert low < g.file_size < high, g.file_size
    assert [i for i in range(g.spec.layers) if not g.spec.recurrent(i)] == list(range(3, g.spec.layers, 4))


def test_cli_writes_model_and_geometry(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    argv = ["synth", "-o", str(out), "--arch", "qwen2moe", "--layers", "1", "--expert-ff", "128", "--type", "Q4_0"]
    assert cli_main([*argv, "--override", "ffn_down*=Q8_0", "--seed", "5"]) == 0
    types = {t.name: QType(t.tensor_type) for t in _reader(out).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == QType.Q8_0 and types["blk.0.attn_q.weight"] == QType.Q4_0
    assert cli_main(["synth", "--geometry", "olmoe-1b-7b", "-o", str(tmp_path / "g.gguf")]) == 0
    assert "OLMoE-1B-7B" in capsys.readouterr().out
    assert cli_main(["synth", "-o", str(out), "--arch", "olmoe", "--kv-heads", "2"]) == 2


def test_fill_random_blocks_gives_well_scaled_weights(tmp_path):
    """Random block fill of a real-shaped (but small) file: every type decodes to std ≈ 1/sqrt(fan_in)."""
    from engine.gguf import open_gguf
    from engine.quant import dequantize
    from engine.synth.fill import fill_random_blocks

    iq = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")
    for q in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "IQ4_XS", *iq):
        path = write_model(tmp_path / f"{q}.gguf", "qwen3moe", seed=1, weight_type=q).path
        assert fill_random_blocks(path, seed=2) > 0
        with open_gguf(path) as gf:
            t = gf.tensor("blk.0.ffn_up_exps.weight")
            x = dequantize(t.data[0], t.qtype)
            assert abs(float(x.mean())) < 0.2 / np.sqrt(t.shape[-1]), q
            assert 0.8 < float(x.std()) * np.sqrt(t.shape[-1]) < 1.2, (q, float(x.std()))


def test_fill_random_blocks_keeps_gated_deltanet_decays_negative(tmp_path):
    """A random fill of a hybrid writes ssm_a = −exp(A_log) < 0 (a decay), as the writer does: a positive value
    would grow the recurrent state at every token of a speed run."""
    from engine.gguf import open_gguf
    from engine.synth.fill import fill_random_blocks

    path = write_model(tmp_path / "h.gguf", "qwen35moe", seed=1, weight_type="Q8_0").path
    assert fill_random_blocks(path, seed=2) > 0
    with open_gguf(path) as gf:
        a = [np.array(gf.tensor(n).data) for n in gf.tensors if n.endswith(".ssm_a")]  # copies: the map closes
    assert a and all((x < 0).all() for x in a)


def test_vocabulary_writer_splits_text_as_the_tokenizer_reads_it():
    """The synthetic vocabularies' pre-tokenizer regexes are the engine tokenizer's (two copies: synth may not import
    the tokenizer package, tests/test_import_boundaries.py)."""
    from engine.synth.tokenizer import PRE_REGEXES
    from engine.tokenizer.pretokenizers import LLAMA3_REGEX, QWEN2_REGEX, QWEN35_REGEX

    assert PRE_REGEXES["qwen2"] == (QWEN2_REGEX,) and PRE_REGEXES["qwen35"] == (QWEN35_REGEX,)
    assert PRE_REGEXES["llama-bpe"] == (LLAMA3_REGEX,)
