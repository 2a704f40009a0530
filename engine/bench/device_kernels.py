"""``sharpi bench device-kernels``: the quantized Triton kernels' GB/s against the GPU's measured
memory bandwidth and against the torch dequantize-then-matmul reference.

Workloads (Qwen3-30B-A3B geometry), each rotating over distinct weights totalling ≥ 1 GB so that
the 50 MB L2 cannot serve them:

- ``moe``: one decode token's routed experts — 8 experts × gate/up [768, 2048] and down [2048, 768]
  from the slot pool through :func:`engine.runtime.triton_moe.moe_decode` (two launches), one call
  per layer over ≥ 48 layers' distinct slots;
- ``q`` [4096, 2048], ``o`` [2048, 4096], ``kv`` [512, 2048]: trunk matrices at decode (one token)
  through :func:`engine.runtime.triton_gemv.matmul`, one call per distinct matrix;
- ``qkv``: a layer's q [4096, 2048], k and v [512, 2048] together through
  :func:`engine.runtime.triton_gemv.matmul_many` (one launch in q8 mode; three in f32 mode).

The main columns time the kernels a default session runs (:func:`default_act`: the routed experts on
q8 activations where the lean all-Q4_K kernels apply, exact float elsewhere) as a decode step's CUDA
graph runs them: with programmatic dependent launch on a GPU that has it (``triton_qblocks.pdl``), so
each call starts launching and prefetching its weights while the previous one runs. Beside them: the
same kernels with PDL off (``SHARPI_PDL=0``: ``engine.config.overriding(pdl=False)``), the exact-float and the integer q8-activation kernels,
the copy floor and the read floor (:mod:`engine.bench.read_floor`: the same launches reading the same
bytes and nothing else — no kernel over those bytes can pass it).

Times are CUDA-event medians over replays of a CUDA graph holding one call per distinct weight set
(device time, launch gaps closed), and over the same calls launched eagerly (what Python adds).
Random blocks get the fixed, realistic scale fields of ``engine.synth.fill``.
``tune`` sweeps launch settings per (kernel, qtype, shape class) and returns the best of each (a launch
table: ``engine/runtime/launch/README.md``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine import config
from engine.bench import read_floor
from engine.quant.formats import QType, block_format
from engine.runtime import kernel_select, triton_gemv, triton_moe, triton_q4k_gemv, triton_q4k_moe, triton_q8
from engine.runtime import triton_qblocks as qb
from engine.runtime.references import dequantize

GB = 1e9
F, D, KE = 768, 2048, 8  # expert width, hidden, experts per token
TRUNK = {"q": (4096, 2048), "o": (2048, 4096), "kv": (512, 2048)}
QKV = ((4096, 2048), (512, 2048), (512, 2048))


def median_ms(fn, reps: int) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def measure_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device read+write GB/s of a large copy (counted as 2 × bytes moved)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / (median_ms(lambda: dst.copy_(src), 20) / 1e3) / GB


def _fill_fields(blocks: torch.Tensor, qtype: QType, s: float) -> None:
    """Fixed scale fields of random blocks [n, type_size] (as engine.synth.fill does, on the GPU)."""

    def f16(x):
        return torch.tensor([x], dtype=torch.float16).view(torch.uint8).to(blocks.device)

    if qtype in (QType.Q4_K, QType.Q5_K):
        d = s / (32 * (4.61 if qtype == QType.Q4_K else 9.23))
        blocks[:, 0:2], blocks[:, 2:4] = f16(d), f16((7.5 if qtype == QType.Q4_K else 15.5) * d)
        blocks[:, 4:12], blocks[:, 12:16] = 160, 0
    elif qtype == QType.Q6_K:
        blocks[:, 192:208], blocks[:, 208:210] = 16, f16(s / (16 * 18.5))
    elif qtype == QType.Q8_0:
        blocks[:, 0:2] = f16(s / 73.9)
    else:
        blocks[:, 0:2] = f16(s / 4.61)


def random_matrix(qtype: QType, rows: int, n: int, copies: int = 1) -> torch.Tensor:
    """uint8 [copies, rows·row_bytes] of random blocks with realistic scales, on the GPU."""
    f = block_format(qtype)
    raw = torch.randint(0, 256, (copies * rows * f.row_bytes(n),), dtype=torch.uint8, device="cuda")
    _fill_fields(raw.view(-1, f.type_size), qtype, 1.0 / math.sqrt(n))
    return raw.view(copies, -1)


def slot_pool(qtype, slots: int, ff: int = F, hidden: int = D) -> tuple[torch.Tensor, int, dict]:
    """A device pool of ``slots`` random experts of width ``ff`` and hidden size ``hidden`` at the slot layout ->
    (pool uint8 [slots, stride], stride, roles as ``triton_moe.moe_decode`` takes them). ``qtype``: one type for
    every role, or a (gate, up, down) tuple."""
    types = qtype if isinstance(qtype, tuple) else (qtype,) * 3
    roles, off = {}, 0
    for r, q, (rows, n) in zip(("gate", "up", "down"), types, ((ff, hidden), (ff, hidden), (hidden, ff))):
        q = QType(q)
        roles[r] = (off, q, rows, n)
        off += -(-rows * block_format(q).row_bytes(n) // 256) * 256
    pool = torch.empty((slots, off), dtype=torch.uint8, device="cuda")
    for o, q, rows, n in roles.values():
        nb = rows * block_format(q).row_bytes(n)
        pool[:, o : o + nb] = random_matrix(q, rows, n, slots)
    return pool, off, roles


def time_in_graph(calls: list, reps: int = 20) -> tuple[float, float]:
    """(µs per call in a CUDA graph of all calls, µs per call launched eagerly)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), qb.graph_warmup():
        for c in calls[:3]:
            c()  # compile and warm, as the capture will launch them, outside it
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    graph = median_ms(g.replay, reps) * 1e3 / len(calls)

    def eager():
        for c in calls:
            c()

    eager()
    return graph, median_ms(eager, max(3, reps // 4)) * 1e3 / len(calls)


def _moe_bytes(qtype: QType) -> int:
    return KE * (2 * F * block_format(qtype).row_bytes(D) + D * block_format(qtype).row_bytes(F))


def moe_workload(qtype: QType, reference: bool = True, act: str = "f32") -> dict:
    layers = max(48, math.ceil(GB / _moe_bytes(qtype)))
    pool, stride, roles = slot_pool(qtype, layers * KE)
    g = torch.Generator().manual_seed(0)
    offs = [(torch.randperm(KE, generator=g) + KE * i).view(1, KE).cuda() * stride for i in range(layers)]
    x = torch.randn(1, D, device="cuda")
    w = torch.rand(1, KE, device="cuda")
    # In a decode graph the ffn norm's launch writes x̂ for the lean Q4_K kernels (MoE.wants_q8_input):
    # their call then starts at the gate/up kernel, as here.
    xq = triton_q8.quantize_act(x) if act == "q8" and triton_q4k_moe.applies_gate_up(roles) else None
    calls = [lambda o=o: triton_moe.moe_decode(pool, o, x, w, roles, act=act, xq=xq) for o in offs]
    graph_us, eager_us = time_in_graph(calls)
    out = {"layers": layers, "bytes": _moe_bytes(qtype), "graph_us": graph_us, "eager_us": eager_us}
    if reference:
        out["reference_us"] = median_ms(lambda: _moe_reference(pool, offs[0], x, w, roles), 5) * 1e3
    return out


def _moe_reference(pool, offs, x, w, roles):
    """The pre-kernel torch path: dequantize the 8 slots' gate/up/down, then batched matmuls."""
    flat = pool.view(-1)
    mats = []
    for r in ("gate", "up", "down"):
        o, q, rows, n = roles[r]
        nb = rows * block_format(q).row_bytes(n)
        raw = torch.stack([flat[int(s) + o : int(s) + o + nb] for s in offs[0].tolist()])
        mats.append(dequantize(raw.view(KE * rows, -1), q, n).view(KE, rows, n))
    h = torch.nn.functional.silu(torch.bmm(mats[0], x.T.expand(KE, D, 1))) * torch.bmm(mats[1], x.T.expand(KE, D, 1))
    return (torch.bmm(mats[2], h)[:, :, 0] * w[0, :, None]).sum(0)


def _norm_xq(x: torch.Tensor, qtype: QType, kind: str, act: str):
    """x̂ as a decode graph hands it to a Q4_K trunk matrix on q8 activations: from the attention norm's
    launch for q, k, v (``step_kernels.add_rms_norm(q8=True)``), so not timed; None for o (the attention
    output: the kernel call quantizes it, timed) and everywhere else."""
    if act == "q8" and kind in ("q", "kv", "qkv") and triton_q4k_gemv.applies(qtype, x.shape[1], 1):
        return triton_q8.quantize_act(x)
    return None


def qkv_workload(qtype: QType, reference: bool = True, act: str = "f32") -> dict:
    n = QKV[0][1]
    sizes = [r * block_format(qtype).row_bytes(n) for r, _ in QKV]
    nbytes = sum(sizes)
    copies = max(48, math.ceil(GB / nbytes))
    mats = [random_matrix(qtype, r, n, copies) for r, _ in QKV]  # separate allocations, as a layer's
    rows = [r for r, _ in QKV]
    x = torch.randn(1, n, device="cuda")
    xq = _norm_xq(x, qtype, "qkv", act)
    calls = [
        lambda i=i: triton_gemv.matmul_many(
            [m[i].view(r, -1) for m, r in zip(mats, rows)], x, qtype, rows, n, act=act, xq=xq
        )
        for i in range(copies)
    ]
    for c in calls:
        c()  # each weight set's launch table (triton_q8_gemv._many_meta) is made once, outside the graph
    graph_us, eager_us = time_in_graph(calls)
    out = {"layers": copies, "bytes": nbytes, "graph_us": graph_us, "eager_us": eager_us}
    if reference:
        w = [dequantize(m[0].view(r, -1), qtype, n) for m, r in zip(mats, rows)]
        out["reference_us"] = median_ms(lambda: [x @ wi.T for wi in w], 5) * 1e3
    return out


def trunk_workload(qtype: QType, kind: str, reference: bool = True, act: str = "f32") -> dict:
    if kind == "qkv":
        return qkv_workload(qtype, reference, act)
    rows, n = TRUNK[kind]
    nbytes = rows * block_format(qtype).row_bytes(n)
    copies = max(48, math.ceil(GB / nbytes))
    mats = random_matrix(qtype, rows, n, copies)
    x = torch.randn(1, n, device="cuda")
    xq = _norm_xq(x, qtype, kind, act)
    calls = [lambda m=m: triton_gemv.matmul(m, x, qtype, rows, n, act=act, xq=xq) for m in mats]
    graph_us, eager_us = time_in_graph(calls)
    out = {"layers": copies, "bytes": nbytes, "graph_us": graph_us, "eager_us": eager_us}
    if reference:
        out["reference_us"] = median_ms(lambda: x @ dequantize(mats[0].view(rows, -1), qtype, n).T, 5) * 1e3
    return out


WORKLOADS = ("moe", "q", "o", "kv", "qkv")


def copy_floor_us(nbytes: int) -> float:
    """µs per launch of a plain device copy moving ``nbytes`` (nbytes/2 read + nbytes/2 written), one
    copy per distinct ≥ 1 GB-rotating buffer in a CUDA graph: what one launch of that traffic costs at
    best on this GPU (launch, ramp-up and tail included) — the practical ceiling for a kernel's GB/s."""
    half = max(16, nbytes // 2 // 16 * 16)
    copies = max(48, math.ceil(GB / half))
    src = torch.empty((copies, half), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_in_graph([lambda i=i: dst[i].copy_(src[i]) for i in range(copies)])[0]


def launch_bytes(qtype: QType, wl: str) -> list[int]:
    """Weight bytes each launch of a workload's call reads, in order (the default f32 kernels: the MoE's
    gate/up then down; matmul_many's q, k, v one launch each)."""
    f = block_format(qtype)
    if wl == "moe":
        return [2 * KE * F * f.row_bytes(D), KE * D * f.row_bytes(F)]
    if wl == "qkv":
        return [r * f.row_bytes(n) for r, n in QKV]
    rows, n = TRUNK[wl]
    return [rows * f.row_bytes(n)]


def _without_pdl(fn):
    """fn() with programmatic dependent launch off (``SHARPI_PDL=0``)."""
    with config.overriding(pdl=False):
        return fn()


def default_act(qtype: QType, wl: str) -> str:
    """The activation mode a default session (``q8_act``: activations rounded like llama.cpp) runs a
    workload with in a decode step's CUDA graph on this GPU: ``kernel_select.moe_act`` / ``trunk_act`` for a
    captured step."""
    dev = torch.device("cuda", torch.cuda.current_device())
    if wl == "moe":
        roles = {"gate": (0, qtype, F, D), "up": (0, qtype, F, D), "down": (0, qtype, D, F)}
        return kernel_select.moe_act(dev, True, roles, kernel_select.CAPTURED)
    return kernel_select.trunk_act(dev, True, qtype, (TRUNK.get(wl) or QKV[0])[1], kernel_select.CAPTURED)


def run(types=triton_gemv.SUPPORTED, workloads=WORKLOADS, extra: bool = True) -> dict:
    """Per type × workload: the kernels a default session runs (``default_act``; programmatic dependent
    launch where the GPU has it — as a decode step's CUDA graph runs them) and, with ``extra``, the same
    with PDL off (``nopdl_us``), the exact-float kernels (``f32_us``) and the integer q8 kernels
    (``q8_us``) — one of the two is the main column again — and the read floor of the same launches."""
    bw = measure_bandwidth()
    rep = {
        "device": torch.cuda.get_device_name(),
        "bandwidth_gb_s": bw,
        "pdl": qb.pdl_supported(),
        "types": {},
        "triton": qb.triton.__version__,
        "triton_table": kernel_select.triton_table_version(),
    }
    for q in types:
        q = QType(q)
        r = {}
        for wl in workloads:
            act = default_act(q, wl)

            def timed(reference=False, act=act, q=q, wl=wl):
                return moe_workload(q, reference, act) if wl == "moe" else trunk_workload(q, wl, reference, act)

            v = timed(True)
            v["act"] = act
            if extra:
                v["nopdl_us"] = _without_pdl(timed)["graph_us"]
                for a in ("f32", "q8"):
                    v[f"{a}_us"] = v["graph_us"] if a == act else timed(act=a)["graph_us"]
            v["gb_s"] = v["bytes"] / (v["graph_us"] / 1e6) / GB
            v["fraction"] = v["gb_s"] / bw
            v["speedup"] = v["reference_us"] / v["eager_us"]
            v["copy_us"] = copy_floor_us(v["bytes"])
            v["copy_fraction"] = v["bytes"] / (v["copy_us"] / 1e6) / GB / bw
            v["floor_us"] = read_floor.read_floor_us(launch_bytes(q, wl), time_in_graph)
            v["floor_fraction"] = v["bytes"] / (v["floor_us"] / 1e6) / GB / bw
            r[wl] = v
        rep["types"][q.name] = r
    return rep


def report_lines(rep: dict) -> list[str]:
    lines = [f"{rep['device']}: measured copy bandwidth {rep['bandwidth_gb_s']:.0f} GB/s (read + write)"]
    if "triton" in rep:
        t = rep["triton_table"]
        table = f"launch/triton={t[0]}.{t[1]}.json, then " if t else ""
        lines.append(f"Triton {rep['triton']}: launch settings from the GPU's table, then {table}the defaults")
    lines.append(
        "graph us: the kernels a default session runs (act: q8 = activations rounded like llama.cpp, integer "
        "kernels; f32 = exact float) in a CUDA graph, one call per distinct weight set, "
        f"programmatic dependent launch {'on' if rep.get('pdl') else 'not available'}; "
        "no-PDL us: the same with SHARPI_PDL=0; f32 us / q8 us: the exact-float / integer kernels; "
        "read floor: kernels that only read the same bytes, same launches, best PDL arrangement (engine.bench.read_floor)"
    )
    lines.append(
        "type  workload act  graph us  GB/s (of bw)   eager us  torch ref us  speedup(eager)  distinct weights"
        "  copy us (of bw)  no-PDL us   f32 us    q8 us  read floor us (of bw)"
    )
    for t, r in rep["types"].items():
        for wl, v in r.items():
            nopdl = f"{v['nopdl_us']:9.1f}" if "nopdl_us" in v else "        -"
            f32 = f"{v['f32_us']:8.1f}" if "f32_us" in v else "       -"
            q8 = f"{v['q8_us']:8.1f}" if "q8_us" in v else "       -"
            lines.append(
                f"{t:<5} {wl:<8} {v.get('act', 'f32'):<3} {v['graph_us']:9.1f}  {v['gb_s']:6.0f} ({v['fraction']:4.0%})  {v['eager_us']:8.1f}"
                f"  {v['reference_us']:12.1f}  {v['speedup']:13.1f}x  {v['layers'] * v['bytes'] / GB:.2f} GB"
                f"  {v['copy_us']:7.1f} ({v['copy_fraction']:4.0%})  {nopdl}  {f32}  {q8}"
                f"  {v['floor_us']:13.1f} ({v['floor_fraction']:4.0%})"
            )
    return lines


# -- the launch-settings sweep (the q8 kernels; the float kernels keep their table) -------------
def _candidates(kernel: str, qtype: QType, cls: str) -> list[dict]:
    """Launch settings worth timing (sm_90 compiles: larger tiles spill, K walks of > 2 unrolled steps
    of the two-matrix gate/up kernel take ptxas tens of seconds)."""
    small = qtype in (QType.Q4_0, QType.Q8_0)  # 32-element blocks: 8× more blocks per row
    f = 4 if small else 1
    tiles = ("halves", "rows")  # triton_q4k_*'s two tile orientations: which is fast depends on the Triton
    if kernel == "gemv_q4k":  # triton_q4k_gemv: whole rows a program
        return [{"BR": br, "num_warps": w, "PF": pf, "TILE": t} for br, w in ((4, 1), (8, 1), (8, 2), (8, 4), (16, 4), (32, 8))
                for pf in (0, 1) for t in tiles]  # fmt: skip
    if kernel == "moe_q4k_gate_up":  # triton_q4k_moe: more, smaller programs lose (docs/benchmarks-gpu.md)
        return [
            {"BR": br, "num_warps": w, "TILE": t} for br, w in ((4, 1), (8, 1), (8, 2), (16, 2), (16, 4)) for t in tiles
        ]
    if kernel == "moe_q4k_down":
        return [{"BR": br, "num_warps": w, "PF": pf, "TILE": t} for br, w in ((2, 1), (4, 1), (4, 2), (8, 2), (8, 4), (16, 4))
                for pf in (0, 1) for t in tiles]  # fmt: skip
    if kernel == "moe_q8_gate_up":  # BR: whole 32-blocks of h
        return [
            {"BR": br, "NB": nb * f, "num_warps": w} for br, nb, w in ((32, 4, 4), (32, 4, 8), (32, 8, 8), (64, 4, 8))
        ]
    if kernel == "moe_q8_down":  # down rows are F = 768 wide: 3 K-quant blocks, 24 small ones
        nbs = (16, 32) if small else (2, 4)
        return [{"BR": br, "NB": nb, "num_warps": 4, "KSPLIT": ks} for br in (8, 16) for nb in nbs for ks in (1, 2, 4)]
    tiles = ((8, 2), (8, 4), (8, 8), (16, 2), (16, 4), (16, 8), (32, 4))
    out = [{"BR": br, "NB": nb * f, "num_warps": 4, "SPLIT": 1} for br, nb in tiles]
    out += [{"BR": 16, "NB": 8 * f, "num_warps": 8, "SPLIT": 1}]
    if cls == "S":
        out += [{"BR": br, "NB": nb * f, "num_warps": 4, "SPLIT": 1} for br, nb in ((2, 8), (4, 4), (4, 8))]
        out += [{"BR": 4, "NB": 4 * f, "num_warps": 4, "SPLIT": sp} for sp in (2, 4)]
    return out


def _tune_targets(qtype: QType) -> list[tuple[str, callable]]:
    """(launch-table key, timing function) per tuned kernel: for Q4_K the kernels q8 mode runs it with at one
    token (triton_q4k_gemv, triton_q4k_moe), for the other types the general q8 kernels."""
    name = qtype.name
    if qtype == QType.Q4_K:
        return [
            (f"gemv_q4k:{name}:M", lambda: trunk_workload(qtype, "q", False, "q8")["graph_us"] + trunk_workload(qtype, "o", False, "q8")["graph_us"]),
            (f"gemv_q4k:{name}:S", lambda: trunk_workload(qtype, "kv", False, "q8")["graph_us"]),
            (f"moe_q4k_gate_up:{name}:L", lambda: moe_workload(qtype, False, "q8")["graph_us"]),
            (f"moe_q4k_down:{name}:M", lambda: moe_workload(qtype, False, "q8")["graph_us"]),
        ]  # fmt: skip
    return [
        (f"gemv_q8:{name}:M", lambda: trunk_workload(qtype, "q", False, "q8")["graph_us"] + trunk_workload(qtype, "o", False, "q8")["graph_us"]),
        (f"gemv_q8:{name}:S", lambda: trunk_workload(qtype, "kv", False, "q8")["graph_us"]),
        (f"gemv_q8:{name}:L", lambda: trunk_workload(qtype, "qkv", False, "q8")["graph_us"]),
        (f"moe_q8_gate_up:{name}:L", lambda: moe_workload(qtype, False, "q8")["graph_us"]),
        (f"moe_q8_down:{name}:M", lambda: moe_workload(qtype, False, "q8")["graph_us"]),
    ]  # fmt: skip


def tune(types=triton_gemv.SUPPORTED, log=print, only: str = "") -> dict[str, dict]:
    """Try each candidate launch setting per (kernel, qtype, shape class); return the best of each (a
    table to save as ``engine/runtime/launch/device=<name>.json``, or to try through
    ``SHARPI_LAUNCH_TABLE``). Timed on the workloads above (CUDA graphs), each candidate over the
    winners so far (``config.overriding(launch_table=...)``: the packaged tables stay as they are).
    ``only``: keys containing this string."""
    table = dict(config.current().launch_table or {})
    best = {}
    for q in types:
        q = QType(q)
        for key, timed in _tune_targets(q):
            if only not in key:
                continue
            kernel, _, cls = key.split(":")
            results = []
            for cfg in _candidates(kernel, q, cls):
                table[key] = cfg
                try:
                    with config.overriding(launch_table=table):
                        results.append((timed(), cfg))
                except Exception as e:  # noqa: BLE001 - a setting that fails to compile just loses
                    log(f"  {key} {cfg}: {type(e).__name__}: {str(e)[:200]}")
            results.sort(key=lambda r: r[0])
            table[key] = best[key] = results[0][1]
            log(f"{key:<26} best {results[0][0]:8.1f} us {results[0][1]}  (worst {results[-1][0]:.1f} us)")
    return best
