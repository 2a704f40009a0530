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


class Harness:
    """The bench's data (moe_half.chain_setup's routed-expert chain; q- and o-sized trunk matrices over ≥ 1 GB)
    and the engine's halves kernels' results on it, to launch, check and time the kernels named like
    ``"rows_dn_8_4"`` (tile, kernel gu / dn / q / o, rows, warps) through ``call(version, label, grid, *args)``."""

    def __init__(self, call):
        import moe_half
        import torch

        from engine.bench import device_kernels as dk
        from engine.quant.formats import QType
        from engine.runtime import triton_q4k_gemv as g4
        from engine.runtime import triton_q4k_moe as q4
        from engine.runtime import triton_q8 as t8

        self.call = call
        (self.bw, self.K, self.F, self.D, _, self.gu_bytes, self.dn_bytes, self.pool, self.roles, self.offs, self.x,
         self.w, self.xq, self.hq, self.frac, self.graph) = moe_half.chain_setup()  # fmt: skip
        self.flat = self.pool.reshape(-1)
        self.wt = self.w.reshape(-1).contiguous()
        self.trunk = {}
        for m, (rows, n) in TRUNK.items():
            copies = max(48, int(-(-dk.GB // (rows * n // 256 * 144))))
            xm = torch.randn(1, n, device="cuda")
            self.trunk[m] = (dk.random_matrix(QType.Q4_K, rows, n, copies), t8.quantize_act(xm), xm)
        o = self.offs[0]
        self.ref = {
            "gu": q4.gate_up(self.pool, o, self.x, self.roles, self.K, {"BR": 8, "num_warps": 2}, self.xq),
            "dn": moe_half.down(self.pool, o, self.hq, self.w, self.roles, self.K, 4, 1),
            **{m: g4.gemv(mats[0], xm, *TRUNK[m], {"BR": 8, "num_warps": 2, "PF": 0}, xqm)
               for m, (mats, xqm, xm) in self.trunk.items()},
        }  # fmt: skip

    def launch(self, v, label, w):
        """One call of kernel ``label`` of Triton ``v`` on weight set ``w`` (slot offsets, or a trunk matrix)."""
        import torch

        _, what, br, _ = label.split("_")
        br = int(br)
        (go, _, _, _), (uo, _, _, _), (do, _, _, _) = (self.roles[r] for r in ("gate", "up", "down"))
        if what == "gu":
            out = torch.empty((w.numel(), self.F), dtype=torch.float32, device="cuda")
            self.call(v, label, (self.F // br, w.numel(), 1), self.flat.view(torch.int32), w, *self.xq, out, go, uo)
        elif what == "dn":
            out = torch.empty((1, self.D), dtype=torch.float32, device="cuda")
            self.call(v, label, (self.D // br, 1, 1), self.flat, self.flat.view(torch.int32), w, *self.hq, self.wt,
                      out, do)  # fmt: skip
        else:
            rows = TRUNK[what][0]
            out = torch.empty((1, rows), dtype=torch.float32, device="cuda")
            f = w.reshape(-1)
            self.call(v, label, ((rows + br - 1) // br, 1, 1), f, f.view(torch.int32), *self.trunk[what][1], out, rows)
        return out

    def weight_sets(self, label):
        what = label.split("_")[1]
        return self.offs if what in ("gu", "dn") else list(self.trunk[what][0])

    def check(self, v, label):
        """The kernel's result against the engine's halves kernels' (the same arithmetic: < 1e-6)."""
        what = label.split("_")[1]
        got, want = self.launch(v, label, self.weight_sets(label)[0]), self.ref[what]
        e = ((got - want).norm() / want.norm()).item()
        assert e < 1e-6, (v, label, e)

    def us(self, v, label):
        """µs a call in the bench's CUDA-graph chain over distinct weight sets."""
        return self.graph([lambda w=w: self.launch(v, label, w) for w in self.weight_sets(label)])


def run():
    """Each exported cubin launched by CuPy (no PDL), beside the box's JIT build of the engine's kernels."""
    os.environ["SHARPI_PDL"] = "0"
    import itertools

    import moe_half
    import torch

    from engine.runtime import triton_q4k_gemv as g4
    from engine.runtime import triton_q4k_moe as q4

    versions = sorted(os.listdir(OUT))
    built = {(v, label): Cubin(v, label) for v in versions for label in kernels()}
    h = Harness(lambda v, label, grid, *a: built[v, label](grid, *a))
    print("cubins from Triton", versions, "; this box's Triton", __import__("triton").__version__, flush=True)
    for v, label in built:
        h.check(v, label)
    # and the box's JIT of the engine's rows kernels (this checkout's triton_q4k_moe / _gemv)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    o, K = h.offs[0], h.K
    got = q4.gate_up(h.pool, o, h.x, h.roles, K, {"BR": 16, "num_warps": 4, "TILE": "rows"}, h.xq)
    assert rel(got, h.ref["gu"]) < 1e-6
    want = q4.down(h.pool, o, h.ref["gu"], h.w, h.roles, K, {"BR": 4, "num_warps": 1, "PF": 0})
    got = q4.down(h.pool, o, h.ref["gu"], h.w, h.roles, K, {"BR": 8, "num_warps": 4, "PF": 0, "TILE": "rows"})
    assert rel(got, want) < 1e-6
    for m, (mats, xqm, xm) in h.trunk.items():
        got = g4.gemv(mats[0], xm, *TRUNK[m], {"BR": 16, "num_warps": 4, "PF": 1, "TILE": "rows"}, xqm)
        assert rel(got, h.ref[m]) < 1e-6, m
    torch.cuda.synchronize()
    print("parity: every exported kernel and the box's rows kernels match the engine's halves kernels (< 1e-6)",
          flush=True)  # fmt: skip

    for rep in range(int(os.environ.get("REPS", "1"))):
        us = h.graph([lambda o=o: moe_half.gate_up(h.pool, o, h.x, h.xq, h.roles, K, 8, 2) for o in h.offs])
        print(f"[{rep}] box JIT: gate/up 8,2 halves {h.frac(us, h.gu_bytes)}", flush=True)
        us = h.graph([lambda o=o: moe_half.down(h.pool, o, h.hq, h.w, h.roles, K, 4, 1) for o in h.offs])
        print(f"[{rep}] box JIT: down 4,1 halves    {h.frac(us, h.dn_bytes)}", flush=True)
        for v in versions:
            for (kind, what), labels in itertools.groupby(kernels(), key=lambda lb: tuple(lb.split("_")[:2])):
                line = [f"{'_'.join(lb.split('_')[2:])} {h.us(v, lb):5.2f}" for lb in labels]
                print(f"[{rep}] Triton {v} {what} {kind:6s}: " + " | ".join(line), flush=True)


def run_pdl():
    """Each exported PDL cubin launched by this box's Triton launcher with PDL, in the bench's chain timer."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime import driver

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
            consts = tuple(const.values())  # the launcher takes them too, last
            built[v, label] = lambda grid, *a, k=k, c=consts: k[grid](*a, *c)
    h = Harness(lambda v, label, grid, *a: built[v, label](grid, *a))
    print("PDL chain: cubins from Triton", versions, "launched by Triton", triton.__version__, flush=True)
    for v, label in built:
        h.check(v, label)
    torch.cuda.synchronize()
    print("parity: every swapped-in cubin matches the engine's kernels (< 1e-6)", flush=True)
    for rep in range(int(os.environ.get("REPS", "1"))):
        for v in versions:
            line = [f"{label} {h.us(v, label):5.2f}" for label in pdl_kernels()]
            print(f"[{rep}] PDL, Triton {v}: " + " | ".join(line), flush=True)


if __name__ == "__main__":
    {"export": export, "run": run, "export-pdl": lambda: export("pdl"), "run-pdl": run_pdl}[sys.argv[1]]()
