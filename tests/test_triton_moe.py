"""Fused MoE Triton kernels (engine.runtime.triton_moe) vs their torch references, and the expert
cache served through them vs the CPU engine: Triton's interpreter here (small shapes), compiled on
a CUDA machine (Qwen3-30B-A3B expert shapes). Subprocesses, so TRITON_INTERPRET applies at import.
The whole-model cache test is CUDA-only: a model's worth of kernels takes the interpreter minutes."""

from __future__ import annotations

import os

import pytest

from tests.triton_data import launch_table, run_script

pytest.importorskip("triton")

KERNELS = r"""
import sys, numpy as np, torch
from engine.quant import QType
from engine.runtime import references as refs, triton_moe as tm
from engine.runtime.references import dequantize
dev, big = sys.argv[1], sys.argv[2] == "big"
rng = np.random.default_rng(1)

from tests.triton_data import blocks, expert_pool, routing_case


cases = [((QType.Q4_K, QType.Q4_K, QType.Q6_K), 256, 512), ((QType.Q8_0, QType.Q4_0, QType.Q5_K), 256, 96),
         ((QType.Q4_0, QType.Q8_0, QType.Q8_0), 96, 64)]
if big:
    cases = [((q, q, q), 768, 2048) for q in (QType.Q4_0, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K)]
    cases.append(((QType.Q4_K, QType.Q4_K, QType.Q6_K), 768, 2048))
for types, F, D in cases:
    E, K = (5, 2) if not big else (16, 8)
    pool, stride, roles = expert_pool(types, F, D, E, dev, rng)
    for T in ((1, 3) if not big else (1, 4, 40)):
        slot_off, x, w = routing_case(T, K, E, D, stride, dev, rng)
        ref = refs.moe_decode_reference(pool, slot_off, x, w, roles)
        errs = []
        decode = lambda *a: tm.moe_decode(*a, act="f32")  # the q8 kernels: tests/test_triton_q8.py
        for fn in ((decode, tm.moe_prefill) if T <= 8 else (tm.moe_prefill,)):
            y = fn(pool, slot_off, x, w, roles)
            errs.append(((y - ref).norm() / ref.norm()).item())
        assert max(errs) < (1e-5 if dev == "cpu" else 1e-4), (types, F, D, T, errs)  # tf32x3 on CUDA
        print([t.name for t in types], F, D, T, " ".join(f"{e:.1e}" for e in errs), flush=True)
# The tiled one-matrix path (trunk with more than TRITON_MAX_T tokens)
for q, R, n in ((QType.Q4_K, 40, 512), (QType.Q8_0, 33, 96)) if not big else ((QType.Q4_K, 4096, 2048), (QType.Q6_K, 2048, 4096)):
    raw = blocks(q, R, n, dev, rng)
    X = torch.from_numpy(rng.standard_normal((37, n)).astype(np.float32)).to(dev)
    ref = (X.double() @ dequantize(raw, q, n).double().T).float()
    y = tm.one_matrix(raw, X, q, R, n)
    err = ((y - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dev == "cpu" else 1e-4), (q, "one_matrix", err)
    print(q.name, "one_matrix", R, n, f"{err:.1e}", flush=True)
print("ok")
"""

CACHE = r"""
import sys, numpy as np
from engine.api import LoadOptions, Session
from engine.plan import DeviceProfile, PlanRequest, device_bytes, expert_slot_layout
from engine.synth.writer import write_model
from tests.oracle import random_tokens
dev, tmp, tol = sys.argv[1], sys.argv[2], float(sys.argv[3])
CTX = 64
path = write_model(tmp + "/q.gguf", "qwen3moe", seed=4, layers=2, weight_type="Q4_K",
                   type_overrides={"*ffn_down*": "Q6_K"}).path
tokens = random_tokens(9, 1024, seed=8)  # 9 > TRITON_MAX_T: prefill takes the grouped kernels
dec = tokens[:3]  # decode steps (few: the interpreter is slow)
with Session.load(str(path), LoadOptions(n_ctx=CTX, device=dev, q8_act=False)) as s:
    ref_dec, ref_pre = s.logits(dec, batch=False), s.logits(tokens)
    L, E = s.args.n_layer, s.args.n_expert
    need = device_bytes(s.spec, n_gpu_layers=L, ctx=CTX, kv_type="f32", reserve=0).total
    for moe, slots in (("cache", L * E // 2), ("resident", L * E)):
        prof = DeviceProfile(vram_bytes=need + slots * expert_slot_layout(s.spec).stride, reserve_bytes=0)
        s.apply(s.plan(PlanRequest(ctx=CTX, n_gpu_layers=L, moe=moe), prof))
        cached = s.applied.experts
        assert cached is not None and all(cached._fused.values()), "the fused kernels must serve these layers"
        for batch, ref, toks in ((False, ref_dec, dec), (True, ref_pre, tokens)):
            got = s.logits(toks, batch=batch)
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err <= tol, (moe, batch, err)
            print(moe, "prefill" if batch else "decode", f"{err:.1e}", flush=True)
print("ok")
"""


def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")


# The interpreter runs programs one by one: fewer, larger tiles keep it quick.
INTERPRETER_LAUNCH = {"moe_gate_up:*:*": {"BR": 16, "NB": 4, "num_warps": 4}}


def test_moe_kernels_match_reference_in_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", **launch_table(tmp_path, INTERPRETER_LAUNCH))
    assert run_script(KERNELS, ["cpu", "small"], env).strip().endswith("ok")


@pytest.mark.cuda
def test_moe_kernels_match_reference_on_cuda():
    _cuda()
    assert run_script(KERNELS, ["cuda", "big"], dict(os.environ)).strip().endswith("ok")


@pytest.mark.cuda
@pytest.mark.parametrize("act,tol", [("f32", 1e-3), ("q8", 3e-2)])
def test_expert_cache_through_fused_kernels_on_cuda(tmp_path, act, tol):
    """f32: the exact-float kernels against the exact-float CPU engine; q8 (SHARPI_DEVICE_ACT=q8): the
    decode kernels round activations to 8 bits (~1 % relative per product), so a looser bound."""
    _cuda()
    env = dict(os.environ, SHARPI_DEVICE_ACT=act)
    assert run_script(CACHE, ["cuda", str(tmp_path), str(tol)], env).strip().endswith("ok")
