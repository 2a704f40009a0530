"""Byte sizes as people type them: ``512MiB``, ``12GiB``, ``12GB``, ``1.5 GiB``, ``4096``.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (kB, MB, GB, TB) powers of
1000, a bare number is bytes. Unit letters are case-insensitive; a lone ``K``/``M``/``G``/``T``
is refused because it is ambiguous (is ``12G`` 12 GB or 12 GiB?).
"""

from __future__ import annotations

import re

from engine.errors import UsageError

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}

_SIZE_RE = re.compile(r"^\s*([-+]?)(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` (``"12GiB"`` → 12884901888); :class:`UsageError` if malformed or negative.

    Fractions are allowed and rounded down to a whole byte (``"1.5KiB"`` → 1536).
    """
    if isinstance(text, bool):
        raise UsageError(f"invalid size {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"size {text} is negative")
        return text
    m = _SIZE_RE.match(str(text))
    if m is None:
        raise UsageError(
            f"invalid size {text!r}: expected a non-negative number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, kB, MB, GB, TB), e.g. 512MiB or 12GiB"
        )
    sign, number, unit = m.groups()
    if sign == "-":
        raise UsageError(f"invalid size {text!r}: a size cannot be negative")
    scale = _UNITS.get(unit.lower())
    if scale is None and unit.lower() in ("k", "m", "g", "t"):
        raise UsageError(
            f"invalid size {text!r}: {unit!r} is ambiguous, write {number}{unit.upper()}iB or {number}{unit.upper()}B"
        )
    if scale is None:
        raise UsageError(f"invalid size {text!r}: unknown unit {unit!r} (use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB)")
    # Integer arithmetic on the digits, so "1.1GB" is exactly 1100000000 bytes.
    whole, _, frac = number.partition(".")
    value = int(whole or 0) * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)
    if value > 1 << 60:
        raise UsageError(f"size {text!r} is implausibly large")
    return value


def format_size(n: int | float) -> str:
    """``12884901888`` → ``"12.00 GiB"``; binary units, two decimals above a KiB."""
    sign = "-" if n < 0 else ""
    v = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{sign}{v:.0f} {unit}" if unit == "B" else f"{sign}{v:.2f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")
