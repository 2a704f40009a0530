# ruff: noqa: B023, E702, E401  (lab script: lambdas run inside the loop iteration that made them)
"""Eager calls of one workload for Nsight Compute: WL=moe|q|o|kv, ACT=f32|q8, QT=Q4_K; prints the
compiled kernels' registers and spills. Run, e.g.: WL=q ACT=f32 ncu --target-processes all
--kernel-name regex:_gemv_kernel --launch-skip 6 --launch-count 1 --section SpeedOfLight --section
Occupancy --section WarpStateStats python3 packaging/gpu_labs/ncu_driver.py"""

import os

import torch

from engine.bench import device_kernels as dk
from engine.quant.formats import QType
from engine.runtime import triton_gemv as tg
from engine.runtime import triton_moe as tm

q = QType[os.environ.get("QT", "Q4_K")]
act = os.environ.get("ACT", "f32")
wl = os.environ.get("WL", "moe")
if wl == "moe":
    layers = 24
    pool, stride, roles = dk._slot_pool(q, layers * dk.KE)
    offs = [(torch.randperm(dk.KE) + dk.KE * i).view(1, dk.KE).cuda() * stride for i in range(layers)]
    x = torch.randn(1, dk.D, device="cuda")
    w = torch.rand(1, dk.KE, device="cuda")
    for o in offs:
        tm.moe_decode(pool, o, x, w, roles, act=act)
else:
    rows, n = dk.TRUNK[wl]
    mats = dk.random_matrix(q, rows, n, 24)
    x = torch.randn(1, n, device="cuda")
    for m in mats:
        tg.matmul(m, x, q, rows, n, act=act)
torch.cuda.synchronize()
for fn in (tm._gate_up_kernel, tm._down_kernel, tg._gemv_kernel):
    try:
        for caches in fn.device_caches.values():
            for k in caches[0].values():
                print(fn.fn.__name__, "regs", k.n_regs, "spills", k.n_spills, "shared", k.metadata.shared)
    except Exception as e:
        print("meta err", e)
