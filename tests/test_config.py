"""engine.config: every variable parsed once into EngineOptions, malformed values named in a UsageError,
the process snapshot, and no other engine module reading or writing the environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine import config
from engine.config import ENV, EngineOptions
from engine.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def test_an_empty_environment_gives_the_documented_defaults():
    assert EngineOptions.from_env({}) == EngineOptions()
    o = EngineOptions()
    assert (o.host_kernels, o.device_kernels, o.cuda_graph, o.device_act) == ("numba", "triton", "graph", None)
    assert o.pdl and o.pdl_prefetch and o.vnni and o.calibrate and not o.triton_interpret
    assert (o.kv_type, o.cpu_moe, o.prompt_upload_min, o.triton_table, o.launch_table) == (None,) * 5
    assert o.prompt_stream_min == 32  # llama.cpp's batch size from which it computes host experts on the GPU
    assert o.prefill_precision is None
    assert EngineOptions.from_env({v: "  " for v in ENV.values()}) == o  # blank is unset


@pytest.mark.parametrize(
    "var,raw,field,want",
    [
        ("SHARPI_KERNELS", "Reference", "host_kernels", "reference"),
        ("SHARPI_BF16", "0", "bf16_prefill", "0"),
        ("SHARPI_BF16", "BF16", "bf16_prefill", "bf16"),
        ("SHARPI_NO_VNNI", "1", "vnni", False),
        ("SHARPI_DEVICE_KERNELS", "reference", "device_kernels", "reference"),
        ("SHARPI_DEVICE_ACT", " Q8 ", "device_act", "q8"),
        ("SHARPI_PREFILL_PRECISION", "BF16", "prefill_precision", "bf16"),
        ("SHARPI_PREFILL_PRECISION", "f32", "prefill_precision", "f32"),
        ("SHARPI_PDL", "0", "pdl", False),
        ("SHARPI_PDL_PREFETCH", "off", "pdl_prefetch", False),
        ("SHARPI_TRITON_TABLE", "3.8", "triton_table", (3, 8)),
        ("SHARPI_TRITON_TABLE", "none", "triton_table", (0, 0)),
        ("TRITON_INTERPRET", "1", "triton_interpret", True),
        ("SHARPI_CUDA_GRAPH", "0", "cuda_graph", "off"),
        ("SHARPI_CUDA_GRAPH", "no", "cuda_graph", "off"),
        ("SHARPI_CUDA_GRAPH", "1", "cuda_graph", "graph"),
        ("SHARPI_CUDA_GRAPH", "eager", "cuda_graph", "eager"),
        ("SHARPI_PROMPT_UPLOAD_MIN", "0", "prompt_upload_min", 0),
        ("SHARPI_CACHE_UPLOAD", "inline", "cache_upload", "inline"),
        ("SHARPI_CACHE_UPLOAD", "background", "cache_upload", "background"),
        ("SHARPI_CACHE_POLICY", "LRU", "cache_policy", "lru"),
        ("SHARPI_CACHE_POLICY", "slru", "cache_policy", "slru"),
        ("SHARPI_PROMPT_STREAM_MIN", "0", "prompt_stream_min", 0),
        ("SHARPI_PROMPT_STREAM_MIN", "64", "prompt_stream_min", 64),
        ("SHARPI_KV_DTYPE", "q8", "kv_type", "q8_0"),
        ("SHARPI_KV_DTYPE", "FP32", "kv_type", "f32"),
        ("SHARPI_CPU_MOE", "1", "cpu_moe", True),
        ("SHARPI_CPU_MOE", "0", "cpu_moe", False),
        ("SHARPI_NO_CALIBRATE", "1", "calibrate", False),
        ("SHARPI_NO_CALIBRATE", "0", "calibrate", True),
        ("SHARPI_CALIBRATION_DIR", "/tmp/x", "calibration_dir", Path("/tmp/x")),
        ("SHARPI_DEMO_MODEL", "/tmp/m.gguf", "demo_model", Path("/tmp/m.gguf")),
        ("SHARPI_DATA_DIR", "/tmp/chats", "data_dir", Path("/tmp/chats")),
        ("SHARPI_ROUTES_DIR", "/tmp/routes", "routes_dir", Path("/tmp/routes")),
        ("SHARPI_HIT_CURVE", "Synthetic", "hit_curve", "synthetic"),
        ("SHARPI_REPLAN_TOKENS", "0", "replan_tokens", 0),
        ("SHARPI_REPLAN_TOKENS", "512", "replan_tokens", 512),
        ("SHARPI_CACHE_MISSES", "Bus", "cache_misses", "bus"),
        ("SHARPI_CACHE_MISSES", "cpu", "cache_misses", "cpu"),
        ("SHARPI_REASONING", "Off", "reasoning", "off"),
        ("SHARPI_REASONING", "harmony", "reasoning", "harmony"),
        ("SHARPI_ENGINE_NICE", "0", "engine_nice", 0),
    ],
)
def test_each_variable(var, raw, field, want):
    assert ENV[field] == var
    assert getattr(EngineOptions.from_env({var: raw}), field) == want


@pytest.mark.parametrize(
    "var,raw",
    [
        ("SHARPI_KERNELS", "fast"),
        ("SHARPI_BF16", "maybe"),
        ("SHARPI_ENGINE_NICE", "high"),
        ("SHARPI_DEVICE_KERNELS", "cuda"),
        ("SHARPI_DEVICE_ACT", "int4"),
        ("SHARPI_PREFILL_PRECISION", "fp16"),
        ("SHARPI_PDL", "2"),
        ("SHARPI_TRITON_TABLE", "three"),
        ("SHARPI_LAUNCH_TABLE", "/nonexistent/table.json"),
        ("TRITON_INTERPRET", "yes please"),
        ("SHARPI_CUDA_GRAPH", "sometimes"),
        ("SHARPI_PROMPT_UPLOAD_MIN", "many"),
        ("SHARPI_PROMPT_UPLOAD_MIN", "-1"),
        ("SHARPI_CACHE_UPLOAD", "later"),
        ("SHARPI_PROMPT_STREAM_MIN", "long"),
        ("SHARPI_PROMPT_STREAM_MIN", "-2"),
        ("SHARPI_KV_DTYPE", "f8"),
        ("SHARPI_CPU_MOE", "yes"),
        ("SHARPI_NO_CALIBRATE", "please"),
    ],
)
def test_a_malformed_value_is_a_usage_error_naming_the_variable(var, raw):
    with pytest.raises(UsageError, match=re.escape(var)):
        EngineOptions.from_env({var: raw})


def test_fields_given_directly_are_checked_too():
    with pytest.raises(UsageError, match="cuda_graph"):
        EngineOptions(cuda_graph="1")
    with pytest.raises(UsageError, match="kv_type"):
        EngineOptions(kv_type="q8")  # from_env accepts the alias; the field holds the canonical name
    with pytest.raises(UsageError, match="prompt_upload_min"):
        EngineOptions(prompt_upload_min=-1)
    with pytest.raises(UsageError, match="prompt_stream_min"):
        EngineOptions(prompt_stream_min=-1)
    with pytest.raises(UsageError, match="prefill_precision"):
        EngineOptions(prefill_precision="tf32")


def test_a_launch_table_file_is_read_once_and_frozen(tmp_path):
    f = tmp_path / "t.json"
    f.write_text('{"gemv:*:*": {"BR": 2, "NB": 4, "num_warps": 4, "SPLIT": 1}}')
    o = EngineOptions.from_env({"SHARPI_LAUNCH_TABLE": str(f)})
    f.write_text("{}")
    assert dict(o.launch_table["gemv:*:*"]) == {"BR": 2, "NB": 4, "num_warps": 4, "SPLIT": 1}
    with pytest.raises(TypeError):
        o.launch_table["gemv:*:*"]["BR"] = 8
    f.write_text('{"gemv": {"BR": 2}}')
    with pytest.raises(UsageError, match="SHARPI_LAUNCH_TABLE"):
        EngineOptions.from_env({"SHARPI_LAUNCH_TABLE": str(f)})
    given = EngineOptions(launch_table={"gemv:*:*": {"BR": 2}})  # a plain dict is frozen too
    with pytest.raises(TypeError):
        given.launch_table["x:*:*"] = {}


def test_with_env_changes_only_the_named_variables():
    base = EngineOptions.from_env({"SHARPI_CUDA_GRAPH": "eager", "SHARPI_DEVICE_ACT": "q8"})
    o = base.with_env({"SHARPI_CUDA_GRAPH": "0"})
    assert (o.cuda_graph, o.device_act) == ("off", "q8")
    assert base.with_env({"SHARPI_DEVICE_ACT": None}).device_act is None
    with pytest.raises(UsageError, match="SHARPI_NOPE"):
        base.with_env({"SHARPI_NOPE": "1"})


def test_the_snapshot_and_a_scoped_override(engine_env):
    engine_env({"SHARPI_PDL": "1"})
    assert config.current() is config.current() and config.current().pdl
    with config.overriding(pdl=False) as o:
        assert config.current() is o and not o.pdl
    assert config.current().pdl


def test_cache_policies_agree_with_the_runtime_and_the_bench():
    from engine.runtime.cache_policies import DEFAULT_POLICY
    from engine.runtime.slot_policies import DEFAULT_SLOT_POLICY, SLOT_POLICIES

    assert tuple(SLOT_POLICIES) == config.CACHE_POLICIES
    assert config.DEFAULT_CACHE_POLICY == DEFAULT_SLOT_POLICY == DEFAULT_POLICY == EngineOptions().cache_policy
    with pytest.raises(UsageError, match="SHARPI_CACHE_POLICY"):
        EngineOptions.from_env({"SHARPI_CACHE_POLICY": "belady"})  # offline only: no runtime policy
    with pytest.raises(UsageError, match="cache_policy"):
        EngineOptions(cache_policy="fifo")


def test_kv_types_agree_with_the_planner():
    from engine.plan.sizing import KV_TYPES

    assert tuple(KV_TYPES) == config.KV_TYPES


def test_reasoning_modes_agree_with_the_formats():
    from engine.generate.reasoning import FORMATS

    assert ("auto", "off", *FORMATS) == config.REASONING_MODES


def test_process_settings_leave_a_user_value_alone():
    code = (
        "import os\n"
        "os.environ['GOMP_SPINCOUNT'] = '77'\n"
        "from engine import config\n"
        "config.apply_process_settings()\n"
        "print(os.environ['GOMP_SPINCOUNT'])\n"
        "del os.environ['GOMP_SPINCOUNT']\n"
        "config.apply_process_settings()\n"
        "print(os.environ['GOMP_SPINCOUNT'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["77", config.gomp_spincount(os.cpu_count() or 1, config._nvidia_gpu())]


def test_spin_count_is_libgomps_own_only_on_a_large_machine_with_a_gpu():
    short = {config.gomp_spincount(c, g) for c, g in [(2, True), (config.MANY_CPUS - 1, True), (64, False), (2, False)]}
    assert short == {"10000"}
    assert config.gomp_spincount(config.MANY_CPUS, True) == config.gomp_spincount(64, True) == "300000"


@pytest.mark.parametrize(
    ("nodes", "gpu"),
    [(["nvidia0", "nvidiactl", "nvidia-uvm"], True), (["nvidiactl", "nvidia-uvm", "null"], False), ([], False)],
)
def test_an_nvidia_gpu_is_a_numbered_device_node(monkeypatch, nodes, gpu):
    monkeypatch.setattr(config.os, "listdir", lambda path: nodes if path == "/dev" else [])
    assert config._nvidia_gpu() is gpu


def test_importing_the_engine_writes_no_environment():
    code = (
        "import os\nbefore = dict(os.environ)\n"
        "import engine.api, engine.ops, engine.runtime.triton_moe, engine.bench.device_kernels\n"
        "print(sorted(set(os.environ.items()) ^ set(before.items())))\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_only_config_reads_or_writes_the_environment():
    """engine/config.py is the one engine module that touches os.environ (the CLI's argument defaults
    aside, and none of those read it now either)."""
    pattern = re.compile(r"os\.environ|os\.getenv|getenv\(|putenv")
    bad = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "engine").rglob("*.py"))
        if p != ROOT / "engine" / "config.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert bad == []


def test_one_default_kv_type_everywhere():
    """The engine, the planner and the app's plan settings default to one KV dtype (bf16)."""
    from engine.kv_layout import DEFAULT_KV_TYPE, resolve_kv_type
    from engine.plan import PlanRequest
    from sharpi_gui.data import PlanSettings

    assert DEFAULT_KV_TYPE == "bf16"
    assert resolve_kv_type() == resolve_kv_type(PlanRequest().kv_type) == PlanSettings.kv_type == DEFAULT_KV_TYPE
