"""The CPU kernels' thread count under a placement (engine.runtime.threads) and its use by a generation."""

from __future__ import annotations

import threading

import numba
import pytest

from engine.api import LoadOptions, Session
from engine.config import EngineOptions
from engine.errors import UsageError
from engine.generate.sampling import SamplingParams
from engine.runtime.threads import host_threads


def test_rule_leaves_cores_only_where_the_device_holds_experts():
    """Two of 16 cores stay free beside a CUDA placement with experts on the device (cache, resident split);
    ``--moe cpu`` and CPU-only placements use every core."""
    o = EngineOptions()
    assert host_threads(o, device_experts=True, cores=16) == 14
    assert host_threads(o, device_experts=True, cores=8) == 7
    assert host_threads(o, device_experts=True, cores=4) == 4
    assert host_threads(o, device_experts=False, cores=16) == 16
    assert host_threads(o, device_experts=True, cores=16, most=8) == 8
    assert host_threads(EngineOptions(host_threads=3), device_experts=True, cores=16) == 3
    assert host_threads(EngineOptions(host_threads=32), device_experts=False, cores=16, most=16) == 16


def test_option_is_checked_and_read_from_the_environment():
    assert EngineOptions.from_env({"SHARPI_HOST_THREADS": "3"}).host_threads == 3
    assert EngineOptions.from_env({}).host_threads is None
    for bad in ("0", "-1", "x"):
        with pytest.raises(UsageError, match="SHARPI_HOST_THREADS"):
            EngineOptions.from_env({"SHARPI_HOST_THREADS": bad})
    with pytest.raises(UsageError, match="host_threads"):
        EngineOptions(host_threads=0)


def test_generation_runs_on_the_sessions_threads_in_the_consuming_thread(synth_model):
    path = str(synth_model("qwen3moe", "Q8_0", vocab=1024).path)
    seen = []
    with Session.load(path, LoadOptions(n_ctx=64, engine=EngineOptions(host_threads=1))) as s:
        assert s.host_threads == 1

        def consume():
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
            for _ in s.generate(prompt_ids=[1, 2, 3], params=SamplingParams.greedy(max_tokens=2)):
                seen.append(numba.get_num_threads())

        t = threading.Thread(target=consume)
        t.start()
        t.join()
    assert seen and set(seen) == {1}
