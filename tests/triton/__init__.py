"""Triton kernels against their torch references, run in the test process itself: under Triton's CPU
interpreter (``TRITON_INTERPRET=1 python -m pytest tests/triton``: small, awkward shapes) or compiled on
a CUDA GPU (``python -m pytest tests/triton`` there: trunk-sized shapes). Triton reads TRITON_INTERPRET
when the engine's kernels are decorated, at import, hence a pytest invocation of their own; conftest.py
skips the directory otherwise and marks everything here ``slow``.

:data:`DEVICE` / :data:`BIG` are for the modules' parameter lists (known at collection, so a failure
names its case); the ``device`` and ``big`` fixtures give the same values."""

from __future__ import annotations

import pytest

from engine.config import EngineOptions

# TRITON_INTERPRET as the engine parses it (engine.config): the kernels run in Triton's interpreter, on the CPU.
INTERPRET = EngineOptions.from_env().triton_interpret
DEVICE = "cpu" if INTERPRET else "cuda"
BIG = not INTERPRET  # compiled on a GPU: trunk-sized shapes; the interpreter: small ones
# With @pytest.mark.cuda on the compiled-kernel cases: skipped under the interpreter (and, with the rest of
# the directory, without CUDA).
CUDA_ONLY = pytest.mark.skipif(INTERPRET, reason="compiled kernels on a CUDA device only")
