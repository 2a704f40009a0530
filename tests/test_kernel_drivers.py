"""engine.kernels.drivers.specialise: the per-type copies of a kernel template are bound as asked, named
apart, and cached on disk like hand-written kernels (numba's other ways of passing a function are not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import config
from engine.kernels import drivers, legacy
from engine.kernels.drivers import specialise

ROOT = Path(__file__).resolve().parents[1]


def _template(x):
    return _SCALE * x  # noqa: F821 (bound by specialise)


def test_every_placeholder_must_be_bound_and_no_other():
    with pytest.raises(TypeError):
        specialise(_template, "_t_none", __name__)
    with pytest.raises(TypeError):
        specialise(_template, "_t_extra", __name__, _SCALE=2.0, _OTHER=1)


def test_the_copy_uses_its_binding_and_a_name_is_not_reused():
    double = specialise(_template, "_t_double", __name__, _SCALE=2.0)
    triple = specialise(_template, "_t_triple", __name__, _SCALE=3.0)
    assert (double(5.0), triple(5.0)) == (10.0, 15.0)
    assert double.py_func.__qualname__ == "_t_double" and double.py_func.__module__ == __name__
    with pytest.raises(ValueError):  # another binding under a name in use would share its cache file
        specialise(_template, "_t_double", __name__, _SCALE=4.0)


def test_the_kernels_are_copies_of_the_shared_drivers():
    assert legacy.gemv_q4_0_q8.py_func.__code__ is drivers.gemv_q8.__code__
    assert legacy.gemv_q4_0_q8.py_func.__globals__["_DOT"] is legacy._dot_q4_0_q8
    assert legacy.gemv_mxfp4_f.py_func.__globals__["_DOT"] is legacy._dot_mxfp4_f


_CHILD = """
import json, numpy as np
from engine.kernels import legacy
w = np.zeros(34, np.uint8); d = np.ones(1, np.float32); x = np.ones(32, np.float32)
legacy._dot_q8_0_f(w, d, x)
st = legacy._dot_q8_0_f.stats
print(json.dumps([sum(st.cache_hits.values()), sum(st.cache_misses.values())]))
"""


def test_a_specialised_kernel_is_loaded_from_the_disk_cache(tmp_path):
    def run():
        env = config.child_environ({"NUMBA_CACHE_DIR": str(tmp_path)})
        out = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert run() == [0, 1]  # compiled and saved
    assert run() == [1, 0]  # a fresh process loads it
