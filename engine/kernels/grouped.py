"""Routed experts for a batch of tokens, grouped by expert (prefill, speculative verification).

Per token, the K chosen experts' gate/up/down rows are read once per token; for a batch of T
tokens that re-reads each selected expert up to T times. Here the (token, slot) pairs of the batch
are bucketed by expert (CSR: ``offsets`` [E+1], ``pairs`` [T·K] sorted by expert, token-major
within an expert), and every selected expert runs once over all its tokens: each weight row is
decoded once per four tokens (the ``_dot4_*`` row kernels of ``kquants``/``legacy``).

The result is bit-identical to :func:`engine.kernels.moe.moe_ffn` called token by token: the same
row dot products (one-token and four-token kernels agree bit for bit), the same SiLU expression,
h quantized row by row exactly as there, and the weighted sum taken per token in top-k order.

Public entry points::

    bucket_by_expert(ids int64 [T, K], n_experts) -> (offsets int64 [E+1], pairs int64 [T·K])
    grouped_moe_ffn(gate, up, down, X [T, D], ids [T, K], weights [T, K], *, q8_act, skip=None) -> [T, D]

``skip`` (bool [T, K]) leaves pairs out: they are bucketed apart, never computed, and add nothing —
the expert cache's host half of a prompt, whose other pairs run on the device.

with numpy references ``bucket_by_expert_ref`` and ``grouped_moe_ffn_ref`` beside them.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from engine.kernels import bf16, scratch
from engine.kernels.iquants import dot4_q8 as _dot4_iq_q8
from engine.kernels.kquants import (
    _dot4_iq4_xs_q8,
    _dot4_q2_k_q8,
    _dot4_q3_k_q8,
    _dot4_q4_k_q8,
    _dot4_q5_k_q8,
    _dot4_q6_k_q8,
)
from engine.kernels.legacy import _dot4_iq4_nl_q8, _dot4_mxfp4_q8, _dot4_q4_0_q8, _dot4_q5_0_q8, _dot4_q8_0_q8
from engine.kernels.moe_fused import FUSED_TYPES, _row_q8, quantize_for
from engine.kernels.prepare import PreparedWeight

ROW_CHUNK = 16  # weight rows per parallel work item
GROUP_CHUNKS = 16  # consecutive work items on one expert


# --- CSR bucketing ----------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def bucket_by_expert(ids, n_experts):
    """(token, slot) pairs grouped by expert.

    ids int64 [T, K] -> (offsets int64 [E+1], pairs int64 [T·K]): the pairs p = t·K + k routed to
    expert e are ``pairs[offsets[e]:offsets[e+1]]``, in increasing p (token-major).
    """
    T, K = ids.shape
    offsets = np.zeros(n_experts + 1, np.int64)
    for t in range(T):
        for k in range(K):
            offsets[ids[t, k] + 1] += 1
    for e in range(n_experts):
        offsets[e + 1] += offsets[e]
    fill = offsets[:-1].copy()
    pairs = np.empty(T * K, np.int64)
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            pairs[fill[e]] = t * K + k
            fill[e] += 1
    return offsets, pairs


def bucket_by_expert_ref(ids: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference of :func:`bucket_by_expert` (a stable sort of the flattened ids)."""
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    pairs = np.argsort(flat, kind="stable").astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=n_experts))]).astype(np.int64)
    return offsets, pairs


# --- fused q8 kernels over expert groups ------------------------------------------------------


@njit(cache=True, nogil=True, parallel=True)
def quantize_rows(qt, X):
    """``moe_fused.quantize_for(qt, X)`` with blocks of rows in parallel (bit-identical: rows are
    quantized independently). X float32 [T, n] (T ≥ 1) -> (qa, da, asum, bsums)."""
    T, n = X.shape
    first = quantize_for(qt, X[:1])  # the widths of the format's arrays
    qa = np.empty((T, n), np.int8)
    da = np.empty((T, first[1].shape[1]), np.float32)
    asum = np.empty((T, first[2].shape[1]), np.int32)
    bsums = np.empty((T, first[3].shape[1]), np.int16)
    nb = min(T, 64)
    for b in prange(nb):
        r0, r1 = b * T // nb, (b + 1) * T // nb
        a = quantize_for(qt, X[r0:r1])
        qa[r0:r1] = a[0]
        da[r0:r1] = a[1]
        asum[r0:r1] = a[2]
        bsums[r0:r1] = a[3]
    return qa, da, asum, bsums


@njit(cache=True, nogil=True, inline="always")
def _row4_q8(qt, w, s, qa, da, asum, bsums, k):
    """One weight row of ggml type ``qt`` against activation rows k..k+3 -> 4 float32."""
    if qt == 12:
        return _dot4_q4_k_q8(w, s, qa, da, bsums, k)
    if qt == 13:
        return _dot4_q5_k_q8(w, s, qa, da, bsums, k)
    if qt == 14:
        return _dot4_q6_k_q8(w, s, qa, da, bsums, k)
    if qt == 11:
        return _dot4_q3_k_q8(w, s, qa, da, bsums, k)
    if qt == 10:
        return _dot4_q2_k_q8(w, s, qa, da, bsums, k)
    if qt == 8:
        return _dot4_q8_0_q8(w, s, qa, da, asum, k)
    if qt == 2:
        return _dot4_q4_0_q8(w, s, qa, da, asum, k)
    if qt == 6:
        return _dot4_q5_0_q8(w, s, qa, da, asum, k)
    if qt == 39:
        return _dot4_mxfp4_q8(w, s, qa, da, asum, k)
    if qt == 20:
        return _dot4_iq4_nl_q8(w, s, qa, da, asum, k)
    if qt == 23:
        return _dot4_iq4_xs_q8(w, s, qa, da, bsums, k)
    if qt == 16 or qt == 17 or qt == 18 or qt == 21 or qt == 22:  # the IQ2/IQ3 grid types
        return _dot4_iq_q8(qt, w, s, qa, da, k)
    nan = np.float32(np.nan)
    return nan, nan, nan, nan


@njit(cache=True, nogil=True)
def _gather_rows(a, src):
    """a [N, m] -> a[src] [len(src), m] (also for m = 0)."""
    out = np.empty((src.shape[0], a.shape[1]), a.dtype)
    for i in range(src.shape[0]):
        out[i] = a[src[i]]
    return out


@njit(cache=True, nogil=True)
def _work_items(offsets, rows, skip):
    """(active experts int64 [A], row chunks per expert) for a matrix of ``rows`` rows: experts with
    tokens and not ``skip[e]``; the chunk count is rounded up to whole groups of GROUP_CHUNKS
    (chunks past the rows are empty)."""
    E = offsets.shape[0] - 1
    n = 0
    for e in range(E):
        if offsets[e + 1] > offsets[e] and not skip[e]:
            n += 1
    active = np.empty(n, np.int64)
    n = 0
    for e in range(E):
        if offsets[e + 1] > offsets[e] and not skip[e]:
            active[n] = e
            n += 1
    nch = (rows + ROW_CHUNK - 1) // ROW_CHUNK
    return active, (nch + GROUP_CHUNKS - 1) // GROUP_CHUNKS * GROUP_CHUNKS


@njit(cache=True, nogil=True, inline="always")
def _item(item, active, nch):
    """Work item -> (expert, row chunk). Items run in groups of GROUP_CHUNKS chunks of one expert
    (its tokens' activations stay in L2 across the group), and each run of A groups visits every
    active expert once, so the contiguous item ranges a static schedule gives each thread carry
    near-equal work however unevenly the tokens are routed."""
    i = np.int64(item)
    per_group = np.int64(active.shape[0] * GROUP_CHUNKS)
    g = i // per_group
    a = (i - g * per_group) // GROUP_CHUNKS
    c = g * GROUP_CHUNKS + i % GROUP_CHUNKS
    return active[a], c


@njit(cache=True, nogil=True, parallel=True)
def grouped_gate_up_q8(qt, graw, gs, uraw, us, offsets, pairs, K, qa, da, asum, bsums, F, qt_down, skip):
    """h[p] = SiLU(gate[e]·x_t) ⊙ (up[e]·x_t) for every pair p = t·K + k routed to expert e.

    graw/uraw uint8 [E·F, row_bytes] (one type ``qt``), gs/us their scales; (offsets, pairs) from
    :func:`bucket_by_expert`; (qa, da, asum, bsums) the T tokens' quantized activations; experts
    with ``skip[e]`` (uint8 [E]) are left out (their rows of h are undefined).
    Returns h's four activation arrays for type ``qt_down``, rows in ``pairs`` order [T·K, F].
    """
    P = pairs.shape[0]
    src = np.empty(P, np.int64)
    for i in range(P):
        src[i] = pairs[i] // K
    sqa = _gather_rows(qa, src)  # [P, D]: expert groups are contiguous rows
    sda = _gather_rows(da, src)
    sas = _gather_rows(asum, src)
    sbs = _gather_rows(bsums, src)
    h = np.empty((P, F), np.float32)
    active, nch = _work_items(offsets, F, skip)
    A = active.shape[0]
    for item in prange(A * nch):
        e, c = _item(item, active, nch)
        p0 = offsets[e]
        n = offsets[e + 1] - p0
        n4 = n - n % 4
        r0, r1 = c * ROW_CHUNK, min(F, (c + 1) * ROW_CHUNK)
        for j in range(0, n4, 4):  # four tokens × the chunk's rows: both stay in L1
            for r in range(r0, r1):
                gr = e * F + r
                g0, g1, g2, g3 = _row4_q8(qt, graw[gr], gs[gr], sqa, sda, sas, sbs, p0 + j)
                u0, u1, u2, u3 = _row4_q8(qt, uraw[gr], us[gr], sqa, sda, sas, sbs, p0 + j)
                h[p0 + j, r] = g0 / (np.float32(1.0) + np.exp(-g0)) * u0
                h[p0 + j + 1, r] = g1 / (np.float32(1.0) + np.exp(-g1)) * u1
                h[p0 + j + 2, r] = g2 / (np.float32(1.0) + np.exp(-g2)) * u2
                h[p0 + j + 3, r] = g3 / (np.float32(1.0) + np.exp(-g3)) * u3
        for r in range(r0, r1):
            gr = e * F + r
            for j in range(n4, n):
                p = p0 + j
                g = _row_q8(qt, graw[gr], gs[gr], sqa[p], sda[p], sas[p], sbs[p])
                u = _row_q8(qt, uraw[gr], us[gr], sqa[p], sda[p], sas[p], sbs[p])
                h[p, r] = g / (np.float32(1.0) + np.exp(-g)) * u
    return quantize_rows(qt_down, h)


@njit(cache=True, nogil=True, parallel=True)
def grouped_down_q8(qt, draw, ds, offsets, pairs, qa, da, asum, bsums, D, o, skip):
    """o[t·K + k] = down[ids[t, k]]·h[t·K + k] for the pairs of experts not ``skip``ped.

    draw uint8 [E·D, row_bytes]; (qa, da, asum, bsums) the quantized h in ``pairs`` order [T·K, F]
    (from :func:`grouped_gate_up_q8`); o float32 [T·K, D], written in place.
    """
    active, nch = _work_items(offsets, D, skip)
    A = active.shape[0]
    for item in prange(A * nch):
        e, c = _item(item, active, nch)
        p0 = offsets[e]
        n = offsets[e + 1] - p0
        n4 = n - n % 4
        d0, d1 = c * ROW_CHUNK, min(D, (c + 1) * ROW_CHUNK)
        for j in range(0, n4, 4):  # four pairs × the chunk's rows: both stay in L1
            for d in range(d0, d1):
                gr = e * D + d
                v0, v1, v2, v3 = _row4_q8(qt, draw[gr], ds[gr], qa, da, asum, bsums, p0 + j)
                o[pairs[p0 + j], d] = v0
                o[pairs[p0 + j + 1], d] = v1
                o[pairs[p0 + j + 2], d] = v2
                o[pairs[p0 + j + 3], d] = v3
        for d in range(d0, d1):
            gr = e * D + d
            for j in range(n4, n):
                p = p0 + j
                o[pairs[p], d] = _row_q8(qt, draw[gr], ds[gr], qa[p], da[p], asum[p], bsums[p])


@njit(cache=True, nogil=True, parallel=True)
def reduce_pairs(o, weights):
    """Y[t] = Σ_k weights[t, k]·o[t·K + k], k in order (as moe_down_q8): o float32 [T·K, D],
    weights float32 [T, K] -> float32 [T, D]."""
    T, K = weights.shape
    D = o.shape[1]
    y = np.empty((T, D), np.float32)
    for t in prange(T):
        for d in range(D):
            y[t, d] = 0.0
        for k in range(K):
            w = np.float32(weights[t, k])
            for d in range(D):
                y[t, d] += w * o[t * K + k, d]
    return y


# --- public entry point -----------------------------------------------------------------------


def _check(gate: PreparedWeight, up: PreparedWeight, down: PreparedWeight, X, ids, weights) -> None:
    E, F, D = gate.n_experts, gate.rows, down.rows
    if up.shape != gate.shape or down.shape != (E, D, F) or X.ndim != 2 or X.shape[1] != D:
        raise ValueError(f"stacks {gate.shape}, {up.shape}, {down.shape} and X {X.shape} do not fit")
    if ids.ndim != 2 or ids.shape[0] != X.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"ids {ids.shape} and weights {weights.shape} must both be [T, K] with T = {X.shape[0]}")
    if ids.size and (ids.min() < 0 or ids.max() >= E):
        raise IndexError(f"expert ids must lie in [0, {E})")


def fused_grouped(gate: PreparedWeight, up: PreparedWeight, down: PreparedWeight, q8_act: bool) -> bool:
    """Whether the fused grouped kernels serve these stacks (else the per-expert gather path)."""
    return q8_act and gate.qtype == up.qtype and gate.qtype in FUSED_TYPES and down.qtype in FUSED_TYPES


def grouped_moe_ffn(
    gate: PreparedWeight,
    up: PreparedWeight,
    down: PreparedWeight,
    X: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    *,
    q8_act: bool,
    skip: np.ndarray | None = None,
    glu=None,
) -> np.ndarray:
    """Y[t] = Σ_k weights[t, k] · down[ids[t, k]] · (SiLU(gate[·]·X[t]) ⊙ up[·]·X[t]), grouped.

    gate, up: stacks [E, F, D]; down: [E, D, F]; X float32 [T, D]; ids int [T, K];
    weights float32 [T, K]; skip bool [T, K] or None: pairs left out of the sum. Returns float32
    [T, D], bit-identical to ``moe.moe_ffn`` per token (over each token's kept pairs) for the fused
    types (Q8_0, Q4_0, Q5_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS and the IQ2/IQ3 grid types with ``q8_act``) where no expert has enough tokens for
    the bf16 units. Other types run each selected expert once over its tokens through
    ``dispatch.gemv_acts``, as do experts with biases or another activation (``glu``, an
    ``engine.kernels.moe.ExpertGLU``: gpt-oss).
    """
    X = np.ascontiguousarray(X, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    weights = np.ascontiguousarray(weights, dtype=np.float32)
    _check(gate, up, down, X, ids, weights)
    T, K = ids.shape
    E = gate.n_experts
    if skip is None:
        offsets, pairs = bucket_by_expert(ids, E)
        dropped = pairs[:0]
    else:
        skip = np.asarray(skip, dtype=bool)
        if skip.shape != ids.shape:
            raise ValueError(f"skip {skip.shape} must be the shape of ids {ids.shape}")
        weights = np.where(skip, np.float32(0.0), weights)  # a dropped pair's row of o is 0: it adds +0
        offsets, pairs = bucket_by_expert(np.where(skip, E, ids), E + 1)  # bucket E: the dropped pairs
        dropped, pairs, offsets = pairs[offsets[E] :], pairs[: offsets[E]], offsets[: E + 1]
    if glu is None and fused_grouped(gate, up, down, q8_act):
        o = scratch.buffer("pairs", T * K * down.rows).reshape(T * K, down.rows)  # o[t·K + k]: pair (t, k)'s output
        counts = np.diff(offsets)
        big = np.zeros(gate.n_experts, np.uint8)  # experts with enough tokens for the bf16 units
        if all(bf16.usable(w.qtype, q8_act) for w in (gate, up, down)):
            big[counts >= bf16.MIN_TOKENS] = 1
        if big.sum() < np.count_nonzero(counts):
            qx = quantize_rows(int(gate.qtype), X)
            qt, qd = int(gate.qtype), int(down.qtype)
            qh = grouped_gate_up_q8(
                qt, gate.raw, gate.scales, up.raw, up.scales, offsets, pairs, K, *qx, gate.rows, qd, big
            )
            grouped_down_q8(qd, down.raw, down.scales, offsets, pairs, *qh, down.rows, o, big)
        if big.any():
            _bf16_experts(gate, up, down, X, offsets, pairs, K, np.flatnonzero(big), o)
        o[dropped] = 0.0
        return reduce_pairs(o, weights)
    return _grouped_gather(gate, up, down, X, offsets, pairs, weights, q8_act, dropped, glu)


def _bf16_experts(gate, up, down, X, offsets, pairs, K, experts, o) -> None:
    """o[pairs of e] = down[e]·(SiLU(gate[e]·x) ⊙ up[e]·x) for each expert e of ``experts``, its
    three matrices dequantized and multiplied on the bf16 units (engine.kernels.bf16)."""
    import torch

    F, D = gate.rows, down.rows
    Xt = torch.from_numpy(X)
    gu = scratch.buffer("gate_up", 2 * F * gate.n).reshape(2 * F, gate.n)
    dn = scratch.buffer("down", D * down.n).reshape(D, down.n)
    for e in experts:
        p = pairs[offsets[e] : offsets[e + 1]]
        xe = Xt[torch.from_numpy(p // K)]  # [n, D]
        bf16.dequant_rows(gate, e * F, (e + 1) * F, gu[:F])
        bf16.dequant_rows(up, e * F, (e + 1) * F, gu[F:])
        g, u = bf16.mm(xe, torch.from_numpy(gu)).split(F, dim=1)  # [n, F] x2
        h = torch.nn.functional.silu(g) * u
        bf16.dequant_rows(down, e * D, (e + 1) * D, dn)
        o[p] = bf16.mm(h, torch.from_numpy(dn)).numpy()


def _grouped_gather(gate, up, down, X, offsets, pairs, weights, q8_act, dropped, glu=None) -> np.ndarray:
    """Any weight type: per selected expert, three gather GEMVs over its contiguous token rows
    (the pairs ``dropped`` add nothing); ``glu``: the experts' biases and activation (None: SwiGLU)."""
    from engine.kernels.dispatch import gemv_acts, prepare_activations
    from engine.kernels.moe import glu_act

    T, K = weights.shape
    F, D = gate.rows, down.rows
    Xs = X[pairs // K]  # [P, D] activations in pairs order
    ag = prepare_activations(gate.qtype, Xs, q8_act=q8_act)
    au = ag if up.qtype == gate.qtype else prepare_activations(up.qtype, Xs, q8_act=q8_act)
    h = np.empty((len(pairs), F), np.float32)
    groups = [(e, int(offsets[e]), int(offsets[e + 1] - offsets[e])) for e in np.flatnonzero(np.diff(offsets))]
    for e, p0, n in groups:
        rows = np.arange(e * F, (e + 1) * F, dtype=np.int64)
        xi = np.full(F, p0, np.int64)
        g = gemv_acts(gate, ag, rows, xi, n, q8_act=q8_act)  # [F, n]
        u = gemv_acts(up, au, rows, xi, n, q8_act=q8_act)
        if glu is None:
            h[p0 : p0 + n] = glu_act(None, g, u).T
        else:
            h[p0 : p0 + n] = glu.hidden(np.full(n, e), g.T, u.T)
    ad = prepare_activations(down.qtype, h, q8_act=q8_act)
    o = np.empty((T * K, D), np.float32)
    o[dropped] = 0.0
    for e, p0, n in groups:
        rows = np.arange(e * D, (e + 1) * D, dtype=np.int64)
        oe = gemv_acts(down, ad, rows, np.full(D, p0, np.int64), n, q8_act=q8_act).T
        o[pairs[p0 : p0 + n]] = oe if glu is None else glu.out(np.full(n, e), oe)
    o = o.reshape(T, K, D)
    y = np.zeros((T, D), np.float32)
    for k in range(K):  # top-k order
        y += weights[:, k : k + 1] * o[:, k]
    return y


def grouped_moe_ffn_ref(
    gate: PreparedWeight,
    up: PreparedWeight,
    down: PreparedWeight,
    X: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    *,
    q8_act: bool,
    skip: np.ndarray | None = None,
    glu=None,
) -> np.ndarray:
    """numpy reference of :func:`grouped_moe_ffn`: ``reference.moe_ffn_ref`` token by token, over
    each token's pairs not in ``skip``."""
    from engine.kernels.reference import moe_ffn_ref

    E = gate.n_experts
    g, u, d = (w.raw.reshape(E, w.rows, -1) for w in (gate, up, down))
    qts = (gate.qtype, up.qtype, down.qtype)
    keep = np.ones(ids.shape, bool) if skip is None else ~np.asarray(skip, bool)
    y = np.zeros((len(X), down.rows), np.float32)
    for t in range(len(X)):
        if keep[t].any():
            y[t] = moe_ffn_ref(qts, g, u, d, X[t], ids[t][keep[t]], weights[t][keep[t]], q8_act=q8_act, glu=glu)
    return y
