"""Whether a GGUF file can run on this machine, decided from its header and the disk before any
weight is read: the app and ``sharpi run`` refuse a file with the reason instead of spending
minutes and all the RAM on one that cannot answer.

Two refusals:

- **no weights**: a geometry-only file (``sharpi synth --geometry``, ``engine.synth.geometry``) has a
  real header and tensor table but its data region is a hole: the file is sparse, its blocks on disk
  a small part of its size. It is for ``sharpi plan`` and ``sharpi inspect``, not for chatting.
- **too large**: its tensors need more memory than the machine's RAM and GPU memory together.

    reason = refusal("model.gguf")   # "" when it may load
"""

from __future__ import annotations

import os
from pathlib import Path

SPARSE_FRACTION = 0.5  # a file whose blocks on disk cover less than this part of its data has none
SPARSE_MIN_HOLE = 64 << 20  # smaller differences are file-system rounding, not a missing data region


def disk_bytes(path: str | os.PathLike) -> int | None:
    """Bytes the file occupies on disk (None where the platform does not say)."""
    st = os.stat(path)
    blocks = getattr(st, "st_blocks", None)
    return None if blocks is None else blocks * 512


def is_weightless(path: str | os.PathLike, data_bytes: int) -> bool:
    """Whether the ``data_bytes`` of tensor data the header declares are (mostly) a hole on disk."""
    on_disk = disk_bytes(path)
    if on_disk is None or data_bytes <= 0:
        return False
    return on_disk < SPARSE_FRACTION * data_bytes and data_bytes - on_disk > SPARSE_MIN_HOLE


def ram_bytes() -> int | None:
    """The machine's physical memory (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def gpu_bytes() -> int:
    """The CUDA device's memory, 0 without one."""
    try:
        import torch

        return torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0
    except Exception:  # a broken driver is a machine without a usable GPU here
        return 0


def _gib(n: int) -> str:
    from engine.plan.units import format_size

    return format_size(n)


NO_WEIGHTS = "no weights (a geometry-only file)"
TOO_LARGE = "more than RAM + GPU memory"


def check(path: str | os.PathLike, ram: int | None = None, vram: int | None = None) -> tuple[str, str]:
    """(kind, reason) why ``path`` cannot run here — kind :data:`NO_WEIGHTS` or :data:`TOO_LARGE`, the
    reason in full — or ("", "") if it may. ``ram`` / ``vram`` default to this machine's. Reads the
    header only."""
    from engine.gguf import open_gguf
    from engine.modelinfo import describe

    with open_gguf(path) as gf:
        info = describe(gf)
    name = Path(path).name
    data = info.trunk_bytes + info.expert_bytes
    if is_weightless(path, data):
        return NO_WEIGHTS, (
            f"{name} holds the shapes of a model but no weights: a geometry-only file, whose "
            f"{_gib(data)} of tensor data are a hole on disk ({_gib(disk_bytes(path) or 0)} stored). "
            'There is nothing to run; the commands "sharpi plan" and "sharpi inspect" read such files.'
        )
    ram = ram_bytes() if ram is None else ram
    vram = gpu_bytes() if vram is None else vram
    if ram is not None and data > ram + vram:
        gpu = f" and {_gib(vram)} of GPU memory" if vram else " and no GPU"
        return TOO_LARGE, (
            f"{name} needs {_gib(data)} for its weights; this machine has {_gib(ram)} of RAM{gpu}. "
            "It cannot run here: a smaller quantization of the model may."
        )
    return "", ""


def refusal(path: str | os.PathLike, ram: int | None = None, vram: int | None = None) -> str:
    """Why ``path`` cannot run here ("" if it may): no weights, or more than RAM + GPU memory."""
    return check(path, ram, vram)[1]
