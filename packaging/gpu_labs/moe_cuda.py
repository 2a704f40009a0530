"""LAB, NOT ADOPTED — can *any* kernel reach the ≥ 70 % line of issue #7 on the routed experts, given full control
of the memory system? The Q4_K routed experts of one decode token, and Q4_K trunk GEMVs, in CUDA C
(moe_fused.cu), built here with NVRTC and launched on the GPU box by CuPy on torch's stream:

  moe_fused   one persistent launch (a program an SM): every weight byte a program needs (its gate/up rows, its
              down rows of all 8 experts) is requested at its start by bulk asynchronous copies into shared
              memory (cp.async.bulk + mbarriers, sm_90); h as rows land; one grid barrier; ĥ; the down from
              shared memory. CH: gate/up rows a copy.
  moe_splitf  no grid barrier: program (j, k) makes pair k's ĥ block j (32 rows, its gate/up rows by cp.async)
              and adds the matching 32 down columns into y with float atomics (PF: its down slice prefetched
              into L2 at its start).
  moe_plain   moe_fused's one launch and grid barrier, but the gate/up half-blocks loaded straight into registers
              by plain 16-byte loads before anything waits (the Triton kernels' way), the down rows by cp.async
              after them, and each program's ĥ block made before the barrier (192 programs, 2 an SM).
  gemv_q/o    a Q4_K trunk GEMV, a program's rows bulk-copied at its start.

Triton cannot express the first (no shared-memory staging or bulk copies under the programmer's control). Every
kernel matches the engine to < 5e-7 (moe_decode_q8_reference, triton_q4k_gemv).

Measured on an H100 (session 11, docs/benchmarks-gpu.md; µs a call in the bench's CUDA-graph chain over ≥ 1 GB of
distinct weights, moe_half.chain_setup; CuPy cannot ask for programmatic dependent launch, the engine's Triton
kernels have it; line = 70 % of the measured bandwidth = 10.2 µs for the 21.2 MB):

  engine moe_decode (Triton: gate/up, quantize h, down)                 15.8–15.9 µs (45 %)
  moe_fused, 16 warps, a program an SM, CH 1                            20.6 µs (35 %); CH 8 / 64: 21.0
    … no dot products / + no rounding of h / + no barrier                 19.3 / 14.4 / 12.2
    … only the gate/up bulk copies (14.2 MB)                               9.9
  moe_splitf, 16 warps, PF 0 (PF 1 is 5 µs slower)                      20.9 µs (34 %); neither dots nor atomics 18.5
  moe_plain, 16 warps (8: 19.7, 4: 20.5)                                19.1 µs (37 %); no dots 15.8, no barrier 16.6,
                                                                         neither 13.5 (53 %)
  trunk q [4096, 2048] / o [2048, 4096], best                            4.8 / 4.4 µs (engine 3.3 / 4.0)

So the stream itself is the wall: bulk copies of the whole 21.2 MB with nothing else in the launch take 12.2 µs
(58 %), plain loads with the launch's own bookkeeping 13.5 µs; the grid barrier adds 2.1–2.5 µs, and a token's h
must be whole before any down row is final.

  python3 packaging/gpu_labs/moe_cuda.py export               # here: NVRTC (pip download nvidia-cuda-nvrtc-cu12,
                                                               # unzip, NVRTC=<libnvrtc.so.12>) -> .devwheels/cuda
  PYTHONPATH=. python3 packaging/gpu_labs/moe_cuda.py run      # on the GPU box (CuPy, torch): parity, timings
  (FUSED="16,1 8,8" picks moe_fused's (warps, CH) settings, FUSED="" none; SPLITF=0 / TRUNK=0 skip those)
"""
# ruff: noqa: E731, B023

import ctypes
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", ".devwheels", "cuda")
NWS = (4, 8, 16)
CHS = (1, 8, 64)  # gate/up rows a bulk copy
sys.path.insert(0, HERE)


def _nvrtc():
    paths = glob.glob(os.environ.get("NVRTC", "/tmp/nvrtc/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
    if not paths:
        sys.exit(
            "NVRTC not found: pip download nvidia-cuda-nvrtc-cu12 --no-deps, unzip, and set NVRTC=<libnvrtc.so.12>"
        )
    return ctypes.CDLL(paths[0])


def compile_cubin(src: str, opts: list[str]) -> bytes:
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"moe_fused.cu", 0, None, None) == 0
    o = [s.encode() for s in opts]
    rc = lib.nvrtcCompileProgram(prog, len(o), (ctypes.c_char_p * len(o))(*o))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(log.value.decode())
    if log.value.strip():
        print(log.value.decode())
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    assert lib.nvrtcGetCUBIN(prog, buf) == 0
    return buf.raw


def export():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(HERE, "moe_fused.cu")) as f:
        src = f.read()
    for nw in NWS:
        for ch in CHS:
            cub = compile_cubin(src, ["--gpu-architecture=sm_90", "--std=c++17", f"-DNW={nw}", f"-DCH={ch}"])
            with open(os.path.join(OUT, f"moe_fused_nw{nw}_ch{ch}.cubin"), "wb") as f:
                f.write(cub)
            print(f"nw {nw} ch {ch}: {len(cub)} bytes")


class Kernels:
    """The cubins, loaded by CuPy, launched on torch's current stream."""

    def __init__(self):
        import cupy

        self.cupy = cupy
        self.mods = {(nw, ch): cupy.RawModule(path=os.path.join(OUT, f"moe_fused_nw{nw}_ch{ch}.cubin"))
                     for nw in NWS for ch in CHS}  # fmt: skip
        self.sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def _fn(self, name, nw, ch, smem):
        fn = self.mods[nw, ch].get_function(name)
        fn.max_dynamic_shared_size_bytes = smem
        return fn

    def fits(self, name, nw, G, smem, ch=1):
        """Whether G programs are resident at once (a grid barrier needs it)."""
        fn = self._fn(name, nw, ch, smem)
        per = self.cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, 32 * nw, smem)
        return per * self.sms >= G, per

    def __call__(self, name, nw, G, smem, *args, ch=1):
        import numpy as np
        import torch

        fn = self._fn(name, nw, ch, smem)
        a = tuple(np.uint64(x.data_ptr()) if isinstance(x, torch.Tensor) else np.int32(x) for x in args)
        with self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            fn(G if isinstance(G, tuple) else (G,), (32 * nw,), a, shared_mem=smem)


def moe_smem(G):
    """moe_fused's shared memory at G programs (the .cu file's map: x̂, ĥ, gate/up rows, padded down rows)."""
    D, KF = 2048, 8 * 768
    maxr, maxd = -(-KF // G), -(-D // G)
    return 13312 + maxr * 2304 + 8 * (maxd * 432 + 48)


def gemv_smem(G, R, nb):
    return 13312 + 2304 + -(-R // G) * nb * 144


def run():
    import moe_half
    import torch

    from engine.bench import device_kernels as dk
    from engine.quant.formats import QType
    from engine.runtime import triton_moe as tm
    from engine.runtime import triton_q4k_gemv as g4
    from engine.runtime import triton_q4k_moe as q4
    from engine.runtime import triton_q8 as t8
    from engine.runtime import triton_q8_moe as m8

    kern = Kernels()
    bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = moe_half.chain_setup()
    (go, _, _, _), (uo, _, _, _), (do, _, _, _) = (roles[r] for r in ("gate", "up", "down"))
    flat = pool.reshape(-1)
    XQ, XD, XS = (t.reshape(-1).contiguous() for t in xq)
    wt = w.reshape(-1).contiguous()
    sync = torch.zeros(64, dtype=torch.int32, device="cuda")
    H = torch.empty(K * F, dtype=torch.float32, device="cuda")
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    print(f"SMs {kern.sms}; line: 70 % of {bw:.0f} GB/s = {nbytes / (0.7 * bw * 1e3):.2f} us for the moe", flush=True)

    o0 = offs[0]
    ref = m8.moe_decode_q8_reference(pool, o0.view(1, K), x, w, roles)
    eng = tm.moe_decode(pool, o0.view(1, K), x, w, roles, act="q8")
    print(f"engine vs reference: {rel(eng, ref):.2e}", flush=True)

    def moe(nw, G, o, mode=0, y=None, ch=1):
        y = torch.empty(D, dtype=torch.float32, device="cuda") if y is None else y
        kern("moe_fused", nw, G, moe_smem(G), flat, o, XQ, XD, XS, wt, H, y, sync, go, uo, do, G, mode, ch=ch)
        return y

    us = graph([lambda o=o: tm.moe_decode(pool, o.view(1, K), x, w, roles, act="q8") for o in offs])
    print(f"engine moe_decode (Triton, PDL): {frac(us, nbytes)}", flush=True)
    # where a wrong sum would come from: h (gate/up) against the engine's, then y
    href = q4.gate_up(pool, o0, x, roles, K, {"BR": 8, "num_warps": 2}, xq)
    got = moe(16, kern.sms, o0).view(1, D)
    print(f"parity nw 16: h {rel(H.view(K, F), href):.1e}, y {rel(got, ref):.1e}, y again "
          f"{rel(moe(16, kern.sms, o0).view(1, D), ref):.1e}", flush=True)  # fmt: skip
    sms = kern.sms
    modes = {0: "", 1: "no dot", 5: "no dot/round", 7: "no dot/round/barrier", 13: "no dot/round/down copies",
             15: "copies of gate/up only"}  # fmt: skip
    grids = {(16, 1): sms, (16, 8): sms, (16, 64): sms, (8, 1): 2 * sms, (8, 8): 2 * sms}
    picked = [tuple(map(int, c.split(","))) for c in os.environ.get("FUSED", "16,1 16,8 16,64 8,1 8,8").split()]
    for nw, ch in picked:
        G = grids[nw, ch]
        ok, per = kern.fits("moe_fused", nw, G, moe_smem(G), ch)
        if not ok:
            print(f"moe nw {nw} G {G}: does not fit ({per} an SM, smem {moe_smem(G)})", flush=True)
            continue
        e = rel(moe(nw, G, o0, ch=ch).view(1, D), ref)
        ys = [torch.empty(D, dtype=torch.float32, device="cuda") for _ in offs]
        line = []
        for mode, label in modes.items():
            us = graph([lambda o=o, y=y: moe(nw, G, o, mode, y, ch) for o, y in zip(offs, ys)])
            line.append(f"{label or 'whole'} {us:5.2f}")
        print(f"moe fused nw {nw:2d} G {G:3d} ch {ch:2d} ({per} an SM, {moe_smem(G) // 1024} KB), parity {e:.1e}: "
              + " | ".join(line), flush=True)  # fmt: skip

    if os.environ.get("SPLITF", "1") == "1":
        split_f(kern, flat, K, F, D, offs, XQ, XD, XS, wt, go, uo, do, ref, rel, graph, frac, nbytes)
    plain(kern, flat, K, F, D, offs, XQ, XD, XS, wt, go, uo, do, ref, rel, graph, frac, nbytes, sync)
    if os.environ.get("TRUNK", "1") == "0":
        return
    for m, (R, n) in {"q": (4096, 2048), "o": (2048, 4096)}.items():
        nb = n // 256
        copies = max(48, int(-(-dk.GB // (R * nb * 144))))
        mats = dk.random_matrix(QType.Q4_K, R, n, copies)
        xm = torch.randn(1, n, device="cuda")
        xqm = t8.quantize_act(xm)
        mq, md, ms = (t.reshape(-1).contiguous() for t in xqm)
        want = g4.gemv(mats[0], xm, R, n, {"BR": 8, "num_warps": 2, "PF": 0}, xqm)
        mb = R * nb * 144
        us = graph([lambda a=a: g4.gemv(a, xm, R, n, {"BR": 4, "num_warps": 1, "PF": 1}, xqm) for a in mats])
        print(f"{m} [{R}, {n}] engine (Triton, PDL, 4 x 1, PF): {frac(us, mb)}", flush=True)
        name = "gemv_q" if nb == 8 else "gemv_o"
        for nw in NWS:
            for G in (sms, 2 * sms, 4 * sms):
                smem = gemv_smem(G, R, nb)
                ok, per = kern.fits(name, nw, G, smem)
                if not ok:
                    continue
                ys = [torch.empty(R, dtype=torch.float32, device="cuda") for _ in range(copies)]
                call = lambda a, y: kern(name, nw, G, smem, a, mq, md, ms, y, R, G)
                call(mats[0], ys[0])
                e = rel(ys[0].view(1, R), want)
                us = graph([lambda a=a, y=y: call(a, y) for a, y in zip(mats, ys)])
                print(f"{m} cuda nw {nw:2d} G {G:3d}: {frac(us, mb)}; parity {e:.1e}", flush=True)
                assert e < 1e-3, e


def split_f(kern, flat, K, F, D, offs, XQ, XD, XS, wt, go, uo, do, ref, rel, graph, frac, nbytes):
    """moe_splitf: no grid barrier; program (j, k) makes ĥ block j of pair k and adds its down columns into Y."""
    import torch

    smem = 13312 + 2 * 32 * 1152
    ys = [torch.zeros(D, dtype=torch.float32, device="cuda") for _ in offs]
    n = len(offs)

    def call(nw, i, pf, mode):
        kern("moe_splitf", nw, (F // 32, K), smem, flat, offs[i], XQ, XD, XS, wt, ys[i], ys[(i + 1) % n], go, uo, do,
             pf, mode)  # fmt: skip

    for nw in NWS:
        ok, per = kern.fits("moe_splitf", nw, 1, smem)
        for pf in (1, 0):
            ys[0].zero_()
            call(nw, 0, pf, 0)
            e = rel(ys[0].view(1, D), ref)
            line = []
            for mode, label in ((0, "whole"), (2, "no atomics"), (1, "no dot"), (3, "neither")):
                us = graph([lambda i=i: call(nw, i, pf, mode) for i in range(n)])
                line.append(f"{label} {frac(us, nbytes)}")
            print(f"moe split-F nw {nw:2d} PF {pf} ({per} an SM, {smem // 1024} KB), parity {e:.1e}: " + " | ".join(line),
                  flush=True)  # fmt: skip


def plain(kern, flat, K, F, D, offs, XQ, XD, XS, wt, go, uo, do, ref, rel, graph, frac, nbytes, sync):
    """moe_plain: one launch, gate/up bytes first as plain loads, ĥ made before the grid barrier."""
    import torch

    G = K * F // 32
    smem = 13312 + K * (-(-D // G) * 432 + 48)
    hq = torch.zeros(G * 8, dtype=torch.int32, device="cuda")
    hd = torch.zeros(G, dtype=torch.float32, device="cuda")
    hs = torch.zeros(2 * G, dtype=torch.float32, device="cuda")
    ys = [torch.zeros(D, dtype=torch.float32, device="cuda") for _ in offs]

    def call(nw, i, mode):
        kern("moe_plain", nw, G, smem, flat, offs[i], XQ, XD, XS, wt, hq, hd, hs, ys[i], sync, go, uo, do, mode)

    for nw in (8, 16, 4):
        ok, per = kern.fits("moe_plain", nw, G, smem)
        if not ok:
            print(f"moe plain nw {nw}: {per} an SM, does not fit", flush=True)
            continue
        call(nw, 0, 0)
        e = rel(ys[0].view(1, D), ref)
        line = []
        for mode, label in ((0, "whole"), (1, "no dot"), (2, "no barrier"), (3, "neither")):
            us = graph([lambda i=i: call(nw, i, mode) for i in range(len(offs))])
            line.append(f"{label} {frac(us, nbytes)}")
        print(f"moe plain nw {nw:2d} ({per} an SM, {smem // 1024} KB), parity {e:.1e}: " + " | ".join(line), flush=True)
        assert e < 1e-3, e


if __name__ == "__main__":
    {"export": export, "run": run}[sys.argv[1] if len(sys.argv) > 1 else "run"]()
