"""The whole static decode step (engine.runtime.graph_decode, ``SHARPI_CUDA_GRAPH=eager``: uncaptured) on
the CPU's simulated device with the fused step kernels, which serve there only in Triton's interpreter:
against the eager path, and the norm and attention launches writing the q8 activations the Q4_K kernels
read. Interpreter-only: compiled, tests/test_graph_decode.py's CUDA tests replay the real graphs."""

from __future__ import annotations

import numpy as np
import pytest

from engine import config
from engine.api import LoadOptions, Session
from engine.models.blocks import Attention, GatedDeltaNet, MoE
from engine.runtime import step_kernels
from engine.runtime import triton_q8 as t8
from engine.runtime.device import DeviceLinear
from tests.oracle import random_tokens
from tests.placement import ARCHS, CTX, whole
from tests.triton import INTERPRET

pytestmark = pytest.mark.skipif(
    not INTERPRET, reason="the fused step kernels serve the CPU in Triton's interpreter only"
)
GEOMETRY = {name: (arch, geo) for name, arch, geo in ARCHS}


@pytest.mark.parametrize("kv", ["f32", "bf16"])
@pytest.mark.parametrize("name", ["qwen3moe", "olmoe", "qwen2moe", "mixtral", "qwen35moe", "qwen3next"])
def test_static_step_with_the_fused_step_kernels(name, kv, synth_model, monkeypatch):
    """The whole static step with the fused kernels (qk_rope_kv among them) equals the eager path: per-head
    norms (qwen3moe), projection norms (olmoe), q/k/v bias (qwen2moe), pair rotation (mixtral), gated attention
    with partial RoPE beside Gated DeltaNet layers (qwen35moe, qwen3next: their one-token core and gated norm
    in step_kernels.delta_net_step and gated_norm)."""
    arch, geo = GEOMETRY[name]
    calls = {"delta_net_step": 0, "gated_norm": 0}
    for fn in calls:
        monkeypatch.setattr(step_kernels, fn, _counted(getattr(step_kernels, fn), calls, fn))
    path = synth_model(arch, seed=3, layers=2, **geo).path
    tokens = random_tokens(20, 1024, seed=1)
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device="cpu")) as s:
        placement = whole(s, kv)
        s.apply(placement, s.engine_options.with_env({"SHARPI_CUDA_GRAPH": "0"}))
        ref = s.logits(tokens, batch=False)
        s.apply(placement, s.engine_options.with_env({"SHARPI_CUDA_GRAPH": "eager"}))
        g = s.model.decode_graph
        assert g._fused  # the fused step kernels serve (qk_rope_kv among them)
        got = s.logits(tokens, batch=False)
        assert g.steps == len(tokens)
        # bf16: a k differing in its last float32 bit may round to the other bf16 neighbour
        tol = 1e-5 if kv == "f32" else 1e-3 * np.abs(ref).max()
        assert np.abs(got - ref).max() <= tol, (name, kv, np.abs(got - ref).max())
    gdn = sum(1 for layer in s.model.layers if isinstance(layer.attn, GatedDeltaNet))
    assert calls == {"delta_net_step": gdn * len(tokens), "gated_norm": gdn * len(tokens)}, (calls, gdn)


def _counted(fn, calls: dict, name: str):
    def wrapped(*a, **k):
        calls[name] += 1
        return fn(*a, **k)

    return wrapped


def test_q8_inputs_come_from_the_norm_kernels(synth_model, monkeypatch, launch_table):
    """Where the routed experts and the attention's q, k, v run the Q4_K kernels on q8 activations, the
    norm launch before them also writes x̂ (step_kernels.add_rms_norm(q8=True)), the attention launch
    writes o's (step_attention.attend(q8=True)), and they skip their own quantize launches: one
    quantize_act call a layer a token (the MoE's h) instead of six, and the same logits bit for bit
    (the static step, uncaptured)."""
    geo = dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=4, experts_used=2, expert_ff=256)
    # Q4_K routed experts and attention matrices, the rest F32 (the interpreter runs those quicker)
    over = {"*_exps*": "Q4_K", "*attn_q.weight": "Q4_K", "*attn_k.weight": "Q4_K", "*attn_v.weight": "Q4_K",
            "*attn_output.weight": "Q4_K"}  # fmt: skip
    path = synth_model("qwen3moe", "F32", seed=5, type_overrides=over, **geo).path
    # the interpreter runs programs one by one: fewer, larger tiles keep it quick
    tiles = {"moe_q4k_gate_up:*:*": {"BR": 64, "num_warps": 4}, "moe_q4k_down:*:*": {"BR": 64, "num_warps": 4},
             "gemv_q4k:*:*": {"BR": 64, "num_warps": 4}}  # fmt: skip
    log = launch_table(tiles)
    tokens = random_tokens(3, 1024, seed=2)
    calls = [0]
    quantize = t8.quantize_act

    def counting(X, *a):
        calls[0] += 1
        return quantize(X, *a)

    monkeypatch.setattr(t8, "quantize_act", counting)
    # the static step, uncaptured; q8 as inside a capture: the lean Q4_K kernels on q8 activations
    opts = config.current().with_env({"SHARPI_CUDA_GRAPH": "eager", "SHARPI_DEVICE_ACT": "q8"})
    with Session.load(str(path), LoadOptions(n_ctx=CTX, device="cpu", engine=opts)) as s:
        s.apply(whole(s))
        moes = [layer.ffn for layer in s.model.layers if isinstance(layer.ffn, MoE)]
        assert moes and all(m.wants_q8_input() for m in moes)
        assert all(layer.attn.wants_q8_input() for layer in s.model.layers)
        got = s.logits(tokens, batch=False)
        with_norm = calls[0]
        no = lambda self: False  # noqa: E731
        monkeypatch.setattr(MoE, "wants_q8_input", no)  # each matrix quantizes x itself
        monkeypatch.setattr(Attention, "wants_q8_input", no)
        monkeypatch.setattr(DeviceLinear, "takes_q8", no)  # o too (not the attention launch)
        s.apply(whole(s))
        calls[0] = 0
        ref = s.logits(tokens, batch=False)
    n = len(tokens) * len(moes)  # a token's layers
    # a layer: x̂ from the norms and from the attention launch (o's); the MoE quantizes h — without: the
    # MoE x and h, q, k, v, o each their own
    assert with_norm == n and calls[0] == 6 * n, (with_norm, calls[0])
    assert np.array_equal(got, ref), np.abs(got - ref).max()
    assert log.kernels() == {"moe_q4k_gate_up", "moe_q4k_down", "gemv_q4k"}
