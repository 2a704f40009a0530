"""The KV cache's row format, as data both the planner and the cache read: dtype names, bytes per
row, the q8_0 block rule. Pure (no torch): ``engine.plan`` prices KV with it and
``engine.kv_cache`` allocates with it, so the two cannot drift.
"""

from __future__ import annotations

from engine.config import KV_ALIASES, KV_TYPES
from engine.errors import PlanError
from engine.quant.formats import QType, block_format, tensor_bytes

__all__ = [
    "HOST_KV_TYPE",
    "KV_TYPES",
    "check_kv_geometry",
    "check_kv_type",
    "kv_layer_bytes",
    "kv_row_bytes",
    "kv_rows",
    "resolve_kv_type",
]

_KV_QTYPE = {"f32": QType.F32, "bf16": QType.BF16, "q8_0": QType.Q8_0}
HOST_KV_TYPE = "f32"  # host-resident layers keep an f32 cache (narrowing KV is a device saving)


def check_kv_type(kv_type: str) -> QType:
    """The ggml type of a KV cache dtype name; :class:`PlanError` for an unknown one."""
    try:
        return _KV_QTYPE[kv_type]
    except KeyError:
        raise PlanError(f"unknown KV type {kv_type!r} (choose one of: {', '.join(KV_TYPES)})") from None


def check_kv_geometry(kv_type: str, kv_dim: int) -> None:
    """A q8_0 cache quantizes each K/V row in blocks of 32: the row width must divide."""
    block = block_format(check_kv_type(kv_type)).block_size
    if kv_dim % block:
        raise PlanError(
            f"--kv-type {kv_type} needs the KV width (kv_heads × head_dim = {kv_dim}) to be a multiple of "
            f"{block} for device-resident layers; use bf16 or f32, or -g 0"
        )


def kv_row_bytes(kv_type: str, kv_dim: int) -> int:
    """Bytes of one position's K (or V) row of width ``kv_dim`` (f32 4 B/elem, bf16 2, q8_0 34/32)."""
    check_kv_geometry(kv_type, kv_dim)
    return tensor_bytes(check_kv_type(kv_type), (kv_dim,))


def kv_layer_bytes(kv_type: str, kv_dim: int, ctx: int) -> int:
    """One layer's cache: K and V, each ``[ctx, kv_dim]`` of ``kv_type``."""
    return 2 * ctx * kv_row_bytes(kv_type, kv_dim)


# Rows a sliding-window layer's cache keeps beyond its window: positions a new prompt (a regenerated reply) or a
# verify pass's roll-back may step back over while the window before them stays in the ring.
KV_WINDOW_SLACK = 256


def kv_rows(ctx: int, window: int = 0) -> int:
    """Positions one layer's cache holds at context ``ctx``: all of them, or for a layer attending to the last
    ``window`` positions only (sliding-window attention), its window and :data:`KV_WINDOW_SLACK` in a ring."""
    return min(ctx, window + KV_WINDOW_SLACK) if window > 0 else ctx


# The cache dtype when nothing asks for one: bf16 halves f32's bytes (memory and decode reads; llama.cpp's default
# is f16, the same size) with f32's exponent range, so no key or value overflows. Exact comparisons ask for f32.
DEFAULT_KV_TYPE = "bf16"


def resolve_kv_type(kv_type: str | None = None, default: str | None = None) -> str:
    """``--kv-type`` if given, else ``default`` (``EngineOptions.kv_type``: ``SHARPI_KV_DTYPE``), else
    ``DEFAULT_KV_TYPE``; checked."""
    value = (kv_type or default or DEFAULT_KV_TYPE).lower()
    value = KV_ALIASES.get(value, value)  # the spellings SHARPI_KV_DTYPE accepts
    check_kv_type(value)
    return value
