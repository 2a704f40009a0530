"""Architectures: one module per ``general.architecture``, resolved by name.

Each module defines ``ARCH``, a frozen ``Args`` (``Args.from_gguf(gf)``) and
``tensor_specs(args) -> list[TensorSpec]``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from engine.errors import UnsupportedArchitectureError
from engine.gguf.reader import GGUFFile
from engine.models.args import ModelArgs
from engine.models.tensors import TensorSpec, validate_tensors

SUPPORTED_ARCHITECTURES = (
    "gemma3",
    "glm4moe",
    "gpt-oss",
    "llama",
    "olmoe",
    "qwen2moe",
    "qwen3",
    "qwen3moe",
    "qwen35",
    "qwen35moe",
    "qwen3next",
)


def arch_module(arch: str) -> ModuleType:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return importlib.import_module(f"engine.models.{arch.replace('-', '_')}")  # gpt-oss: engine.models.gpt_oss


def read_args(gf: GGUFFile) -> ModelArgs:
    """The architecture's hyperparameters; raises for an unsupported or inconsistent file."""
    try:
        mod = arch_module(gf.architecture)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(str(e), gf.path) from None
    return mod.Args.from_gguf(gf)


def model_tensor_specs(args: ModelArgs) -> list[TensorSpec]:
    return arch_module(args.arch).tensor_specs(args)


def check_model_file(gf: GGUFFile) -> tuple[ModelArgs, list[TensorSpec]]:
    """Read args, check every tensor's presence, shape and type: what a loader needs up front."""
    args = read_args(gf)
    specs = model_tensor_specs(args)
    validate_tensors(gf, specs)
    gf.check_weight_types()
    return args, specs


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelArgs",
    "TensorSpec",
    "arch_module",
    "check_model_file",
    "model_tensor_specs",
    "read_args",
]


def build_model(gf: GGUFFile, *, q8_act: bool = True, experts=None, copy_weights: bool = True):
    """Check the file and build its architecture's :class:`~engine.models.base.DecoderModel`.
    ``copy_weights``: host matrices copied out of the map (False: they stay mapped, page-cache backed)."""
    from engine.models.weights import Weights

    args, _ = check_model_file(gf)
    return arch_module(args.arch).Model(Weights(gf, q8_act=q8_act, resident=copy_weights), args, experts)
