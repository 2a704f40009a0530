"""Prompts on the tensor cores: the tiled prompt kernels of engine.runtime.triton_moe on float32 operands
(tf32x3, SHARPI_PREFILL_PRECISION=f32) against bfloat16 ones (bf16 MMA, the CUDA default), for the
Qwen3-30B-A3B geometry (D 2048, expert F 768, 128 experts, top-8; trunk q 4096×2048, k/v 512×2048,
o 2048×4096), each quant type for every matrix; torch's bf16 matmul of the dequantized weights is the
ceiling. CUDA events around each call, warm-up first, the median of --reps; ms and TFLOP/s.

    PYTHONPATH=. python3 labs/prefill_tc.py [--tokens 512] [--types Q4_K,Q6_K] [--reps 20] [--sweep]

Rows, per quant type:
- trunk q, k, o: ``one_matrix`` (the whole call, x's rounding to bf16 included); ceiling ``X @ Wᵀ`` in bf16;
- moe gate (one grouped launch over the 128 experts' [768, 2048], tokens routed at random), moe down (one
  launch, [2048, 768]), moe (the whole ``moe_prefill``: sort, tile table, three launches, SwiGLU, combine);
  ceiling one dense bf16 matmul of the same FLOPs (T·K rows), which no grouped kernel can pass;
- a layer's matrices (q, k, v = k, o, moe) summed, and the prompt rate they alone would allow over 48 layers.
Weights are random blocks (engine.kernels.testing.random_weight); the trunk's fit in L2, the experts' do not.
The bf16 column's "diff" is its relative difference from the f32 result (bf16 rounding: ~1e-3).

--sweep times grouped_bf16 launch candidates (BR, BT, NB, num_warps) on gate, down, q, k and o and prints
each workload's fastest, and per shape class the candidate with the least summed time, as entries for
engine/runtime/launch/device=<GPU>.json (each compile takes seconds: sweep one type a run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from dataclasses import replace

import numpy as np
import torch

from engine import config
from engine.kernels.testing import random_weight
from engine.quant.formats import QType, block_format
from engine.runtime import kernel_select as ks
from engine.runtime import triton_moe as tm
from engine.runtime import triton_qblocks as qb
from engine.runtime.references import dequantize

triton, tl = qb.triton, qb.tl


@triton.jit
def _dequant_kernel(W, OFF, OUT, rows, n, row_bytes, nb, QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr,
                    PW: tl.constexpr, NPART: tl.constexpr, ALIGN: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
    """OUT[g] (bf16 [rows, n]) = the quantized matrix at byte OFF[g] of W, dequantized (prototype)."""
    g = tl.program_id(2)
    base = tl.load(OFF + g)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < rows
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    boff, m2 = qb.block_offsets(tl.multiple_of(base, 16) + r.to(tl.int64) * row_bytes, b, nb, rmask, TS, ALIGN)
    l = tl.arange(0, PW)
    for i in tl.static_range(NPART):
        w = qb.part(W, boff, m2, QT, i, PW)
        col = b[:, None] * QK + i * PW + l[None, :]
        ptr = OUT + g.to(tl.int64) * rows * n + r[:, None, None].to(tl.int64) * n + col[None, :, :]
        tl.store(ptr, qb.round_bf16(w).to(tl.bfloat16), mask=m2[:, :, None])


def dequant_bf16(pool_flat, offs, q, rows, n):
    """bf16 [G, rows, n], contiguous: the G matrices at byte offsets ``offs``, dequantized."""
    G = offs.shape[0]
    out = torch.empty((G, rows, n), dtype=torch.bfloat16, device=pool_flat.device)
    geo = qb.geometry(q)
    nb = n // geo["QK"]
    NB = 2 if geo["QK"] == 256 else 8
    _dequant_kernel[(triton.cdiv(rows, 64), triton.cdiv(nb, NB), G)](
        pool_flat, offs, out, rows, n, block_format(q).row_bytes(n), nb, BR=64, NB=NB, num_warps=4, **geo)
    return out


def moe_dq_gmm(pool, stride, slot_off, x, w, roles, q):
    """Prototype: every expert's matrices dequantized to bf16 scratch, then torch._grouped_mm over the
    pairs sorted by expert (two grouped GEMMs: gate|up, down)."""
    T, K_ = slot_off.shape
    flat = pool.reshape(-1)
    e_off = torch.arange(E, device=x.device, dtype=torch.int64) * stride
    gu = torch.cat([dequant_bf16(flat, e_off + roles[r][0], q, F, D) for r in ("gate", "up")], 1)  # [E, 2F, D]
    wd = dequant_bf16(flat, e_off + roles["down"][0], q, D, F)
    return gmm_part(gu, wd, slot_off // stride, x, w), (gu, wd)


def gmm_part(gu, wd, eid, x, w):
    T, K_ = eid.shape
    flat = eid.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
    xs = x.to(torch.bfloat16)[order // K_]
    y = torch._grouped_mm(xs, gu.transpose(1, 2), offs=offs)  # [J, 2F]
    h = (torch.nn.functional.silu(y[:, :F].float()) * y[:, F:].float()).to(torch.bfloat16)
    d = torch._grouped_mm(h, wd.transpose(1, 2), offs=offs)  # [J, D]
    out = torch.empty((T * K_, D), dtype=torch.float32, device=x.device)
    out[order] = d.float() * w.reshape(-1)[order, None]
    return out.view(T, K_, D).sum(1)

D, F, E, K = 2048, 768, 128, 8
TRUNK = {"q": (4096, 2048), "k": (512, 2048), "o": (2048, 4096)}  # v has k's shape
LAYERS = 48


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median ms of ``fn()`` by CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def options(precision: str):
    return replace(config.current(), prefill_precision=precision)


def expert_pool(q: QType, rng: np.random.Generator, dev):
    """128 slots of gate [F, D] | up [F, D] | down [D, F] of type q -> (pool [E, stride], stride, roles)."""
    roles, o, parts = {}, 0, []
    for r, (rows, n) in (("gate", (F, D)), ("up", (F, D)), ("down", (D, F))):
        raw = torch.from_numpy(random_weight(q, (E, rows, n), rng)).reshape(E, -1)
        roles[r] = (o, q, rows, n)
        size = -(-raw.shape[1] // 256) * 256
        parts.append(torch.nn.functional.pad(raw, (0, size - raw.shape[1])))
        o += size
    return torch.cat(parts, 1).to(dev), o, roles


def routing(T: int, stride: int, dev):
    logits = torch.randn(T, E, device=dev)
    w, ids = torch.softmax(logits, -1).topk(K, -1)
    return ids * stride, (w / w.sum(-1, keepdim=True)).float()


def row(name: str, flop: float, cells: dict) -> None:
    txt = "  ".join(f"{k} {ms:7.3f} ms {flop / ms / 1e9:6.1f} TF/s" + (f" diff {d:.1e}" if d is not None else "")
                    for k, (ms, d) in cells.items())  # fmt: skip
    print(f"  {name:<6} {flop / 1e9:6.2f} GFLOP  {txt}", flush=True)


def bench_type(q: QType, T: int, reps: int, rng, dev) -> None:
    print(f"{q.name}  T={T}  ({torch.cuda.get_device_name(dev)}, launch settings: "
          f"f32 {ks.launch('grouped', q, 2048, ks.device_name(dev))}, "
          f"bf16 {ks.launch('grouped_bf16', q, 2048, ks.device_name(dev))})")  # fmt: skip
    X = torch.randn(T, 4096, device=dev)
    layer = {"f32": 0.0, "bf16": 0.0, "torch": 0.0}
    for name, (R, n) in TRUNK.items():
        raw = torch.from_numpy(random_weight(q, (R, n), rng)).to(dev)
        x = X[:, :n].contiguous()
        y32 = tm.one_matrix(raw, x, q, R, n, options=options("f32"))
        y16 = tm.one_matrix(raw, x, q, R, n, options=options("bf16"))
        W16, x16 = dequantize(raw, q, n).to(torch.bfloat16), x.to(torch.bfloat16)
        cells = {
            "f32": (timed(lambda: tm.one_matrix(raw, x, q, R, n, options=options("f32")), reps), None),
            "bf16": (timed(lambda: tm.one_matrix(raw, x, q, R, n, options=options("bf16")), reps), rel(y16, y32)),
            "torch": (timed(lambda: x16 @ W16.T, reps), None),
        }
        row(name, 2.0 * T * R * n, cells)
        for k in layer:
            layer[k] += cells[k][0] * (2 if name == "k" else 1)  # v as k
    pool, stride, roles = expert_pool(q, rng, dev)
    slot_off, w = routing(T, stride, dev)
    x = X[:, :D].contiguous()
    flat = slot_off.reshape(-1)
    order = torch.argsort(flat, stable=True)
    seg, tok = flat[order], order // K
    J = T * K
    h = torch.randn(J, F, device=dev)
    for name, (off, R, n, X_) in (("gate", (roles["gate"][0], F, D, x)), ("down", (roles["down"][0], D, F, h))):
        ident = tok if name == "gate" else torch.arange(J, device=dev)
        cells = {}
        res = {}
        for prec in ("f32", "bf16"):
            xo = tm.operand(X_, prec)
            tiles: dict = {}
            fn = lambda xo=xo, tiles=tiles: tm.grouped_matmul(  # noqa: E731
                pool, seg, off, ident, xo, q, R, n, E, options=options(prec), tiles=tiles
            )
            res[prec] = fn()
            cells[prec] = (timed(fn, reps), rel(res[prec], res["f32"]) if prec == "bf16" else None)
        A, B = torch.randn(J, n, device=dev, dtype=torch.bfloat16), torch.randn(R, n, device=dev, dtype=torch.bfloat16)
        cells["torch"] = (timed(lambda A=A, B=B: A @ B.T, reps), None)
        row(name, 2.0 * J * R * n, cells)
    res, cells = {}, {}
    for prec in ("f32", "bf16"):
        fn = lambda prec=prec: tm.moe_prefill(pool, slot_off, x, w, roles, options(prec), n_experts=E)  # noqa: E731
        res[prec] = fn()
        cells[prec] = (timed(fn, reps), rel(res[prec], res["f32"]) if prec == "bf16" else None)
    A, B = torch.randn(J, D, device=dev, dtype=torch.bfloat16), torch.randn(F, D, device=dev, dtype=torch.bfloat16)
    cells["torch"] = (3 * timed(lambda: A @ B.T, reps), None)
    row("moe", 6.0 * J * F * D, cells)
    if hasattr(torch, "_grouped_mm"):
        try:
            y, (gu, wd) = moe_dq_gmm(pool, stride, slot_off, x, w, roles, q)
            eid = slot_off // stride
            c2 = {
                "dq+gmm": (timed(lambda: moe_dq_gmm(pool, stride, slot_off, x, w, roles, q), reps), rel(y, res["f32"])),
                "gmm only": (timed(lambda: gmm_part(gu, wd, eid, x, w), reps), None),
            }
            row("moe*", 6.0 * J * F * D, c2)
        except Exception as e:  # noqa: BLE001
            print(f"  moe* dq+gmm failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    for k in layer:
        layer[k] += cells[k][0]
    print("  layer  " + "  ".join(f"{k} {ms:7.3f} ms -> {T / (LAYERS * ms / 1e3):8.0f} tok/s" for k, ms in layer.items()))


def sweep_type(q: QType, T: int, reps: int, rng, dev) -> None:
    """grouped_bf16 candidates on gate, down (grouped) and q, k, o (dense); winners per workload and class."""
    cands = [dict(BR=br, BT=bt, NB=nb, num_warps=nw)
             for br, bt, nb, nw in itertools.product((64, 128), (32, 64, 128), (1, 2), (4, 8))]  # fmt: skip
    pool, stride, roles = expert_pool(q, rng, dev)
    slot_off, _ = routing(T, stride, dev)
    flat = slot_off.reshape(-1)
    order = torch.argsort(flat, stable=True)
    seg, tok = flat[order], order // K
    J = T * K
    xs = {n: torch.randn(T, n, device=dev).to(torch.bfloat16) for n in {D, *(n for _, n in TRUNK.values())}}
    h = torch.randn(J, F, device=dev).to(torch.bfloat16)
    tiles: dict = {}  # the tile tables by BT, built once (moe_prefill builds them once a layer)
    work = {
        "gate": (F, lambda c: tm.grouped_matmul(pool, seg, roles["gate"][0], tok, xs[D], q, F, D, E, cfg=c, tiles=tiles)),
        "down": (D, lambda c, i=torch.arange(J, device=dev): tm.grouped_matmul(
            pool, seg, roles["down"][0], i, h, q, D, F, E, cfg=c, tiles=tiles)),
    }  # fmt: skip
    for name, (R, n) in TRUNK.items():
        raw = torch.from_numpy(random_weight(q, (R, n), rng)).to(dev)
        work[name] = (R, lambda c, raw=raw, R=R, n=n: tm.dense_matmul(raw, xs[n], q, R, n, cfg=c))
    times: dict = {}
    for name, (R, fn) in work.items():
        for c in cands:
            key = tuple(c.values())
            try:
                times[name, key] = timed(lambda c=c: fn(c), reps, warmup=2)
            except Exception as e:  # a candidate that does not compile (resources) is skipped
                times[name, key] = float("inf")
                print(f"  {name} {c}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
        best = min(cands, key=lambda c: times[name, tuple(c.values())])
        default = ks.launch("grouped_bf16", q, R, ks.device_name(dev))
        dkey = tuple(default[k] for k in ("BR", "BT", "NB", "num_warps"))
        print(f"  {name:<5} best {best} {times[name, tuple(best.values())]:.3f} ms; default {default} "
              f"{times.get((name, dkey), float('nan')):.3f} ms", flush=True)  # fmt: skip
    for cls in ("S", "M"):
        names = [nm for nm, (R, _) in work.items() if ks.shape_class(R) == cls]
        best = min(cands, key=lambda c: sum(times[nm, tuple(c.values())] for nm in names))
        print(f'  "grouped_bf16:{q.name}:{cls}": {json.dumps(best)},   (sum of {", ".join(names)})')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    assert torch.cuda.is_available(), "a CUDA GPU is needed"
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    for name in a.types.split(","):
        q = QType[name.strip()]
        assert block_format(q).block_size in (32, 256)
        (sweep_type if a.sweep else bench_type)(q, a.tokens, a.reps, rng, dev)


if __name__ == "__main__":
    main()
