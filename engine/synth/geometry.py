"""Geometry-only GGUFs of real models: a real header and tensor table, the data left as a hole.

The file is written up to the start of the tensor data and then extended with ``truncate`` to
its full size, so it is sparse: its apparent size is the real model's, it occupies a few MB of
disk, and reading the data region yields zeros. Planner and loader code can open it like the
real file. The vocabulary has the real size (trained tokens, then ``[PADn]`` placeholders).

Weight types approximate llama.cpp's Q4_K_M recipe (``llama_tensor_get_type`` in
``src/llama-quant.cpp``), stated here because it is approximate:

* every matrix Q4_K, ``token_embd`` included; ``output`` Q6_K;
* ``attn_v`` and every ``ffn_down*`` (dense, routed ``_exps`` and shared ``_shexp``) Q6_K on the
  layers llama.cpp's ``use_more_bits`` picks (the first and last eighth, and every third layer
  between: 24 of 48 for Qwen3-30B-A3B);
* 8-expert models (Mixtral): ``attn_k`` and ``attn_v`` Q8_0;
* rows not a multiple of 256 fall back as llama.cpp does (Qwen1.5-MoE's 1408-wide
  ``ffn_down_exps`` become Q5_0/Q8_0); norms, biases and routers F32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from engine.errors import UsageError
from engine.quant.formats import QType
from engine.synth.encode import TensorPlan, plan_types
from engine.synth.metadata import write_hparams
from engine.synth.specs import SynthSpec, TensorDecl, make_spec, tensor_layout
from engine.synth.tokenizer import Vocab, build_vocab, write_tokenizer


@dataclass(frozen=True)
class RealModel:
    """A published model's geometry and tokenizer kind; ``recipe``: its weight types, "q4_k_m" (the
    approximation in the module docstring) or "mxfp4" (gpt-oss as OpenAI ships it: routed experts MXFP4, every
    other matrix Q8_0 — an approximation of the published files, whose non-expert matrices are wider)."""

    title: str
    spec: SynthSpec
    tokenizer: str  # "bpe" | "spm"
    pre: str | None
    recipe: str = "q4_k_m"


GEOMETRIES: dict[str, RealModel] = {
    "qwen3-30b-a3b": RealModel(
        "Qwen3-30B-A3B",
        make_spec(
            "qwen3moe", layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, experts_used=8,
            expert_ff=768, ff=6144, vocab=151936, ctx=40960, rope_base=1e6, rms_eps=1e-6,
        ),
        "bpe",
        "qwen2",
    ),
    "olmoe-1b-7b": RealModel(
        "OLMoE-1B-7B",
        make_spec(
            "olmoe", layers=16, hidden=2048, heads=16, kv_heads=16, head_dim=128, experts=64, experts_used=8,
            expert_ff=1024, vocab=50304, ctx=4096, rope_base=10000.0, rms_eps=1e-5,
        ),
        "bpe",
        "olmo",
    ),
    "qwen1.5-moe-a2.7b": RealModel(
        "Qwen1.5-MoE-A2.7B",
        make_spec(
            "qwen2moe", layers=24, hidden=2048, heads=16, kv_heads=16, head_dim=128, experts=60, experts_used=4,
            expert_ff=1408, shared_ff=5632, ff=5632, vocab=151936, ctx=8192, rope_base=1e6, rms_eps=1e-6,
            qkv_bias=True,
        ),
        "bpe",
        "qwen2",
    ),
    "mixtral-8x7b": RealModel(
        "Mixtral-8x7B",
        make_spec(
            "llama", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, experts=8, experts_used=2,
            expert_ff=14336, vocab=32000, ctx=32768, rope_base=1e6, rms_eps=1e-5,
        ),
        "spm",
        None,
    ),
    # Z.ai's config: 46 layers (the first dense, first_k_dense_replace = 1) and one NextN/MTP block after them
    # (block_count 47, as llama.cpp's converter writes it), half of each head rotated (partial_rotary_factor 0.5).
    "glm-4.5-air": RealModel(
        "GLM-4.5-Air",
        make_spec(
            "glm4moe", layers=46, dense_lead=1, nextn=1, hidden=4096, heads=96, kv_heads=8, head_dim=128,
            experts=128, experts_used=8, expert_ff=1408, shared_ff=1408, ff=10944, vocab=151552, ctx=131072,
            rope_base=1e6, rms_eps=1e-5, rope_dim=64, qkv_bias=True, expert_scale=1.0,
        ),
        "bpe",
        "llama-bpe",  # a stand-in: the real file's pre-tokenizer is "glm4", which the tokenizer does not know yet
    ),
    # OpenAI's config.json: 24 / 36 layers alternating sliding (128) and full attention, 64 query heads of 64 and 8
    # KV heads on a 2880 residual, 32 / 128 experts of 2880 (top 4), YaRN ×32 from 4096 positions, o200k_harmony's
    # 201088-token vocabulary.
    "gpt-oss-20b": RealModel(
        "gpt-oss-20b",
        make_spec(
            "gpt-oss", layers=24, hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, experts_used=4,
            expert_ff=2880, vocab=201088, ctx=131072, rope_base=150000.0, rms_eps=1e-5, sliding_window=128,
            yarn_factor=32.0, yarn_orig_ctx=4096,
        ),
        "bpe",
        "llama-bpe",  # a stand-in: the real files' pre-tokenizer is "gpt-4o" (o200k), which the tokenizer lacks
        "mxfp4",
    ),
    "gpt-oss-120b": RealModel(
        "gpt-oss-120b",
        make_spec(
            "gpt-oss", layers=36, hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=128, experts_used=4,
            expert_ff=2880, vocab=201088, ctx=131072, rope_base=150000.0, rms_eps=1e-5, sliding_window=128,
            yarn_factor=32.0, yarn_orig_ctx=4096,
        ),
        "bpe",
        "llama-bpe",
        "mxfp4",
    ),
    # Qwen's config.json (qwen3_5_moe_text): 40 layers, every fourth gated full attention (16 query / 2 KV heads of
    # 256, a quarter of each head rotated, base 1e7), the other 30 Gated DeltaNet (16 key heads, 32 value heads, both
    # 128 wide, conv 4); 256 experts of 512 (top 8) plus a 512-wide shared expert; one MTP block (block_count 41).
    "qwen3.6-35b-a3b": RealModel(
        "Qwen3.6-35B-A3B",
        make_spec(
            "qwen35moe", layers=40, nextn=1, hidden=2048, heads=16, kv_heads=2, head_dim=256, rope_dim=64,
            experts=256, experts_used=8, expert_ff=512, shared_ff=512, vocab=248320, ctx=262144, rope_base=1e7,
            rms_eps=1e-6, ssm_conv=4, ssm_state=128, ssm_groups=16, ssm_v_heads=32, full_attn_interval=4,
        ),
        "bpe",
        "qwen35",
    ),
    # Qwen3-Next-80B-A3B: the same hybrid layout over 48 layers with 512 experts (top 10) and Qwen2's vocabulary; the
    # GGUFs llama.cpp's converter writes carry no MTP block.
    "qwen3-next-80b-a3b": RealModel(
        "Qwen3-Next-80B-A3B",
        make_spec(
            "qwen3next", layers=48, hidden=2048, heads=16, kv_heads=2, head_dim=256, rope_dim=64, experts=512,
            experts_used=10, expert_ff=512, shared_ff=512, vocab=151936, ctx=262144, rope_base=1e7, rms_eps=1e-6,
            ssm_conv=4, ssm_state=128, ssm_groups=16, ssm_v_heads=32, full_attn_interval=4,
        ),
        "bpe",
        "qwen2",
    ),
}  # fmt: skip


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of layers that get more bits in ``_M`` mixes (``use_more_bits``)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_overrides(spec: SynthSpec, decls: list[TensorDecl]) -> dict[str, QType]:
    """Per-tensor type overrides on top of Q4_K that approximate a Q4_K_M file (module docstring)."""
    out: dict[str, QType] = {"output": QType.Q6_K}
    for d in decls:
        short = d.name.split(".")[-2] if d.layer is not None else ""
        if short == "attn_v":
            more = use_more_bits(d.layer, spec.layers)
            out[d.name] = QType.Q8_0 if spec.experts == 8 else QType.Q6_K if more else QType.Q4_K
        elif short == "attn_k" and spec.experts == 8:
            out[d.name] = QType.Q8_0
        elif short.startswith("ffn_down") and use_more_bits(d.layer, spec.layers):
            out[d.name] = QType.Q6_K
    return out


@dataclass(frozen=True)
class GeometryFile:
    """A written geometry-only file: its tensors, where the data starts, its apparent size."""

    path: Path
    model: RealModel
    tensors: tuple[TensorPlan, ...]
    vocab: Vocab
    data_offset: int
    file_size: int

    @property
    def spec(self) -> SynthSpec:
        return self.model.spec

    @property
    def tensor_bytes(self) -> int:
        """Sum of the tensors' data sizes (without alignment padding)."""
        return sum(p.nbytes for p in self.tensors)


def write_sparse(
    path: Path, spec: SynthSpec, plans: list[TensorPlan], vocab: Vocab, name: str, file_type: QType
) -> tuple[int, int]:
    """Write a GGUF's header, metadata, tokenizer and tensor table for ``plans``, and size the file
    so the data region is a hole (no blocks allocated; ``engine.synth.fill`` can fill it).
    Returns (data offset, end of data) in bytes."""
    w = GGUFWriter(path, spec.arch)
    write_hparams(w, spec, name=name, file_type=file_type)
    write_tokenizer(w, vocab)
    size = 0
    for p in plans:
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
        size += GGUFWriter.ggml_pad(p.nbytes, w.data_alignment)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    f = w.fout[0]
    f.flush()
    data_offset = GGUFWriter.ggml_pad(f.tell(), w.data_alignment)
    f.truncate(data_offset + size)  # the hole
    w.close()
    return data_offset, data_offset + size


def write_geometry(path: str | os.PathLike, model_name: str) -> GeometryFile:
    """Write the geometry-only GGUF of ``model_name`` (a key of :data:`GEOMETRIES`) to ``path``."""
    key = model_name.lower()
    if key not in GEOMETRIES:
        raise UsageError(f"unknown model {model_name!r} (known: {', '.join(GEOMETRIES)})")
    model = GEOMETRIES[key]
    spec = model.spec
    decls = tensor_layout(spec)
    if model.recipe == "mxfp4":
        plans, file_type = plan_types(decls, QType.Q8_0, {"*_exps": QType.MXFP4}), QType.MXFP4
    else:
        plans, file_type = plan_types(decls, QType.Q4_K, q4_k_m_overrides(spec, decls)), QType.Q4_K
    vocab = build_vocab(model.tokenizer, spec.vocab, model.pre)

    path = Path(path)
    name = f"{model.title} (geometry only, no weights)"
    data_offset, end = write_sparse(path, spec, plans, vocab, name, file_type)
    return GeometryFile(path, model, tuple(plans), vocab, data_offset, end)
