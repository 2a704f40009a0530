"""One token times a Q4_K trunk matrix on q8 activations with the routed experts' half-block decoder
(:func:`engine.runtime.triton_q4k_moe._load_half` / ``_dot_half``): the fast path of
:func:`engine.runtime.triton_gemv.matmul` in q8 mode for Q4_K at T = 1 — in a default session, the
trunk matrices of a decode step's CUDA graph (``kernel_select.trunk_act``). Same arithmetic as
``triton_q8_gemv`` (x rounded by ``triton_q8``'s rule, dp4a products), so
:func:`engine.runtime.references.matmul_q8_reference` is its reference.

Contract (:func:`gemv`): raw uint8 [rows, 144·n/256] (Q4_K blocks, ggml's ``block_q4_K``; 16-byte aligned),
x float32 [1, n] (n a multiple of 256) -> float32 [1, rows] = W · x̂, x̂ = x through ``triton_q8``'s rounding.
x̂ comes from the norm kernel before the matrix where there is one (``step_kernels.add_rms_norm(q8=True)``:
the attention's q, k and v), else from one ``triton_q8.quantize_act`` launch (the output projection).
Each thread decodes half Q4_K blocks with ``triton_q4k_moe``'s decoder; the kernels' figures against the
exact-float GEMV are in docs/lab-notebook.md ("Trunk Q4_K GEMV on q8 activations").

Grid (rows / BR,): a program walks whole rows, [2·NB, BR] tiles with a row's half-blocks on the fastest
lanes (the row's sum stays in the warp); ``TILE: "rows"`` takes [BR, 2·NB] tiles (:func:`_gemv_kernel_t`,
the orientation triton_q4k_moe's docstring explains). PF: the program's rows are prefetched into L2 before the PDL
wait (a trunk matrix's bytes are constant).
"""

from __future__ import annotations

import torch

from engine.quant.formats import QType
from engine.runtime import triton_q4k_moe as q4
from engine.runtime import triton_q8 as t8
from engine.runtime import triton_qblocks as qb

triton, tl = qb.triton, qb.tl


# A matrix smaller than this takes the exact-float kernel when x̂ would need its own quantize launch
# (~1.3 µs in a graph on the H100): q8 saves ~0.5 µs a MB (o, 4.7 MB: 1.3 + 4.1 against 6.6 µs; k, 0.6 MB:
# 1.3 + 2.0 against 2.2). kernel_select.trunk_act applies it.
MIN_BYTES_OWN_QUANT = 3 << 20


def applies(qtype: QType, n: int, T: int) -> bool:
    """Whether :func:`gemv` serves this matrix and batch: Q4_K, one token, n a multiple of 256."""
    return QType(qtype) == QType.Q4_K and T == 1 and n % 256 == 0


if triton is not None:

    @triton.jit
    def _rows(W, R, NB: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr):
        """The program's rows r0 … r0 + BR − 1 (their L2 prefetch, PF, before the PDL wait): (rows, rows < R,
        rows to read — past R, row 0, not stored)."""
        r0 = tl.program_id(0) * BR
        if PF:
            qb.prefetch_rows(W, 0, r0, R, BR, 144 * NB, NT)
        qb.pdl_enter(PDL)
        rows = r0 + tl.arange(0, BR)
        rm = rows < R
        return rows, rm, tl.where(rm, rows, 0)

    @triton.jit
    def _gemv_kernel(W, W32, XQ, XD, XS, Y, R, NB: tl.constexpr, BR: tl.constexpr, ASM: tl.constexpr,
                     PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr):  # fmt: skip
        """Y[rows] = W[rows]·x̂ for rows r0 … r0 + BR − 1 (< R) of the Q4_K matrix W (NB blocks a row)."""
        rows, rm, rr = _rows(W, R, NB, BR, PDL, PF, NT)
        e = tl.arange(0, 2 * NB)
        b = e // 2
        zp = tl.zeros([2 * NB, BR], dtype=tl.int32)
        hs = (e % 2)[:, None] + zp
        off = tl.multiple_of(b[:, None] * q4.BLOCK_WORDS + rr[None, :].to(tl.int64) * (q4.BLOCK_WORDS * NB), [4, 4])
        X = XQ + (zp + (b * 64 + (e % 2) * 32)[:, None])
        XDp = XD + (zp + (b * 8 + (e % 2) * 4)[:, None])
        XSp = XS + (zp + (b * 16 + (e % 2) * 8)[:, None])
        y = tl.sum(q4._dot_half(q4._load_half(W32 + off, hs), hs, X, XDp, XSp, ASM), axis=0)
        tl.store(Y + rows, y, mask=rm)

    @triton.jit
    def _gemv_kernel_t(W, W32, XQ, XD, XS, Y, R, NB: tl.constexpr, BR: tl.constexpr, ASM: tl.constexpr,
                       PDL: tl.constexpr, PF: tl.constexpr, NT: tl.constexpr):  # fmt: skip
        """:func:`_gemv_kernel` with [rows, half-blocks] tiles (launch setting ``TILE: "rows"``; the
        activation pointers [1, 2·NB] shared by the tile's rows — triton_q4k_moe's docstring says when)."""
        rows, rm, rr = _rows(W, R, NB, BR, PDL, PF, NT)
        e = tl.arange(0, 2 * NB)[None, :]
        b = e // 2
        hs = e % 2
        off = tl.multiple_of(rr[:, None].to(tl.int64) * (q4.BLOCK_WORDS * NB) + b * q4.BLOCK_WORDS, [4, 4])
        X = XQ + b * 64 + hs * 32
        XDp = XD + b * 8 + hs * 4
        XSp = XS + b * 16 + hs * 8
        y = tl.sum(q4._dot_half(q4._load_half(W32 + off, q4._bc(hs, off)), hs, X, XDp, XSp, ASM), axis=1)
        tl.store(Y + rows, y, mask=rm)


def gemv(raw: torch.Tensor, x: torch.Tensor, rows: int, n: int, cfg: dict, xq: tuple | None = None) -> torch.Tensor:
    """raw uint8 [rows, row_bytes] Q4_K (16-byte aligned) times x float32 [1, n] rounded by triton_q8's
    rule -> float32 [1, rows]. xq: x̂ already made (``quantize_act(x)``'s tensors), else one launch here.
    cfg: {"BR", "num_warps", "PF", "TILE"} (launch table "gemv_q4k": engine/runtime/launch/)."""
    dev = x.device
    XQ, XD, XS = xq if xq is not None else t8.quantize_act(x.contiguous())
    pdl = qb.pdl(dev)
    Y = torch.empty((1, rows), dtype=torch.float32, device=dev)
    flat = raw.reshape(-1)
    kernel = _gemv_kernel_t if cfg.get("TILE") == "rows" else _gemv_kernel
    kernel[(triton.cdiv(rows, cfg["BR"]),)](
        flat, flat.view(torch.int32), XQ, XD, XS, Y, rows, NB=n // 256, BR=cfg["BR"], ASM=t8.use_asm(dev), PDL=pdl,
        PF=qb.prefetch(pdl) * cfg.get("PF", 1), NT=32 * cfg["num_warps"], num_warps=cfg["num_warps"],
        **qb.launch_kw(pdl),
    )  # fmt: skip
    return Y
