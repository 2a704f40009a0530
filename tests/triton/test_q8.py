"""Integer (dp4a) kernels with q8 activations (engine.runtime.triton_q8*): the activation quantizer
against its torch specification (bit for bit), the GEMV / matmul / matmul_many / fused-MoE kernels
against torch references that dequantize the weights and multiply by the dequantized q8 activations
(≤ 1e-5 relative), and against the exact-float references within the error the activation rounding
predicts. Triton's interpreter (the plain-Triton dp4a emulation, small awkward shapes), or compiled
with PTX dp4a on CUDA (trunk and expert shapes). The kernel-choice rules are tests/test_triton_q8.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.quant import QType
from engine.runtime import kernel_select as ks
from engine.runtime import references as refs
from engine.runtime import triton_gemv as tg
from engine.runtime import triton_moe as tm
from engine.runtime import triton_q4k_gemv as g4
from engine.runtime import triton_q4k_moe as m4
from engine.runtime import triton_q8 as t8
from engine.runtime import triton_q8_moe as m8
from engine.runtime.references import dequantize
from tests.triton import BIG, INTERPRET
from tests.triton_data import blocks, expert_pool, routing_case

Q = QType


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# The interpreter runs programs one by one: fewer, larger tiles keep it quick; the table's settings here
# walk K in a runtime loop, split in two.
INTERPRETER_LAUNCH = {
    "gemv_q8:*:*": {"BR": 16, "NB": 1, "num_warps": 4, "SPLIT": 2, "UNROLL": 0},
    "moe_q8_gate_up:*:*": {"BR": 64, "NB": 2, "num_warps": 4},
    "moe_q8_down:*:*": {"BR": 64, "NB": 1, "num_warps": 4, "KSPLIT": 2},
    "moe_q4k_gate_up:*:*": {"BR": 64, "num_warps": 4},
    "moe_q4k_down:*:*": {"BR": 64, "num_warps": 4},
}
TABLE_KERNELS = {key.split(":")[0] for key in INTERPRETER_LAUNCH}


def test_quantize_act_is_its_specification_bit_for_bit(device):
    """A zero block, a tiny one, ±127 extremes."""
    rng = np.random.default_rng(3)
    X = torch.from_numpy(rng.standard_normal((5, 320)).astype(np.float32)).to(device)
    X[1, :32] = 0
    X[2, 32:64] *= 1e-30
    XQ, XD, XS = t8.quantize_act(X)
    q, d, s = refs.quantize_act_reference(X)
    assert torch.equal(t8.unpack_words(XQ), q) and torch.equal(XD, d) and torch.equal(XS, s), "quantize_act"
    assert q.abs().max() == 127 and (q[1, :32] == 0).all()


def check_stat(Y, W, X, Yf) -> float:
    """Activation rounding e = x - x̂, |e| ≤ d/2 per element: |Y - Yf| ≤ Σ|w|·d/2 per output (hard), and
    ||Y - Yf|| near sqrt(Σ w²·d²/12) (e ~ uniform on ±d/2, independent): within [0.5, 2]×."""
    _, d, _ = refs.quantize_act_reference(X)
    de = d.repeat_interleave(32, -1)  # [T, n]
    hard = (W.abs()[None] * de[:, None, :] / 2).sum(-1)  # [T, rows]
    err = (Y - Yf).abs()
    assert (err <= hard * 1.0001 + 1e-6).all(), "hard rounding bound"
    pred = ((W[None] ** 2) * (de[:, None, :] ** 2) / 12).sum(-1).sum().sqrt().item()
    ratio = (Y - Yf).norm().item() / pred
    assert 0.5 < ratio < 2.0, ("rounding error off its prediction", ratio)
    return ratio


# -- GEMV / matmul / matmul_many ---------------------------------------------------------------------
if not BIG:
    SHAPES = {"Q4_0": (37, 96), "Q8_0": (37, 96), "Q4_K": (21, 512), "Q5_K": (21, 256), "Q6_K": (21, 256)}
    # the interpreter is slow: one explicit setting (K walk unrolled) + the table's (runtime loop, split)
    CFGS = ({"BR": 4, "NB": 2, "num_warps": 4, "SPLIT": 1, "UNROLL": 4},)
    TOKENS = (1, 3)
else:
    SHAPES = {q: (4096, 2048) for q in ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
    CFGS = ({"BR": 4, "NB": 4, "num_warps": 4, "SPLIT": 3, "UNROLL": 0},)  # + the table's (unrolled)
    TOKENS = (1, 5)


def _weights(name: str, device, rng):
    rows, n = SHAPES[name]
    qt = QType[name]
    raws = [blocks(qt, r, n, device, rng) for r in (rows, rows // 4 + 1, rows // 4 + 1)]  # q, k, v-like
    return qt, rows, n, raws


@pytest.mark.parametrize("T", TOKENS, ids=[f"T{t}" for t in TOKENS])
@pytest.mark.parametrize("name", list(SHAPES))
def test_matmul_q8_matches_the_reference(name, T, device, big, launch_table):
    """matmul (an explicit setting and the table's) and matmul_many against matmul_q8_reference; the
    difference from exact float is the activation rounding's (check_stat)."""
    log = launch_table(INTERPRETER_LAUNCH) if INTERPRET else None
    rng = np.random.default_rng((3, int(QType[name]), T))
    qt, rows, n, raws = _weights(name, device, rng)
    W = dequantize(raws[0], qt, n)
    X = torch.from_numpy(rng.standard_normal((T, n)).astype(np.float32)).to(device)
    ref = refs.matmul_q8_reference(raws[0], X, qt, rows, n)
    Yf = X @ W.T
    for cfg in (*CFGS, None):
        Y = tg.matmul(raws[0], X, qt, rows, n, cfg, act="q8")
        assert rel(Y, ref) < 1e-5, (name, T, cfg, rel(Y, ref))
    check_stat(Y, W, X, Yf)  # the table's launch
    for cfg in (CFGS[0],) if T > 1 or not big else (CFGS[0], None):
        outs = tg.matmul_many(raws, X, qt, [r.shape[0] for r in raws], n, cfg, act="q8")
        for r, y in zip(raws, outs):
            e = rel(y, refs.matmul_q8_reference(r, X, qt, r.shape[0], n))
            assert e < 1e-5, (name, T, "many", cfg, e)
    if log is not None:
        assert log.kernels() == {ks.matmul_kernel(qt, n, T, "q8")} & TABLE_KERNELS


@pytest.mark.parametrize("name", list(SHAPES))
def test_gemv_q8_with_slot_offsets_matches_the_reference(name, device):
    rng = np.random.default_rng((4, int(QType[name])))
    qt, rows, n, raws = _weights(name, device, rng)
    pool = torch.cat([raws[0].reshape(-1), raws[0].reshape(-1)])
    X = torch.from_numpy(rng.standard_normal((3, n)).astype(np.float32)).to(device)
    offs = torch.tensor([0, raws[0].numel(), 0], dtype=torch.int64, device=device)
    Y = tg.gemv(pool, offs, X, qt, rows, n, CFGS[-1], act="q8")
    assert rel(Y, refs.gemv_q8_reference(pool, offs, X, qt, rows, n)) < 1e-5, (name, "gemv")


# -- fused MoE decode --------------------------------------------------------------------------------
if not BIG:
    MOE_CASES = [((Q.Q4_K, Q.Q4_K, Q.Q6_K), 256, 256), ((Q.Q8_0, Q.Q4_0, Q.Q5_K), 256, 96),
                 ((Q.Q4_0, Q.Q8_0, Q.Q8_0), 96, 64), ((Q.Q4_K, Q.Q4_K, Q.Q4_K), 256, 512)]  # fmt: skip
    E, K, MOE_TOKENS = 3, 2, (1, 3)
    MOE_CFGS = (({"BR": 16, "NB": 2, "num_warps": 4}, {"BR": 64, "NB": 1, "num_warps": 4, "KSPLIT": 1}),)  # h in float
else:
    MOE_CASES = [((Q.Q4_0, Q.Q4_0, Q.Q8_0), 768, 2048), ((Q.Q5_K, Q.Q5_K, Q.Q5_K), 768, 2048),
                 ((Q.Q4_K, Q.Q4_K, Q.Q6_K), 768, 2048), ((Q.Q4_K, Q.Q4_K, Q.Q4_K), 768, 2048)]  # fmt: skip
    E, K, MOE_TOKENS = 16, 8, (1, 4)
    # h quantized in the gate/up tile (BR 32; the table's BR 8 keeps h in float), on the Q4_0 case only
    MOE_CFGS = (({"BR": 32, "NB": 16, "num_warps": 4}, {"BR": 16, "NB": 32, "num_warps": 4, "KSPLIT": 1}),)


def _case_id(case) -> str:
    types, F, D = case
    return "-".join(t.name for t in types) + f"-F{F}-D{D}"


@pytest.mark.parametrize("T", MOE_TOKENS, ids=[f"T{t}" for t in MOE_TOKENS])
@pytest.mark.parametrize("case", MOE_CASES, ids=[_case_id(c) for c in MOE_CASES])
def test_moe_decode_q8_matches_the_reference(case, T, device, big, launch_table):
    """moe_decode on q8 activations (Q4_K gate/up: triton_q4k_moe; others triton_q8_moe) against
    moe_decode_q8_reference, and near the exact-float reference."""
    log = launch_table(INTERPRETER_LAUNCH) if INTERPRET else None
    types, F, D = case
    rng = np.random.default_rng((5, *map(int, types), F, D, T))
    pool, stride, roles = expert_pool(types, F, D, E, device, rng)
    slot_off, x, w = routing_case(T, K, E, D, stride, device, rng)
    lean_gu = types[:2] == (Q.Q4_K, Q.Q4_K)  # triton_q4k_moe's gate/up; h rounded only into its Q4_K down
    assert tm.triton_q4k_moe.applies_gate_up(roles) == lean_gu
    assert tm.triton_q4k_moe.applies(roles) == (types == (Q.Q4_K,) * 3)
    ref = refs.moe_decode_q8_reference(pool, slot_off, x, w, roles, round_h=not lean_gu or types[2] == Q.Q4_K)
    y = tm.moe_decode(pool, slot_off, x, w, roles, act="q8")
    errs = [rel(y, ref)]
    for cg, cd in MOE_CFGS if (types[0] == Q.Q4_0 if big else F <= 96) else ():  # one case: compile time
        errs.append(rel(m8.moe_decode_q8(pool, slot_off, x, w, roles, cg, cd), ref))
    assert max(errs) < 1e-4, (_case_id(case), T, errs)  # h's rounding may flip a code where float sums differ
    f32 = rel(y, refs.moe_decode_reference(pool, slot_off, x, w, roles))
    assert f32 < 0.05, (_case_id(case), T, "vs exact float", f32)
    if log is not None:
        assert log.kernels() == set(ks.moe_kernels(roles, "q8")) & TABLE_KERNELS


def test_q4k_moe_skipped_pair_never_reads_junk_into_the_sum(device):
    """triton_q4k_moe's down kernel reads slot 0's rows for a skipped pair (slot −1) and must drop them
    by a select: with slot 0 full of NaN scales the result stays finite and equals the reference."""
    rng = np.random.default_rng(11)
    pool, stride, roles = expert_pool((Q.Q4_K, Q.Q4_K, Q.Q4_K), 256, 256, 2, device, rng)
    pool[0] = 0xFF  # slot 0 is junk (fp16 scales 0xFFFF: NaN); the skipped pair below reads its rows
    slot_off = torch.tensor([[stride, -1]], dtype=torch.int64, device=device)
    x = torch.from_numpy(rng.standard_normal((1, 256)).astype(np.float32)).to(device)
    w = torch.tensor([[0.7, 0.3]], device=device)
    cfg = {"BR": 64, "num_warps": 4}
    slots = slot_off.reshape(-1)
    H = m4.gate_up(pool, slots, x, roles, 2, cfg)
    assert (H[1] == 0).all(), "a skipped pair's h is 0"
    y = m4.down(pool, slots, H, w, roles, 2, cfg)
    ref = refs.moe_decode_q8_reference(pool, slot_off, x, w, roles)
    assert torch.isfinite(y).all(), "the junk slot leaked into the sum"
    assert rel(y, ref) < 1e-5


@pytest.mark.parametrize("tile", ["halves", "rows"])
def test_q4k_tiles_of_both_orientations_match_the_reference(tile, device):
    """triton_q4k_moe / triton_q4k_gemv take [half-blocks, rows] or [rows, half-blocks] tiles (launch setting
    TILE; which one is fast depends on the Triton that compiles them): both give the q8 reference's result,
    skipped pairs and a partial last row tile included."""
    rng = np.random.default_rng(21)
    pool, stride, roles = expert_pool((Q.Q4_K, Q.Q4_K, Q.Q4_K), 256, 512, 3, device, rng)
    for T in (1, 2):
        slot_off, x, w = routing_case(T, 2, 3, 512, stride, device, rng)
        slot_off[0, 1] = -1  # a skipped pair
        slots = slot_off.reshape(-1).contiguous()
        ref = refs.moe_decode_q8_reference(pool, slot_off, x, w, roles)
        H = m4.gate_up(pool, slots, x, roles, 2, {"BR": 64, "num_warps": 4, "TILE": tile})
        assert (H[1] == 0).all(), (tile, "skipped pair")
        y = m4.down(pool, slots, H, w, roles, 2, {"BR": 64, "num_warps": 4, "PF": 0, "TILE": tile})
        assert rel(y, ref) < 1e-5, (tile, T, rel(y, ref))
    raw = blocks(Q.Q4_K, 40, 512, device, rng)  # 40 rows: the last tile is partial
    x = torch.from_numpy(rng.standard_normal((1, 512)).astype(np.float32)).to(device)
    ref = refs.matmul_q8_reference(raw, x, Q.Q4_K, 40, 512)
    y = g4.gemv(raw, x, 40, 512, {"BR": 16, "num_warps": 4, "PF": 0, "TILE": tile})
    assert rel(y, ref) < 1e-5, (tile, "gemv", rel(y, ref))
