"""The decoder math on the host in numba: the twins of :mod:`engine.models.layers`, and one decode
step of a whole MoE layer in a single call.

The torch functions of ``layers`` are the reference. On the host, torch's per-op dispatch (~60 small
ops per layer) and a second OpenMP pool beside numba's cost more than the arithmetic, so host layers
run these instead (``engine.models.host.HostOps``, the host implementation of the layer step's ops):
the same ggml ops on rows ``[T, ...]`` (T = 1 for decode, the prompt chunk for prefill),
tests/test_host_decode.py holding each to its torch twin.

:func:`decode_moe_layer` goes further for the common decode case — every matrix of the layer in
a type the fused q8 kernels serve, an F32 router with softmax routing, routed experts on the CPU, no
shared expert, an F32 KV cache on the host — and runs the whole layer inside numba: RMS norm, q/k/v
GEMVs, q/k norm and RoPE, the KV write, attention, the output projection, routing and the two fused
expert kernels, with no Python between them. The GEMVs are the kernels' own drivers
(``engine.kernels.kquants``/``legacy``/``floats``), the expert steps ``engine.kernels.moe_fused``,
so the result is bit-identical to the step-by-step host path (``HostOps``).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from engine.kernels import floats, iquants, kquants, legacy
from engine.kernels.moe_fused import _row_q8, moe_down_q8, moe_gate_up_q8, quantize_for
from engine.kernels.simd import (
    F32x8,
    hsum_f32,
    load_f32x8,
    load_kv8,
    prefetch,
    prefetch_array,
    prefetch_distance,
    store_kv8,
    vadd,
    vfma,
    vfma_s,
    zero_f32,
)


@intrinsic
def _store_f32x8(typingctx, arr, off, v):
    """arr[off:off+8] = v (F32x8) for a 1-D float32 array; no bounds check."""
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.float32 and v == F32x8):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(ir.VectorType(ir.FloatType(), 8)))
        builder.store(args[2], ptr, align=4)
        return context.get_dummy_value()

    return types.none(arr, off, v), codegen


# --- the twins of engine.models.layers ------------------------------------------------------------


@njit(cache=True, nogil=True)
def rms_norm_host(x, w, eps):
    """x float32 [n], w float32 [n] (or [0]: no weight) -> float32 [n] (ggml_rms_norm, ggml_mul).

    As ggml: the sum of squares in float64, mean and scale in float32."""
    n = x.shape[0]
    s = 0.0
    for i in range(n):
        s += np.float64(x[i] * x[i])
    scale = np.float32(1.0) / np.sqrt(np.float32(s / n) + np.float32(eps))
    y = np.empty(n, np.float32)
    if w.shape[0]:
        for i in range(n):
            y[i] = x[i] * scale * w[i]
    else:
        for i in range(n):
            y[i] = x[i] * scale
    return y


@njit(cache=True, nogil=True, parallel=True)
def rms_norm_rows(X, w, eps):
    """``rms_norm`` of each row: X float32 [T, n] -> [T, n] (rows in parallel)."""
    Y = np.empty_like(X)
    for t in prange(X.shape[0]):
        Y[t] = rms_norm_host(X[t], w, eps)
    return Y


@njit(cache=True, nogil=True)
def _norm_heads(x, w, heads, hd, eps):
    """In place: RMS norm of each of ``heads`` slices of length hd (weights w [hd])."""
    for h in range(heads):
        x[h * hd : (h + 1) * hd] = rms_norm_host(x[h * hd : (h + 1) * hd], w, eps)


@njit(cache=True, nogil=True)
def _rope_heads(x, heads, hd, cos, sin, neox):
    """In place: rotate the first 2·len(cos) dims of each head (apply_rope for one position)."""
    half = cos.shape[0]
    for h in range(heads):
        o = h * hd
        for i in range(half):
            if neox:
                a, b = o + i, o + i + half
            else:
                a, b = o + 2 * i, o + 2 * i + 1
            x0, x1 = x[a], x[b]
            x[a] = x0 * cos[i] - x1 * sin[i]
            x[b] = x0 * sin[i] + x1 * cos[i]


@njit(cache=True, nogil=True)
def qk_norm_rope_one(q, k, q_norm, k_norm, qk_norm, eps, cos, sin, neox, H, Hkv, hd):
    """In place on one position's q [H·hd] and k [Hkv·hd]: optional RMS norm (qk_norm 0 none,
    1 per head "head", 2 whole projection "proj"), then RoPE with cos, sin float32 [rope_dim/2]."""
    if qk_norm == 2:
        q[:] = rms_norm_host(q, q_norm, eps)
        k[:] = rms_norm_host(k, k_norm, eps)
    elif qk_norm == 1:
        _norm_heads(q, q_norm, H, hd, eps)
        _norm_heads(k, k_norm, Hkv, hd, eps)
    _rope_heads(q, H, hd, cos, sin, neox)
    _rope_heads(k, Hkv, hd, cos, sin, neox)


@njit(cache=True, nogil=True, parallel=True)
def qk_norm_rope_rows(q, k, q_norm, k_norm, qk_norm, eps, cos, sin, neox, H, Hkv, hd):
    """``qk_norm_rope_one`` for q [T, H·hd], k [T, Hkv·hd], cos, sin [T, rope_dim/2] (rows in
    parallel)."""
    for t in prange(q.shape[0]):
        qk_norm_rope_one(q[t], k[t], q_norm, k_norm, qk_norm, eps, cos[t], sin[t], neox, H, Hkv, hd)


@njit(cache=True, nogil=True, inline="always")
def _dot_f32(a, ao, b, bo, n):
    """Σ a[ao:ao+n]·b[bo:bo+n] (n a multiple of 16) on two 8-lane accumulators."""
    a0 = zero_f32()
    a1 = zero_f32()
    for d in range(0, n, 16):
        a0 = vfma(load_f32x8(a, ao + d), load_kv8(b, bo + d), a0)
        a1 = vfma(load_f32x8(a, ao + d + 8), load_kv8(b, bo + d + 8), a1)
    return hsum_f32(vadd(a0, a1))


@njit(cache=True, nogil=True, inline="always")
def _dot4_f32(a, ao, b, bo, n):
    """(_dot_f32(a, ao + h·n, b, bo, n) for h in 0..3): four heads of a against one row of b, each with
    _dot_f32's two accumulators and sums (bit-identical), b's vectors loaded once for the four."""
    a0 = zero_f32()
    a1 = zero_f32()
    b0 = zero_f32()
    b1 = zero_f32()
    c0 = zero_f32()
    c1 = zero_f32()
    e0 = zero_f32()
    e1 = zero_f32()
    for d in range(0, n, 16):
        k0 = load_kv8(b, bo + d)
        k1 = load_kv8(b, bo + d + 8)
        o = ao + d
        a0 = vfma(load_f32x8(a, o), k0, a0)
        a1 = vfma(load_f32x8(a, o + 8), k1, a1)
        o += n
        b0 = vfma(load_f32x8(a, o), k0, b0)
        b1 = vfma(load_f32x8(a, o + 8), k1, b1)
        o += n
        c0 = vfma(load_f32x8(a, o), k0, c0)
        c1 = vfma(load_f32x8(a, o + 8), k1, c1)
        o += n
        e0 = vfma(load_f32x8(a, o), k0, e0)
        e1 = vfma(load_f32x8(a, o + 8), k1, e1)
    return hsum_f32(vadd(a0, a1)), hsum_f32(vadd(b0, b1)), hsum_f32(vadd(c0, c1)), hsum_f32(vadd(e0, e1))


@njit(cache=True, nogil=True, inline="always")
def _pv64(Vf, kvd, o, P, sa, out, oo):
    """out[oo:oo+64] = Σ_p sa[p]·Vf[o + p·kvd : +64] on eight 8-lane accumulators."""
    a0 = zero_f32()
    a1 = zero_f32()
    a2 = zero_f32()
    a3 = zero_f32()
    a4 = zero_f32()
    a5 = zero_f32()
    a6 = zero_f32()
    a7 = zero_f32()
    for p in range(P):
        w = sa[p]
        a0 = vfma_s(load_kv8(Vf, o), w, a0)
        a1 = vfma_s(load_kv8(Vf, o + 8), w, a1)
        a2 = vfma_s(load_kv8(Vf, o + 16), w, a2)
        a3 = vfma_s(load_kv8(Vf, o + 24), w, a3)
        a4 = vfma_s(load_kv8(Vf, o + 32), w, a4)
        a5 = vfma_s(load_kv8(Vf, o + 40), w, a5)
        a6 = vfma_s(load_kv8(Vf, o + 48), w, a6)
        a7 = vfma_s(load_kv8(Vf, o + 56), w, a7)
        o += kvd
    _store_f32x8(out, oo, a0)
    _store_f32x8(out, oo + 8, a1)
    _store_f32x8(out, oo + 16, a2)
    _store_f32x8(out, oo + 24, a3)
    _store_f32x8(out, oo + 32, a4)
    _store_f32x8(out, oo + 40, a5)
    _store_f32x8(out, oo + 48, a6)
    _store_f32x8(out, oo + 56, a7)


@njit(cache=True, nogil=True, inline="always")
def store_kv_row(row, x):
    """row = x (float32 [n], n % 8 == 0) for a KV-cache row of float32, or of bf16 bit patterns (uint16, rounded
    to nearest even as torch rounds)."""
    for i in range(0, x.shape[0], 8):
        store_kv8(row, i, load_f32x8(x, i))


@njit(cache=True, nogil=True)
def store_kv_rows(C, start, X):
    """Rows start … start+T−1 of the cache C [n_ctx, W] (float32, or bf16 bits as uint16) = X float32 [T, W],
    C-contiguous (the vector loads read each row's memory as packed)."""
    for t in range(X.shape[0]):
        store_kv_row(C[start + t], X[t])


SPLIT = 256  # decode: positions per attention work item (more items than KV heads for many cores)


@njit(cache=True, nogil=True)
def _attend(q, out, t0, o0, B, Kf, Vf, kvd, p0, P, kh, g, hd, scale, ml):
    """The g query heads of KV head kh for the B tokens q[t0:t0+B] (rows [H·hd]) -> out[o0:o0+B].

    Token t0+b sees positions p0 .. p0+P-B+b (causal: the block's last token sees P of them).
    Kf, Vf: the caches flattened, row p at p·kvd; each K/V row is loaded once for the whole
    block and all g heads. With ml [H, 2] empty ([0, 2]) out gets the attention output; else
    (B = 1) out gets Σ_p exp(s_p − m)·V[p] and ml[h] = (m, Σ_p exp(s_p − m)), a partial result
    that ``_attend_split`` merges with the other position ranges."""
    ko = kh * hd
    R = B * g  # score rows r = b·g + j
    s = np.empty((R, P), np.float32)
    ahead = 8 * kvd  # in decode K, V come from DRAM (the weights' stream evicts them): prefetch
    for i in range(P):
        p = p0 + i
        o = p * kvd + ko + ahead
        if o + hd <= Kf.shape[0]:
            for c in range(0, hd, 64 // Kf.itemsize):  # one hint a cache line
                prefetch(Kf, o + c)
                prefetch(Vf, o + c)
        for b in range(max(0, i - (P - B)), B):  # the tokens that see position p
            qb = q[t0 + b]
            g4 = g - g % 4
            for j in range(0, g4, 4):  # four heads on each load of the K row
                d0, d1, d2, d3 = _dot4_f32(qb, (kh * g + j) * hd, Kf, p * kvd + ko, hd)
                r = b * g + j
                s[r, i] = d0 * scale
                s[r + 1, i] = d1 * scale
                s[r + 2, i] = d2 * scale
                s[r + 3, i] = d3 * scale
            for j in range(g4, g):
                s[b * g + j, i] = _dot_f32(qb, (kh * g + j) * hd, Kf, p * kvd + ko, hd) * scale
    for r in range(R):
        n = P - B + 1 + r // g  # positions this row sees
        m = s[r, 0]
        for i in range(1, n):
            m = max(m, s[r, i])
        tot = np.float32(0.0)
        for i in range(n):
            e = np.exp(s[r, i] - m)
            s[r, i] = e
            tot += e
        if ml.shape[0]:
            ml[kh * g + r, 0] = m
            ml[kh * g + r, 1] = tot
        else:
            inv = np.float32(1.0) / tot
            for i in range(n):
                s[r, i] *= inv
        for i in range(n, P):
            s[r, i] = 0.0  # unseen positions weigh nothing in a paired P·V pass
    Vp = Vf[p0 * kvd :]  # the P·V loops below count positions from p0
    # out_r = Σ_p s[r, p]·V[p] in registers: two rows × 32 lanes share each load of V
    r = 0
    while r < R:
        r2 = r + 1 if r + 1 < R else r  # an odd last row pairs with itself ...
        outa, outb = out[o0 + r // g], out[o0 + r2 // g]
        oa, ob = (kh * g + r % g) * hd, (kh * g + r2 % g) * hd
        sa, sb = s[r], s[r2]
        n = P - B + 1 + r2 // g  # positions the pair needs
        d0 = 0
        if r2 == r:  # ... after 64 lanes at a time on its own
            d0 = hd - hd % 64
            for dc in range(0, d0, 64):
                _pv64(Vp, kvd, ko + dc, n, sa, outa, oa + dc)
        d32 = hd - hd % 32
        for dc in range(d0, d32, 32):
            a0 = zero_f32()
            a1 = zero_f32()
            a2 = zero_f32()
            a3 = zero_f32()
            b0 = zero_f32()
            b1 = zero_f32()
            b2 = zero_f32()
            b3 = zero_f32()
            o = ko + dc
            for p in range(n):
                v0 = load_kv8(Vp, o)
                v1 = load_kv8(Vp, o + 8)
                v2 = load_kv8(Vp, o + 16)
                v3 = load_kv8(Vp, o + 24)
                wa, wb = sa[p], sb[p]
                a0 = vfma_s(v0, wa, a0)
                a1 = vfma_s(v1, wa, a1)
                a2 = vfma_s(v2, wa, a2)
                a3 = vfma_s(v3, wa, a3)
                b0 = vfma_s(v0, wb, b0)
                b1 = vfma_s(v1, wb, b1)
                b2 = vfma_s(v2, wb, b2)
                b3 = vfma_s(v3, wb, b3)
                o += kvd
            _store_f32x8(outa, oa + dc, a0)
            _store_f32x8(outa, oa + dc + 8, a1)
            _store_f32x8(outa, oa + dc + 16, a2)
            _store_f32x8(outa, oa + dc + 24, a3)
            _store_f32x8(outb, ob + dc, b0)
            _store_f32x8(outb, ob + dc + 8, b1)
            _store_f32x8(outb, ob + dc + 16, b2)
            _store_f32x8(outb, ob + dc + 24, b3)
        if d32 < hd:  # hd % 32 == 16: the last 16 lanes
            a0 = zero_f32()
            a1 = zero_f32()
            b0 = zero_f32()
            b1 = zero_f32()
            o = ko + d32
            for p in range(n):
                v0 = load_kv8(Vp, o)
                v1 = load_kv8(Vp, o + 8)
                a0 = vfma_s(v0, sa[p], a0)
                a1 = vfma_s(v1, sa[p], a1)
                b0 = vfma_s(v0, sb[p], b0)
                b1 = vfma_s(v1, sb[p], b1)
                o += kvd
            _store_f32x8(outa, oa + d32, a0)
            _store_f32x8(outa, oa + d32 + 8, a1)
            _store_f32x8(outb, ob + d32, b0)
            _store_f32x8(outb, ob + d32 + 8, b1)
        r += 2


QUERY_ROWS = 8  # prefill: about this many (token, head) score rows share each K/V row load


@njit(cache=True, nogil=True, parallel=True)
def attention_rows(q, K, V, start, H, Hkv, hd):
    """Causal GQA attention (``attention``): q float32 [T, H·hd] at positions start..start+T-1;
    K, V float32 [≥start+T, Hkv·hd] (the cache) -> float32 [T, H·hd]. Softmax of q·k/sqrt(hd) in
    float32. Each K/V row is read once for the g = H/Hkv query heads sharing it; (token, KV head)
    pairs run in parallel, early and late tokens interleaved so threads get equal work. hd % 16 == 0."""
    T = q.shape[0]
    g = H // Hkv
    scale = np.float32(1.0 / np.sqrt(np.float64(hd)))
    out = np.empty((T, H * hd), np.float32)
    kvd = K.shape[1]
    Kf = K.reshape(K.shape[0] * kvd)
    Vf = V.reshape(V.shape[0] * kvd)
    nc = (start + T + SPLIT - 1) // SPLIT if T == 1 else 1
    if nc > 1:  # one token, a long context: equal position ranges, merged after
        return _attend_split(q, Kf, Vf, kvd, start + 1, nc, H, Hkv, hd, scale)
    none = np.empty((0, 2), np.float32)
    B = max(2, QUERY_ROWS // g) if T > 1 else 1  # measured: g = 8 -> 2 tokens, g = 1 -> 8
    nb = (T + B - 1) // B
    for item in prange(nb * Hkv):
        i = item // Hkv
        blk = i // 2 if i % 2 == 0 else nb - 1 - i // 2  # early and late blocks alternate
        t0 = blk * B
        Bt = min(B, T - t0)
        _attend(q, out, t0, t0, Bt, Kf, Vf, kvd, 0, start + t0 + Bt, item % Hkv, g, hd, scale, none)
    return out


@njit(cache=True, nogil=True, parallel=True)
def _attend_split(q, Kf, Vf, kvd, P, nc, H, Hkv, hd, scale):
    """One token (q [1, H·hd]) over P positions in nc ranges × Hkv heads of parallel work, the
    partial softmax sums merged as flash-decoding does -> float32 [1, H·hd]."""
    g = H // Hkv
    chunk = (P + nc - 1) // nc
    parts = np.empty((nc, H * hd), np.float32)
    ml = np.empty((nc, H, 2), np.float32)
    for item in prange(nc * Hkv):
        c = item // Hkv
        p0 = c * chunk
        _attend(q, parts, 0, c, 1, Kf, Vf, kvd, p0, min(P, p0 + chunk) - p0, item % Hkv, g, hd, scale, ml[c])
    out = np.empty((1, H * hd), np.float32)
    wc = np.empty(nc, np.float32)  # each range's rescale exp(m_c − m), once per head
    for h in range(H):
        m = ml[0, h, 0]
        for c in range(1, nc):
            m = max(m, ml[c, h, 0])
        tot = np.float32(0.0)
        for c in range(nc):
            wc[c] = np.exp(ml[c, h, 0] - m)
            tot += wc[c] * ml[c, h, 1]
        for d in range(hd):
            acc = np.float32(0.0)
            for c in range(nc):
                acc += wc[c] * parts[c, h * hd + d]
            out[0, h * hd + d] = acc / tot
    return out


@njit(cache=True, nogil=True)
def route_rows(logits, k, renormalise):
    """Router logits float32 [T, E] -> (ids int64 [T, k], weights float32 [T, k]): softmax, top-k
    by probability (descending; lower id first on ties), optionally renormalised
    (``route_softmax_topk``)."""
    T, E = logits.shape
    ids = np.empty((T, k), np.int64)
    w = np.empty((T, k), np.float32)
    p = np.empty(E, np.float32)
    for t in range(T):
        m = logits[t].max()
        tot = np.float32(0.0)
        for e in range(E):
            p[e] = np.exp(logits[t, e] - m)
            tot += p[e]
        for e in range(E):
            p[e] = p[e] / tot
        order = np.argsort(-p, kind="mergesort")  # stable: ties keep the lower id first
        for j in range(k):
            ids[t, j] = order[j]
            w[t, j] = p[order[j]]
        if renormalise:
            sw = np.float32(0.0)
            for j in range(k):
                sw += w[t, j]
            for j in range(k):
                w[t, j] = w[t, j] / sw
    return ids, w


# --- one decode step of a whole MoE layer -------------------------------------------------------

QK_NORM = {None: 0, "head": 1, "proj": 2}  # decode_moe_layer's qk_mode for Attention.qk_norm


@njit(cache=True, nogil=True)
def gemv_q8(qt, raw, s, qa, da, asum, bsums):
    """W·x for one token: raw uint8 [R, row_bytes] of ggml type ``qt`` (a fused type), s its
    scales, (qa, da, asum, bsums) = ``quantize_for(qt, x [1, n])``. Returns float32 [R]."""
    R = raw.shape[0]
    rows = np.arange(R)
    xi = np.zeros(R, np.int64)
    out = np.empty((R, 1), np.float32)
    if qt == 12:
        kquants.gemv_q4_k_q8(raw, s, rows, xi, qa, da, bsums, out)
    elif qt == 13:
        kquants.gemv_q5_k_q8(raw, s, rows, xi, qa, da, bsums, out)
    elif qt == 14:
        kquants.gemv_q6_k_q8(raw, s, rows, xi, qa, da, bsums, out)
    elif qt == 11:
        kquants.gemv_q3_k_q8(raw, s, rows, xi, qa, da, bsums, out)
    elif qt == 10:
        kquants.gemv_q2_k_q8(raw, s, rows, xi, qa, da, bsums, out)
    elif qt == 8:
        legacy.gemv_q8_0_q8(raw, s, rows, xi, qa, da, asum, out)
    elif qt == 2:
        legacy.gemv_q4_0_q8(raw, s, rows, xi, qa, da, asum, out)
    elif qt == 6:
        legacy.gemv_q5_0_q8(raw, s, rows, xi, qa, da, asum, out)
    elif qt == 39:
        legacy.gemv_mxfp4_q8(raw, s, rows, xi, qa, da, asum, out)
    elif qt == 20:
        legacy.gemv_iq4_nl_q8(raw, s, rows, xi, qa, da, asum, out)
    elif qt == 23:
        kquants.gemv_iq4_xs_q8(raw, s, rows, xi, qa, da, bsums, out)
    elif qt == 16 or qt == 17 or qt == 18 or qt == 21 or qt == 22:  # the IQ2/IQ3 grid types
        iquants.gemv_q8(raw, s, rows, xi, qa, da, bsums, out)
    else:
        out[:] = np.nan
    return out.reshape(R)


@njit(cache=True, nogil=True, inline="always")
def _pick(i, R0, R1, w0, w1, w2):
    """Row i of the rows of w0, w1, w2 stacked: (the matrix's row array, its local row)."""
    if i < R0:
        return w0[i]
    if i < R0 + R1:
        return w1[i - R0]
    return w2[i - R0 - R1]


@njit(cache=True, nogil=True, parallel=True)
def qkv_q8(qt0, w0, s0, qt1, w1, s1, qt2, w2, s2, qa, da, asum, bsums):
    """Three GEMVs on one token in one parallel loop (q, k, v: one barrier instead of three).
    Types of one activation family (K-quants with Q8_K, or Q8_0/Q4_0/Q5_0 with Q8_0), the
    activations (qa, da, asum, bsums) = ``quantize_for(qt0, x [1, n])``. Row values equal
    ``gemv_q8`` (the same row kernels). Returns (float32 [R0], [R1], [R2])."""
    R0, R1, R2 = w0.shape[0], w1.shape[0], w2.shape[0]
    M = R0 + R1 + R2
    out = np.empty(M, np.float32)
    ahead = prefetch_distance(w0)
    CH = 16
    for c in prange((M + CH - 1) // CH):
        for i in range(c * CH, min(M, (c + 1) * CH)):
            j = i + ahead
            if j < M:
                prefetch_array(_pick(j, R0, R1, w0, w1, w2))
            if i < R0:
                out[i] = _row_q8(qt0, w0[i], s0[i], qa[0], da[0], asum[0], bsums[0])
            elif i < R0 + R1:
                out[i] = _row_q8(qt1, w1[i - R0], s1[i - R0], qa[0], da[0], asum[0], bsums[0])
            else:
                r = i - R0 - R1
                out[i] = _row_q8(qt2, w2[r], s2[r], qa[0], da[0], asum[0], bsums[0])
    return out[:R0], out[R0 : R0 + R1], out[R0 + R1 :]


@njit(cache=True, nogil=True, inline="always")
def _k_family(qt):
    return qt == 10 or qt == 11 or qt == 12 or qt == 13 or qt == 14 or qt == 23 or (16 <= qt <= 18 or 21 <= qt <= 22)


@njit(cache=True, nogil=True)
def decode_moe_layer(
    x, attn_norm, ffn_norm, eps,
    qt_q, wq, sq, qt_k, wk, sk, qt_v, wv, sv, bq, bk, bv,
    q_norm, k_norm, qk_mode, cos, sin, neox, H, Hkv, hd,
    Kc, Vc, pos,
    qt_o, wo, so,
    router, k_top, renorm,
    qt_gu, wg, sg, wu, su, qt_d, wd, sd,
):  # fmt: skip
    """x float32 [D] of the token at position ``pos`` -> (x' float32 [D], expert ids int64 [K]);
    cos, sin float32 [1, rope_dim/2].

    x' = x + attn(rms_norm(x)); x' += experts(rms_norm(x')), exactly as ``DecoderLayer.step`` with
    ``Attention`` and ``MoE`` (no shared expert, softmax routing) on ``HostOps``. Writes k, v into row ``pos`` of the cache arrays
    Kc, Vc float32 [n_ctx, Hkv·hd]. Biases and norm weights may be empty arrays (absent).
    """
    D = x.shape[0]
    h = rms_norm_host(x, attn_norm, eps).reshape(1, D)
    a = quantize_for(qt_q, h)
    if _k_family(qt_q) == _k_family(qt_k) and _k_family(qt_k) == _k_family(qt_v):
        q, k, v = qkv_q8(qt_q, wq, sq, qt_k, wk, sk, qt_v, wv, sv, a[0], a[1], a[2], a[3])
    else:
        q = gemv_q8(qt_q, wq, sq, a[0], a[1], a[2], a[3])
        if qt_k != qt_q:
            a = quantize_for(qt_k, h)
        k = gemv_q8(qt_k, wk, sk, a[0], a[1], a[2], a[3])
        if qt_v != qt_k:
            a = quantize_for(qt_v, h)
        v = gemv_q8(qt_v, wv, sv, a[0], a[1], a[2], a[3])
    if bq.shape[0]:
        q += bq
        k += bk
        v += bv
    qk_norm_rope_one(q, k, q_norm, k_norm, qk_mode, eps, cos[0], sin[0], neox, H, Hkv, hd)
    q2 = q.reshape(1, q.shape[0])
    store_kv_row(Kc[pos], k)
    store_kv_row(Vc[pos], v)
    o = attention_rows(q2, Kc, Vc, pos, H, Hkv, hd)  # [1, H*hd]
    a = quantize_for(qt_o, o)
    x = x + gemv_q8(qt_o, wo, so, a[0], a[1], a[2], a[3])
    h = rms_norm_host(x, ffn_norm, eps).reshape(1, D)
    E = router.shape[0]
    logits = np.empty((E, 1), np.float32)
    floats.gemv_f32(router, np.arange(E), np.zeros(E, np.int64), h, logits)
    ids, w = route_rows(logits.reshape(1, E), k_top, renorm)
    a = quantize_for(qt_gu, h)
    F = wg.shape[0] // E
    _, qa, da, asum, bsums = moe_gate_up_q8(qt_gu, wg, sg, wu, su, ids[0], a[0], a[1], a[2], a[3], F, qt_d)
    return x + moe_down_q8(qt_d, wd, sd, ids[0], w[0], qa, da, asum, bsums, D), ids[0]
