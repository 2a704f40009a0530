"""One token's routed experts of one MoE layer on the CPU, as a C function over raw pointers: the host
node of a whole-token decode CUDA graph (``engine.runtime.graph_decode``).

:func:`run_layer` reads a descriptor (int64 [:data:`N_FIELDS`]: the fields below) that holds the
addresses of the layer's prepared gate/up/down stacks (``PreparedWeight.raw`` and ``.scales``, C-order,
kept alive by the caller) and of the token's hand-over in pinned memory — the normed row h float32
[D], the routing weights float32 [K], the expert ids int64 [K] — and writes y float32 [D] =
Σ_k weights[k]·down[ids[k]](SiLU(gate[ids[k]]·h) ⊙ up[ids[k]]·h) with the fused q8 kernels of
``engine.kernels.moe_fused``: the same calls, in the same order, as ``engine.kernels.moe.moe_ffn``
(so the same float32 result). Ids outside [0, E) make y zero and set ``STATUS`` to 1 (0 otherwise).

:func:`run_layer` is not cached on disk: numba's cache of a function that calls parallel kernels crashed on
reload (a segfault in the reloaded code, numba 0.68). ``engine.kernels.moe_host_node.node_address`` compiles
the C wrapper a CUDA host node calls.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from engine.kernels.moe_fused import FUSED_TYPES, moe_down_q8, moe_gate_up_q8, quantize_for

# Descriptor fields (int64 each). Stacks: *_RAW the address of uint8 [E·rows, *_RB] (row bytes),
# *_SC the address of float32 [E·rows, *_NS] (scales per row).
(QT_GU, QT_DOWN, F, D, K, E, G_RAW, G_RB, G_SC, G_NS, U_RAW, U_RB, U_SC, U_NS,
 D_RAW, D_RB, D_SC, D_NS, H, WEIGHTS, IDS, Y, STATUS) = range(23)  # fmt: skip
N_FIELDS = 23


@intrinsic
def _ptr(typingctx, addr):
    """An int64 address as a ``void*`` (for ``numba.carray``)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(addr), codegen


@njit(nogil=True)
def run_layer(d):
    """The experts of one token for descriptor ``d`` (int64 [N_FIELDS]); see the module docstring."""
    qt, qt_down = d[QT_GU], d[QT_DOWN]
    nf, nd, nk, ne = d[F], d[D], d[K], d[E]
    ids = carray(_ptr(d[IDS]), (nk,), np.int64)
    y = carray(_ptr(d[Y]), (nd,), np.float32)
    for k in range(nk):
        if ids[k] < 0 or ids[k] >= ne:
            y[:] = 0.0
            d[STATUS] = 1
            return
    graw = carray(_ptr(d[G_RAW]), (ne * nf, d[G_RB]), np.uint8)
    gs = carray(_ptr(d[G_SC]), (ne * nf, d[G_NS]), np.float32)
    uraw = carray(_ptr(d[U_RAW]), (ne * nf, d[U_RB]), np.uint8)
    us = carray(_ptr(d[U_SC]), (ne * nf, d[U_NS]), np.float32)
    draw = carray(_ptr(d[D_RAW]), (ne * nd, d[D_RB]), np.uint8)
    ds = carray(_ptr(d[D_SC]), (ne * nd, d[D_NS]), np.float32)
    x = carray(_ptr(d[H]), (1, nd), np.float32)
    w = carray(_ptr(d[WEIGHTS]), (nk,), np.float32)
    qa, da, asum, bsums = quantize_for(qt, x)
    _, qa2, da2, asum2, bsums2 = moe_gate_up_q8(qt, graw, gs, uraw, us, ids, qa, da, asum, bsums, nf, qt_down)
    y[:] = moe_down_q8(qt_down, draw, ds, ids, w, qa2, da2, asum2, bsums2, nd)
    d[STATUS] = 0


def applies(stacks, q8_act: bool) -> bool:
    """Whether a layer's stacks (``ExpertStacks``) run here: q8 activations, one quantized type for gate
    and up, every type fused, C-contiguous arrays."""
    g, u, dn = stacks.gate, stacks.up, stacks.down
    arrays = (g.raw, g.scales, u.raw, u.scales, dn.raw, dn.scales)
    return (
        q8_act
        and g.qtype == u.qtype
        and g.qtype in FUSED_TYPES
        and dn.qtype in FUSED_TYPES
        and g.raw.dtype == np.uint8
        and dn.raw.dtype == np.uint8
        and all(a.ndim == 2 and a.flags.c_contiguous for a in arrays)
        and g.scales.dtype == np.float32
        and dn.scales.dtype == np.float32
    )


def descriptor(stacks, h: np.ndarray, weights: np.ndarray, ids: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The descriptor for one layer: ``stacks`` (``applies``), the hand-over arrays h float32 [D] (or
    [1, D]), weights float32 [K], ids int64 [K] and the output y float32 [D] (all C-contiguous, kept
    alive by the caller as long as the descriptor is used)."""
    g, u, dn = stacks.gate, stacks.up, stacks.down
    for a, dt in ((h, np.float32), (weights, np.float32), (ids, np.int64), (y, np.float32)):
        if a.dtype != dt or not a.flags.c_contiguous:
            raise ValueError(f"hand-over array {a.dtype} {a.shape} must be C-contiguous {np.dtype(dt)}")
    n_e, nf, nd = g.n_experts, g.rows, dn.rows
    if ids.size != weights.size or h.size != nd or y.size != nd or dn.shape != (n_e, nd, nf):
        raise ValueError(f"stacks {g.shape}, {dn.shape} do not fit h {h.shape}, ids {ids.shape}, y {y.shape}")
    d = np.zeros(N_FIELDS, np.int64)
    d[QT_GU], d[QT_DOWN], d[F], d[D], d[K], d[E] = int(g.qtype), int(dn.qtype), nf, nd, ids.size, n_e
    for base, p in ((G_RAW, g), (U_RAW, u), (D_RAW, dn)):
        d[base], d[base + 1] = p.raw.ctypes.data, p.raw.shape[1]
        d[base + 2], d[base + 3] = p.scales.ctypes.data, p.scales.shape[1]
    d[H], d[WEIGHTS], d[IDS], d[Y] = h.ctypes.data, weights.ctypes.data, ids.ctypes.data, y.ctypes.data
    return d
