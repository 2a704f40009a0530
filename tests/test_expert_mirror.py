"""The expert cache's host copy of the experts (``engine.runtime.expert_pool.HostMirror``), which the fused kernels
read over the bus for a miss (``EngineOptions.cache_misses``): its bytes at the slot layout, the offsets the
kernels take, its reuse across placements, and when it is made at all. (The kernels reading it: tests/triton.)"""

from __future__ import annotations

import numpy as np
import pytest

from engine.api import LoadOptions, Session
from engine.plan import expert_slot_layout
from engine.runtime.device import DeviceArena
from engine.runtime.expert_pool import MIRROR_PROGRESS, ROLES, ExpertPool, HostMirror
from engine.synth.writer import write_model


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("mirror") / "q.gguf", "qwen3moe", seed=4, layers=2,
                       weight_type="Q4_K", type_overrides={"*ffn_down*": "Q6_K"}).path  # fmt: skip
    with Session.load(str(path), LoadOptions(n_ctx=32, device="cpu")) as s:
        yield s


def _pool(s: Session) -> ExpertPool:
    return ExpertPool(s.model.expert_stacks(), {0, 1}, DeviceArena("cpu", None), expert_slot_layout(s.spec), 3, 4)


def test_the_copy_holds_each_expert_at_the_slot_layout_and_its_offsets_point_there(session):
    pool, told = _pool(session), []
    m = HostMirror.build(pool, [0, 1], "bus", progress=lambda *a: told.append(a))
    assert m is not None and m.nbytes == 2 * session.args.n_expert * pool.layout.stride
    assert told == [(1, 2, MIRROR_PROGRESS), (2, 2, MIRROR_PROGRESS)]  # a layer at a time
    off = m.offsets(pool).numpy()
    for j, i in enumerate((0, 1)):
        for e in range(session.args.n_expert):
            assert pool.pool.data_ptr() + off[i, e] == m.buf[j, e].ctypes.data
            for r in ROLES:
                src = pool.expert_bytes[(i, r)][e]
                o = pool.layout.role_offset[r]
                assert np.array_equal(m.buf[j, e, o : o + src.size], src), (i, e, r)
    m.close()
    assert m.buf is None


def test_a_re_placement_reuses_the_copy_and_cpu_misses_free_it(session):
    m = HostMirror.build(_pool(session), [0, 1], "bus")
    again = _pool(session)  # a new placement: a new pool and stacks over the same mapped file
    assert HostMirror.build(again, [1], "bus", reuse=m, progress=lambda *a: pytest.fail("copied again")) is m
    assert HostMirror.build(again, [0, 1], "cpu", reuse=m) is None and m.buf is None  # closed: RAM back
    assert HostMirror.build(again, [0, 1], "auto") is None  # the simulated device keeps CPU misses
    assert HostMirror.build(again, [], "bus") is None


def test_bus_asked_where_the_copy_does_not_fit_stays_on_the_cpu(session, monkeypatch, caplog):
    from engine.runtime import expert_pool

    monkeypatch.setattr(expert_pool, "available_ram", lambda: HostMirror.MARGIN)
    assert HostMirror.build(_pool(session), [0, 1], "bus") is None
    assert "misses stay on the CPU" in caplog.text


@pytest.mark.parametrize("background", [False, True])
def test_uploads_copy_from_the_host_copy_not_the_map(session, monkeypatch, background):
    """With a host copy, an upload takes the slot's bytes from it as they stand (one copy, no staging from the
    memory map), and the pool's slot then holds exactly the expert's bytes."""
    pool = ExpertPool(session.model.expert_stacks(), {0, 1}, DeviceArena("cpu", None),
                      expert_slot_layout(session.spec), 3, 4, background=background)  # fmt: skip
    m = HostMirror.build(pool, [0, 1], "bus")
    pool.mirror_rows = m.rows()
    monkeypatch.setattr(pool, "_fill", lambda *a: pytest.fail("staged from the memory map"))
    if background:
        assert pool.upload_later([(1, 2), (0, 5)]) == 2
        pool.drain()
    else:
        assert pool.upload(1, 2, set()) and pool.upload(0, 5, set())
    pool.sync()
    lay = pool.layout
    for i, e in ((1, 2), (0, 5)):
        got = pool.pool[pool.offset(i, e) : pool.offset(i, e) + lay.stride].numpy()
        for r in ROLES:
            src = pool.expert_bytes[(i, r)][e]
            o = lay.role_offset[r]
            assert np.array_equal(got[o : o + src.size], src), (i, e, r)
    assert pool.uploaded_bytes == 2 * sum(pool.expert_bytes[(0, r)].shape[1] for r in ROLES)
    pool.mirror_rows = None
    m.close()
