"""engine.plan building blocks: size parsing, the shared sizing function, ModelSpec, cost model.

Expected values come from first principles written out in the tests (bytes per element, block
sizes) or from independent code (the synthetic writer's own tensor table, the runtime KV cache),
never from the planner itself.
"""

from __future__ import annotations

import pytest

from engine.errors import UsageError
from engine.models import qwen3moe
from engine.plan import (
    DeviceProfile,
    ModelSpec,
    PlanError,
    device_bytes,
    expert_slot_layout,
    fit_skew,
    format_size,
    hit_rate,
    kv_layer_bytes,
    parse_size,
    predict,
)
from engine.plan.sizing import kv_row_bytes, scratch_estimate
from engine.quant.formats import QType

GiB, MiB = 1 << 30, 1 << 20


# -- sizes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,expected",
    [
        ("512MiB", 512 * MiB),
        ("12GiB", 12 * GiB),
        ("12GB", 12 * 10**9),
        ("12 gib", 12 * GiB),
        ("1.5KiB", 1536),
        ("1.1GB", 1_100_000_000),
        (".5GiB", GiB // 2),
        ("4096", 4096),
        ("0", 0),
        ("7B", 7),
        ("3kB", 3000),
        ("2TiB", 2 << 40),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12GX", "-1GiB", "12G", "", "GiB", "1e9", "1..2GB", "12 Gi B", "nan", "-0"])
def test_parse_size_rejects_with_usage_error(text):
    with pytest.raises(UsageError, match="invalid size"):
        parse_size(text)


def test_format_size():
    assert format_size(12 * GiB) == "12.00 GiB"
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.50 KiB"


# -- KV pricing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_type,num,den", [("f32", 4, 1), ("bf16", 2, 1), ("q8_0", 34, 32)])
def test_kv_bytes_per_element(kv_type, num, den):
    # K and V, ctx positions, kv_dim wide: 2 · ctx · kv_dim · (bytes per element).
    for ctx, kv_dim in [(1, 32), (32768, 512), (4096, 2048), (7, 1024)]:
        assert kv_layer_bytes(kv_type, kv_dim, ctx) * den == 2 * ctx * kv_dim * num


def test_kv_q8_0_needs_width_multiple_of_32():
    with pytest.raises(PlanError, match="multiple of 32"):
        kv_row_bytes("q8_0", 48)
    assert kv_row_bytes("bf16", 48) == 96
    with pytest.raises(PlanError, match="unknown KV type"):
        kv_row_bytes("f16", 64)


@pytest.mark.parametrize("kv_type", ["f32", "bf16", "q8_0"])
def test_kv_sizing_matches_runtime_cache(kv_type):
    """The planner's KV price is what engine.kv_cache.KVCache really allocates."""
    torch = pytest.importorskip("torch")
    from engine.kv_cache import KVCache

    n_layers, ctx, kv_dim = 3, 96, 64
    cache = KVCache({i: torch.device("cpu") for i in range(n_layers)}, ctx, kv_dim, kv_type)
    assert cache.nbytes == n_layers * kv_layer_bytes(kv_type, kv_dim, ctx)


# -- ModelSpec -------------------------------------------------------------------------------------
def _qwen3_args(**kw) -> qwen3moe.Args:
    geo = dict(
        arch="qwen3moe",
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_vocab=1000,
        n_ctx_train=4096,
        rms_eps=1e-6,
        rope_base=1e6,
        rope_dim=64,
        rope_neox=True,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        norm_topk=True,
    )
    geo.update(kw)
    return qwen3moe.Args(**geo)


def _q4k_except_vectors(s):
    return QType.F32 if len(s.shape) == 1 or s.name.endswith("ffn_gate_inp.weight") else QType.Q4_K


def test_model_spec_from_args_groups_bytes():
    a = _qwen3_args()
    spec = ModelSpec.from_args(a, _q4k_except_vectors)
    D, Q, KV, E, F = 256, 256, 128, 8, 256
    q4k = lambda n: n // 256 * 144  # Q4_K: 144 bytes per 256 elements
    lay = spec.layers[0]
    assert lay.trunk == {
        "attn_q": q4k(Q * D),
        "attn_k": q4k(KV * D),
        "attn_v": q4k(KV * D),
        "attn_o": q4k(D * Q),
        "norms": 4 * (D + D + 64 + 64),  # attn_norm, ffn_norm, per-head q/k norms
        "router": 4 * E * D,
    }
    assert lay.expert_role_bytes == {"gate": q4k(F * D), "up": q4k(F * D), "down": q4k(D * F)}
    assert lay.n_expert == E and spec.routed_bytes == 4 * E * 3 * q4k(F * D)
    assert spec.tied_output is False and spec.output_bytes == q4k(1000 * 256)
    assert spec.trunk_prefix == tuple(k * lay.trunk_bytes for k in range(5))


def test_model_spec_tied_output_prices_embeddings():
    a = _qwen3_args()
    spec = ModelSpec.from_args(a, lambda s: None if s.name == "output.weight" else _q4k_except_vectors(s))
    assert spec.tied_output and spec.output_bytes == spec.token_embd_bytes == 1000 * 256 // 256 * 144


def test_model_spec_matches_loader_views(tmp_path):
    """ModelSpec bytes equal the bytes of the tensor views a loader copies, on a real file."""
    from engine.gguf import open_gguf
    from engine.synth import write_model

    m = write_model(tmp_path / "m.gguf", "qwen2moe", weight_type="Q4_K", layers=2, experts=4, experts_used=2)
    with open_gguf(m.path) as gf:
        spec = ModelSpec.from_gguf(gf)
        views = {name: t.data.nbytes for name, t in gf.tensors.items()}
    for lay in spec.layers:
        prefix = f"blk.{lay.index}."
        mine = {n: b for n, b in views.items() if n.startswith(prefix)}
        routed = {n: b for n, b in mine.items() if "_exps" in n}
        assert lay.trunk_bytes == sum(mine.values()) - sum(routed.values())
        assert lay.routed_bytes == sum(routed.values())
        assert "shexp" in lay.trunk and "shexp_gate" in lay.trunk and "bias" in lay.trunk
    assert spec.token_embd_bytes == views["token_embd.weight"]
    assert spec.output_bytes == views["output.weight"]


# -- device bytes ----------------------------------------------------------------------------------
def test_device_bytes_rules():
    spec = ModelSpec.from_args(_qwen3_args(), _q4k_except_vectors)
    L, ctx = spec.n_layer, 1024
    kv1 = 2 * ctx * 128 * 4
    assert device_bytes(spec, n_gpu_layers=0, ctx=ctx, kv_type="f32", reserve=999, scratch=5).total == 0
    d = device_bytes(spec, n_gpu_layers=2, ctx=ctx, kv_type="f32", reserve=100, scratch=10)
    assert (d.trunk, d.kv, d.globals, d.experts) == (2 * spec.layers[0].trunk_bytes, 2 * kv1, 0, 0)
    assert d.total == 110 + d.trunk + d.kv
    full = device_bytes(spec, n_gpu_layers=L, ctx=ctx, kv_type="f32", expert_slots=3, reserve=0, scratch=0)
    assert full.globals == spec.output_norm_bytes + spec.output_bytes
    assert full.experts == 3 * expert_slot_layout(spec).stride
    with pytest.raises(PlanError):
        device_bytes(spec, n_gpu_layers=0, ctx=ctx, kv_type="f32", expert_slots=1)


def test_slot_layout_takes_largest_role_over_layers_aligned():
    spec = ModelSpec.from_args(
        _qwen3_args(), lambda s: QType.Q6_K if "blk.3.ffn_down_exps" in s.name else _q4k_except_vectors(s)
    )
    lay = expert_slot_layout(spec)
    q4k, q6k = 256 * 256 // 256 * 144, 256 * 256 // 256 * 210
    assert lay.role_bytes == {"gate": q4k, "up": q4k, "down": q6k}
    assert lay.role_offset == {"gate": 0, "up": q4k, "down": 2 * q4k}  # 36864 is a multiple of 256
    assert lay.stride == 2 * q4k + q6k + (-q6k % 256)


def test_scratch_estimate_grows_with_context_up_to_the_attention_block():
    from engine.models.layers import ATTN_SCORE_BYTES

    spec = ModelSpec.from_args(_qwen3_args(), _q4k_except_vectors)
    H = spec.n_head
    a, b = scratch_estimate(spec, 8), scratch_estimate(spec, 16)
    assert b - a == 3 * 4 * H * 512 * 8  # scores, masked scores, probabilities: all heads × 512 queries × 8 more
    # past one attention block's bytes the queries go in row blocks: no growth with the context
    big = ATTN_SCORE_BYTES // (4 * H * 512) + 1
    assert scratch_estimate(spec, big) == scratch_estimate(spec, 100 * big)


# -- cost model ------------------------------------------------------------------------------------
def test_hit_rate_shape():
    for E in (8, 60, 128):
        assert hit_rate(0.0, E, 1.0) == 0.0 and hit_rate(1.0, E, 1.0) == 1.0
        assert hit_rate(0.25, E, 0.0) == pytest.approx(0.25)  # uniform popularity: hit rate = capacity
        caps = [k / 20 for k in range(21)]
        for s in (0.0, 0.5, 0.8, 1.2):
            h = [hit_rate(c, E, s) for c in caps]
            assert all(x <= y + 1e-12 for x, y in zip(h, h[1:]))
        assert hit_rate(0.3, E, 1.0) > hit_rate(0.3, E, 0.5) > hit_rate(0.3, E, 0.0)


def test_hit_rate_zipf_value():
    # Hottest 2 of 4 experts under Zipf(1): (1 + 1/2) / (1 + 1/2 + 1/3 + 1/4).
    assert hit_rate(0.5, 4, 1.0) == pytest.approx(1.5 / (1 + 1 / 2 + 1 / 3 + 1 / 4))


def test_fit_skew_inverts_hit_rate():
    for s in (0.0, 0.3, 0.8, 1.5):
        h = hit_rate(0.3, 128, s)
        assert fit_skew(0.3, h, 128) == pytest.approx(s, abs=1e-6)


def test_predict_by_hand():
    """One tiny layer on the device, experts on the CPU / cache / resident: sums written out."""
    spec = ModelSpec.from_args(_qwen3_args(n_layer=1), _q4k_except_vectors)
    prof = DeviceProfile(cpu_expert_gbps=10, h2d_gbps=5, device_gbps=100, sync_us=20, expert_skew=0.0)
    prof = prof.without_overheads()  # the bytes and crossings; fixed costs: tests/test_plan_costs.py
    lay, K, pos = spec.layers[0], 2, 100
    kv_read = 2 * pos * 128 * 2  # bf16 rows of K and V up to the position
    dev_fixed = lay.trunk_bytes + kv_read + spec.output_norm_bytes + spec.output_bytes
    cpu_fixed = spec.token_embd_bytes / 1000  # one embedding row
    e = lay.expert_bytes
    common = dict(n_gpu_layers=1, kv_type="bf16", position=pos)

    cpu = predict(spec, prof, mode="cpu", **common)
    assert cpu.seconds == pytest.approx(dev_fixed / 100e9 + (cpu_fixed + K * e) / 10e9 + 4 * 20e-6)

    res = predict(spec, prof, mode="resident", expert_slots=8, **common)
    assert res.seconds == pytest.approx((dev_fixed + K * e) / 100e9 + cpu_fixed / 10e9 + 2 * 20e-6)

    # 2 of 8 slots, uniform: h = 1/4. Eager, the layer crosses to the host only when an expert misses;
    # as graph replays it hands its row and routes over every token.
    h = 0.25
    links = (dev_fixed + h * K * e) / 100e9 + (cpu_fixed + (1 - h) * K * e) / 10e9 + (1 - h) * K * e / 5e9
    for graphs, crossings in ((False, 2 + 2 * (1 - h**K)), (True, 2 + 2)):
        cache = predict(spec, prof, mode="cache", expert_slots=2, graphs=graphs, **common)
        expect = links + crossings * 20e-6
        assert cache.hit_rate == pytest.approx(h) and cache.seconds == pytest.approx(expect)
        assert cache.tok_s == pytest.approx(1 / expect)


def test_profile_validation():
    with pytest.raises(PlanError):
        DeviceProfile(vram_bytes=-1)
    with pytest.raises(PlanError):
        DeviceProfile(h2d_gbps=0)
    with pytest.raises(PlanError, match="unknown device profile keys"):
        DeviceProfile.from_dict({"vram": 1})
    p = DeviceProfile(cpu_expert_gbps=31.5, measured=("cpu_expert_gbps",))
    assert DeviceProfile.from_dict(p.to_dict()) == p
