"""The C-callable wrapper of ``engine.kernels.moe_host.run_layer`` (compiled when this module is
imported: ``moe_host.node_address`` imports it on first use)."""

import numpy as np
from numba import carray, cfunc, types

from engine.kernels.moe_host import N_FIELDS, run_layer


@cfunc(types.void(types.voidptr), nopython=True)
def node(p):
    """void node(void* descriptor): ``run_layer`` on the int64 [N_FIELDS] descriptor at ``p``."""
    run_layer(carray(p, (N_FIELDS,), np.int64))
