"""Write synthetic GGUF models that llama.cpp loads: random (or given) weights, real layouts.

Values are deterministic: each tensor (and each expert of a stacked tensor) draws from its own
generator seeded by ``(seed, crc32(name), expert)``, so a tensor does not change when others are
added, reordered or given explicitly. Magnitudes keep activations well scaled through many layers:
linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1) (N(0, 1/D) when the output is tied to
them, so logits stay ~ N(0, 1)), norm weights ~ 1 + N(0, 0.05²), and
routers ~ N(0, (ROUTER_GAIN)²/D) so expert logits spread over several units and top-k choices
are rarely razor-thin.

Data is streamed tensor by tensor (one expert at a time for stacked experts), so writing a
multi-GB random model needs memory for one expert only.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from engine.errors import UsageError
from engine.quant.formats import QType
from engine.synth import specs as S
from engine.synth.encode import TensorPlan, encode, parse_qtype, plan_types
from engine.synth.metadata import write_hparams
from engine.synth.specs import SynthSpec, make_spec, tensor_layout
from engine.synth.tokenizer import Vocab, build_vocab, write_tokenizer

ROUTER_GAIN = 3.0  # router logits ~ N(0, 3²): top-k gaps of order 1, not 1e-5
NORM_JITTER = 0.05
BIAS_STD = 0.1


@dataclass(frozen=True)
class SynthModel:
    """What :func:`write_model` wrote: the file, its geometry, tensor types and vocabulary."""

    path: Path
    spec: SynthSpec
    tensors: tuple[TensorPlan, ...]
    vocab: Vocab
    seed: int

    @property
    def arch(self) -> str:
        return self.spec.arch

    @property
    def fallbacks(self) -> dict[str, tuple[QType, QType]]:
        """{tensor name: (requested type, written type)} for tensors whose rows forced a fallback."""
        return {p.name: (p.requested, p.qtype) for p in self.tensors if p.fell_back}

    def types(self) -> dict[str, QType]:
        """{tensor name: ggml type written}."""
        return {p.name: p.qtype for p in self.tensors}

    def hf_tokenizer(self):
        """The ``tokenizers.Tokenizer`` equivalent of the file's vocabulary (see :class:`Vocab`)."""
        return self.vocab.hf_tokenizer()


def write_model(
    path: str | os.PathLike,
    arch: str,
    *,
    seed: int = 0,
    weight_type: QType | str = "F32",
    type_overrides: Mapping[str, QType | str] | None = None,
    tokenizer: str | Vocab | None = None,
    pre: str | None = None,
    weights: Mapping[str, np.ndarray] | None = None,
    name: str | None = None,
    **geometry,
) -> SynthModel:
    """Write a complete GGUF model of architecture ``arch`` to ``path``.

    arch: ``qwen3moe``, ``qwen2moe``, ``olmoe``, ``llama`` (dense, or Mixtral-style with
        ``experts=E``) or ``qwen3``.
    geometry: :class:`SynthSpec` fields (``layers``, ``hidden``, ``heads``, ``kv_heads``,
        ``head_dim``, ``experts``, ``experts_used``, ``expert_ff``, ``ff``, ``shared_ff``, ``vocab``,
        ``ctx``, ``rope_base``, ``rms_eps``, ``tied_output``, ``qkv_bias``, ``rope_freqs``);
        unspecified ones take tiny per-architecture defaults.
    weight_type: type of every matrix (F32, F16, BF16, Q8_0, Q4_0, Q5_0, Q2_K, Q3_K, Q4_K, Q5_K,
        Q6_K, MXFP4, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S);
        ``type_overrides`` maps glob patterns to types (see :func:`plan_types`).
    tokenizer: ``"bpe"`` (default; ``"spm"`` for ``llama`` and ``gemma3``, ``"harmony"`` — byte-level BPE with
        gpt-oss's specials and chat format — for ``gpt-oss``) and ``pre`` its pre-tokenizer
        (``qwen2`` default, ``llama-bpe``, ``olmo``, ``default``); or a ready :class:`Vocab`
        (e.g. from :func:`~engine.synth.tokenizer.train_bpe_vocab` on a model's own corpus) whose
        length equals the ``vocab`` geometry.
    weights: optional {GGUF tensor name: float array of the tensor's numpy shape} used instead of
        random values (e.g. a trained model being exported); other tensors stay random.
    Returns a :class:`SynthModel` describing the file.
    """
    spec = make_spec(arch, **geometry)
    if isinstance(tokenizer, Vocab):
        if pre is not None:
            raise UsageError("pre applies to a tokenizer kind, not to a ready Vocab")
        if len(tokenizer) != spec.vocab:
            raise UsageError(f"the given vocabulary has {len(tokenizer)} tokens, the geometry says vocab={spec.vocab}")
        vocab = tokenizer
    else:
        kind = {"llama": "spm", "gemma3": "spm", "gpt-oss": "harmony"}.get(arch, "bpe")
        vocab = build_vocab(tokenizer or kind, spec.vocab, pre)
    if len(vocab) != spec.vocab:
        raise AssertionError(f"vocabulary has {len(vocab)} tokens for {spec.vocab} embedding rows")
    plans = plan_types(tensor_layout(spec), weight_type, type_overrides)
    given = dict(weights or {})
    unknown = set(given) - {p.name for p in plans}
    if unknown:
        raise UsageError(f"weights given for tensors the {arch} layout does not have: {sorted(unknown)}")
    for p in plans:
        if p.name in given and tuple(np.shape(given[p.name])) != p.shape:
            raise UsageError(f"weight {p.name!r} has shape {np.shape(given[p.name])}, expected {p.shape}")

    path = Path(path)
    w = GGUFWriter(path, arch)
    write_hparams(w, spec, name=name or f"synthetic {arch}", file_type=parse_qtype(weight_type))
    write_tokenizer(w, vocab)
    for p in plans:
        # Element shape with a non-uint8 dtype: the writer then takes the shape as given.
        w.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes, raw_dtype=p.qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    f = w.fout[0]
    _pad(f, w.data_alignment)
    for p in plans:
        written = 0
        for chunk in _values(p, seed, given.get(p.name), spec.tied_output):
            data = encode(chunk, p.qtype)
            f.write(data.tobytes())
            written += data.nbytes
        assert written == p.nbytes, (p.name, written, p.nbytes)
        _pad(f, w.data_alignment)
    w.close()
    return SynthModel(path, spec, tuple(plans), vocab, seed)


def _pad(f, alignment: int) -> None:
    pos = f.tell()
    f.write(b"\0" * (-pos % alignment))


def _rng(seed: int, name: str, part: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), part])


def _values(p: TensorPlan, seed: int, given: np.ndarray | None, tied: bool) -> Iterator[np.ndarray]:
    """float32 chunks of the tensor's values along its outermost axis (experts one at a time)."""
    d = p.decl
    if given is not None:
        arr = np.asarray(given, dtype=np.float32)
        if d.kind == S.EXPERTS:
            yield from arr
        else:
            yield arr
        return
    if d.kind == S.EXPERTS:
        for e in range(d.shape[0]):
            yield _random(d, _rng(seed, d.name, e), d.shape[1:])
    else:
        yield _random(d, _rng(seed, d.name), d.shape, tied)


def _random(d: S.TensorDecl, rng: np.random.Generator, shape: tuple[int, ...], tied: bool = False) -> np.ndarray:
    """Random values for a tensor of ``d``'s kind; see the module docstring for the scales."""
    fan_in = d.shape[-1]
    if d.kind in (S.NORM,):
        return 1.0 + NORM_JITTER * rng.standard_normal(shape, dtype=np.float32)
    if d.kind == S.BIAS:
        return BIAS_STD * rng.standard_normal(shape, dtype=np.float32)
    if d.kind == S.SINKS:  # sink logits of the order of the scores, so they take a visible share
        return rng.standard_normal(shape, dtype=np.float32)
    if d.kind == S.SSM_A:  # −exp(A_log): a decay per head
        return -np.exp(0.5 * rng.standard_normal(shape, dtype=np.float32))
    if d.kind == S.ROPE_FREQS:
        # Llama-3-style factors: 1 for high frequencies rising to a few for the lowest ones.
        return np.linspace(1.0, 4.0, shape[0], dtype=np.float32)
    if d.kind == S.EMBEDDING and not tied:
        return rng.standard_normal(shape, dtype=np.float32)
    gain = ROUTER_GAIN if d.kind == S.ROUTER else 1.0
    std = np.float32(gain / np.sqrt(fan_in))
    return std * rng.standard_normal(shape, dtype=np.float32)
