"""engine.gguf: reading valid files, and clear errors (never crashes or hangs) on bad ones."""

from __future__ import annotations

import os
import random

import gguf
import numpy as np
import pytest

from engine.errors import (
    GGUFError,
    MissingTensorError,
    NotGGUFError,
    SharpIError,
    TensorShapeError,
    TruncatedFileError,
    UnsupportedArchitectureError,
    UnsupportedQuantTypeError,
    UnsupportedVersionError,
)
from engine.gguf import open_gguf
from engine.modelinfo import describe
from engine.models import check_model_file, read_args

ARCH = "qwen3moe"
D, H, HKV, HD, E, K, F, V, L = 64, 4, 2, 16, 4, 2, 32, 40, 2


def _write_tiny(path, *, drop: str | None = None, reshape: str | None = None, qtype_for: dict | None = None):
    """A tiny but complete qwen3moe file written directly with gguf.GGUFWriter."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F * K)
    w.add_expert_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_token_types([1] * V)
    w.add_token_merges(["t 0"])
    w.add_chat_template("{{ messages }}")

    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for i in range(L):
        b = f"blk.{i}."
        shapes.update(
            {
                b + "attn_norm.weight": (D,),
                b + "attn_q.weight": (H * HD, D),
                b + "attn_k.weight": (HKV * HD, D),
                b + "attn_v.weight": (HKV * HD, D),
                b + "attn_output.weight": (D, H * HD),
                b + "attn_q_norm.weight": (HD,),
                b + "attn_k_norm.weight": (HD,),
                b + "ffn_norm.weight": (D,),
                b + "ffn_gate_inp.weight": (E, D),
                b + "ffn_gate_exps.weight": (E, F, D),
                b + "ffn_up_exps.weight": (E, F, D),
                b + "ffn_down_exps.weight": (E, D, F),
            }
        )
    for name, shape in shapes.items():
        if name == drop:
            continue
        if name == reshape:
            shape = shape[:-1] + (shape[-1] * 2,)
        arr = rng.standard_normal(shape).astype(np.float32)
        qt = (qtype_for or {}).get(name)
        if qt is None:
            w.add_tensor(name, arr)
        else:
            raw = gguf.quants.quantize(arr, qt)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_reads_metadata_tensors_and_args(tiny):
    with open_gguf(tiny) as gf:
        assert gf.version == 3
        assert gf.architecture == ARCH
        t = gf.tensor("blk.1.ffn_down_exps.weight")
        assert t.shape == (E, D, F) and t.qtype.name == "F32"
        # Zero-copy: the view's bytes are the file's bytes at the recorded offset.
        with open(tiny, "rb") as f:
            f.seek(t.offset)
            assert f.read(t.nbytes) == t.data.tobytes()
        args, specs = check_model_file(gf)
        assert (args.n_layer, args.n_embd, args.n_head, args.n_head_kv, args.head_dim) == (L, D, H, HKV, HD)
        assert (args.n_expert, args.n_expert_used, args.n_ff_exp, args.n_vocab) == (E, K, F, V)
        assert args.norm_topk and args.rope_neox and not args.tied_output
        assert abs(args.rms_eps - 1e-6) < 1e-12
        info = describe(gf)
        assert info.expert_bytes == L * 3 * E * F * D * 4
        assert info.trunk_bytes + info.expert_bytes == sum(t.nbytes for t in gf.tensors.values())
        assert info.per_expert_bytes == 3 * F * D * 4
        assert info.has_chat_template and info.tokenizer_model == "gpt2" and info.vocab_size == V


def test_metadata_read_through_key_constants(tiny):
    from engine.gguf import keys

    with open_gguf(tiny) as gf:
        assert gf.require(keys.arch_key(keys.EXPERT_COUNT, ARCH), int) == E
        assert gf.get(keys.TOKENIZER_TOKENS)[:2] == ["t0", "t1"]


def test_specific_errors(tmp_path, tiny):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(NotGGUFError, match="not a GGUF"):
        open_gguf(p)
    data = bytearray(tiny.read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    p.write_bytes(bytes(data))
    with pytest.raises(UnsupportedVersionError, match="version 7"):
        open_gguf(p)
    p.write_bytes(tiny.read_bytes()[:-100])
    with pytest.raises(TruncatedFileError, match="truncated"):
        open_gguf(p)
    with pytest.raises(GGUFError, match="no such file"):
        open_gguf(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="directory"):
        open_gguf(tmp_path)
    p.write_bytes(b"")
    with pytest.raises(NotGGUFError, match="too small"):
        open_gguf(p)


def test_unsupported_architecture_lists_supported(tmp_path, tiny):
    data = tiny.read_bytes()
    # Same-length rename of the architecture value keeps the file otherwise valid.
    p = tmp_path / "arch.gguf"
    p.write_bytes(data.replace(b"qwen3moe", b"qwen9moe"))
    with (
        open_gguf(p) as gf,
        pytest.raises(UnsupportedArchitectureError, match="supported: gemma3, glm4moe, gpt-oss, llama, olmoe"),
    ):
        read_args(gf)


def test_missing_and_misshaped_tensors(tmp_path):
    a = _write_tiny(tmp_path / "a.gguf", drop="blk.1.attn_k_norm.weight")
    with open_gguf(a) as gf, pytest.raises(MissingTensorError, match="blk.1.attn_k_norm.weight"):
        check_model_file(gf)
    b = _write_tiny(tmp_path / "b.gguf", reshape="blk.0.attn_q.weight")
    with open_gguf(b) as gf, pytest.raises(TensorShapeError, match="blk.0.attn_q.weight"):
        check_model_file(gf)


def test_unsupported_quant_type_names_the_tensor(tmp_path):
    path = _write_tiny(tmp_path / "q.gguf", qtype_for={"blk.0.attn_v.weight": gguf.GGMLQuantizationType.Q4_1})
    with open_gguf(path) as gf, pytest.raises(UnsupportedQuantTypeError, match="blk.0.attn_v.weight.*Q4_1"):
        check_model_file(gf)


def _load(path) -> None:
    with open_gguf(path) as gf:
        check_model_file(gf)
        describe(gf)


def _mutations(data: bytes, header_end: int, rng: random.Random):
    """Yield (label, bytes): truncations, byte flips and targeted field corruptions."""
    n = len(data)
    for _ in range(150):
        cut = rng.randrange(0, n)
        yield f"truncate@{cut}", data[:cut]
    for cut in range(0, min(header_end, 64)):
        yield f"truncate-head@{cut}", data[:cut]
    for _ in range(250):
        b = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4))):
            pos = rng.randrange(0, header_end)
            b[pos] = rng.randrange(256)
        yield "flip", bytes(b)
    for _ in range(100):
        # Overwrite an 8-byte window with an extreme integer: counts, lengths, dims, offsets.
        b = bytearray(data)
        pos = rng.randrange(0, header_end - 8)
        val = rng.choice((0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, 255, 65535))
        b[pos : pos + 8] = val.to_bytes(8, "little")
        yield f"int@{pos}={val}", bytes(b)


@pytest.mark.timeout(300)
def test_fuzzed_files_raise_project_errors_only(tmp_path, tiny):
    data = tiny.read_bytes()
    with open_gguf(tiny) as gf:
        header_end = gf.data_offset
    rng = random.Random(1234)
    p = tmp_path / "m.gguf"
    count = ok = 0
    for label, blob in _mutations(data, header_end, rng):
        p.write_bytes(blob)
        count += 1
        try:
            _load(p)
            ok += 1
        except SharpIError as e:
            msg = str(e)
            assert str(p) in msg and len(msg) > len(str(p)) + 10, (label, msg)
        except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
            pytest.fail(f"{label}: {type(e).__name__}: {e}")
        finally:
            # Views into the map must not keep the file open between cases.
            pass
    assert count >= 500
    assert ok < count  # the mutations really exercised the error paths
    os.remove(p)
