"""The Q4_K MoE tiles the other way round: [rows, half-blocks] instead of the engine's [half-blocks, rows]
(triton_q4k_moe). Triton picks the blocked layout of a tile from its shape, and the two orientations swap
between Triton versions (``--sass`` counts the sm_90 code offline with Triton's own ptxas):

- Triton 3.6 (the H100 boxes): the engine's tiles give a thread several *rows* at one half-block — the q8
  activations loaded once for them, a row's sum in its warp (gate/up 8 × 2 warps: 78 registers, 32 loads,
  1 barrier) — and these tiles give it several half-blocks, a row's sum across warps through shared
  memory (164 registers, 32 loads, 27 barriers).
- Triton 3.9 (this repository's CPU venv): the reverse — the engine's tiles compile to 86 registers,
  43 loads and 3 barriers, these to 80 / 32 / 1 at 16 × 4 warps.

Measured on the H100 (Triton 3.6, 2026-11-22, docs/benchmarks-gpu.md "Session 9"): these tiles lose there
(gate/up 8.27 µs at best against 8.01, down 6.97 against 5.45, whole call 16.49 against 14.21 µs). Under
Triton 3.7–3.9 they win (session 10, cubin_lab.py) and are the engine's default there.
Same arithmetic, same results (parity < 1e-6 with the engine's kernels).

  TRITON_INTERPRET=1 PYTHONPATH=. python3 packaging/gpu_labs/moe_rows.py      # parity, no GPU
  PYTHONPATH=. python3 packaging/gpu_labs/moe_rows.py                         # + H100 timings
  PYTHONPATH=. python3 packaging/gpu_labs/moe_rows.py --sass                  # sm_90 SASS counts, no GPU
  (GU / DN = "BR,warps ..." settings swept)
"""
# ruff: noqa: E731, B023

import os
import sys

import numpy as np
import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_half import cfgs  # noqa: E402  ("a,b,... a,b,..." launch settings from $var)

from engine.quant.formats import QType  # noqa: E402
from engine.runtime import triton_q4k_moe as q4  # noqa: E402
from engine.runtime import triton_q8 as t8  # noqa: E402
from engine.runtime import triton_qblocks as qb  # noqa: E402

Q = QType.Q4_K


# The kernels are the engine's now (session 10): triton_q4k_moe._gate_up_kernel_t / _down_kernel_t, launch
# setting TILE "rows" — the default from Triton 3.7 on (triton_gemv.LAUNCH_BY_TRITON).
gate_up_kernel = q4._gate_up_kernel_t
down_kernel = q4._down_kernel_t


def gate_up(pool, slots, xq, roles, K, BR, warps):
    (go, _, F, D), (uo, _, _, _) = roles["gate"], roles["up"]
    XQ, XD, XS = xq
    dev = XQ.device
    pdl = qb.pdl(dev)
    H = torch.empty((slots.numel(), F), dtype=torch.float32, device=dev)
    gate_up_kernel[(F // BR, slots.numel())](
        pool.reshape(-1).view(torch.int32), slots, XQ, XD, XS, H, go, uo, F=F, K=K, NB=D // 256, BR=BR,
        ASM=t8.use_asm(dev), PDL=pdl, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return H


def down(pool, slots, hq, weights, roles, K, BR, warps):
    do, _, D, F = roles["down"]
    HQ, HD, HS = hq
    dev = HQ.device
    pdl = qb.pdl(dev)
    T = slots.numel() // K
    Y = torch.empty((T, D), dtype=torch.float32, device=dev)
    flat = pool.reshape(-1)
    down_kernel[(D // BR, T)](
        flat, flat.view(torch.int32), slots, HQ, HD, HS, weights.reshape(-1).contiguous(), Y, do, D=D, K=K,
        NBF=F // 256, BR=BR, ASM=t8.use_asm(dev), PDL=pdl, PF=0, NT=32 * warps, num_warps=warps, **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y


def parity(dev):
    from tests.triton_data import expert_pool, routing_case

    rng = np.random.default_rng(7)
    F, D, E, K = (256, 512, 3, 2) if dev == "cpu" else (768, 2048, 16, 8)
    pool, stride, roles = expert_pool((Q, Q, Q), F, D, E, dev, rng)
    gu_cfg, dn_cfg = q4_cfg(dev)
    for T in (1, 3):
        slot_off, x, w = routing_case(T, K, E, D, stride, dev, rng)
        slots = slot_off.reshape(-1).contiguous()
        xq = t8.quantize_act(x)
        ref_h = q4.gate_up(pool, slots, x, roles, K, gu_cfg, xq)
        for BR, wp in cfgs("GU", "8,2 4,1" if dev == "cpu" else "8,2 16,4 32,4 16,2 32,8"):
            h = gate_up(pool, slots, xq, roles, K, BR, wp)
            e = ((h - ref_h).norm() / ref_h.norm()).item()
            assert e < 1e-6, ("gate/up", BR, wp, e)
        hq = t8.quantize_act(ref_h)
        ref_y = q4.down(pool, slots, ref_h, w, roles, K, dn_cfg)
        for BR, wp in cfgs("DN", "4,1 2,2" if dev == "cpu" else "4,1 4,2 8,2 8,4 16,4"):
            y = down(pool, slots, hq, w, roles, K, BR, wp)
            e = ((y - ref_y).norm() / ref_y.norm()).item()
            assert e < 1e-6, ("down", BR, wp, e)
        print(f"parity T={T}: [rows, half-blocks] tiles match the engine's kernels (< 1e-6)", flush=True)


def q4_cfg(dev):
    return ({"BR": 8, "num_warps": 2}, {"BR": 4, "num_warps": 1, "PF": 0}) if dev == "cuda" else (
        {"BR": 8, "num_warps": 1}, {"BR": 4, "num_warps": 1, "PF": 0})  # fmt: skip


def gpu():
    import moe_half

    bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = moe_half.chain_setup()
    gu_cfg, dn_cfg = q4_cfg("cuda")
    us = graph([lambda o=o: q4.gate_up(pool, o, x, roles, K, gu_cfg, xq) for o in offs])
    print(f"engine gate/up {gu_cfg}: {frac(us, gu_bytes)}", flush=True)
    best = {}
    for BR, wp in cfgs("GU", "8,2 16,4 32,4 16,2 32,8 8,1 16,1 32,2"):
        us = graph([lambda o=o: gate_up(pool, o, xq, roles, K, BR, wp) for o in offs])
        best["gu"] = min(best.get("gu", (1e9, None)), (us, (BR, wp)))
        print(f"rows gate/up BR {BR} warps {wp}: {frac(us, gu_bytes)}", flush=True)
    h = torch.randn(K, F, device="cuda")
    us = graph([lambda o=o: q4.down(pool, o, h, w, roles, K, dn_cfg) for o in offs])
    print(f"engine quantize h + down {dn_cfg}: {frac(us, dn_bytes)}", flush=True)
    for BR, wp in cfgs("DN", "4,1 4,2 8,2 8,4 16,4 2,1 16,8"):
        us = graph([lambda o=o: down(pool, o, hq, w, roles, K, BR, wp) for o in offs])
        best["dn"] = min(best.get("dn", (1e9, None)), (us, (BR, wp)))
        print(f"rows down (h̃ given) BR {BR} warps {wp}: {frac(us, dn_bytes)}", flush=True)
    g, dn = best["gu"][1], best["dn"][1]
    for label, fn in {
        "engine (x̂ given): gate/up, quantize h, down": lambda o: q4.down(
            pool, o, q4.gate_up(pool, o, x, roles, K, gu_cfg, xq), w, roles, K, dn_cfg),
        f"rows (x̂ given): gate/up {g}, quantize h, down {dn}": lambda o: down(
            pool, o, t8.quantize_act(gate_up(pool, o, xq, roles, K, *g)), w, roles, K, *dn),
    }.items():  # fmt: skip
        us = graph([lambda o=o: fn(o) for o in offs])
        print(f"{label}: {frac(us, nbytes)}", flush=True)


def show_sass(label, fn, sig, const, warps):
    """Compile ``fn`` for sm_90 offline (Triton's own ptxas; pointer arguments 16-byte aligned as the JIT
    assumes) and print its registers and counts of loads (16-byte ones apart), barriers, shared-memory ops,
    shuffles and dp4a."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    nv = os.path.dirname(triton.__file__) + "/backends/nvidia/bin/"
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})  # fmt: skip
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([nv + "cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
        s = subprocess.run([nv + "nvdisasm", "-c", f.name], capture_output=True, text=True).stdout
    ins = [ln for ln in s.splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/", ln)]
    n = lambda op: sum(op in ln for ln in ins)
    reg = re.search(r"REG:(\d+)", res).group(1)
    print(f"{label:<34} regs {reg:>3}  SASS {len(ins):4d}  LDG {n('LDG'):3d} (128-bit {n('LDG.E.128'):3d})  "
          f"BAR {n('BAR'):2d}  LDS/STS {n('LDS') + n('STS'):2d}  SHFL {n('SHFL'):2d}  IDP {n('IDP'):3d}")  # fmt: skip


def sass():
    """Registers, loads, barriers and dp4a of each kernel at sm_90 (offline: Triton's own ptxas)."""
    pk = dict(ASM=True, PDL=1)
    show = lambda label, fn, sig, const, warps: show_sass(label, fn, sig, const | pk, warps)

    s_gu = {"W32": "*i32", "SLOT": "*i64", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "H": "*fp32", "go": "i32",
            "uo": "i32"}  # fmt: skip
    s_dn = {"W32": "*i32", "SLOT": "*i64", "HQ": "*i32", "HD": "*fp32", "HS": "*fp32", "WT": "*fp32", "Y": "*fp32",
            "do": "i32"}  # fmt: skip
    c = lambda sig, **kw: ({**sig, **{k: "constexpr" for k in kw}, "ASM": "constexpr", "PDL": "constexpr"}, kw)
    for BR, wp in cfgs("GU", "8,2 16,4 32,4 16,2 32,8"):
        show(f"engine gate/up BR {BR} warps {wp}", q4._gate_up_kernel, *c(s_gu, F=768, K=8, NB=8, BR=BR), wp)
        show(f"rows gate/up BR {BR} warps {wp}", gate_up_kernel, *c(s_gu, F=768, K=8, NB=8, BR=BR), wp)
    s_dn_e = {"W": "*u8", **s_dn}
    for BR, wp in cfgs("DN", "4,1 4,2 8,2 8,4 16,4"):
        sig, kw = c(s_dn_e, D=2048, K=8, NBF=3, BR=BR)
        sig.update(PF="constexpr", NT="constexpr")
        show(f"engine down BR {BR} warps {wp}", q4._down_kernel, sig, {**kw, "PF": 0, "NT": 32 * wp}, wp)
        show(f"rows down BR {BR} warps {wp}", down_kernel, sig, {**kw, "PF": 0, "NT": 32 * wp}, wp)


if __name__ == "__main__":
    if "--sass" in sys.argv:
        sass()
    elif os.environ.get("TRITON_INTERPRET") == "1":
        parity("cpu")
    else:
        parity("cuda")
        gpu()
    sys.exit(0)
