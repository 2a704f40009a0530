"""How many threads numba's parallel loops (the CPU experts, the host layers) run with under a placement.

A CUDA placement whose device holds experts (the expert cache, a resident split) leaves ``cores // 8`` cores free
(two of 16): the cache's upload worker and the CUDA driver's threads run beside the decode, and a parallel loop
that shares a core with them waits at its barrier for a descheduled worker. Measured on an H200 box with 16 Xeon
cores, 2026-11-28 (docs/benchmarks.md, "Two cores left to the driver"): the 12 GiB resident split decoded 77.7
tok/s at 14 threads against 60.2 at 16, the expert cache under a replayed routing trace 57.1 against 47.6.
With every routed expert on the CPU (``--moe cpu``) nothing runs behind the step, and since the OpenMP workers
spin between layers (``engine.config.gomp_spincount``) every core is faster: 42.4 tok/s at 16 threads against
38.5 at 14, interleaved in one job (docs/benchmarks.md, "`--moe cpu` on every core"). A placement wholly on the
CPU, or on the simulated device, uses every core. ``EngineOptions.host_threads`` (``SHARPI_HOST_THREADS``,
``-t``) overrides the rule.
"""

from __future__ import annotations

import os

from engine.config import EngineOptions


def host_threads(
    options: EngineOptions, device_experts: bool, cores: int | None = None, most: int | None = None
) -> int:
    """The thread count for a placement: ``options.host_threads`` when set, else every core less
    ``cores // 8`` on a CUDA placement whose device holds experts (``device_experts``), every core otherwise;
    at most ``most`` (numba's pool size)."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    n = options.host_threads if options.host_threads is not None else cores - (cores // 8 if device_experts else 0)
    return max(1, min(n, most if most is not None else n))


def use_host_threads(n: int) -> None:
    """Run the calling thread's numba loops on ``n`` threads (numba's count is per calling thread)."""
    import numba

    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
