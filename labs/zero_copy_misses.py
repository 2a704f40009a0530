"""Can the GPU compute an expert-cache miss itself, reading the expert's quantized bytes straight from pinned
host memory over the bus (zero-copy), so that a decode step needs no host round trip per miss layer?

The fused decode kernels address every (token, expert) pair by a byte offset from the pool's base
(``triton_moe.moe_decode``), so a pair whose offset is ``host_ptr - pool_ptr + slot·stride`` reads a pinned host
row in the slot layout instead: no kernel change. This lab measures, for Qwen3-30B-A3B's expert shape (Q4_K
gate/up/down, 8 experts a token), one call per layer over 48 layers' distinct experts in one CUDA graph:

- every pair from the device pool (the hit path), every pair from pinned host memory, and 1 or 2 of the 8
  from host memory (the realistic 95 % hit rate gives ~0.4 misses a layer);
- the outputs of host and device reads (must be equal: the same bytes);
- the bus's copy bandwidth (pinned host -> device, ``copy_``) for comparison;
- whether ``cudaHostRegister`` (read-only) accepts a file-backed read-only memory map, and a kernel reading it.

  PYTHONPATH=. python3 labs/zero_copy_misses.py
"""

import mmap
import os
import tempfile

import numpy as np
import torch

from engine.bench.device_kernels import KE, median_ms, slot_pool
from engine.quant.formats import QType
from engine.runtime import triton_moe, triton_q4k_moe, triton_q8
from engine.runtime import triton_qblocks as qb

LAYERS = 48


def graph_ms(calls) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), qb.graph_warmup():
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    return median_ms(g.replay, 20)


def copy_bandwidth(pool, host, stride) -> None:
    """The bus's copy bandwidth (pinned host -> device), and one expert's copy as an upload makes it."""
    big = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    ms = median_ms(lambda: dst.copy_(big, non_blocking=True), 10)
    print(f"pinned host -> device copy: {(1 << 30) / ms / 1e6:.1f} GB/s", flush=True)
    one, d1 = host[0], torch.empty_like(pool[0])
    ms = median_ms(lambda: d1.copy_(one, non_blocking=True), 50)
    print(f"one expert's copy: {ms * 1e3:.1f} us ({stride / ms / 1e6:.1f} GB/s)", flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(0), flush=True)
    q = QType.Q4_K
    n_slots = LAYERS * KE
    pool, stride, roles = slot_pool(q, n_slots)  # device [n_slots, stride]
    host = pool.cpu().pin_memory()
    delta = host.data_ptr() - pool.data_ptr()
    x = torch.randn(1, 2048, device="cuda")
    w = torch.rand(1, KE, device="cuda")
    xq = triton_q8.quantize_act(x) if triton_q4k_moe.applies_gate_up(roles) else None
    expert_mb = stride / 1e6
    print(f"slot stride {stride} B ({expert_mb:.2f} MB), pool {pool.numel() / 1e9:.2f} GB", flush=True)

    base = torch.arange(KE, device="cuda")
    offs = {}
    for name, n_host in (("device", 0), ("host 1 of 8", 1), ("host 2 of 8", 2), ("host 8 of 8", 8)):
        rows = []
        for i in range(LAYERS):
            o = (base + KE * i) * stride
            h = torch.zeros(KE, dtype=torch.int64, device="cuda")
            h[:n_host] = delta
            rows.append((o + h).view(1, KE))
        offs[name] = rows

    def layer_calls(rows, act):
        xa = xq if act == "q8" else None
        return [lambda o=o: triton_moe.moe_decode(pool, o, x, w, roles, act=act, xq=xa) for o in rows]

    for act in ("q8", "f32"):
        ref, dev_ms = None, graph_ms(layer_calls(offs["device"], act))
        for n_host, (name, rows) in zip((0, 1, 2, 8), offs.items(), strict=True):
            calls = layer_calls(rows, act)
            y = calls[0]()
            torch.cuda.synchronize()
            ref = y.clone() if ref is None else ref
            ms = graph_ms(calls)
            extra = ""
            if n_host:
                host_gb = LAYERS * n_host * stride / 1e9
                extra = f", {host_gb / max(ms - dev_ms, 1e-6) * 1e3:.1f} GB/s for the host bytes beyond the device time"
            print(f"act {act:3s} {name:12s}: {ms * 1e3 / LAYERS:8.1f} us a layer ({ms:.3f} ms / 48), "
                  f"equal {torch.equal(y, ref)}{extra}", flush=True)  # fmt: skip

    copy_bandwidth(pool, host, stride)

    # a file-backed read-only map registered with CUDA
    cudart = torch.cuda.cudart()
    with tempfile.NamedTemporaryFile(dir="/tmp", delete=False) as f:
        host.numpy().tofile(f)
        path = f.name
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    arr = np.frombuffer(m, dtype=np.uint8)
    ptr = arr.ctypes.data
    for flags, what in ((8, "ReadOnly"), (8 | 2, "ReadOnly|Mapped"), (0, "Default")):
        err = cudart.cudaHostRegister(ptr, arr.nbytes, flags)
        print(f"cudaHostRegister(file map, {what}) -> {err}", flush=True)
        if int(err) == 0:
            d = ptr - pool.data_ptr()
            rows = [((base + KE * i) * stride + d).view(1, KE) for i in range(LAYERS)]
            y = triton_moe.moe_decode(pool, rows[0], x, w, roles, act="q8", xq=xq)
            torch.cuda.synchronize()
            calls = [lambda o=o: triton_moe.moe_decode(pool, o, x, w, roles, act="q8", xq=xq) for o in rows]
            ms = graph_ms(calls)
            dev = triton_moe.moe_decode(pool, offs["device"][0], x, w, roles, act="q8", xq=xq)
            print(f"  kernel on the registered map: equal {torch.equal(y, dev)}, {ms * 1e3 / LAYERS:.1f} us a layer, "
                  f"{LAYERS * KE * stride / ms / 1e6:.1f} GB/s", flush=True)  # fmt: skip
            cudart.cudaHostUnregister(ptr)
            break
    del arr
    m.close()
    os.close(fd)
    os.unlink(path)


if __name__ == "__main__":
    main()
