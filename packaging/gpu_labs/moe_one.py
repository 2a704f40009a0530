"""LAB, NOT ADOPTED — the whole routed-expert decode of all-Q4_K experts in **one launch**, measured slower
than the engine's four launches (docs/benchmarks-gpu.md, session 6: 22.3–27.7 µs against 17.3–17.5 on an
H100; even with both in-launch waits removed, i.e. wrong sums, 18.0). Kept as the record of the attempt.

The idea: the four launches (quantize x, gate/up, quantize h, down: engine.runtime.triton_q4k_moe) cannot
keep the memory busy across launch boundaries, so put them in one grid where every program issues its
weight loads first and then waits, inside the launch, for what it needs from other programs:

- program roles come from a **ticket** (an atomic counter), not the program id: ticket 0 quantizes x;
  tickets 1 … NGU are gate/up tiles (pair-major); the rest are down tiles. A program waits only on
  programs with smaller tickets, which are running or done, so the launch cannot deadlock whatever the
  GPU schedules (the argument of decoupled look-back scans);
- a gate/up tile loads its gate and up blocks, waits for x's quantization, computes h for BR rows and
  stores it in float; the last tile of a pair (a per-pair arrival counter) quantizes the pair's h with
  the module rule of ``triton_q8`` and counts the pair ready;
- a down tile loads its rows of all the token's experts, waits until every pair is ready, and sums
  ``w_k · down_k · ĥ_k``; the last down tile resets the counters, so the launch leaves its sync buffer
  as it found it (all zero) — a CUDA graph replays it as is.

Publishing is ``fence.acq_rel.gpu`` in every thread, a program barrier, then one atomic; waiting is a
volatile poll (with ``nanosleep``) and a fence. The sync buffer is allocated once, outside graph capture.

Why it loses: holding a tile's loaded weights across a wait takes the registers (167–250 a thread against
~100), the waits add 4–5 µs (hundreds of programs polling two counters), and the programs of one grid
are no cheaper to dispatch than those of four. Whole Q4_K blocks a thread (the session-5 decoder, in
moe_lean.py); the arithmetic is the engine's, bit for bit (parity below).

  PYTHONPATH=. python3 packaging/gpu_labs/moe_one.py [BRG,BRD ...]     # on a CUDA machine (~2 min)
"""

# ruff: noqa: B023
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_lean import _dot_block, _load_block  # noqa: E402

from engine.bench import device_kernels as dk  # noqa: E402
from engine.bench.read_floor import read_floor_us  # noqa: E402
from engine.quant.formats import QType  # noqa: E402
from engine.runtime import triton_moe as tm  # noqa: E402
from engine.runtime import triton_q4k_moe as q4  # noqa: E402
from engine.runtime import triton_q8 as t8  # noqa: E402
from engine.runtime import triton_q8_moe as m8  # noqa: E402
from engine.runtime import triton_qblocks as qb  # noqa: E402
from tests.triton_data import expert_pool, routing_case  # noqa: E402

triton, tl = qb.triton, qb.tl
Q = QType.Q4_K

LINE = (
    tl.constexpr(32) if tl is not None else 32
)  # int32 words between counters (one 128-byte line each: pollers never share a line with the atomics)
MAX_PAIRS = 64  # (token, expert) pairs a sync buffer serves: T·K ≤ 64 (TRITON_MAX_T = 8 tokens of 8 experts)
_SYNC: dict[tuple[str, int | None], torch.Tensor] = {}


def sync_buffer(device: torch.device) -> torch.Tensor | None:
    """The zeroed int32 counters of :func:`moe` on ``device`` (one per device, allocated once, outside
    any graph capture); None while a capture runs and none exists yet."""
    key = (device.type, device.index)
    if key not in _SYNC:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _SYNC[key] = torch.zeros((4 + MAX_PAIRS) * int(LINE), dtype=torch.int32, device=device)
    return _SYNC[key]


@triton.jit
def _asm(CODE: tl.constexpr):
    """PTX CODE (ending in ``mov.u32 $0, $1;``) in every thread of the program, kept for its side effect."""
    z = tl.zeros([1], dtype=tl.int32)
    tl.inline_asm_elementwise(CODE, "=r,r", [z], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fence(ASM: tl.constexpr):
    """fence.acq_rel.gpu in every thread (the interpreter runs programs one at a time: nothing)."""
    if ASM:
        _asm("fence.acq_rel.gpu; mov.u32 $0, $1;")


@triton.jit
def _publish(C, ASM: tl.constexpr):
    """This program's stores, then +1 on counter C: visible to whoever reads C after it."""
    _fence(ASM)
    tl.debug_barrier()
    tl.atomic_add(C, 1, sem="release", scope="gpu")


@triton.jit
def _await(C, n, ASM: tl.constexpr, NAP: tl.constexpr = 32):
    """Poll counter C until it reaches n, then fence (loads after this see what the publishers stored)."""
    c = tl.load(C, volatile=True)
    while c < n:
        if ASM:
            if NAP == 32:
                _asm("nanosleep.u32 32; mov.u32 $0, $1;")
            elif NAP == 256:
                _asm("nanosleep.u32 256; mov.u32 $0, $1;")
            elif NAP == 1000:
                _asm("nanosleep.u32 1000; mov.u32 $0, $1;")
        c = tl.load(C, volatile=True)
    _fence(ASM)


@triton.jit
def _quant8(SRC, QQ, QD, QS, row, c, n32):
    """triton_q8's rounding (``quant_tile`` / ``store_q8``: quantize_act's rule) of 32-blocks
    8c … 8c + 7 (those < n32) of row ``row`` of float SRC [rows, 32·n32] into its q8 buffers."""
    blk = c * 8 + tl.arange(0, 8)
    bm = blk < n32
    v = tl.load(SRC + row.to(tl.int64) * (32 * n32) + blk[:, None] * 32 + tl.arange(0, 32)[None, :],
                mask=bm[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
    words, d, s = t8.quant_tile(v, 8)
    t8.store_q8(QQ, QD, QS, row, blk, bm, words, d, s, n32)


@triton.jit
def _gate_up_tile(W32, SLOT, XQ, XD, XS, H, HQ, HD, HS, SYNC, go, uo, j, D: tl.constexpr, F: tl.constexpr,
                  K: tl.constexpr, BRG: tl.constexpr, NPH: tl.constexpr, NXQ: tl.constexpr, ASM: tl.constexpr,
                  WAIT: tl.constexpr, NAP: tl.constexpr):  # fmt: skip
    """Gate/up tile j (pair-major): h for BRG rows of one pair; the pair's last tile quantizes its h."""
    NB: tl.constexpr = D // 256
    TF: tl.constexpr = F // BRG  # tiles a pair
    q = j // TF
    r0 = (j % TF) * BRG
    slot = tl.load(SLOT + q)
    if slot >= 0:
        rows = r0 + tl.arange(0, BRG)
        t = q // K
        b = tl.arange(0, NB)
        off = tl.multiple_of(b[:, None] * q4.BLOCK_WORDS + rows[None, :] * (q4.BLOCK_WORDS * NB), [4, 4])
        gb = _load_block(W32 + tl.multiple_of((slot + go) // 4, 4) + off)
        ub = _load_block(W32 + tl.multiple_of((slot + uo) // 4, 4) + off)
        if WAIT % 2:
            _await(SYNC + LINE, NXQ, ASM, NAP)  # x̂
        zp = tl.zeros([NB, BRG], dtype=tl.int32)
        Xp = XQ + t * (64 * NB) + (zp + b[:, None] * 64)
        XDp = XD + t * (8 * NB) + (zp + b[:, None] * 8)
        XSp = XS + t * (16 * NB) + (zp + b[:, None] * 16)
        g = tl.sum(_dot_block(gb, Xp, XDp, XSp, ASM), axis=0)
        u = tl.sum(_dot_block(ub, Xp, XDp, XSp, ASM), axis=0)
        h = g / (1.0 + tl.exp(-g)) * u  # ggml_swiglu_split
    else:
        h = tl.zeros([BRG], dtype=tl.float32)
    tl.store(H + q.to(tl.int64) * F + r0 + tl.arange(0, BRG), h)
    _fence(ASM)
    tl.debug_barrier()
    arrived = tl.atomic_add(SYNC + (4 + q) * LINE, 1, sem="acq_rel", scope="gpu")
    if arrived == TF - 1:  # the pair's last tile: quantize its h, count the pair ready
        tl.atomic_xchg(SYNC + (4 + q) * LINE, 0, sem="relaxed", scope="gpu")
        _fence(ASM)
        for c in tl.static_range(NPH):  # loads of all chunks issue before the first store waits
            _quant8(H, HQ, HD, HS, q, c, F // 32)
        _publish(SYNC + 2 * LINE, ASM)


@triton.jit
def _down_tile(W32, SLOT, WT, HQ, HD, HS, Y, SYNC, do, j, D: tl.constexpr, F: tl.constexpr, K: tl.constexpr,
               BRD: tl.constexpr, NDN: tl.constexpr, ASM: tl.constexpr, NPAIRS: tl.constexpr, WAIT: tl.constexpr,
               NAP: tl.constexpr):  # fmt: skip
    """Down tile j (token-major): BRD rows of Y[t] over the token's K experts, experts × a row's blocks
    on one axis (as triton_q4k_moe's down kernel); the last tile resets the counters."""
    NBF: tl.constexpr = F // 256
    t = j // (D // BRD)
    r0 = (j % (D // BRD)) * BRD
    rows = r0 + tl.arange(0, BRD)
    RW: tl.constexpr = q4.BLOCK_WORDS * NBF  # words a row
    NBP: tl.constexpr = triton.next_power_of_2(NBF)
    e = tl.arange(0, K * NBP)
    lane = e % NBP
    lc = tl.minimum(lane, NBF - 1)
    q = t * K + e // NBP
    slot = tl.load(SLOT + q)
    keep = (lane < NBF) & (slot >= 0)
    wk = tl.load(WT + q)
    P = W32 + (tl.multiple_of((tl.maximum(slot, 0) + do) // 4 + lc * q4.BLOCK_WORDS, 4)[:, None] + (rows * RW)[None, :])
    blk = _load_block(P)
    if WAIT // 2:
        _await(SYNC + 2 * LINE, NPAIRS, ASM, NAP)  # every pair's ĥ
    zp = tl.zeros([K * NBP, BRD], dtype=tl.int32)
    Xp = HQ + (zp + (q * (64 * NBF) + lc * 64)[:, None])
    XDp = HD + (zp + (q * (8 * NBF) + lc * 8)[:, None])
    XSp = HS + (zp + (q * (16 * NBF) + lc * 16)[:, None])
    v = _dot_block(blk, Xp, XDp, XSp, ASM)
    y = tl.sum(tl.where(keep[:, None], v * wk[:, None], 0.0), axis=0)
    tl.store(Y + t * D + rows, y)
    _fence(ASM)
    tl.debug_barrier()
    done = tl.atomic_add(SYNC + 3 * LINE, 1, sem="acq_rel", scope="gpu")
    if done == NDN - 1:  # every program has taken its ticket and passed its waits: reset
        tl.atomic_xchg(SYNC, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(SYNC + LINE, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(SYNC + 2 * LINE, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(SYNC + 3 * LINE, 0, sem="relaxed", scope="gpu")


@triton.jit
def _moe_kernel(W32, SLOT, X, WT, XQ, XD, XS, H, HQ, HD, HS, Y, SYNC, go, uo, do,
                T: tl.constexpr, D: tl.constexpr, F: tl.constexpr, K: tl.constexpr, BRG: tl.constexpr,
                BRD: tl.constexpr, NPX: tl.constexpr, NPH: tl.constexpr, ASM: tl.constexpr,
                PDL: tl.constexpr, WAIT: tl.constexpr = 3, NAP: tl.constexpr = 32):  # fmt: skip
    """Y[t] = Σ_k WT[t, k] · down_k · ĥ(SiLU(gate_k·x̂_t) · up_k·x̂_t) for the T·K pairs at byte offsets
    SLOT of the pool (−1: skipped). Grid: 1 + NGU + NDN programs of one warp; see the module text.
    SYNC: counters LINE words apart — 0 tickets, 1 x̂ ready, 2 pairs ready, 3 down tiles done, then
    one per pair (its gate/up tiles arrived)."""
    NXQ: tl.constexpr = T * NPX  # x̂ programs
    NGU: tl.constexpr = T * K * (F // BRG)
    NDN: tl.constexpr = T * (D // BRD)
    qb.pdl_enter(PDL)  # x and SLOT come from the kernels before; so may the previous launch of this kernel,
    me = tl.atomic_add(SYNC, 1, sem="relaxed", scope="gpu")  # whose last program resets the counters
    if me < NXQ:  # 8 32-blocks of x̂
        _quant8(X, XQ, XD, XS, me // NPX, me % NPX, D // 32)
        _publish(SYNC + LINE, ASM)
    elif me < NXQ + NGU:
        _gate_up_tile(
            W32, SLOT, XQ, XD, XS, H, HQ, HD, HS, SYNC, go, uo, me - NXQ, D, F, K, BRG, NPH, NXQ, ASM, WAIT, NAP
        )
    else:
        _down_tile(W32, SLOT, WT, HQ, HD, HS, Y, SYNC, do, me - NXQ - NGU, D, F, K, BRD, NDN, ASM, T * K, WAIT, NAP)


def moe(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, roles: dict, K: int,
        cfg: dict) -> torch.Tensor:  # fmt: skip
    """Σ_k weights[t, k] · down_k · ĥ_{t·K+k} float32 [T, D], ĥ = SiLU(gate·x̂) · (up·x̂) through
    triton_q8's rounding, for the pairs at byte offsets ``slots`` [T·K] (−1: skipped) — what
    ``triton_q4k_moe.down(gate_up(...))`` computes, in one launch (all-Q4_K roles, T·K ≤ MAX_PAIRS).
    cfg: {"BRG": gate/up rows a tile, "BRD": down rows a tile}."""
    (go, _, F, D), (uo, _, _, _), (do, _, _, _) = (roles[r] for r in ("gate", "up", "down"))
    BRG, BRD = cfg["BRG"], cfg["BRD"]
    if F % BRG or D % BRD:
        raise ValueError(f"one-launch Q4_K MoE setting {cfg} does not divide F={F}, D={D}")
    dev = x.device
    sync = sync_buffer(dev)
    if sync is None:
        raise RuntimeError("one-launch MoE: no sync buffer on this device (allocate it before graph capture)")
    P = slots.numel()
    T = P // K
    if P > MAX_PAIRS:
        raise ValueError(f"one-launch MoE serves at most {MAX_PAIRS} pairs, got {P}")
    f32, i32 = torch.float32, torch.int32
    XQ, XD, XS = (torch.empty((T, D // n), dtype=d, device=dev) for n, d in ((4, i32), (32, f32), (16, f32)))
    H = torch.empty((P, F), dtype=f32, device=dev)
    HQ, HD, HS = (torch.empty((P, F // n), dtype=d, device=dev) for n, d in ((4, i32), (32, f32), (16, f32)))
    Y = torch.empty((T, D), dtype=f32, device=dev)
    pdl = qb.pdl(dev)
    grid = T * triton.cdiv(D // 32, 8) + P * (F // BRG) + T * (D // BRD)
    _moe_kernel[(grid,)](
        pool.reshape(-1).view(torch.int32), slots, x.contiguous(), weights.to(f32).contiguous(), XQ, XD, XS, H, HQ,
        HD, HS, Y, sync, go, uo, do, T=T, D=D, F=F, K=K, BRG=BRG, BRD=BRD,
        NPX=triton.cdiv(D // 32, 8), NPH=triton.cdiv(F // 32, 8), ASM=t8.use_asm(dev), PDL=pdl,
        num_warps=1, **{k: cfg[k] for k in ("WAIT", "NAP") if k in cfg}, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def parity():
    rng = np.random.default_rng(7)
    pool, stride, roles = expert_pool((Q, Q, Q), 768, 2048, 16, "cuda", rng)
    for T in (1, 4):
        slot_off, x, w = routing_case(T, 8, 16, 2048, stride, "cuda", rng)
        if T == 4:
            slot_off[2, 3] = -1
        slots = slot_off.reshape(-1).contiguous()
        ref = m8.moe_decode_q8_reference(pool, slot_off, x, w, roles)
        for cfg in CFGS:
            y = moe(pool, slots, x, w, roles, 8, cfg)
            torch.cuda.synchronize()
            rel = ((y - ref).norm() / ref.norm()).item()
            print(f"parity T={T} {cfg}: vs reference {rel:.1e}, "
                  f"sync zero {int(sync_buffer(y.device).abs().sum()) == 0}", flush=True)  # fmt: skip
    # graph replays: 48 launches a graph, 200 replays, each replay the same result, the counters back to zero
    offs = [routing_case(1, 8, 16, 2048, stride, "cuda", rng)[0] for _ in range(48)]
    x = torch.randn(1, 2048, device="cuda")
    w = torch.rand(1, 8, device="cuda")
    outs = [None] * 48
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = [moe(pool, o.reshape(-1), x, w, roles, 8, CFGS[0]) for o in offs]
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i, o in enumerate(offs):
            outs[i] = moe(pool, o.reshape(-1), x, w, roles, 8, CFGS[0])
    t0 = time.time()
    same = True
    for _ in range(200):
        g.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(outs, eager))
    print(f"200 replays of 48 launches: {time.time() - t0:.2f} s, equal to eager {same}, "
          f"sync zero {int(sync_buffer(x.device).abs().sum()) == 0}", flush=True)  # fmt: skip


def timings():
    bw = dk.measure_bandwidth()
    nbytes = dk._moe_bytes(Q)
    name = torch.cuda.get_device_name()
    floor = read_floor_us(dk.launch_bytes(Q, "moe"), dk._graph_us)
    print(f"{name}: copy bandwidth {bw:.0f} GB/s; {nbytes / 1e6:.1f} MB a call; read floor {floor:.2f} us "
          f"({nbytes / floor / 1e3 / bw:.0%})", flush=True)  # fmt: skip

    def show(label, us):
        print(f"{label:28s} {us:6.2f} us  {nbytes / us / 1e3:6.0f} GB/s ({nbytes / us / 1e3 / bw:.0%})", flush=True)

    layers = max(48, -(-dk.GB // nbytes))
    pool, stride, roles = dk._slot_pool(Q, layers * 8)
    g = torch.Generator().manual_seed(0)
    offs = [((torch.randperm(8, generator=g) + 8 * i).cuda() * stride).contiguous() for i in range(layers)]
    x = torch.randn(1, dk.D, device="cuda")
    w = torch.rand(1, 8, device="cuda")
    graph = lambda calls: dk._graph_us(calls)[0]  # noqa: E731
    show(
        "four launches (engine)",
        graph([lambda o=o: tm.moe_decode(pool, o.view(1, 8), x, w, roles, "q8") for o in offs]),
    )
    runs = [(f"one launch {c['BRG']},{c['BRD']}", c) for c in CFGS]
    runs += [(f"one launch {e}", dict(CFGS[0], **e)) for e in ({"NAP": 256}, {"NAP": 1000}, {"WAIT": 2}, {"WAIT": 1},
                                                              {"WAIT": 0})]  # WAIT < 3: wrong sums, timing only  # fmt: skip
    for label, cfg in runs:
        show(label, graph([lambda o=o: moe(pool, o, x, w, roles, 8, cfg) for o in offs]))


CFGS = [dict(BRG=int(a), BRD=int(b)) for a, b in (c.split(",") for c in sys.argv[1:])] or [
    dict(BRG=8, BRD=4), dict(BRG=4, BRD=2), dict(BRG=4, BRD=4), dict(BRG=8, BRD=2), dict(BRG=2, BRD=2),
    dict(BRG=4, BRD=1)]  # fmt: skip

if __name__ == "__main__":
    parity()
    timings()
