"""One token's attention over the KV cache in one or two launches (the device step's
``DeviceStepOps.attend``), in place of torch's four (scores GEMM with scale and mask, softmax,
probs·V GEMM, the mask's elementwise op); optionally also writing the output in ``triton_q8``'s
activation format, so a Q4_K o projection on q8 activations needs no quantize launch of its own.

:func:`attend`: grid (H, S). A program takes one query head over one chunk of CH positions, walking only
the positions up to the token's (a device scalar: later positions of the static length are never read),
32 at a time with an online softmax; scores and probs·V are float32 multiply-and-sum tiles (the G query
heads of a KV head read its rows from L2 after the first). With one chunk (S = 1) it writes the output;
else each chunk writes its running max, sum and weighted V sum, and :func:`_combine_kernel` (grid H)
merges them — flash-decoding. The reference is :func:`engine.models.layers.attention_static` (equal up
to the order of float32 sums).
"""

from __future__ import annotations

import torch

from engine.runtime import triton_q8 as t8
from engine.runtime import triton_qblocks as qb

triton, tl = qb.triton, qb.tl

BL = 32  # positions a step of a program's walk
SPLITS = 16  # chunks a head's positions are cut into at most (programs: H · S)


def chunk(length: int) -> int:
    """Positions a program covers for a static length: at least BL, enough for ≤ SPLITS chunks."""
    return max(BL, triton.next_power_of_2(-(-length // SPLITS)))


if triton is not None:

    @triton.jit
    def _kv_tile(C, rows, valid, col, W: tl.constexpr, HD: tl.constexpr, BF16: tl.constexpr):
        """Rows ``rows`` [BL] of the cache C (float32, or bfloat16 viewed as int16) [n_ctx, W], columns
        col … col + HD − 1, as float32 [BL, HD] (rows not ``valid``: 0)."""
        p = C + rows[:, None].to(tl.int64) * W + col + tl.arange(0, HD)[None, :]
        if BF16:  # (both branches assign: the compiler types every return of a jit function)
            t = (tl.load(p, mask=valid[:, None], other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            t = tl.load(p, mask=valid[:, None], other=0.0)
        return t

    @triton.jit
    def _store_out(O, XQ, XD, XS, out, heads, hm, HD: tl.constexpr, NH: tl.constexpr, Q8: tl.constexpr):
        """out [NH, HD] of query heads ``heads`` [NH] (mask hm) into O [1, H·HD], and with Q8 its
        triton_q8 copy (HD % 32 == 0: a head is HD / 32 whole blocks), made from the values read back
        from O — the compiler may recompute ``out`` in another layout for a second use, summing in
        another order, and the copy must be quantize_act(O)'s bit for bit."""
        off = heads[:, None] * HD + tl.arange(0, HD)[None, :]
        tl.store(O + off, out, mask=hm[:, None])
        if Q8:
            NB: tl.constexpr = NH * HD // 32
            tl.debug_barrier()  # the whole program's stores are visible to its loads
            bm = tl.reshape(hm[:, None] & (tl.arange(0, HD // 32) >= 0)[None, :], [NB])
            x = tl.load(O + tl.reshape(off, [NB, 32]), mask=bm[:, None], other=0.0)
            words, d, s = t8.quant_tile(x, NB)
            blk = tl.reshape(heads[:, None] * (HD // 32) + tl.arange(0, HD // 32)[None, :], [NB])
            t8.store_q8(XQ, XD, XS, tl.program_id(0) * 0, blk, bm, words, d, s, 0)  # one row: blocks by index

    @triton.jit
    def _attend_kernel(Q, KC, VC, POS, O, PM, PL, PA, XQ, XD, XS, scale, H, W: tl.constexpr, G: tl.constexpr,
                       HD: tl.constexpr, CH: tl.constexpr, BLK: tl.constexpr, SPLIT: tl.constexpr,
                       BF16: tl.constexpr, Q8: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
        i = tl.program_id(0)  # query head
        s = tl.program_id(1)  # chunk
        qb.pdl_enter(PDL)
        pos = tl.load(POS)
        kv = i // G
        one = tl.arange(0, 1)
        d = tl.arange(0, HD)
        q = tl.load(Q + i * HD + d)
        m = tl.full([1], float("-inf"), tl.float32)
        lsum = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([HD], dtype=tl.float32)
        start = s * CH
        end = tl.minimum(start + CH, pos + 1)
        for j in range(start, end, BLK):
            rows = j + tl.arange(0, BLK)
            valid = rows < end
            k = _kv_tile(KC, rows, valid, kv * HD, W, HD, BF16)
            sc = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))  # [BLK]
            mn = tl.maximum(m, tl.max(sc, axis=0))
            alpha = tl.exp(m - mn)  # m = -inf on the first step: 0
            p = tl.exp(sc - mn)
            lsum = lsum * alpha + tl.sum(p, axis=0)
            v = _kv_tile(VC, rows, valid, kv * HD, W, HD, BF16)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = mn
        if SPLIT:  # this chunk's running max, sum and weighted V sum (a chunk past the token: -inf, 0, 0)
            tl.store(PM + s * H + i + one, m)
            tl.store(PL + s * H + i + one, lsum)
            tl.store(PA + (s * H + i) * HD + d, acc)
        else:
            _store_out(O, XQ, XD, XS, tl.reshape(acc / lsum, [1, HD]), i + one, one >= 0, HD, 1, Q8)

    @triton.jit
    def _combine_kernel(PM, PL, PA, O, XQ, XD, XS, S, H, HD: tl.constexpr, SP: tl.constexpr, Q8: tl.constexpr,
                        PDL: tl.constexpr):  # fmt: skip
        """Query head program_id(0): the S chunks' partial softmax sums merged (rescaled to the largest max)."""
        i = tl.program_id(0)
        qb.pdl_enter(PDL)
        sp = tl.arange(0, SP)
        sm = sp < S
        m = tl.load(PM + sp * H + i, mask=sm, other=float("-inf"))
        mx = tl.max(m, axis=0)  # finite: chunk 0 always holds position 0
        w = tl.where(sm, tl.exp(m - mx), 0.0)
        lsum = tl.sum(w * tl.load(PL + sp * H + i, mask=sm, other=0.0), axis=0)
        a = tl.load(PA + (sp * H + i)[:, None] * HD + tl.arange(0, HD)[None, :], mask=sm[:, None], other=0.0)
        out = tl.sum(a * w[:, None], axis=0) / lsum
        one = tl.arange(0, 1)
        _store_out(O, XQ, XD, XS, tl.reshape(out, [1, HD]), i + one, one >= 0, HD, 1, Q8)


def applies(head_dim: int, n_head: int, n_head_kv: int, kv_dtype: torch.dtype) -> bool:
    """Whether :func:`attend` takes this geometry: a power-of-two head size of 32 … 256 (whole q8 blocks),
    H a multiple of Hkv, a float32 or bfloat16 cache."""
    pow2 = head_dim & (head_dim - 1) == 0
    return pow2 and 32 <= head_dim <= 256 and n_head % n_head_kv == 0 and kv_dtype in (torch.float32, torch.bfloat16)


def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, length: int, n_head: int,
           n_head_kv: int, head_dim: int, q8: bool = False):  # fmt: skip
    """q [1, H, hd] (or [1, H·hd]) float32, the token's query; kc, vc [n_ctx, Hkv·hd] float32 or bfloat16, the
    cache with the token's K/V already written at ``pos`` (int64 [1], on the device; attended: positions
    0 … pos, all < ``length``) -> [1, H·hd] float32, or with ``q8`` (o, its triton_q8 copy (XQ, XD, XS))."""
    dev = q.device
    H, Hkv, hd = n_head, n_head_kv, head_dim
    G = H // Hkv
    ch = chunk(length)
    S = -(-length // ch)
    bf16 = kc.dtype == torch.bfloat16
    o = torch.empty((1, H * hd), dtype=torch.float32, device=dev)
    xq = (torch.empty((1, H * hd // 4), dtype=torch.int32, device=dev),
          torch.empty((1, H * hd // 32), dtype=torch.float32, device=dev),
          torch.empty((1, H * hd // 16), dtype=torch.float32, device=dev)) if q8 else (o, o, o)  # fmt: skip
    if S > 1:
        pm = torch.empty((S, H), dtype=torch.float32, device=dev)
        pl = torch.empty_like(pm)
        pa = torch.empty((S, H, hd), dtype=torch.float32, device=dev)
    else:
        pm = pl = pa = o
    pdl = qb.pdl(dev)
    k_, v_ = (kc.view(torch.int16), vc.view(torch.int16)) if bf16 else (kc, vc)
    _attend_kernel[(H, S)](
        q.contiguous(), k_, v_, pos, o, pm, pl, pa, *xq, 1.0 / float(hd) ** 0.5, H, W=Hkv * hd, G=G, HD=hd, CH=ch,
        BLK=BL, SPLIT=S > 1, BF16=bf16, Q8=q8 and S == 1, PDL=pdl, num_warps=4, **qb.launch_kw(pdl),
    )  # fmt: skip
    if S > 1:
        _combine_kernel[(H,)](
            pm, pl, pa, o, *xq, S, H, HD=hd, SP=triton.next_power_of_2(S), Q8=q8, PDL=pdl, num_warps=1,
            **qb.launch_kw(pdl),
        )  # fmt: skip
    return (o, xq) if q8 else o
