"""The C-callable wrapper of ``engine.kernels.moe_host.run_layer``: ``void node(void* descriptor)``, what a CUDA
host node calls (``cuLaunchHostFunc``: on the driver's callback thread, without the GIL; nothing in it touches
Python or CUDA).

:func:`node_address` compiles it on first use only (5–9 s on 2 cores, not cached: see ``moe_host``), so
importing this module costs nothing and the CPU-only engine never pays for it. The callback thread runs
numba's parallel loops with numba's default thread count (``NUMBA_NUM_THREADS``), not a count another
thread set.
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc, types

from engine.kernels.moe_host import N_FIELDS, run_layer

_NODE = None


def _node(p):
    run_layer(carray(p, (N_FIELDS,), np.int64))


def node_address() -> int:
    """The address of ``void node(void* descriptor)``, which runs ``run_layer`` (compiled on first call)."""
    global _NODE
    if _NODE is None:
        from numba.np.ufunc import parallel

        # numba starts its thread pool when a parallel dispatcher first runs; the node runs parallel loops
        # without going through one, so the pool is started here.
        parallel._launch_threads()
        _NODE = cfunc(types.void(types.voidptr), nopython=True)(_node)
    return _NODE.address
