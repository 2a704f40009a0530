"""DeviceProfile: the machine as the planner sees it — VRAM, reserve, scratch, link bandwidths.

Bandwidths are *effective* rates (bytes a kernel or copy actually moves per second, not the
datasheet peak). Unmeasured ones take the documented defaults below; a profile built from
measurements lists the measured fields in ``measured`` so the UI can say which numbers are guesses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from engine.plan.sizing import PlanError

MiB = 1 << 20
GiB = 1 << 30

# Defaults when nothing is measured (see docs/planner.md for where they come from).
DEFAULT_VRAM = 12 * GiB  # the target card class
DEFAULT_RESERVE = 512 * MiB  # CUDA context, cuBLAS workspace, allocator slack
DEFAULT_CPU_EXPERT_GBPS = 20.0  # host reading quantized weights while computing (DDR4/DDR5 desktop)
DEFAULT_H2D_GBPS = 22.0  # PCIe 4.0 x16, expert-sized copies
DEFAULT_DEVICE_GBPS = 400.0  # GDDR6X mid-range card, effective
DEFAULT_SYNC_US = 10.0  # one host↔device round trip (launch + synchronise + small copy)
# Zipf exponent of expert popularity used by the hit-rate model. 0.8 in the static hottest-n
# formula reproduces an LRU cache (Che approximation) on a Zipf(1.0) stream, which is what the
# published hit-rate anchors fit; see costmodel.hit_rate.
DEFAULT_SKEW = 0.8

_GBPS_FIELDS = ("cpu_expert_gbps", "h2d_gbps", "device_gbps")


@dataclass(frozen=True)
class DeviceProfile:
    """One device plus its host, for planning.

    vram_bytes: total device memory SharpI may use (the "VRAM budget" slider).
    reserve_bytes: part of it never available to tensors (context, workspaces, slack).
    scratch_bytes: activation scratch; ``None`` = estimate from the model and context
        (:func:`engine.plan.sizing.scratch_estimate`).
    cpu_expert_gbps: host GB/s (1e9 B/s) for weights computed on the CPU (experts, host layers).
    h2d_gbps: host→device copy GB/s (expert uploads on cache misses).
    device_gbps: device memory GB/s (trunk, KV and cached experts read per token).
    sync_us: cost of one host↔device crossing in microseconds.
    expert_skew: Zipf exponent of expert popularity (0 = uniform) for the cache hit-rate model.
    measured: names of the fields above that were measured rather than defaulted.
    """

    vram_bytes: int = DEFAULT_VRAM
    reserve_bytes: int = DEFAULT_RESERVE
    scratch_bytes: int | None = None
    cpu_expert_gbps: float = DEFAULT_CPU_EXPERT_GBPS
    h2d_gbps: float = DEFAULT_H2D_GBPS
    device_gbps: float = DEFAULT_DEVICE_GBPS
    sync_us: float = DEFAULT_SYNC_US
    expert_skew: float = DEFAULT_SKEW
    measured: tuple[str, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        for f in ("vram_bytes", "reserve_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise PlanError(f"profile {f} must be a non-negative integer, got {v!r}")
        if self.scratch_bytes is not None and (not isinstance(self.scratch_bytes, int) or self.scratch_bytes < 0):
            raise PlanError(f"profile scratch_bytes must be a non-negative integer or None, got {self.scratch_bytes!r}")
        for f in _GBPS_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise PlanError(f"profile {f} must be a positive number, got {v!r}")
        if not 0 <= self.sync_us < 1e6:
            raise PlanError(f"profile sync_us must be in [0, 1e6), got {self.sync_us!r}")
        if not 0 <= self.expert_skew <= 4:
            raise PlanError(f"profile expert_skew must be in [0, 4], got {self.expert_skew!r}")
        known = {f.name for f in fields(self)}
        bad = [m for m in self.measured if m not in known]
        if bad:
            raise PlanError(f"profile measured names unknown fields {bad}")

    def with_budget(self, vram_bytes: int) -> DeviceProfile:
        """The same machine with another VRAM budget (what the slider changes)."""
        return replace(self, vram_bytes=vram_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["measured"] = list(self.measured)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceProfile:
        """Inverse of :meth:`to_dict`; unknown keys are a :class:`PlanError` (typos must not pass)."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise PlanError(f"unknown device profile keys {sorted(unknown)} (known: {sorted(known)})")
        kw = dict(d)
        if "measured" in kw:
            kw["measured"] = tuple(kw["measured"])
        return cls(**kw)
