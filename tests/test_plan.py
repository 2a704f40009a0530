"""Planner acceptance on geometry-only GGUFs of real models (issue 5), the CLI, and a property test.

Expected bytes come from the synthetic writer's own tensor table (``engine.synth`` builds it from
llama.cpp's layout independently of ``engine.models``) and from KV formulas written out here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cli.main import main
from engine.config import EngineOptions
from engine.errors import UsageError
from engine.gguf import open_gguf
from engine.models import qwen3moe
from engine.plan import DeviceProfile, ModelSpec, PlanError, PlanRequest, format_size, plan, resolve_moe
from engine.plan.planner import AUTO_CACHE_MARGIN
from engine.plan.sizing import expert_slot_layout, scratch_estimate
from engine.quant.formats import QType
from engine.synth import specs as S

GiB, MiB = 1 << 30, 1 << 20
QWEN3 = "qwen3-30b-a3b"
MODELS = ("qwen3-30b-a3b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "mixtral-8x7b")


class Geo:
    """A written geometry file, its ModelSpec, and the independent byte table of the writer."""

    def __init__(self, written, spec: ModelSpec):
        self.path = str(written.path)
        self.spec = spec
        s = written.spec
        self.L, self.E, self.kv_dim = s.layers, s.experts, s.kv_dim
        self.trunk = [0] * s.layers
        self.routed = [0] * s.layers
        self.role_max: dict[str, int] = {}
        self.role_bytes: list[dict[str, int]] = [{} for _ in range(s.layers)]  # one expert's, per layer
        self.embd = self.output = self.output_norm = 0
        for p in written.tensors:
            d = p.decl
            if d.layer is not None and d.layer >= s.layers:
                continue  # a NextN block (GLM-4.5): stored after the trunk, not loaded
            if d.kind == S.EXPERTS:
                self.routed[d.layer] += p.nbytes
                role = d.name.split(".")[2].split("_")[1]  # blk.N.ffn_gate_exps.weight -> gate
                self.role_max[role] = max(self.role_max.get(role, 0), p.nbytes // d.shape[0])
                self.role_bytes[d.layer][role] = p.nbytes // d.shape[0]
            elif d.layer is not None:
                self.trunk[d.layer] += p.nbytes
            elif d.kind == S.EMBEDDING:
                self.embd = p.nbytes
            elif d.kind == S.OUTPUT:
                self.output = p.nbytes
            elif d.name == "output_norm.weight":
                self.output_norm = p.nbytes
        if not self.output:
            self.output = self.embd  # tied

    def kv(self, kv_type: str, ctx: int, layers: int) -> int:
        num, den = {"f32": (4, 1), "bf16": (2, 1), "q8_0": (34, 32)}[kv_type]
        return layers * 2 * ctx * self.kv_dim * num // den

    @property
    def stride(self) -> int:
        return sum(-(-b // 256) * 256 for b in self.role_max.values())

    def resident(self, lo: int, n: int) -> int:
        """Every expert of layers lo..n-1 at its own layer's stride (roles aligned to 256 bytes)."""
        return sum(self.E * sum(-(-b // 256) * 256 for b in self.role_bytes[i].values()) for i in range(lo, n))

    def device_total(
        self,
        n: int,
        ctx: int,
        kv_type: str,
        reserve: int,
        scratch: int,
        slots: int,
        resident_from: int | None = None,
        stream: int = 0,
    ) -> int:
        """slots: cache slots at the largest stride; resident_from: instead, experts resident from that layer;
        stream: prompt-streaming staging slots, the same stride as the cache's."""
        if n == 0:
            return 0
        out = self.output + self.output_norm if n == self.L else 0
        experts = slots * self.stride if resident_from is None else self.resident(resident_from, n)
        return reserve + scratch + sum(self.trunk[:n]) + self.kv(kv_type, ctx, n) + out + experts + stream * self.stride

    def placed_total(self, p, reserve: int, scratch: int) -> int:
        """device_total of a placement as its mode allocates."""
        res = p.n_cpu_moe if p.moe_mode == "resident" else None
        slots = 0 if res is not None else p.expert_slots_allocated
        return self.device_total(p.n_gpu_layers, p.ctx, p.kv_type, reserve, scratch, slots, res, p.stream_slots)


@pytest.fixture(scope="module")
def geo(tmp_path_factory):
    from engine.synth.geometry import write_geometry

    d = tmp_path_factory.mktemp("plan_geometry")
    cache: dict[str, Geo] = {}

    def get(name: str) -> Geo:
        if name not in cache:
            written = write_geometry(d / f"{name}.gguf", name)
            with open_gguf(written.path) as gf:
                cache[name] = Geo(written, ModelSpec.from_gguf(gf))
        return cache[name]

    return get


def _plan(spec, vram, overheads=True, **req):
    prof = {k: req.pop(k) for k in list(req) if k in ("reserve_bytes", "scratch_bytes", "h2d_gbps", "cpu_expert_gbps")}
    profile = DeviceProfile(vram_bytes=vram, **prof)
    return plan(spec, profile if overheads else profile.without_overheads(), PlanRequest(**req))


def _walk_numbers(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _walk_numbers(v)
    elif isinstance(x, list):
        for v in x:
            yield from _walk_numbers(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield x


# -- the model spec --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_spec_matches_writer_table(geo, name):
    g = geo(name)
    spec = g.spec
    assert spec.n_layer == g.L
    assert [lay.trunk_bytes for lay in spec.layers] == g.trunk  # routed experts never in the trunk
    assert [lay.routed_bytes for lay in spec.layers] == g.routed
    assert spec.expert_role_max == g.role_max
    assert (spec.token_embd_bytes, spec.output_bytes, spec.output_norm_bytes) == (g.embd, g.output, g.output_norm)


# -- Qwen3-Coder-30B-A3B on 12 GiB -----------------------------------------------------------------
def test_qwen3_12gib_32k_puts_every_trunk_layer_on_the_gpu(geo, capsys):
    g = geo(QWEN3)
    p = _plan(g.spec, 12 * GiB, ctx=32768, kv_type="f32", n_gpu_layers=-1)
    assert p.n_gpu_layers == 48 and p.layer_reason == "all 48 layers fit"
    assert all(lay.device == "gpu" for lay in p.layers)
    assert p.device.trunk == sum(g.trunk) < 1 * GiB  # trunk only: the sibling's phantom experts are gone
    assert p.kv_bytes == g.kv("f32", 32768, 48) == 6 * GiB
    budget = 12 * GiB - g.device_total(48, 32768, "f32", p.profile.reserve_bytes, p.device.scratch, 0)
    assert p.expert_cache_budget_bytes == budget > 0
    assert p.expert_slots == budget // expert_slot_layout(g.spec).stride
    assert p.expert_slots_needed == 48 * 128

    from engine.cli.cmd_plan import print_summary

    print_summary(p)
    out = capsys.readouterr().out
    assert f"budget {format_size(budget)} = {p.expert_slots} slots" in out
    assert "tok/s" in out and "mode" in out and "map" in out


@pytest.mark.parametrize("narrow", ["bf16", "q8_0"])
def test_narrower_kv_grows_expert_budget_by_exactly_the_kv_saved(geo, narrow):
    g = geo(QWEN3)
    wide = _plan(g.spec, 12 * GiB, ctx=32768, kv_type="f32")
    thin = _plan(g.spec, 12 * GiB, ctx=32768, kv_type=narrow)
    assert thin.n_gpu_layers == wide.n_gpu_layers == 48
    assert thin.kv_bytes == g.kv(narrow, 32768, 48)
    saved = wide.kv_bytes - thin.kv_bytes
    assert saved > 0
    assert thin.expert_cache_budget_bytes - wide.expert_cache_budget_bytes == saved


# -- other models, splits, explicit -g -------------------------------------------------------------
@pytest.mark.parametrize(
    "name,vram,ctx,kv,want_layers",
    [
        ("olmoe-1b-7b", 4 * GiB, 4096, "f32", 16),
        ("olmoe-1b-7b", 1 * GiB, 4096, "f32", None),  # split
        ("mixtral-8x7b", 12 * GiB, 8192, "f32", 32),
        ("mixtral-8x7b", 3 * GiB // 2, 8192, "q8_0", None),  # split
        ("qwen1.5-moe-a2.7b", 8 * GiB, 8192, "bf16", 24),
        ("qwen3-30b-a3b", 3 * GiB, 32768, "f32", None),  # split
        ("glm-4.5-air", 12 * GiB, 4096, "bf16", 46),  # a dense first layer, 45 MoE layers
        ("glm-4.5-air", 3 * GiB, 16384, "f32", None),  # split
    ],
)
def test_profiles_and_layer_splits_are_maximal(geo, name, vram, ctx, kv, want_layers):
    g = geo(name)
    reserve, scratch = 256 * MiB, 64 * MiB
    p = _plan(g.spec, vram, ctx=ctx, kv_type=kv, reserve_bytes=reserve, scratch_bytes=scratch)
    n = p.n_gpu_layers
    if want_layers is not None:
        assert n == want_layers
    else:
        assert 0 < n < g.L
        assert str(n) in p.layer_reason and "over the" in p.layer_reason
    # Maximal prefix, checked with the writer's own byte table.
    assert g.device_total(n, ctx, kv, reserve, scratch, 0) <= vram
    if n < g.L:
        assert g.device_total(n + 1, ctx, kv, reserve, scratch, 0) > vram
    assert p.device.total == g.placed_total(p, reserve, scratch) <= vram
    assert [lay.device for lay in p.layers] == ["gpu"] * n + ["cpu"] * (g.L - n)


def test_explicit_gpu_layers_are_honoured(geo):
    g = geo(QWEN3)
    p = _plan(g.spec, 12 * GiB, ctx=8192, kv_type="q8_0", n_gpu_layers=10)
    assert p.n_gpu_layers == 10 and p.gpu_layers == (0, 10) and p.cpu_layers == (10, 48)
    assert [lay.device for lay in p.layers] == ["gpu"] * 10 + ["cpu"] * 38
    assert p.expert_slots_needed == 10 * 128
    assert _plan(g.spec, 12 * GiB, ctx=8192, n_gpu_layers=1000).n_gpu_layers == 48
    assert _plan(g.spec, 12 * GiB, ctx=8192, n_gpu_layers=0).device.total == 0
    with pytest.raises(PlanError, match="at most .* layers fit"):
        _plan(g.spec, 3 * GiB, ctx=32768, kv_type="f32", n_gpu_layers=40)


@pytest.mark.parametrize("vram", [0, 100 * MiB, 600 * MiB - 1])
def test_budget_too_small_for_one_layer_gives_cpu_only_plan(geo, vram):
    g = geo(QWEN3)
    # reserve 512 MiB + scratch ≈ 107 MiB at 32K already exceed 600 MiB: nothing fits.
    p = _plan(g.spec, vram, ctx=32768, kv_type="q8_0")
    assert p.n_gpu_layers == 0 and p.layer_reason.startswith("CPU only")
    assert all(lay.device == "cpu" and lay.experts == "cpu" for lay in p.layers)
    assert p.device.total == 0 and p.expert_cache_budget_bytes == 0 and p.expert_slots == 0
    assert p.moe_mode == "cpu" and "no layer is on the device" in p.moe_reason
    d = p.to_dict()
    assert all(x >= 0 for x in _walk_numbers(d))
    assert d["predicted_tok_s"]["cpu"] > 0 and d["predicted_tok_s"]["cache"] is None


def test_reason_names_the_layer_when_reserve_fits_but_a_layer_does_not(geo):
    g = geo(QWEN3)
    reserve, scratch = 256 * MiB, 64 * MiB
    one = g.device_total(1, 32768, "f32", reserve, scratch, 0)
    p = _plan(g.spec, one - 1, ctx=32768, kv_type="f32", reserve_bytes=reserve, scratch_bytes=scratch)
    assert p.n_gpu_layers == 0 and "too small for one layer" in p.layer_reason
    assert _plan(g.spec, one, ctx=32768, reserve_bytes=reserve, scratch_bytes=scratch).n_gpu_layers == 1


# -- expert mode -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overheads", [False, True])
def test_auto_picks_the_fastest_prediction_as_the_budget_grows(geo, overheads):
    """From 3 to 30 GiB: auto's mode is the fastest prediction (a cache must beat the best steady option —
    CPU experts or a resident split — by AUTO_CACHE_MARGIN); the resident split is the smallest whose
    experts all fit, it only moves down as the budget grows, and it reaches 0 (everything resident)."""
    g = geo(QWEN3)
    splits = []
    for k in range(14, 121):  # 3.5 GiB .. 30 GiB in quarter-GiB steps
        p = _plan(g.spec, k * GiB // 4, overheads=overheads, ctx=32768, kv_type="q8_0")
        assert p.n_gpu_layers == 48
        t = p.predicted_tok_s
        steady = max(t["cpu"], t["resident"] or 0.0)
        if p.moe_mode == "cache":
            assert t["cache"] >= AUTO_CACHE_MARGIN * steady
        else:
            assert t[p.moe_mode] == steady
            assert t["cache"] is None or t["cache"] < AUTO_CACHE_MARGIN * steady
        if p.moe_mode == "resident":
            split = p.n_cpu_moe
            assert [lay.experts for lay in p.layers] == ["cpu"] * split + ["resident"] * (48 - split)
            assert p.device.experts == g.resident(split, 48)
            if split:  # the smallest such split: one more layer's experts would not fit
                assert p.device.total - p.device.experts + g.resident(split - 1, 48) > p.budget_bytes
            splits.append(split)
    assert splits == sorted(splits, reverse=True) and splits and splits[-1] == 0
    if not overheads:  # bytes only: keeping experts on the device always beats the CPU's bytes
        assert p.moe_mode == "resident"


@pytest.mark.parametrize(
    "flags,env,vram,want",
    [
        (dict(), {"SHARPI_CPU_MOE": "1"}, 12 * GiB, "cpu"),  # auto says cache here
        (dict(cpu_moe=True), {}, 12 * GiB, "cpu"),
        (dict(moe="cpu"), {}, 12 * GiB, "cpu"),
        (dict(), {"SHARPI_CPU_MOE": "0"}, 3 * GiB, "cache"),  # auto says cpu here
        (dict(moe="cache"), {}, 3 * GiB, "cache"),
        (dict(cpu_moe=True), {"SHARPI_CPU_MOE": "0"}, 12 * GiB, "cpu"),  # the flag beats the environment
        (dict(moe="resident"), {}, 24 * GiB, "resident"),
    ],
)
def test_overrides_win(geo, flags, env, vram, want):
    g = geo(QWEN3)
    auto = _plan(g.spec, vram, overheads=False, ctx=32768, kv_type="q8_0")  # bytes only: auto differs
    assert auto.moe_mode != want or want == "resident"
    mode, source = resolve_moe(
        flags.get("moe", "auto"), flags.get("cpu_moe", False), EngineOptions.from_env(env).cpu_moe
    )
    p = _plan(g.spec, vram, ctx=32768, kv_type="q8_0", moe=mode, moe_source=source)
    assert p.moe_mode == want and source in p.moe_reason
    assert p.expert_slots_allocated == {"cpu": 0, "cache": p.expert_slots, "resident": p.expert_slots_needed}[want]


def test_resident_that_does_not_fit_keeps_the_first_layers_experts_on_the_cpu(geo):
    g = geo(QWEN3)
    p = _plan(g.spec, 12 * GiB, ctx=32768, kv_type="q8_0", moe="resident", moe_source="--moe")
    n = p.n_cpu_moe
    assert 0 < n < 48 and p.moe_mode == "resident" and "do not fit" in p.moe_reason
    assert [lay.experts for lay in p.layers] == ["cpu"] * n + ["resident"] * (48 - n)
    assert p.device.experts == g.resident(n, 48) and p.expert_slots_allocated == (48 - n) * 128
    assert p.device.total - p.device.experts + g.resident(n - 1, 48) > 12 * GiB  # smallest split
    # --n-cpu-moe is a floor for the split
    q = _plan(g.spec, 12 * GiB, ctx=32768, kv_type="q8_0", moe="resident", moe_source="--moe", n_cpu_moe=n + 3)
    assert q.n_cpu_moe == n + 3 and q.device.experts == g.resident(n + 3, 48)


def test_impossible_overrides(geo):
    g = geo(QWEN3)
    with pytest.raises(PlanError, match="resident is impossible: no layer is on the device"):
        _plan(g.spec, 12 * GiB, ctx=32768, kv_type="q8_0", moe="resident", moe_source="--moe", n_gpu_layers=0)
    with pytest.raises(PlanError, match="no layer is on the device"):
        _plan(g.spec, 100 * MiB, ctx=4096, moe="cache", moe_source="--moe")
    # The environment falls back quietly (a slider must not error); the reason says why.
    p = _plan(g.spec, 100 * MiB, ctx=4096, moe="cache", moe_source="SHARPI_CPU_MOE=0")
    assert p.moe_mode == "cpu" and "SHARPI_CPU_MOE=0" in p.moe_reason
    with pytest.raises(PlanError, match="contradicts"):
        resolve_moe("cache", True, None)
    with pytest.raises(UsageError, match="SHARPI_CPU_MOE must be 0 or 1"):
        EngineOptions.from_env({"SHARPI_CPU_MOE": "yes"})


def test_n_cpu_moe_keeps_first_layers_experts_on_cpu(geo):
    g = geo(QWEN3)
    p = _plan(g.spec, 12 * GiB, ctx=32768, kv_type="q8_0", n_cpu_moe=10)
    assert p.n_cpu_moe >= 10  # a resident split may keep more on the CPU, never fewer
    assert [lay.experts for lay in p.layers[: p.n_cpu_moe]] == ["cpu"] * p.n_cpu_moe
    assert {lay.experts for lay in p.layers[p.n_cpu_moe :]} == {p.moe_mode}
    assert p.expert_slots_needed == 38 * 128
    allcpu = _plan(g.spec, 12 * GiB, ctx=32768, kv_type="q8_0", n_cpu_moe=99)
    assert allcpu.moe_mode == "cpu" and "--n-cpu-moe" in allcpu.moe_reason and allcpu.expert_slots == 0


def test_q8_0_kv_needs_width_multiple_of_32():
    a = qwen3moe.Args(
        arch="qwen3moe", n_layer=2, n_embd=64, n_head=2, n_head_kv=2, head_dim=24, n_vocab=100, n_ctx_train=512,
        rms_eps=1e-6, rope_base=1e4, rope_dim=24, rope_neox=True, n_expert=4, n_expert_used=2, n_ff_exp=32,
    )  # fmt: skip
    spec = ModelSpec.from_args(a, lambda s: QType.F32)
    with pytest.raises(PlanError, match="multiple of 32"):
        plan(spec, DeviceProfile(), PlanRequest(ctx=256, kv_type="q8_0"))
    p = plan(spec, DeviceProfile(), PlanRequest(ctx=256, kv_type="q8_0", n_gpu_layers=0))
    assert p.n_gpu_layers == 0
    assert plan(spec, DeviceProfile(), PlanRequest(ctx=256, kv_type="bf16")).n_gpu_layers == 2


# -- JSON, speed, CLI ------------------------------------------------------------------------------
def test_json_form(geo):
    g = geo("olmoe-1b-7b")
    p = _plan(g.spec, 4 * GiB, ctx=4096, kv_type="bf16")
    d = json.loads(p.to_json())
    for key in (
        "n_gpu_layers", "kv_bytes", "kv_type", "expert_cache_budget_bytes", "expert_slots", "moe_mode",
        "moe_reason", "predicted_tok_s", "layers", "recommended_ctx", "routed_expert_bytes",
    ):  # fmt: skip
        assert key in d
    assert set(d["predicted_tok_s"]) == {"cpu", "cache", "resident"}
    assert [x["index"] for x in d["layers"]] == list(range(16))
    assert d["layers"][0]["components"]["attn_q"] > 0 and d["kv_type"] == "bf16"


def test_plan_is_pure(geo, monkeypatch):
    """A dragging slider calls plan() freely: it opens no file, touches no device and gives the same
    placement every time (its speed is ``sharpi plan --bench``'s business)."""
    import builtins

    import torch

    g = geo(QWEN3)
    prof, req = DeviceProfile(vram_bytes=12 * GiB), PlanRequest(ctx=32768, kv_type="q8_0")
    first = plan(g.spec, prof, req)
    for name, mod in (("open", builtins), ("empty", torch), ("zeros", torch), ("device", torch.cuda)):
        monkeypatch.setattr(mod, name, lambda *a, _n=name, **k: pytest.fail(f"plan() called {_n}"))
    assert all(plan(g.spec, prof, req) == first for _ in range(3))


def test_cli_summary_and_json(geo, capsys, engine_env):
    engine_env({"SHARPI_CPU_MOE": None, "SHARPI_KV_DTYPE": None})
    path = geo("olmoe-1b-7b").path  # a small vocabulary: quick to open
    assert main(["plan", "-m", path, "--vram", "2.5GiB", "-c", "4096", "--kv-type", "q8_0", "-g", "-1"]) == 0
    out = capsys.readouterr().out
    assert "all 16 layers fit" in out and "experts   budget" in out and "tok/s" in out
    assert ("C" * 16 in out) == ("mode      cache" in out) and ("G" * 16 in out) == ("mode      cpu" in out)
    assert main(["plan", "-m", path, "--vram", "2.5GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["n_gpu_layers"] == 16 and d["kv_type"] == "bf16" and d["moe_mode"] in ("cpu", "cache", "resident")
    engine_env({"SHARPI_CPU_MOE": "1", "SHARPI_KV_DTYPE": "q8_0"})
    assert main(["plan", "-m", path, "--vram", "2.5GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["moe_mode"] == "cpu" and d["moe_source"] == "SHARPI_CPU_MOE=1" and d["kv_type"] == "q8_0"


@pytest.mark.parametrize("size", ["12GX", "-1GiB", "12G", "lots"])
def test_cli_malformed_size_is_a_usage_error(geo, capsys, size):
    with pytest.raises(SystemExit) as e:
        main(["plan", "-m", geo("olmoe-1b-7b").path, "--vram", size])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid size" in err and "Traceback" not in err


def test_cli_impossible_request_exits_2(geo, capsys):
    path = geo("olmoe-1b-7b").path
    assert main(["plan", "-m", path, "--vram", "1GiB", "-g", "16"]) == 2
    assert "at most" in capsys.readouterr().err
    assert main(["plan", "-m", path, "--moe", "cache", "--cpu-moe"]) == 2
    assert main(["plan", "-m", path, "--bench", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["n_layer"] == 16 and r["median_ms"] < 50


def test_cli_subprocess_no_traceback(geo):
    env = dict(os.environ)
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli.main", "plan", "-m", geo("olmoe-1b-7b").path, "--vram", "12GX"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and "invalid size '12GX'" in r.stderr and "Traceback" not in r.stderr


# -- property test ---------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    name=st.sampled_from(MODELS),
    vram=st.integers(0, 40 * GiB),
    ctx=st.integers(1, 131072),
    kv=st.sampled_from(["f32", "bf16", "q8_0"]),
    ngl=st.one_of(st.just(-1), st.integers(0, 60)),
    moe=st.sampled_from(["auto", "cpu", "cache", "resident"]),
    n_cpu_moe=st.one_of(st.just(0), st.integers(0, 60)),
    reserve=st.integers(0, 1 * GiB),
    scratch=st.one_of(st.none(), st.integers(0, 512 * MiB)),
)
def test_property_budget_never_exceeded_and_every_layer_placed_once(
    geo, name, vram, ctx, kv, ngl, moe, n_cpu_moe, reserve, scratch
):
    g = geo(name)
    prof = DeviceProfile(vram_bytes=vram, reserve_bytes=reserve, scratch_bytes=scratch)
    req = PlanRequest(ctx=ctx, kv_type=kv, n_gpu_layers=ngl, moe=moe, moe_source="--moe", n_cpu_moe=n_cpu_moe)
    try:
        p = plan(g.spec, prof, req)
    except PlanError:
        # Only an explicit request can be impossible; auto always yields a plan.
        assert ngl != -1 or moe in ("cache", "resident")
        return
    n = p.n_gpu_layers
    assert 0 <= n <= g.L and (ngl == -1 or n == min(ngl, g.L))
    assert [lay.index for lay in p.layers] == list(range(g.L))
    assert [lay.device for lay in p.layers] == ["gpu"] * n + ["cpu"] * (g.L - n)
    assert p.gpu_layers[1] == p.cpu_layers[0] and p.cpu_layers[1] == g.L
    used_scratch = scratch_estimate(g.spec, ctx) if scratch is None else scratch
    assert p.device.total == g.placed_total(p, reserve, used_scratch) <= vram
    # Staging for long prompts only where a device layer keeps its experts on the host: two equal halves of
    # between min(E, 8) and E slots, from what the mode left.
    host_dev = sum(1 for lay in p.layers if lay.device == "gpu" and lay.experts == "cpu")
    assert p.device.stream == p.stream_slots * g.stride
    if p.stream_slots:
        assert host_dev and p.stream_slots % 2 == 0 and 2 * min(g.E, 8) <= p.stream_slots <= 2 * g.E
    assert p.expert_slots_allocated <= p.expert_slots_needed
    if p.moe_mode == "cache":
        assert 0 < p.expert_slots_allocated == p.expert_slots
    assert all(x >= 0 for x in _walk_numbers(p.to_dict()))


def test_long_prompts_stream_host_experts_through_staging_the_mode_leaves(geo):
    """--moe cpu with room: two halves of a whole layer's 128 experts, priced and noted; a budget with room
    for less than two halves of 8: none, and the note says why; the knob off (prompt_stream=False): none, no
    note; a cache that takes every byte left: none."""
    g = geo(QWEN3)
    stride = expert_slot_layout(g.spec).stride
    p = _plan(g.spec, 12 * GiB, ctx=4096, kv_type="f32", moe="cpu")
    assert p.n_gpu_layers == 48 and p.stream_slots == 256 and p.device.stream == 256 * stride
    assert any("long prompts stream the host experts of 48 device layers" in n for n in p.notes)
    assert p.to_dict()["device_bytes"]["stream"] == 256 * stride and p.to_dict()["stream_slots"] == 256
    snug = p.device.total - 256 * stride + 15 * stride  # room for 15 slots: less than two halves of 8
    q = _plan(g.spec, snug, ctx=4096, kv_type="f32", moe="cpu", n_gpu_layers=48)
    assert q.stream_slots == 0 and q.device.stream == 0
    assert any("long prompts run the host experts of 48 device layers on the CPU" in n for n in q.notes)
    mid = _plan(g.spec, snug + 25 * stride, ctx=4096, kv_type="f32", moe="cpu", n_gpu_layers=48)
    assert mid.stream_slots == 40  # 40 slots of room: two halves of 20
    off = plan(g.spec, DeviceProfile(vram_bytes=12 * GiB), PlanRequest(ctx=4096, moe="cpu", prompt_stream=False))
    assert off.stream_slots == 0 and not any("long prompts" in n for n in off.notes)
    cache = _plan(g.spec, 12 * GiB, ctx=4096, kv_type="f32", moe="cache")
    assert cache.stream_slots == 0 and not any("long prompts" in n for n in cache.notes)
    split = _plan(g.spec, 12 * GiB, ctx=4096, kv_type="f32", moe="cache", n_cpu_moe=40)
    assert split.expert_slots_allocated == 8 * 128 and split.stream_slots == 256  # 40 host layers beside the pool


def test_a_resident_split_leaves_room_to_stream_its_cpu_layers_experts(geo):
    """With prompt streaming on, the split is the smallest whose resident experts plus a staging of two chunks
    of STREAM_SPLIT_CHUNK experts fit, and the placement streams through it; with streaming off, one layer
    fewer may keep its experts on the CPU."""
    from engine.plan.sizing import STREAM_SPLIT_CHUNK

    g = geo(QWEN3)
    on = _plan(g.spec, 12 * GiB, ctx=4096, kv_type="f32", moe="resident", moe_source="--moe")
    off = _plan(g.spec, 12 * GiB, ctx=4096, kv_type="f32", moe="resident", moe_source="--moe", prompt_stream=False)
    assert 0 < off.n_cpu_moe <= on.n_cpu_moe < 48
    assert on.stream_slots >= 2 * STREAM_SPLIT_CHUNK and off.stream_slots == 0
    assert (on.resident_split, off.resident_split) == (on.n_cpu_moe, off.n_cpu_moe)  # what the app names
    n = on.n_cpu_moe
    keep = 2 * STREAM_SPLIT_CHUNK * g.stride
    assert on.device.total - on.device.stream + keep <= 12 * GiB
    assert on.device.total - on.device.stream - on.device.experts + g.resident(n - 1, 48) + keep > 12 * GiB
