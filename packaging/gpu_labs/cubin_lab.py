"""The routed-expert kernels as another Triton compiles them, timed on a GPU that has a different Triton.

The lent GPU boxes carry torch 2.11 + Triton 3.6; a GPU user who installs today's torch gets Triton 3.9, whose
blocked layouts give the Q4_K MoE tiles the other orientation (``moe_rows.py --sass``, session 9). A Triton
wheel is too large to carry to the box, but its output is not: ``export`` compiles the kernels for sm_90 here
(Triton's own ptxas, no GPU) into ``.devwheels/cubins/`` (cubin + launch facts), and ``run`` loads those
cubins on the box with CuPy and launches them on torch's stream, so the bench's CUDA-graph chain timer
(moe_half.chain_setup) times them beside the box's own JIT build of the same source. Everything runs without
programmatic dependent launch (``SHARPI_PDL=0``; a CuPy launch cannot ask for it), so the figures compare
the compilers and tile orientations, not the engine's PDL chain.

  PYTHONPATH=. python3 packaging/gpu_labs/cubin_lab.py export     # here: the local Triton's sm_90 cubins
  PYTHONPATH=<an unpacked triton wheel>:. python3 packaging/gpu_labs/cubin_lab.py export   # another version's
  PYTHONPATH=. python3 packaging/gpu_labs/cubin_lab.py run        # on the GPU box (CuPy, torch): parity, timings
  PYTHONPATH=. python3 packaging/gpu_labs/cubin_lab.py export-pdl # here: the kernels that PDL chains (PDL=1)
  PYTHONPATH=. python3 packaging/gpu_labs/cubin_lab.py run-pdl    # on the box: each cubin launched by the box's
                                                                  # own Triton launcher, with PDL, in the chain

Measured on the H100 (session 10, docs/benchmarks-gpu.md): from Triton 3.7 the [rows, half-blocks] gate/up wins
(under 3.9 with PDL: 7.6 µs against 11.1 for the old default), and the down and trunk settings move; the adopted
settings are triton_gemv.LAUNCH_BY_TRITON.

``run-pdl`` compiles each kernel with the box's Triton (``launch_pdl``), then swaps the loaded function for the
exported cubin's (same signature, same parameters), so the box's launcher starts another Triton's code with
programmatic dependent launch — the decode graph's conditions.
"""
# ruff: noqa: E731, B023

import json
import os
import re
import sys

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".devwheels", "cubins")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

S_GU = {"W32": "*i32", "SLOT": "*i64", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "H": "*fp32", "go": "i32",
        "uo": "i32"}  # fmt: skip
S_DN = {"W": "*u8", "W32": "*i32", "SLOT": "*i64", "HQ": "*i32", "HD": "*fp32", "HS": "*fp32", "WT": "*fp32",
        "Y": "*fp32", "do": "i32"}  # fmt: skip
S_GV = {"W": "*u8", "W32": "*i32", "XQ": "*i32", "XD": "*fp32", "XS": "*fp32", "Y": "*fp32", "R": "i32"}
# the engine's kernels, both tile orientations (TILE "halves": [half-blocks, rows]; "rows": [rows, half-blocks]),
# at the bench's shapes (30B-A3B: experts F 768, D 2048; trunk q [4096, 2048], o [2048, 4096])
GU_CFGS = ((8, 2), (16, 4), (16, 2), (32, 4), (8, 4))
DN_CFGS = ((4, 1), (4, 2), (8, 2), (8, 4), (2, 1), (16, 4))
GV_CFGS = ((8, 2), (16, 4), (8, 4), (16, 2), (4, 1))
TRUNK = {"q": (4096, 2048), "o": (2048, 4096)}


def kernels():
    from engine.runtime import triton_q4k_gemv as g4
    from engine.runtime import triton_q4k_moe as q4

    out = {}
    for kind, gu, dn, gv in (("halves", q4._gate_up_kernel, q4._down_kernel, g4._gemv_kernel),
                             ("rows", q4._gate_up_kernel_t, q4._down_kernel_t, g4._gemv_kernel_t)):  # fmt: skip
        for br, wp in GU_CFGS:
            out[f"{kind}_gu_{br}_{wp}"] = (gu, S_GU, dict(F=768, K=8, NB=8, BR=br, ASM=True, PDL=0), wp)
        for br, wp in DN_CFGS:
            c = dict(D=2048, K=8, NBF=3, BR=br, ASM=True, PDL=0, PF=0, NT=32 * wp)
            out[f"{kind}_dn_{br}_{wp}"] = (dn, S_DN, c, wp)
        for m, (_, n) in TRUNK.items():
            for br, wp in GV_CFGS:
                c = dict(NB=n // 256, BR=br, ASM=True, PDL=0, PF=0, NT=32 * wp)
                out[f"{kind}_{m}_{br}_{wp}"] = (gv, S_GV, c, wp)
    return out


def pdl_kernels():
    """The settings compared in the PDL chain (the engine's constexprs: PDL on; trunk rows prefetched)."""
    from engine.runtime import triton_q4k_gemv as g4
    from engine.runtime import triton_q4k_moe as q4

    fns = {"halves": (q4._gate_up_kernel, q4._down_kernel, g4._gemv_kernel),
           "rows": (q4._gate_up_kernel_t, q4._down_kernel_t, g4._gemv_kernel_t)}  # fmt: skip
    out = {}
    for kind, br, wp in (("halves", 8, 2), ("rows", 16, 4), ("rows", 8, 2)):
        out[f"{kind}_gu_{br}_{wp}"] = (fns[kind][0], S_GU, dict(F=768, K=8, NB=8, BR=br, ASM=True, PDL=1), wp)
    for kind, br, wp in (("halves", 4, 1), ("halves", 8, 2), ("rows", 4, 2), ("rows", 8, 4), ("rows", 16, 4)):
        c = dict(D=2048, K=8, NBF=3, BR=br, ASM=True, PDL=1, PF=0, NT=32 * wp)
        out[f"{kind}_dn_{br}_{wp}"] = (fns[kind][1], S_DN, c, wp)
    for m, (_, n) in TRUNK.items():
        for kind, br, wp in (("halves", 8, 2), ("halves", 8, 4), ("halves", 4, 1), ("rows", 8, 4)):
            c = dict(NB=n // 256, BR=br, ASM=True, PDL=1, PF=1, NT=32 * wp)
            out[f"{kind}_{m}_{br}_{wp}"] = (fns[kind][2], S_GV, c, wp)
    return out


def _compile(fn, sig, const, warps, pdl=False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {**sig, **{k: "constexpr" for k in const}}
    # what the JIT specialises for the bench's arguments: pointers and integers divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(full.values()) if t[0] in "*i"}
    opts = {"num_warps": warps, **({"launch_pdl": True} if pdl else {})}
    return triton.compile(ASTSource(fn, full, const, attrs), target=GPUTarget("cuda", 90, 32), options=opts)


def export(which="run"):
    import triton

    out = os.path.join(OUT + ("_pdl" if which == "pdl" else ""), triton.__version__)
    os.makedirs(out, exist_ok=True)
    ks = pdl_kernels() if which == "pdl" else kernels()
    for label, (fn, sig, const, warps) in ks.items():
        k = _compile(fn, sig, const, warps)
        ptx = k.asm["ptx"]
        entry = re.search(r"\.entry (\w+)\(([^)]*)\)", ptx)
        nparams = entry.group(2).count(".param")
        with open(os.path.join(out, label + ".cubin"), "wb") as f:
            f.write(k.asm["cubin"])
        facts = {"name": entry.group(1), "warps": warps, "shared": k.metadata.shared, "params": nparams,
                 "user_params": len(sig), "triton": triton.__version__}  # fmt: skip
        with open(os.path.join(out, label + ".json"), "w") as f:
            json.dump(facts, f)
    print(f"Triton {triton.__version__}: {len(ks)} kernels exported to {out}", flush=True)


class Cubin:
    """One exported kernel, launched by CuPy on torch's current stream (so torch's graph capture records it)."""

    def __init__(self, version, label):
        import cupy

        self.cupy = cupy
        with open(os.path.join(OUT, version, label + ".json")) as f:
            self.facts = json.load(f)
        self.fn = cupy.RawModule(path=os.path.join(OUT, version, label + ".cubin")).get_function(self.facts["name"])

    def __call__(self, grid, *args):
        import numpy as np
        import torch

        a = [np.uint64(x.data_ptr()) if isinstance(x, torch.Tensor) else np.int32(x) for x in args]
        a += [np.uint64(0)] * (self.facts["params"] - len(a))  # Triton's global / profile scratch: unused here
        with self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.fn(grid, (32 * self.facts["warps"],), tuple(a), shared_mem=self.facts["shared"])


def run():
    os.environ["SHARPI_PDL"] = "0"
    import moe_half
    import torch

    from engine.bench import device_kernels as dk
    from engine.quant.formats import QType
    from engine.runtime import triton_q4k_gemv as g4
    from engine.runtime import triton_q4k_moe as q4
    from engine.runtime import triton_q8 as t8

    bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = moe_half.chain_setup()
    (go, _, _, _), (uo, _, _, _), (do, _, _, _) = roles["gate"], roles["up"], roles["down"]
    flat = pool.reshape(-1)
    w32 = flat.view(torch.int32)
    wt = w.reshape(-1).contiguous()
    versions = sorted(os.listdir(OUT))
    built = {(v, label): Cubin(v, label) for v in versions for label in kernels()}
    print("cubins from Triton", versions, "; this box's Triton", __import__("triton").__version__, flush=True)

    def gu(v, kind, o, br, wp):
        H = torch.empty((o.numel(), F), dtype=torch.float32, device="cuda")
        built[v, f"{kind}_gu_{br}_{wp}"]((F // br, o.numel()), w32, o, *xq, H, go, uo)
        return H

    def dn(v, kind, o, br, wp):
        Y = torch.empty((1, D), dtype=torch.float32, device="cuda")
        built[v, f"{kind}_dn_{br}_{wp}"]((D // br, 1), flat, w32, o, *hq, wt, Y, do)
        return Y

    def gv(v, kind, m, raw, xqm, br, wp):
        rows = TRUNK[m][0]
        Y = torch.empty((1, rows), dtype=torch.float32, device="cuda")
        f = raw.reshape(-1)
        built[v, f"{kind}_{m}_{br}_{wp}"](((rows + br - 1) // br,), f, f.view(torch.int32), *xqm, Y, rows)
        return Y

    trunk = {}
    for m, (rows, n) in TRUNK.items():
        copies = max(48, int(-(-dk.GB // (rows * n // 256 * 144))))
        xm = torch.randn(1, n, device="cuda")
        trunk[m] = (dk.random_matrix(QType.Q4_K, rows, n, copies), t8.quantize_act(xm), xm)

    # parity against the box's JIT build of the engine's halves kernels (the same arithmetic; < 1e-6)
    o = offs[0]
    ref_h = q4.gate_up(pool, o, x, roles, K, {"BR": 8, "num_warps": 2}, xq)
    ref_y = moe_half.down(pool, o, hq, w, roles, K, 4, 1)
    ref_t = {m: g4.gemv(mats[0], xm, *TRUNK[m], {"BR": 8, "num_warps": 2, "PF": 0}, xqm)
             for m, (mats, xqm, xm) in trunk.items()}  # fmt: skip
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    for v in versions:
        for kind in ("halves", "rows"):
            for br, wp in GU_CFGS:
                assert rel(gu(v, kind, o, br, wp), ref_h) < 1e-6, (v, kind, "gu", br, wp)
            for br, wp in DN_CFGS:
                assert rel(dn(v, kind, o, br, wp), ref_y) < 1e-6, (v, kind, "dn", br, wp)
            for m, (mats, xqm, _) in trunk.items():
                for br, wp in GV_CFGS:
                    assert rel(gv(v, kind, m, mats[0], xqm, br, wp), ref_t[m]) < 1e-6, (v, kind, m, br, wp)
    # and the box's JIT of the engine's rows kernels (this checkout's triton_q4k_moe / _gemv)
    assert rel(q4.gate_up(pool, o, x, roles, K, {"BR": 16, "num_warps": 4, "TILE": "rows"}, xq), ref_h) < 1e-6
    want = q4.down(pool, o, ref_h, w, roles, K, {"BR": 4, "num_warps": 1, "PF": 0})
    assert rel(q4.down(pool, o, ref_h, w, roles, K, {"BR": 8, "num_warps": 4, "PF": 0, "TILE": "rows"}), want) < 1e-6
    for m, (mats, xqm, xm) in trunk.items():
        got = g4.gemv(mats[0], xm, *TRUNK[m], {"BR": 16, "num_warps": 4, "PF": 1, "TILE": "rows"}, xqm)
        assert rel(got, ref_t[m]) < 1e-6, m
    torch.cuda.synchronize()
    print("parity: every exported kernel and the box's rows kernels match the engine's halves kernels (< 1e-6)",
          flush=True)  # fmt: skip

    reps = int(os.environ.get("REPS", "1"))
    for rep in range(reps):
        us = graph([lambda o=o: moe_half.gate_up(pool, o, x, xq, roles, K, 8, 2) for o in offs])
        print(f"[{rep}] box JIT: gate/up 8,2 halves {frac(us, gu_bytes)}", flush=True)
        us = graph([lambda o=o: moe_half.down(pool, o, hq, w, roles, K, 4, 1) for o in offs])
        print(f"[{rep}] box JIT: down 4,1 halves    {frac(us, dn_bytes)}", flush=True)
        for v in versions:
            for kind in ("halves", "rows"):
                line = []
                for br, wp in GU_CFGS:
                    us = graph([lambda o=o: gu(v, kind, o, br, wp) for o in offs])
                    line.append(f"{br},{wp} {us:5.2f}")
                print(f"[{rep}] Triton {v} gate/up {kind:6s}: " + " | ".join(line), flush=True)
            for kind in ("halves", "rows"):
                line = []
                for br, wp in DN_CFGS:
                    us = graph([lambda o=o: dn(v, kind, o, br, wp) for o in offs])
                    line.append(f"{br},{wp} {us:5.2f}")
                print(f"[{rep}] Triton {v} down {kind:6s}: " + " | ".join(line), flush=True)
            for m, (mats, xqm, _) in trunk.items():
                for kind in ("halves", "rows"):
                    line = []
                    for br, wp in GV_CFGS:
                        us = graph([lambda r=r: gv(v, kind, m, r, xqm, br, wp) for r in mats])
                        line.append(f"{br},{wp} {us:5.2f}")
                    print(f"[{rep}] Triton {v} {m} {kind:6s}: " + " | ".join(line), flush=True)


def run_pdl():
    """Each exported PDL cubin launched by this box's Triton launcher with PDL, in the bench's chain timer."""
    import moe_half
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime import driver

    from engine.bench import device_kernels as dk
    from engine.quant.formats import QType
    from engine.runtime import triton_q4k_gemv as g4
    from engine.runtime import triton_q4k_moe as q4
    from engine.runtime import triton_q8 as t8

    bw, K, F, D, nbytes, gu_bytes, dn_bytes, pool, roles, offs, x, w, xq, hq, frac, graph = moe_half.chain_setup()
    (go, _, _, _), (uo, _, _, _), (do, _, _, _) = roles["gate"], roles["up"], roles["down"]
    flat = pool.reshape(-1)
    w32 = flat.view(torch.int32)
    wt = w.reshape(-1).contiguous()
    root = OUT + "_pdl"
    versions = sorted(os.listdir(root))
    dev = torch.cuda.current_device()
    backend = make_backend(GPUTarget("cuda", 90, 32))
    built = {}
    for label, (fn, sig, const, warps) in pdl_kernels().items():
        for v in versions:
            k = _compile(fn, sig, const, warps, pdl=True)  # this box's build: its launcher, PDL attribute on
            k._init_handles()
            with open(os.path.join(root, v, label + ".json")) as f:
                facts = json.load(f)
            assert facts["params"] == len(re.search(r"\.entry \w+\(([^)]*)\)", k.asm["ptx"]).group(1).split(","))
            if v != triton.__version__:
                with open(os.path.join(root, v, label + ".cubin"), "rb") as f:
                    cubin = f.read()
                shared = max(facts["shared"], k.metadata.shared)
                k.module, k.function, *_ = driver.active.utils.load_binary(facts["name"], cubin, shared, dev)
                k.metadata = k.metadata._replace(shared=shared)
                k.packed_metadata = backend.pack_metadata(k.metadata)
            built[v, label] = lambda grid, *a, k=k, c=tuple(const.values()): k[grid](*a, *c)  # constexprs last
    print("PDL chain: cubins from Triton", versions, "launched by Triton", triton.__version__, flush=True)

    def gu(v, kind, o, br, wp):
        H = torch.empty((o.numel(), F), dtype=torch.float32, device="cuda")
        built[v, f"{kind}_gu_{br}_{wp}"]((F // br, o.numel(), 1), w32, o, *xq, H, go, uo)
        return H

    def dn(v, kind, o, br, wp):
        Y = torch.empty((1, D), dtype=torch.float32, device="cuda")
        built[v, f"{kind}_dn_{br}_{wp}"]((D // br, 1, 1), flat, w32, o, *hq, wt, Y, do)
        return Y

    def gv(v, kind, m, raw, xqm, br, wp):
        rows = TRUNK[m][0]
        Y = torch.empty((1, rows), dtype=torch.float32, device="cuda")
        f = raw.reshape(-1)
        built[v, f"{kind}_{m}_{br}_{wp}"](((rows + br - 1) // br, 1, 1), f, f.view(torch.int32), *xqm, Y, rows)
        return Y

    trunk = {}
    for m, (rows, n) in TRUNK.items():
        copies = max(48, int(-(-dk.GB // (rows * n // 256 * 144))))
        xm = torch.randn(1, n, device="cuda")
        trunk[m] = (dk.random_matrix(QType.Q4_K, rows, n, copies), t8.quantize_act(xm), xm)
    o = offs[0]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    ref_h = q4.gate_up(pool, o, x, roles, K, {"BR": 8, "num_warps": 2}, xq)
    ref_y = moe_half.down(pool, o, hq, w, roles, K, 4, 1)
    ref_t = {m: g4.gemv(mats[0], xm, *TRUNK[m], {"BR": 8, "num_warps": 2, "PF": 0}, xqm)
             for m, (mats, xqm, xm) in trunk.items()}  # fmt: skip
    for v, label in built:
        kind, what, br, wp = label.split("_")
        br, wp = int(br), int(wp)
        if what == "gu":
            e = rel(gu(v, kind, o, br, wp), ref_h)
        elif what == "dn":
            e = rel(dn(v, kind, o, br, wp), ref_y)
        else:
            e = rel(gv(v, kind, what, trunk[what][0][0], trunk[what][1], br, wp), ref_t[what])
        assert e < 1e-6, (v, label, e)
    torch.cuda.synchronize()
    print("parity: every swapped-in cubin matches the engine's kernels (< 1e-6)", flush=True)
    for rep in range(int(os.environ.get("REPS", "1"))):
        for v in versions:
            line = []
            for label in pdl_kernels():
                kind, what, br, wp = label.split("_")
                br, wp = int(br), int(wp)
                if what == "gu":
                    us = graph([lambda o=o: gu(v, kind, o, br, wp) for o in offs])
                elif what == "dn":
                    us = graph([lambda o=o: dn(v, kind, o, br, wp) for o in offs])
                else:
                    mats, xqm, _ = trunk[what]
                    us = graph([lambda r=r: gv(v, kind, what, r, xqm, br, wp) for r in mats])
                line.append(f"{label} {us:5.2f}")
            print(f"[{rep}] PDL, Triton {v}: " + " | ".join(line), flush=True)


if __name__ == "__main__":
    {"export": export, "run": run, "export-pdl": lambda: export("pdl"), "run-pdl": run_pdl}[sys.argv[1]]()
