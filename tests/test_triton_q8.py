"""Integer (dp4a) kernels with q8 activations (engine.runtime.triton_q8*): the activation quantizer
against its torch specification (bit for bit), the GEMV / matmul / matmul_many / fused-MoE kernels
against torch references that dequantize the weights and multiply by the dequantized q8
activations (≤ 1e-5 relative), and against the exact-float references within the error the
activation rounding predicts. Triton's interpreter here (the plain-Triton dp4a emulation, small
awkward shapes); compiled with PTX dp4a on a CUDA machine (trunk and expert shapes)."""

from __future__ import annotations

import os

import pytest

from tests.triton_data import launch_table, run_script

pytest.importorskip("triton")

SCRIPT = r"""
import sys, numpy as np, torch
from engine.quant import QType
from engine.runtime import references as refs, triton_gemv as tg, triton_moe as tm, triton_q8 as t8, triton_q8_moe as m8
from engine.runtime.references import dequantize
from tests.triton_data import blocks, expert_pool, routing_case
dev, big = sys.argv[1], sys.argv[2] == "big"
rng = np.random.default_rng(3)
rel = lambda a, b: ((a - b).norm() / b.norm()).item()

# 1. the quantizer: bit for bit (a zero block, a tiny one, ±127 extremes)
X = torch.from_numpy(rng.standard_normal((5, 320)).astype(np.float32)).to(dev)
X[1, :32] = 0
X[2, 32:64] *= 1e-30
XQ, XD, XS = t8.quantize_act(X)
q, d, s = refs.quantize_act_reference(X)
assert torch.equal(t8.unpack_words(XQ), q) and torch.equal(XD, d) and torch.equal(XS, s), "quantize_act"
assert q.abs().max() == 127 and (q[1, :32] == 0).all()


def check_stat(Y, W, X, Yf):
    # Activation rounding e = x - x̂, |e| ≤ d/2 per element: |Y - Yf| ≤ Σ|w|·d/2 per output (hard),
    # and ||Y - Yf|| near sqrt(Σ w²·d²/12) (e ~ uniform on ±d/2, independent): within [0.5, 2]×.
    _, d, _ = refs.quantize_act_reference(X)
    de = d.repeat_interleave(32, -1)  # [T, n]
    hard = (W.abs()[None] * de[:, None, :] / 2).sum(-1)  # [T, rows]
    err = (Y - Yf).abs()
    assert (err <= hard * 1.0001 + 1e-6).all(), "hard rounding bound"
    pred = ((W[None] ** 2) * (de[:, None, :] ** 2) / 12).sum(-1).sum().sqrt().item()
    ratio = (Y - Yf).norm().item() / pred
    assert 0.5 < ratio < 2.0, ("rounding error off its prediction", ratio)
    return ratio


# 2. GEMV / matmul / matmul_many
if not big:
    shapes = {"Q4_0": (37, 96), "Q8_0": (37, 96), "Q4_K": (21, 512), "Q5_K": (21, 256), "Q6_K": (21, 256)}
    # the interpreter is slow: one explicit setting (K walk unrolled) + the table's (runtime loop, split)
    cfgs = ({"BR": 4, "NB": 2, "num_warps": 4, "SPLIT": 1, "UNROLL": 4},)
    Ts = (1, 3)
else:
    shapes = {q: (4096, 2048) for q in ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}
    cfgs = ({"BR": 4, "NB": 4, "num_warps": 4, "SPLIT": 3, "UNROLL": 0},)  # + the table's (unrolled)
    Ts = (1, 5)
for name, (rows, n) in shapes.items():
    qt = QType[name]
    raws = [blocks(qt, r, n, dev, rng) for r in (rows, rows // 4 + 1, rows // 4 + 1)]  # q, k, v-like
    W = dequantize(raws[0], qt, n)
    for T in Ts:
        X = torch.from_numpy(rng.standard_normal((T, n)).astype(np.float32)).to(dev)
        ref = refs.matmul_q8_reference(raws[0], X, qt, rows, n)
        Yf = X @ W.T
        for cfg in cfgs + (None,):
            Y = tg.matmul(raws[0], X, qt, rows, n, cfg, act="q8")
            assert rel(Y, ref) < 1e-5, (name, T, cfg, rel(Y, ref))
        ratio = check_stat(Y, W, X, Yf)
        for cfg in (cfgs[0],) if T > 1 or not big else (cfgs[0], None):
            outs = tg.matmul_many(raws, X, qt, [r.shape[0] for r in raws], n, cfg, act="q8")
            for r, y in zip(raws, outs):
                e = rel(y, refs.matmul_q8_reference(r, X, qt, r.shape[0], n))
                assert e < 1e-5, (name, T, "many", e)
        print(name, rows, n, T, f"{rel(Y, ref):.1e}", f"vs f32 {rel(Y, Yf):.1e} ({ratio:.2f} of predicted)", flush=True)
    pool = torch.cat([raws[0].reshape(-1), raws[0].reshape(-1)])
    X = torch.from_numpy(rng.standard_normal((3, n)).astype(np.float32)).to(dev)
    offs = torch.tensor([0, raws[0].numel(), 0], dtype=torch.int64, device=dev)
    Y = tg.gemv(pool, offs, X, qt, rows, n, cfgs[-1], act="q8")
    assert rel(Y, refs.gemv_q8_reference(pool, offs, X, qt, rows, n)) < 1e-5, (name, "gemv")


# 3. fused MoE decode
Q = QType
if not big:
    cases = [((Q.Q4_K, Q.Q4_K, Q.Q6_K), 256, 256), ((Q.Q8_0, Q.Q4_0, Q.Q5_K), 256, 96), ((Q.Q4_0, Q.Q8_0, Q.Q8_0), 96, 64),
             ((Q.Q4_K, Q.Q4_K, Q.Q4_K), 256, 512)]  # Q4_K gate/up: triton_q4k_moe
    E, K, Ts = 3, 2, (1, 3)
    cfgs = (({"BR": 16, "NB": 2, "num_warps": 4}, {"BR": 64, "NB": 1, "num_warps": 4, "KSPLIT": 1}),)  # h in float
else:
    cases = [((Q.Q4_0, Q.Q4_0, Q.Q8_0), 768, 2048), ((Q.Q5_K, Q.Q5_K, Q.Q5_K), 768, 2048), ((Q.Q4_K, Q.Q4_K, Q.Q6_K), 768, 2048),
             ((Q.Q4_K, Q.Q4_K, Q.Q4_K), 768, 2048)]  # Q4_K gate/up: triton_q4k_moe
    E, K, Ts = 16, 8, (1, 4)
    # h quantized in the gate/up tile (BR 32; the table's BR 8 keeps h in float), on the Q4_0 case only
    cfgs = (({"BR": 32, "NB": 16, "num_warps": 4}, {"BR": 16, "NB": 32, "num_warps": 4, "KSPLIT": 1}),)
for types, F, D in cases:
    pool, stride, roles = expert_pool(types, F, D, E, dev, rng)
    for T in Ts:
        slot_off, x, w = routing_case(T, K, E, D, stride, dev, rng)
        lean_gu = types[:2] == (Q.Q4_K, Q.Q4_K)  # triton_q4k_moe's gate/up; h rounded only into its Q4_K down
        assert tm.triton_q4k_moe.applies_gate_up(roles) == lean_gu
        assert tm.triton_q4k_moe.applies(roles) == (types == (Q.Q4_K,) * 3)
        ref = refs.moe_decode_q8_reference(pool, slot_off, x, w, roles, round_h=not lean_gu or types[2] == Q.Q4_K)
        y = tm.moe_decode(pool, slot_off, x, w, roles, act="q8")
        errs = [rel(y, ref)]
        for cg, cd in cfgs if (types[0] == Q.Q4_0 if big else F <= 96) else ():  # one case: compile time
            errs.append(rel(m8.moe_decode_q8(pool, slot_off, x, w, roles, cg, cd), ref))
        assert max(errs) < 1e-4, (types, T, errs)  # h's rounding may flip a code where float sums differ
        f32 = rel(y, refs.moe_decode_reference(pool, slot_off, x, w, roles))
        assert f32 < 0.05, (types, T, "vs exact float", f32)
        print([t.name for t in types], F, D, T, " ".join(f"{e:.1e}" for e in errs), f"vs f32 {f32:.1e}", flush=True)
print("ok")
"""


# The interpreter runs programs one by one: fewer, larger tiles keep it quick; the table's settings here
# walk K in a runtime loop, split in two.
INTERPRETER_LAUNCH = {
    "gemv_q8:*:*": {"BR": 16, "NB": 1, "num_warps": 4, "SPLIT": 2, "UNROLL": 0},
    "moe_q8_gate_up:*:*": {"BR": 64, "NB": 2, "num_warps": 4},
    "moe_q8_down:*:*": {"BR": 64, "NB": 1, "num_warps": 4, "KSPLIT": 2},
    "moe_q4k_gate_up:*:*": {"BR": 64, "num_warps": 4},
    "moe_q4k_down:*:*": {"BR": 64, "num_warps": 4},
}


def test_q8_kernels_match_reference_in_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", **launch_table(tmp_path, INTERPRETER_LAUNCH))
    assert run_script(SCRIPT, ["cpu", "small"], env).strip().endswith("ok")


@pytest.mark.cuda
def test_q8_kernels_match_reference_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    assert run_script(SCRIPT, ["cuda", "big"], dict(os.environ)).strip().endswith("ok")


def test_moe_act_follows_the_models_activation_rounding(monkeypatch):
    """Routed experts decode on q8 activations on a compiled CUDA device inside a graph capture when the
    model rounds its activations like llama.cpp (q8_act) and the lean Q4_K gate/up kernel applies; exact
    float otherwise; $SHARPI_DEVICE_ACT overrides."""
    torch = pytest.importorskip("torch")
    from engine.config import EngineOptions
    from engine.quant.formats import QType
    from engine.runtime import kernel_select as ks

    plain = EngineOptions()  # neither SHARPI_DEVICE_ACT nor TRITON_INTERPRET
    q4k = {
        "gate": (0, QType.Q4_K, 768, 2048),
        "up": (884736, QType.Q4_K, 768, 2048),
        "down": (1769472, QType.Q4_K, 2048, 768),
    }
    q6k_down = dict(q4k, down=(1769472, QType.Q6_K, 2048, 768))  # a Q4_K_M layer with more bits
    q6k = {r: (o, QType.Q6_K, R, n) for r, (o, _, R, n) in q4k.items()}
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    EAGER, CAPTURED = ks.EAGER, ks.CAPTURED

    def act(device, q8_act, roles, step=None, options=plain):
        return ks.moe_act(device, q8_act, roles, step, options)

    assert act(cuda, True, q4k, EAGER) == "f32"  # eager launches
    assert act(cuda, True, q4k, CAPTURED) == "q8"
    assert act(cuda, True, q6k_down, CAPTURED) == "q8"  # lean gate/up, exact-float down
    assert act(cuda, False, q4k, CAPTURED) == "f32"  # --exact-float
    assert act(cuda, True, q6k, CAPTURED) == "f32"  # the general q8 kernels are not faster
    assert act(cpu, True, q4k, CAPTURED) == "f32"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)  # by default, torch is asked
    assert act(cuda, True, q4k) == "q8"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert act(cuda, True, q4k) == "f32"
    assert act(cuda, True, q4k, CAPTURED, EngineOptions.from_env({"TRITON_INTERPRET": "1"})) == "f32"
    assert act(cuda, False, q6k, options=EngineOptions.from_env({"SHARPI_DEVICE_ACT": "q8"})) == "q8"


SKIP_SCRIPT = r"""
import numpy as np, torch
from engine.quant import QType
from engine.runtime import references as refs, triton_q4k_moe as m4
from tests.triton_data import expert_pool
rng = np.random.default_rng(11)
Q = QType.Q4_K
pool, stride, roles = expert_pool((Q, Q, Q), 256, 256, 2, "cpu", rng)
pool[0] = 0xFF  # slot 0 is junk (fp16 scales 0xFFFF: NaN); the skipped pair below reads its rows
slot_off = torch.tensor([[stride, -1]], dtype=torch.int64)
x = torch.from_numpy(rng.standard_normal((1, 256)).astype(np.float32))
w = torch.tensor([[0.7, 0.3]])
cfg = {"BR": 64, "num_warps": 4}
slots = slot_off.reshape(-1)
H = m4.gate_up(pool, slots, x, roles, 2, cfg)
assert (H[1] == 0).all(), "a skipped pair's h is 0"
y = m4.down(pool, slots, H, w, roles, 2, cfg)
ref = refs.moe_decode_q8_reference(pool, slot_off, x, w, roles)
assert torch.isfinite(y).all(), "the junk slot leaked into the sum"
assert ((y - ref).norm() / ref.norm()).item() < 1e-5
print("ok")
"""


def test_q4k_moe_skipped_pair_never_reads_junk_into_the_sum():
    """triton_q4k_moe's down kernel reads slot 0's rows for a skipped pair (slot −1) and must drop them
    by a select: with slot 0 full of NaN scales the result stays finite and equals the reference."""
    assert run_script(SKIP_SCRIPT, [], dict(os.environ, TRITON_INTERPRET="1")).strip().endswith("ok")


def test_trunk_act_and_the_small_matrix_rule(monkeypatch):
    """Trunk matrices multiply one token on q8 activations (triton_q4k_gemv) on a compiled CUDA device
    inside a graph capture when the model rounds like llama.cpp and the matrix is Q4_K; exact float
    otherwise, and for a matrix under MIN_BYTES_OWN_QUANT that would quantize x itself (its own launch
    costs more than q8 saves); $SHARPI_DEVICE_ACT overrides. DeviceLinear reports its bytes exactly
    when it is not handed x̂."""
    import numpy as np

    torch = pytest.importorskip("torch")
    from engine.bench.calibrate import random_blocks
    from engine.config import EngineOptions
    from engine.kernels.prepare import prepare_weight
    from engine.quant.formats import QType
    from engine.runtime import device as dv
    from engine.runtime import kernel_select as ks
    from engine.runtime import triton_gemv as tg
    from engine.runtime import triton_q4k_gemv as qg

    plain, forced = EngineOptions(), EngineOptions.from_env({"SHARPI_DEVICE_ACT": "q8"})
    CAPTURED = ks.CAPTURED
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    small, big = qg.MIN_BYTES_OWN_QUANT - 1, qg.MIN_BYTES_OWN_QUANT

    def act(device, q8_act, qtype, n, step=None, own_quant_bytes=None, options=plain):
        return ks.trunk_act(device, q8_act, qtype, n, step, own_quant_bytes, options)

    assert act(cuda, True, QType.Q4_K, 2048, CAPTURED) == "q8"
    assert act(cuda, True, QType.Q4_K, 2048, CAPTURED, own_quant_bytes=big) == "q8"
    assert act(cuda, True, QType.Q4_K, 2048, CAPTURED, own_quant_bytes=small) == "f32"
    assert act(cuda, True, QType.Q4_K, 2048, ks.EAGER) == "f32"  # eager launches
    assert act(cuda, False, QType.Q4_K, 2048, CAPTURED) == "f32"  # --exact-float
    assert act(cuda, True, QType.Q6_K, 2048, CAPTURED) == "f32"
    assert act(cuda, True, QType.Q4_K, 2048 + 32, CAPTURED) == "f32"  # n not whole blocks
    assert act(cpu, True, QType.Q4_K, 2048, CAPTURED) == "f32"
    assert act(cpu, False, QType.Q6_K, 2048, options=forced) == "q8"
    assert act(cpu, False, QType.Q4_K, 2048, own_quant_bytes=small, options=forced) == "q8"  # forced
    seen = []
    monkeypatch.setattr(ks, "trunk_act", lambda *a, own_quant_bytes=None, **k: seen.append(own_quant_bytes) or "f32")
    monkeypatch.setattr(tg, "matmul", lambda raw, x, q, r, n, cfg=None, act=None, xq=None, options=None: x[:, :r])
    rng = np.random.default_rng(0)
    lin = dv.DeviceLinear(prepare_weight(QType.Q4_K, random_blocks(QType.Q4_K, 64, 256, rng)),
                          dv.DeviceArena(cpu, 1 << 30), "trunk", options=EngineOptions(triton_interpret=True))  # fmt: skip
    x = torch.zeros(1, 256)
    lin(x)
    lin(x, (x, x, x))
    assert seen == [lin.raw.numel(), None]


TILE_SCRIPT = r"""
import numpy as np, torch
from engine.quant import QType
from engine.runtime import references as refs, triton_q4k_gemv as g4, triton_q4k_moe as m4
from tests.triton_data import blocks, expert_pool, routing_case
rng = np.random.default_rng(21)
Q = QType.Q4_K
rel = lambda a, b: ((a - b).norm() / b.norm()).item()
pool, stride, roles = expert_pool((Q, Q, Q), 256, 512, 3, "cpu", rng)
for T in (1, 2):
    slot_off, x, w = routing_case(T, 2, 3, 512, stride, "cpu", rng)
    slot_off[0, 1] = -1  # a skipped pair
    slots = slot_off.reshape(-1).contiguous()
    ref = refs.moe_decode_q8_reference(pool, slot_off, x, w, roles)
    for tile in ("halves", "rows"):
        H = m4.gate_up(pool, slots, x, roles, 2, {"BR": 64, "num_warps": 4, "TILE": tile})
        assert (H[1] == 0).all(), (tile, "skipped pair")
        y = m4.down(pool, slots, H, w, roles, 2, {"BR": 64, "num_warps": 4, "PF": 0, "TILE": tile})
        assert rel(y, ref) < 1e-5, (tile, T, rel(y, ref))
raw = blocks(Q, 40, 512, "cpu", rng)  # 40 rows: the last tile is partial
x = torch.from_numpy(rng.standard_normal((1, 512)).astype(np.float32))
ref = refs.matmul_q8_reference(raw, x, Q, 40, 512)
for tile in ("halves", "rows"):
    y = g4.gemv(raw, x, 40, 512, {"BR": 16, "num_warps": 4, "PF": 0, "TILE": tile})
    assert rel(y, ref) < 1e-5, (tile, "gemv", rel(y, ref))
print("ok")
"""


def test_q4k_tiles_of_both_orientations_match_the_reference_in_the_interpreter():
    """triton_q4k_moe / triton_q4k_gemv take [half-blocks, rows] or [rows, half-blocks] tiles (launch setting
    TILE; which one is fast depends on the Triton that compiles them): both give the q8 reference's result,
    skipped pairs and a partial last row tile included."""
    assert run_script(TILE_SCRIPT, [], dict(os.environ, TRITON_INTERPRET="1")).strip().endswith("ok")


def test_launch_settings_follow_the_installed_triton(monkeypatch):
    """The Triton-version tables (launch/triton=X.Y.json): the newest not newer than the installed Triton
    applies, none before 3.7; a GPU's own table still comes first and the default fills what the version
    table leaves out; SHARPI_TRITON_TABLE picks another version's (or none)."""
    from engine.config import EngineOptions
    from engine.errors import UsageError
    from engine.quant.formats import QType
    from engine.runtime import kernel_select as ks

    assert ks.triton_table((3, 6)) == {}
    assert ks.triton_table((3, 7)) is ks.BY_TRITON[(3, 7)]
    assert ks.triton_table((3, 10)) is ks.BY_TRITON[max(ks.BY_TRITON)]
    assert ks.triton_table((4, 0)) is ks.BY_TRITON[max(ks.BY_TRITON)]
    plain = EngineOptions()
    monkeypatch.setattr(ks, "triton_version", lambda: (3, 6))
    assert ks.launch("moe_q4k_gate_up", QType.Q4_K, 6144, options=plain)["TILE"] == "halves"
    v38 = EngineOptions.from_env({"SHARPI_TRITON_TABLE": "3.8"})  # another version's settings, on purpose
    assert ks.triton_table(options=v38) is ks.BY_TRITON[(3, 8)]
    monkeypatch.setattr(ks, "triton_version", lambda: (3, 9))
    assert ks.triton_table(options=EngineOptions.from_env({"SHARPI_TRITON_TABLE": "none"})) == {}
    assert ks.launch("moe_q4k_gate_up", QType.Q4_K, 6144, options=plain)["TILE"] == "rows"
    assert ks.launch("gemv_q4k", QType.Q4_K, 4096, options=plain) == ks.DEFAULT["gemv_q4k:*:M"]  # 3.9 keeps it
    assert ks.launch("gemv_q4k", QType.Q4_K, 512, options=plain) == ks.DEFAULT["gemv_q4k:*:*"]  # no S entry
    monkeypatch.setattr(ks, "triton_version", lambda: (3, 8))
    assert ks.launch("gemv_q4k", QType.Q4_K, 4096, options=plain) == ks.BY_TRITON[(3, 8)]["gemv_q4k:*:M"]
    assert ks.triton_table_version(options=plain) == (3, 8)
    with pytest.raises(UsageError, match="SHARPI_TRITON_TABLE"):
        EngineOptions.from_env({"SHARPI_TRITON_TABLE": "three"})
    monkeypatch.setattr(ks, "triton_version", lambda: (3, 9))
    # a GPU's own table (device=Some_GPU.json) first; SHARPI_LAUNCH_TABLE's before it
    monkeypatch.setattr(ks, "BY_DEVICE", {"Some_GPU": {"moe_q4k_gate_up:*:*": {"BR": 4, "num_warps": 1}}})
    assert ks.launch("moe_q4k_gate_up", QType.Q4_K, 6144, "Some GPU", plain) == {"BR": 4, "num_warps": 1}
    mine = EngineOptions(launch_table={"moe_q4k_gate_up:*:*": {"BR": 2, "num_warps": 1}})
    assert ks.launch("moe_q4k_gate_up", QType.Q4_K, 6144, "Some GPU", mine) == {"BR": 2, "num_warps": 1}


def test_device_kernels_report_names_the_triton_and_its_table():
    pytest.importorskip("torch")
    from engine.bench import device_kernels as dk

    rep = {"device": "GPU", "bandwidth_gb_s": 3000.0, "types": {}}
    lines = dk.report_lines({**rep, "triton": "3.9.0", "triton_table": (3, 9)})
    assert any("Triton 3.9.0" in ln and "launch/triton=3.9.json" in ln for ln in lines)
    lines = dk.report_lines({**rep, "triton": "3.6.0", "triton_table": None})
    assert any("Triton 3.6.0" in ln and "triton=" not in ln for ln in lines)
