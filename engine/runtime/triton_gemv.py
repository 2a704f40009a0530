"""Triton GEMV straight from quantized GGUF blocks: gather by byte offset, dequantize in
registers, dot with the activations — no float copy of the weights.

``gemv(pool, offsets, X, qtype, rows, n) -> Y``: for each pair p, ``Y[p] = W_p · X[p]`` where
``W_p`` is the ``[rows, n]`` matrix whose raw bytes start at ``pool[offsets[p]]`` (cached experts:
a slot's role offset per (token, expert) pair). ``matmul(raw, X, qtype, rows, n)``: one matrix,
a few tokens (the trunk at decode): each program reads its weight tile once for all of them.

A program owns ``BR`` rows and walks K ``NB`` blocks at a time (a 2-D tile of BR × NB blocks,
loaded along each row's bytes); with ``SPLIT > 1`` the K range is cut into slices whose partial
sums are added afterwards (matrices with few rows). The reference is
``engine.runtime.tdequant.dequantize`` followed by a matmul (:func:`gemv_reference`);
``tests/test_triton_gemv.py`` holds them together in Triton's interpreter and on CUDA.

Launch settings are data: :data:`LAUNCH` maps ``"<kernel>:<qtype>:<shape class>"`` to
``{"BR", "NB", "num_warps", "SPLIT"}``; ``LAUNCH["default"]`` is the documented default and
``LAUNCH[<torch.cuda.get_device_name()>]`` overrides it key by key (filled from
``sharpi bench device-kernels --tune``). Missing keys fall back to ``"<kernel>:*:<class>"``, then
``"<kernel>:*:*"``. The per-GPU tables live in ``triton_launch.json`` beside this file; the default
generalises the H100's sweep by block family (docs/lab-notebook.md, "Launch settings").
An optional ``"UNROLL"`` caps the unrolled K walk (:data:`UNROLL`).

Two kinds of kernels (:func:`act_mode`): ``"f32"`` — the exact-float kernels below (dequantize each
element, float FMAs), the default — and ``"q8"`` — integer dp4a products with the activations
rounded to 8-bit blocks (``triton_q8``, ``triton_q8_gemv``; launch keys ``gemv_q8:…``), chosen by
``SHARPI_DEVICE_ACT=q8`` or ``act="q8"``. :data:`DEFAULT_ACT` is f32: a single-matrix q8 call needs one
more launch to quantize x and is no faster per byte (the kernels are bound by memory latency, not by
instruction issue); :func:`matmul_many` in q8 mode (q, k, v in one launch) is the one place they win
(docs/lab-notebook.md, "Activation modes"). Inside a decode step's CUDA graph a default session takes
the lean Q4_K kernels instead (:func:`graph_act`).
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import torch

from engine.quant.formats import QType, block_format
from engine.runtime import triton_q4k_gemv, triton_q8, triton_q8_gemv
from engine.runtime import triton_qblocks as qb
from engine.runtime.tdequant import dequantize_at

triton, tl = qb.triton, qb.tl
SUPPORTED = qb.SUPPORTED

# Shape classes: by the number of output rows a launch computes (rows × pairs).
CLASSES = ((1024, "S"), (4096, "M"), (1 << 62, "L"))
# K walks of at most this many tile steps are unrolled (qb.acc_rows STEPS); a launch setting
# "UNROLL" overrides it (0: always a runtime loop).
UNROLL = qb.UNROLL
LAUNCH: dict[str, dict[str, dict[str, int]]] = {
    "default": {
        "gemv:*:*": {"BR": 8, "NB": 8, "num_warps": 4, "SPLIT": 1},  # 256-element blocks (K-quants)
        "gemv:*:S": {"BR": 2, "NB": 8, "num_warps": 4, "SPLIT": 1},  # few rows: more, smaller programs
        "gemv:Q6_K:*": {"BR": 4, "NB": 2, "num_warps": 4, "SPLIT": 1},  # larger Q6_K tiles spill
        "gemv:Q4_0:*": {"BR": 4, "NB": 32, "num_warps": 4, "SPLIT": 1},  # 32-element blocks
        "gemv:Q8_0:*": {"BR": 4, "NB": 32, "num_warps": 4, "SPLIT": 1},
        "gemv:Q4_0:S": {"BR": 2, "NB": 32, "num_warps": 4, "SPLIT": 1},
        "gemv:Q8_0:S": {"BR": 2, "NB": 32, "num_warps": 4, "SPLIT": 1},
        # q8 kernels: a thread should hold ≥ 4 words of a tile (BR·NB·8 ≥ 512 at 4 warps)
        # triton_q4k_gemv (Q4_K, q8 mode, one token); settings and their figures: docs/lab-notebook.md
        "gemv_q4k:*:*": {"BR": 8, "num_warps": 2, "PF": 1, "TILE": "halves"},
        # q, o (2048–4096 rows): one warp a program, 4 rows (timed in a PDL chain)
        "gemv_q4k:*:M": {"BR": 4, "num_warps": 1, "PF": 1, "TILE": "halves"},
        "gemv_q8:*:*": {"BR": 16, "NB": 8, "num_warps": 4, "SPLIT": 1},
        "gemv_q8:*:S": {"BR": 4, "NB": 8, "num_warps": 4, "SPLIT": 1},
        "gemv_q8:Q6_K:*": {"BR": 8, "NB": 8, "num_warps": 4, "SPLIT": 1},
        "gemv_q8:Q4_0:*": {"BR": 8, "NB": 32, "num_warps": 4, "SPLIT": 1},
        "gemv_q8:Q8_0:*": {"BR": 8, "NB": 32, "num_warps": 4, "SPLIT": 1},
        "gemv_q8:Q4_0:S": {"BR": 4, "NB": 32, "num_warps": 4, "SPLIT": 1},
        "gemv_q8:Q8_0:S": {"BR": 4, "NB": 32, "num_warps": 4, "SPLIT": 1},
    }
}
LAUNCH.update(json.loads((Path(__file__).with_name("triton_launch.json")).read_text()))

# Settings that depend on the Triton that compiles the kernels, over LAUNCH["default"] (a GPU's own table still
# comes first): the newest entry not newer than the installed Triton applies; none below 3.7, whose layouts the
# default was tuned under. Triton 3.7 swapped the blocked layouts the Q4_K half-block kernels' tiles get
# (triton_q4k_moe's docstring), so from 3.7 the MoE gate/up takes the [rows, half-blocks] tiles ("TILE": "rows")
# and the down and trunk settings move. Comments: µs a call on an H100 in a PDL graph chain against the default's
# settings under the same Triton (docs/lab-notebook.md, "Launch settings by Triton version"):
LAUNCH_BY_TRITON: dict[tuple[int, int], dict[str, dict]] = {
    (3, 7): {  # q, o keep the default's 4 × 1 halves: q 3.7, o 4.2
        "moe_q4k_gate_up:*:*": {"BR": 16, "num_warps": 4, "TILE": "rows"},  # 7.9 against 8.7
        "moe_q4k_down:*:*": {"BR": 8, "num_warps": 2, "PF": 0, "TILE": "halves"},  # 6.1 against 6.5
    },
    (3, 8): {
        "moe_q4k_gate_up:*:*": {"BR": 16, "num_warps": 4, "TILE": "rows"},  # 7.7 against 8.4
        "moe_q4k_down:*:*": {"BR": 8, "num_warps": 4, "PF": 0, "TILE": "rows"},  # 6.0 against 6.3
        "gemv_q4k:*:M": {"BR": 8, "num_warps": 4, "PF": 1, "TILE": "halves"},  # q 3.7 against 3.8, o 4.1 against 4.1
    },
    (3, 9): {  # q, o keep the default's 4 × 1 halves: q 3.4, o 4.1
        "moe_q4k_gate_up:*:*": {"BR": 16, "num_warps": 4, "TILE": "rows"},  # 7.6 against 11.1
        "moe_q4k_down:*:*": {"BR": 16, "num_warps": 4, "PF": 0, "TILE": "rows"},  # 6.0 against 6.6
    },
}


@cache
def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton; (0, 0) without one."""
    if triton is None:
        return (0, 0)
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


ENV_TRITON_TABLE = "SHARPI_TRITON_TABLE"


def triton_table_version(version: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """The LAUNCH_BY_TRITON key that applies to ``version`` — the newest not newer than it — or None. Default:
    ``$SHARPI_TRITON_TABLE`` ("3.9"; "none" for the defaults alone — to run another version's settings on this
    one), else the installed Triton."""
    env = os.environ.get(ENV_TRITON_TABLE, "")
    if version is None and env:
        try:
            version = (0, 0) if env == "none" else tuple(int(p) for p in env.split(".")[:2])
        except ValueError:
            raise ValueError(f"{ENV_TRITON_TABLE}={env!r}: expected a Triton version such as 3.9, or none") from None
    v = triton_version() if version is None else version
    return max((k for k in LAUNCH_BY_TRITON if k <= v), default=None)


def triton_table(version: tuple[int, int] | None = None) -> dict[str, dict]:
    """The LAUNCH_BY_TRITON entry :func:`triton_table_version` picks, or {}."""
    key = triton_table_version(version)
    return LAUNCH_BY_TRITON[key] if key else {}


ENV_ACT = "SHARPI_DEVICE_ACT"
ACT_MODES = ("q8", "f32")
DEFAULT_ACT = "f32"  # on a compiled CUDA device (measured faster there; see the module docstring)


def act_mode(device: torch.device, act: str | None = None) -> str:
    """``act`` if given, else ``$SHARPI_DEVICE_ACT``, else :data:`DEFAULT_ACT` on a compiled CUDA
    device and ``"f32"`` otherwise (Triton's interpreter, the simulated device)."""
    mode = (act or os.environ.get(ENV_ACT, "")).strip().lower()
    if not mode:
        mode = DEFAULT_ACT if qb.compiled(device) else "f32"
    if mode not in ACT_MODES:
        raise ValueError(f"device activation mode {mode!r}: expected one of {ACT_MODES}")
    return mode


def graph_act(device: torch.device, eligible: bool, capturing: bool | None = None) -> str:
    """The activation mode of a one-token launch the lean q8 kernels could serve: ``$SHARPI_DEVICE_ACT``
    when set; else ``"q8"`` where ``eligible`` (the caller's test: a model that rounds its activations
    like llama.cpp, a compiled CUDA device, a kernel that applies) and the launch goes into a CUDA graph
    step (``capturing``, default ``triton_qblocks.in_graph_step()``: capturing, or the warm-up before a
    capture); else ``"f32"``. Eager launches keep exact float: from Python the q8 path is no faster
    (``triton_moe.decode_act``)."""
    if os.environ.get(ENV_ACT, "").strip():
        return act_mode(device, None)
    if not eligible:
        return "f32"
    if capturing is None:
        capturing = qb.in_graph_step()
    return "q8" if capturing else "f32"


def trunk_act(
    device: torch.device,
    q8_act: bool,
    qtype: QType,
    n: int,
    capturing: bool | None = None,
    own_quant_bytes: int | None = None,
) -> str:
    """:func:`graph_act` for a trunk matrix multiplying one token: eligible for a model that rounds its
    activations like llama.cpp (``q8_act``) and a Q4_K matrix (``triton_q4k_gemv``) on a compiled CUDA
    device.
    ``own_quant_bytes``: the matrix's bytes when x̂ is not handed to it (the kernel call then quantizes
    x in a launch of its own): under ``triton_q4k_gemv.MIN_BYTES_OWN_QUANT`` that launch costs more than
    q8 saves, so exact float."""
    small = own_quant_bytes is not None and own_quant_bytes < triton_q4k_gemv.MIN_BYTES_OWN_QUANT
    eligible = q8_act and qb.compiled(device) and triton_q4k_gemv.applies(qtype, n, 1) and not small
    return graph_act(device, eligible, capturing)


def available() -> bool:
    return triton is not None


def shape_class(out_rows: int) -> str:
    return next(name for limit, name in CLASSES if out_rows <= limit)


def launch(kernel: str, qtype: QType, out_rows: int, device_name: str = "") -> dict[str, int]:
    """The launch settings for ``kernel`` on ``qtype`` computing ``out_rows`` rows (see LAUNCH): the GPU's
    table, then the installed Triton's (LAUNCH_BY_TRITON), then the default."""
    cls, name = shape_class(out_rows), QType(qtype).name
    keys = (f"{kernel}:{name}:{cls}", f"{kernel}:{name}:*", f"{kernel}:*:{cls}", f"{kernel}:*:*")
    for table in (LAUNCH.get(device_name, {}), triton_table(), LAUNCH["default"]):
        for k in keys:
            if k in table:
                return dict(table[k])
    raise KeyError(f"no launch settings for {kernel}")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        W, OFFS, X, Y, R, n, row_bytes, nb, T,
        QT: tl.constexpr, TS: tl.constexpr, QK: tl.constexpr, PW: tl.constexpr, NPART: tl.constexpr,
        ALIGN: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr,
        STEPS: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr,
    ):  # fmt: skip
        """Y[s, p·BT + t, rows] = Σ over K-slice s of W_p[rows] · X[p·BT + t] (t < BT, p·BT + t < T).
        PF: OFFS is constant (a trunk matrix), so the rows are prefetched into L2 before the PDL wait."""
        p = tl.program_id(1)
        s = tl.program_id(2)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < R
        if PF:
            off = tl.multiple_of(tl.load(OFFS + p), 16)  # slots and matrices start 16-byte aligned
            qb.prefetch_rows(W, off, tl.program_id(0) * BR, tl.where(s == 0, R, 0), BR, row_bytes, NT)  # K slice 0
            qb.pdl_enter(PDL)
        else:
            qb.pdl_enter(PDL)
            off = tl.multiple_of(tl.load(OFFS + p), 16)
        rowoff = off + rows.to(tl.int64) * row_bytes  # [BR] row starts
        per = tl.cdiv(tl.cdiv(nb, SPLIT), NB) * NB  # blocks per K slice, a multiple of NB
        kb0 = s * per
        kb1 = tl.minimum(kb0 + per, nb)
        l = tl.arange(0, PW)
        t0 = p * BT
        if BT == 1:
            acc3 = tl.zeros([BR, NB, PW], dtype=tl.float32)  # summed once, after the K loop
            xrow = X + t0.to(tl.int64) * n
            acc3 = qb.acc_rows(acc3, W, rowoff, rmask, kb0, kb1, xrow, 1.0, QT, TS, QK, PW, NPART, ALIGN, NB, STEPS)
            acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
            tl.store(Y + (s * T + t0).to(tl.int64) * R + rows, acc, mask=rmask)
        else:
            tt = tl.arange(0, BT)
            acc = tl.zeros([BT, BR], dtype=tl.float32)
            for b0 in range(kb0, kb1, NB):
                b = b0 + tl.arange(0, NB)
                boff, m2 = qb.block_offsets(rowoff, b, kb1, rmask, TS, ALIGN)
                for i in tl.static_range(NPART):
                    w = qb.part(W, boff, m2, QT, i, PW)
                    xcol = b[:, None] * QK + i * PW + l[None, :]  # [NB, PW]
                    for t in tl.static_range(BT):
                        # [NB], in vector form: the interpreter rejects a scalar & vector mask
                        ok = (b < kb1) & (b * 0 + t0 + t < T)
                        xv = tl.load(X + (t0 + t).to(tl.int64) * n + xcol, mask=ok[:, None], other=0.0)
                        pt = tl.sum(tl.sum(w * xv[None, :, :], axis=2), axis=1)  # [BR]
                        acc += tl.where(tt[:, None] == t, pt[None, :], 0.0)
            ymask = ((t0 + tt) < T)[:, None] & rmask[None, :]
            tl.store(Y + (s * T + t0 + tt[:, None]).to(tl.int64) * R + rows[None, :], acc, mask=ymask)


def _run(pool, offsets, X, qtype, rows, n, bt, cfg, constant_offsets: bool = False) -> torch.Tensor:
    """Launch the GEMV kernel: X float32 [T, n] in groups of ``bt`` rows, one offset per group
    (``constant_offsets``: no kernel writes them, so the weights may be prefetched before the PDL wait)."""
    pdl = qb.pdl(X.device)
    T = X.shape[0]
    g = qb.geometry(qtype)
    nb = n // g["QK"]
    split = max(1, min(cfg["SPLIT"], nb))
    out = torch.empty((split, T, rows), dtype=torch.float32, device=X.device)
    grid = (triton.cdiv(rows, cfg["BR"]), offsets.shape[0], split)
    per = triton.cdiv(triton.cdiv(nb, split), cfg["NB"]) * cfg["NB"]  # blocks per K slice (as the kernel)
    _gemv_kernel[grid](
        pool, offsets, X, out, rows, n, block_format(qtype).row_bytes(n), nb, T,
        BR=cfg["BR"], NB=cfg["NB"], BT=bt, SPLIT=split, STEPS=qb.steps(per, cfg["NB"], cfg.get("UNROLL", UNROLL)),
        PDL=pdl, PF=int(qb.prefetch(pdl) and constant_offsets), NT=32 * cfg["num_warps"], num_warps=cfg["num_warps"], **g,
        **qb.launch_kw(pdl),
    )  # fmt: skip
    return out[0] if split == 1 else out.sum(0)


def gemv(
    pool: torch.Tensor,
    offsets: torch.Tensor,
    X: torch.Tensor,
    qtype: QType,
    rows: int,
    n: int,
    cfg: dict | None = None,
    act: str | None = None,
) -> torch.Tensor:
    """pool uint8 [...] (contiguous); offsets int64 [P] byte offsets; X float32 [P, n] -> float32 [P, rows]."""
    qtype = QType(qtype)
    if act_mode(X.device, act) == "q8":
        cfg = cfg or launch("gemv_q8", qtype, rows * X.shape[0], device_name(X.device))
        return triton_q8_gemv.gemv_q8(pool, offsets, X.contiguous(), qtype, rows, n, cfg)
    cfg = cfg or launch("gemv", qtype, rows * X.shape[0], device_name(X.device))
    return _run(pool, offsets, X.contiguous(), qtype, rows, n, 1, cfg)


def matmul(
    raw: torch.Tensor,
    X: torch.Tensor,
    qtype: QType,
    rows: int,
    n: int,
    cfg: dict | None = None,
    act: str | None = None,
    xq: tuple | None = None,
) -> torch.Tensor:
    """One quantized matrix (raw uint8 [rows, row_bytes]) times X float32 [T, n] -> [T, rows], T ≤ 8.
    q8 mode, Q4_K, one token: ``triton_q4k_gemv`` (xq: X already in triton_q8's format, e.g. from the
    norm kernel; else it quantizes X itself); other q8 cases: ``triton_q8_gemv``."""
    qtype = QType(qtype)
    T = X.shape[0]
    if act_mode(X.device, act) == "q8":
        if triton_q4k_gemv.applies(qtype, n, T):
            return triton_q4k_gemv.gemv(
                raw, X, rows, n, cfg or launch("gemv_q4k", qtype, rows, device_name(X.device)), xq
            )
        cfg = cfg or launch("gemv_q8", qtype, rows, device_name(X.device))
        return triton_q8_gemv.matmul_q8(raw, X.contiguous(), qtype, rows, n, cfg, zero_offset(X.device))
    bt = triton.next_power_of_2(T)
    cfg = cfg or launch("gemv", qtype, rows, device_name(X.device))
    return _run(raw.reshape(-1), zero_offset(X.device), X.contiguous(), qtype, rows, n, bt, cfg, True)


def matmul_many(
    raws: list[torch.Tensor],
    X: torch.Tensor,
    qtype: QType,
    rows: list[int],
    n: int,
    cfg: dict | None = None,
    act: str | None = None,
    xq: tuple | None = None,
) -> list[torch.Tensor]:
    """Several matrices of one qtype and width n (raws[i] uint8 [rows[i], row_bytes], each 16-byte
    aligned; e.g. a layer's q, k, v) times the same X float32 [T, n], T ≤ 8 -> [T, rows[i]] each.
    q8 mode: Q4_K at one token, one ``triton_q4k_gemv`` launch each on one x̂ (xq, else quantized
    once here); other types one launch for all (plus X's quantization); f32 mode: one :func:`matmul` each."""
    qtype = QType(qtype)
    q8 = act_mode(X.device, act) == "q8"
    if q8 and triton_q4k_gemv.applies(qtype, n, X.shape[0]):
        xq = xq if xq is not None else triton_q8.quantize_act(X.contiguous())
        return [matmul(r, X, qtype, R, n, cfg, act, xq) for r, R in zip(raws, rows)]
    if not q8 or len(raws) == 1:
        return [matmul(r, X, qtype, R, n, cfg, act) for r, R in zip(raws, rows)]
    cfg = cfg or launch("gemv_q8", qtype, sum(rows), device_name(X.device))
    Y = triton_q8_gemv.matmul_many_q8(raws, X.contiguous(), qtype, rows, n, cfg)
    return list(torch.split(Y, list(rows), dim=1))


_ZERO: dict[torch.device, torch.Tensor] = {}


def zero_offset(device: torch.device) -> torch.Tensor:
    """int64 [1] zero on ``device``, made once (a fresh one per call is a fill kernel per GEMV)."""
    z = _ZERO.get(device)
    if z is None:
        z = _ZERO[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return z


def gemv_reference(
    pool: torch.Tensor, offsets: torch.Tensor, X: torch.Tensor, qtype: QType, rows: int, n: int
) -> torch.Tensor:
    """The same contract as :func:`gemv`, by torch dequantize-then-matmul (the specification)."""
    return torch.stack([dequantize_at(pool, o, qtype, rows, n) @ X[p] for p, o in enumerate(offsets.tolist())])
