# ruff: noqa: B023, E702, E401  (lab script: lambdas run inside the loop iteration that made them)
"""What a pure streaming read reaches in Triton on this GPU, one launch per matrix, in a CUDA graph
rotating over >= 1 GB: the ceiling for any decode GEMV of that size without programmatic dependent
launch. Run on the GPU machine from the repo root: PYTHONPATH=. python3 packaging/gpu_labs/pure_loads.py
H100, 2026-11-22 (session 4): a 4.2 MB read takes 3.09 us at best (46 % of the copy bandwidth),
whatever the tile; docs/benchmarks-gpu.md has the table."""

import math

import torch
import triton
import triton.language as tl

from engine.bench import device_kernels as dk


@triton.jit
def load_only(W, Y, nw, BR: tl.constexpr, BW: tl.constexpr, STEPS: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    acc = tl.zeros([BR, BW], dtype=tl.int32)
    base = W + rows.to(tl.int64)[:, None] * nw + tl.arange(0, BW)[None, :]
    for s in tl.static_range(STEPS):
        acc ^= tl.load(base + s * BW)
    tl.store(Y + rows, tl.xor_sum(acc, 1))


@triton.jit
def load_loop(W, Y, nw, BR: tl.constexpr, BW: tl.constexpr, NS: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    acc = tl.zeros([BR, BW], dtype=tl.int32)
    base = W + rows.to(tl.int64)[:, None] * nw + tl.arange(0, BW)[None, :]
    for s in tl.range(0, nw, BW, num_stages=NS):
        acc ^= tl.load(base + s)
    tl.store(Y + rows, tl.xor_sum(acc, 1))


bw = dk.measure_bandwidth()
print(f"copy bw {bw:.0f} GB/s", flush=True)
GB = 1e9
for name, rows, nw in (
    ("q-like 4096x256w (4 MB)", 4096, 256),
    ("o-like 2048x512w", 2048, 512),
    ("moe-like 12288x288w (14 MB)", 12288, 288),
    ("big 16384x1024w (64MB)", 16384, 1024),
):
    nbytes = rows * nw * 4
    copies = max(8, math.ceil(GB / nbytes))
    W = torch.randint(-(2**31), 2**31 - 1, (copies, rows * nw), dtype=torch.int32, device="cuda")
    Y = torch.empty(rows, dtype=torch.int32, device="cuda")
    cp = dk.copy_floor_us(nbytes * 2)  # copy floor: read nbytes, write nbytes
    print(
        f"{name}: read {nbytes / 1e6:.1f} MB; ideal {nbytes / bw / 1e3:.2f} us; copy(read+write same read) {cp:.2f} us",
        flush=True,
    )
    res = []
    for BR in (1, 2, 4, 8, 16):
        for BW in (64, 128, 256, 512):
            if nw % BW and nw > BW:
                continue
            if BR * BW > 8192 or BR * BW < 128:
                continue
            for warps in (2, 4, 8):
                if BR * BW // (32 * warps) < 1:
                    continue
                steps = -(-nw // BW)
                try:
                    if steps <= 16 and nw % BW == 0:
                        us = dk._graph_us(
                            [
                                lambda m=m: load_only[(triton.cdiv(rows, BR),)](
                                    m, Y, nw, BR=BR, BW=BW, STEPS=steps, num_warps=warps
                                )
                                for m in W
                            ]
                        )[0]
                        res.append((us, f"unrolled BR{BR} BW{BW} w{warps}"))
                    for ns in (2, 4):
                        if nw % BW == 0:
                            us = dk._graph_us(
                                [
                                    lambda m=m: load_loop[(triton.cdiv(rows, BR),)](
                                        m, Y, nw, BR=BR, BW=BW, NS=ns, num_warps=warps
                                    )
                                    for m in W
                                ]
                            )[0]
                            res.append((us, f"loop{ns} BR{BR} BW{BW} w{warps}"))
                except Exception as e:
                    print("  err", BR, BW, warps, type(e).__name__, str(e)[:100])
    res.sort()
    if not res:
        print("   no setting divides this row width", flush=True)
        continue
    for us, lab in res[:6]:
        print(f"   {us:7.2f} us  {nbytes / us / 1e3:6.0f} GB/s ({nbytes / us / 1e3 / bw:4.0%})  {lab}", flush=True)
    print(f"   worst {res[-1][0]:.2f} {res[-1][1]}", flush=True)
    del W
    torch.cuda.empty_cache()
