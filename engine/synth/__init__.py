"""Synthetic GGUF models: random-weight files of every architecture and weight type that
llama.cpp loads, and geometry-only files of real model shapes (header + sparse data hole).

Public API::

    write_model(path, arch, *, seed, weight_type, type_overrides, tokenizer, pre, weights,
                **geometry) -> SynthModel
    make_spec(arch, **geometry) -> SynthSpec
    build_vocab(kind, size, pre) -> Vocab
"""

from engine.synth.specs import ARCHS, SynthSpec, make_spec, tensor_layout
from engine.synth.tokenizer import Vocab, build_vocab
from engine.synth.writer import SynthModel, write_model

__all__ = ["ARCHS", "SynthModel", "SynthSpec", "Vocab", "build_vocab", "make_spec", "tensor_layout", "write_model"]
