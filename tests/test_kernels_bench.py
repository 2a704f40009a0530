"""``sharpi bench kernels``: the benchmark machinery runs and reports consistent numbers (tiny sizes)."""

from __future__ import annotations

import numpy as np

from engine.bench import kernels as bench
from engine.cli.main import build_parser
from engine.quant import QType


def test_read_sum_is_a_sum():
    a = np.arange(64 * 32 * 4, dtype=np.float32) % 7
    assert bench._read_sum(a, 4) == a.sum(dtype=np.float64)


def test_bench_type_small_and_table():
    r = bench.bench_type(
        QType.Q4_K, q8_act=True, reps=2, min_working_set=1 << 20, experts=(8, 256, 512, 2), trunk=(64, 512)
    )
    assert r.experts_ms > 0 and r.trunk_ms > 0
    # GB/s is bytes of 2 experts × 3 matrices over the time
    step_bytes = 2 * 3 * 256 * 512 // 256 * 144
    np.testing.assert_allclose(r.experts_gbs, step_bytes / (r.experts_ms * 1e-3) / 1e9, rtol=1e-6)
    report = {
        "machine": bench.machine_info(),
        "bandwidth": {"bytes": 1, "best_gbs": 10.0, "median_gbs": 9.0},
        "results": [r.__dict__],
    }
    text = bench.format_table(report)
    assert "Q4_K" in text and "q8" in text


def test_cli_parses_bench_kernels():
    args = build_parser().parse_args(["bench", "kernels", "--json", "--types", "Q4_K,Q8_0", "--variant", "q8"])
    assert args.bench_what == "kernels" and args.json and args.types == "Q4_K,Q8_0"
