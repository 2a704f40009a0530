"""The expert profiler: exact counts on a scripted trace, decay, step series, export round trip."""

from __future__ import annotations

import csv
import json

import numpy as np

from engine.profiler import HEAT_DECAY, ExpertProfiler, export


def test_counts_exact_on_a_scripted_trace(tmp_path):
    p = ExpertProfiler(n_layer=2, n_expert=4, history=3)
    p.begin_step()
    p.record_route(0, np.array([[0, 1], [1, 2]]))  # 2 tokens, top-2
    p.record_route(1, np.array([[3, 3], [0, 1]]))
    p.record_cache(1, hit_ids=[3, 0], miss_ids=[3, 1], uploaded={3: 1000, 1: 500})
    p.end_step(2)
    p.begin_step()
    p.record_route(0, np.array([[2, 3]]))
    p.set_resident(1, [3])
    p.end_step(1)
    s = p.snapshot()
    assert s.calls.tolist() == [[1, 2, 2, 1], [1, 1, 0, 2]]
    assert s.hits.tolist() == [[0, 0, 0, 0], [1, 0, 0, 1]]
    assert s.misses.tolist() == [[0, 0, 0, 0], [0, 1, 0, 1]]
    assert s.uploaded_bytes[1].tolist() == [0, 500, 0, 1000]
    assert s.resident.tolist() == [[False] * 4, [False, False, False, True]]
    assert s.tokens_total == 3 and s.step_tokens.tolist() == [2, 1]
    assert s.step_hit_rate[0] == 0.5 and np.isnan(s.step_hit_rate[1])
    # heat: layer 0 expert 1 had 2 calls before two+one decayed tokens
    assert np.isclose(s.heat[0, 1], 2 * HEAT_DECAY**3)
    assert np.isclose(s.heat[0, 3], 1 * HEAT_DECAY**1)
    assert s.hit_rate == 0.5
    j, c = export(s, tmp_path / "stats")
    d = json.loads(j.read_text())
    assert d["calls"] == s.calls.tolist() and d["steps"]["tokens"] == [2, 1]
    with c.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and rows[7] == {
        "layer": "1",
        "expert": "3",
        "calls": "2",
        "hits": "1",
        "misses": "1",
        "uploaded_bytes": "1000",
        "heat": f"{s.heat[1, 3]:.6g}",
        "resident": "1",
    }


def test_step_history_is_a_ring():
    p = ExpertProfiler(1, 2, history=3)
    for n in range(1, 6):
        p.begin_step()
        p.end_step(n)
    assert p.snapshot().step_tokens.tolist() == [3, 4, 5]
    p.reset()
    assert p.snapshot().tokens_total == 0 and len(p.snapshot().step_tokens) == 0
