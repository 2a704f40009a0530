"""Memory before loading: the loader computes what it will allocate (weight copies, KV, scratch) and
compares it with the RAM available — here a budget given to the loader (LoadOptions.ram_budget) — before
anything is copied: a load that does not fit is a HostMemoryError with the numbers and what would fit;
auto mode keeps the weights memory-mapped when a copy would not fit, and the model still generates."""

from __future__ import annotations

import errno
from dataclasses import replace

import numpy as np
import pytest

from engine import config
from engine.api import LoadOptions, Session, memory_plan
from engine.errors import GGUFError, HostMemoryError
from engine.generate import SamplingParams
from engine.gguf import open_gguf
from engine.models import weights as weights_mod
from engine.plan import ModelSpec
from engine.plan.sizing import host_load


@pytest.fixture(scope="module")
def model(synth_model):
    return synth_model("qwen3moe", "Q8_0", layers=2, experts=8, expert_ff=512)  # expert stacks over 1 MiB


@pytest.fixture
def copies(monkeypatch):
    """Counts the weight copies the loader makes (engine.models.weights.anonymous_copy)."""
    made = []
    real = weights_mod.anonymous_copy
    monkeypatch.setattr(weights_mod, "anonymous_copy", lambda a: made.append(a.nbytes) or real(a))
    return made


def _opts(mode="auto", **kw):
    return LoadOptions(n_ctx=256, device="cpu", engine=replace(config.current(), weights=mode), **kw)


def _spec(path) -> ModelSpec:
    with open_gguf(path) as gf:
        return ModelSpec.from_gguf(gf)


def test_the_estimate_counts_copies_kv_and_scratch(model, copies):
    spec = _spec(model.path)
    load = host_load(spec, ctx=256, kv_type="f32", copy_weights=True)
    assert load.kv == spec.n_layer * 2 * 256 * spec.kv_dim * 4
    assert load.weights == spec.trunk_bytes + spec.output_bytes + spec.routed_bytes
    with Session.load(str(model.path), _opts("copy")) as s:
        assert s.memory.copy_weights and s.memory.load == load
        list(s.generate("a b c", params=SamplingParams.greedy(max_tokens=2)))
        # every copy the load and a generation made was counted (matrices under 1 MiB stay mapped)
        assert 0 < sum(copies) <= load.weights


def test_a_context_that_does_not_fit_is_refused_before_any_copy(model, copies):
    spec = _spec(model.path)
    need = host_load(spec, ctx=256, kv_type="f32", copy_weights=False)
    with pytest.raises(HostMemoryError) as e:
        Session.load(str(model.path), _opts(ram_budget=need.total - 1))
    msg = str(e.value)
    assert "does not fit in RAM" in msg and "KV cache for 256 tokens" in msg and "RAM budget" in msg
    assert "a smaller quantization" in msg
    assert copies == []


def test_the_refusal_says_what_would_fit(model):
    spec = _spec(model.path)
    mapped_1k = host_load(spec, ctx=1024, kv_type="f32", copy_weights=False)
    copied_4k = host_load(spec, ctx=4096, kv_type="f32", copy_weights=True)
    budget = mapped_1k.total + 1
    with pytest.raises(HostMemoryError, match=r"a context of at most (\d+) tokens") as e:
        memory_plan(spec, ctx=4096, kv_type="f32", mode="copy", budget=budget)
    n = int(__import__("re").search(r"at most (\d+) tokens", str(e.value)).group(1))
    assert 1024 <= n < 4096 and host_load(spec, ctx=n, kv_type="f32", copy_weights=False).total <= budget
    assert copied_4k.total > budget and "q8_0 KV cache" in str(e.value) or "q8_0" not in str(e.value)


def test_auto_keeps_weights_mapped_when_a_copy_would_not_fit_and_generates(model, copies, caplog):
    """A model whose copy is larger than the budget (the room KV and scratch leave is under the file size) loads mapped, no
    copy made, and gives the same tokens as the copied load."""
    spec = _spec(model.path)
    mapped = host_load(spec, ctx=256, kv_type="f32", copy_weights=False)
    copied = host_load(spec, ctx=256, kv_type="f32", copy_weights=True)
    budget = mapped.total + (copied.total - mapped.total) // 2
    assert budget - mapped.total < model.path.stat().st_size  # the room left for weights: less than the file
    with Session.load(str(model.path), _opts(ram_budget=budget)) as s:
        assert not s.memory.copy_weights and "memory-mapped" in s.memory.note
        ids = [e.token_id for e in s.generate("a b c", params=SamplingParams.greedy(max_tokens=4))]
    assert copies == []
    with Session.load(str(model.path), _opts("copy")) as s:
        assert [e.token_id for e in s.generate("a b c", params=SamplingParams.greedy(max_tokens=4))] == ids


def test_mmap_mode_is_selectable(model, copies):
    with Session.load(str(model.path), _opts("mmap")) as s:
        assert not s.memory.copy_weights and s.memory.note == ""
        list(s.generate("a", params=SamplingParams.greedy(max_tokens=2)))
    assert copies == []


def test_weights_option_from_the_environment_and_cli(engine_env):
    assert config.EngineOptions.from_env({"SHARPI_WEIGHTS": "mmap"}).weights == "mmap"
    with pytest.raises(Exception, match="SHARPI_WEIGHTS"):
        config.EngineOptions.from_env({"SHARPI_WEIGHTS": "fast"})
    from engine.cli.main import build_parser

    a = build_parser().parse_args(["run", "--mmap", "-p", "x", "--ram", "2GiB"])
    assert a.weights == "mmap" and a.ram == 2 << 30


def test_a_refused_mapping_is_a_project_error(model, monkeypatch):
    """np.memmap under an address-space cap raised a raw OSError [Errno 12]."""
    from engine.gguf import reader

    def refuse(*a, **k):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(reader._CheckedReader, "__init__", refuse)
    with pytest.raises(HostMemoryError, match="refused to map"):
        open_gguf(model.path)

    def unreadable(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(reader._CheckedReader, "__init__", unreadable)
    with pytest.raises(GGUFError, match="cannot read"):
        open_gguf(model.path)


def test_an_allocation_failure_while_loading_is_a_project_error(model, monkeypatch):
    def fail(a):
        raise MemoryError

    monkeypatch.setattr(weights_mod, "anonymous_copy", fail)
    with pytest.raises(HostMemoryError, match="refused memory"):
        Session.load(str(model.path), _opts("copy"))
    assert np  # numpy imported for the fixtures' arrays


def test_the_30b_geometry_at_its_trained_context_is_refused_before_copying(synth_geometry, copies):
    """The 18.55 GB file at 40,960 tokens was OOM-killed with no message on a 23 GiB machine."""
    g = synth_geometry("qwen3-30b-a3b")
    opts = LoadOptions(n_ctx=40960, device="cpu", ram_budget=6 << 30)  # its f32 KV alone is 7.5 GiB
    with pytest.raises(HostMemoryError, match=r"KV cache for 40960 tokens") as e:
        Session.load(str(g.path), opts)
    assert "GiB" in str(e.value) and "context of at most" in str(e.value)
    assert copies == []
