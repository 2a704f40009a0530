"""Shared fixtures: small synthetic GGUF models built once per session, and a safe llama.cpp opener.

Use them from any test module::

    def test_something(synth_model):
        m = synth_model("qwen3moe", "Q4_K", layers=2, experts=4)   # SynthModel, cached
        path = m.path

    def test_oracle(synth_model, open_llama):
        llm = open_llama(synth_model("llama", experts=4).path)     # closed after the test

    def test_knob(engine_env):
        engine_env({"SHARPI_CPU_MOE": "1"})   # engine.config.current() with that variable, this test only

    @pytest.mark.llama
    def test_remote(llama_server):             # a third-party OpenAI server on the demo model
        RemoteSession(llama_server)            # its base URL, http://127.0.0.1:PORT/v1
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

# The suite holds paths to each other and to llama.cpp (itself run with f32 K and V) at float32 tolerances, so
# its sessions, and the CLI children they start, default to an f32 KV cache. The product's default (bf16:
# engine.kv_layout.DEFAULT_KV_TYPE) is tested where a test names it (test_config, test_host_decode,
# test_demo_model).
os.environ.setdefault("SHARPI_KV_DTYPE", "f32")
# Nor does it read or write this machine's calibration cache: a calibration made here (the app's, a benchmark's)
# changes the speeds every plan is made with, so a test expecting the default speeds failed on a machine that had
# one. Tests of the cache point SHARPI_CALIBRATION_DIR at folders of their own.
_CALIBRATION_DIR = tempfile.mkdtemp(prefix="sharpi-tests-calibration-")
atexit.register(shutil.rmtree, _CALIBRATION_DIR, True)
os.environ.setdefault("SHARPI_CALIBRATION_DIR", _CALIBRATION_DIR)
# Nor the user's routing history (the planner's cache hit-rate curve): an empty folder of the suite's own.
_ROUTES_DIR = tempfile.mkdtemp(prefix="sharpi-tests-routes-")
atexit.register(shutil.rmtree, _ROUTES_DIR, True)
os.environ.setdefault("SHARPI_ROUTES_DIR", _ROUTES_DIR)


def pytest_configure(config) -> None:
    """The test process is an entry point too: the engine's process settings before any kernel runs
    (engine.config.apply_process_settings; before, importing engine.ops made them)."""
    from engine import config as engine_config

    engine_config.apply_process_settings()


def _digest(value) -> str:
    """A stable description of fixture arguments (arrays by content) for cache keys."""
    if isinstance(value, np.ndarray):
        return f"array{value.shape}{value.dtype}:{hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_digest(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_digest(v) for v in value) + "]"
    return repr(value)


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    """Session temp directory holding the synthetic files."""
    return tmp_path_factory.mktemp("synth")


@pytest.fixture(scope="session")
def synth_model(synth_dir) -> Callable:
    """Factory ``synth_model(arch, qtype="F32", **kwargs) -> engine.synth.SynthModel``.

    Writes (once per session per distinct argument set) a random-weight GGUF with
    ``engine.synth.write_model(path, arch, weight_type=qtype, seed=0, **kwargs)``; ``kwargs`` are
    any of its keywords: geometry (``layers``, ``hidden``, ``experts``, ``vocab``, ...),
    ``type_overrides``, ``tokenizer``, ``pre``, ``seed``, ``weights``. Returns the cached
    :class:`~engine.synth.SynthModel` (``.path``, ``.spec``, ``.types()``, ``.hf_tokenizer()``).
    """
    from engine.synth import write_model

    cache: dict[str, object] = {}

    def make(arch: str, qtype="F32", **kwargs):
        kwargs.setdefault("seed", 0)
        key = f"{arch}|{qtype}|{_digest(kwargs)}"
        if key not in cache:
            name = hashlib.sha1(key.encode()).hexdigest()[:12]
            cache[key] = write_model(synth_dir / f"{arch}-{qtype}-{name}.gguf", arch, weight_type=qtype, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def synth_geometry(synth_dir) -> Callable:
    """Factory ``synth_geometry(model_name) -> engine.synth.geometry.GeometryFile``, cached.

    Geometry-only (sparse, no weights) files of real models: ``qwen3-30b-a3b``, ``olmoe-1b-7b``,
    ``qwen1.5-moe-a2.7b``, ``mixtral-8x7b``. Never run them through llama.cpp in CI: it touches
    every page of the (zero) data region, i.e. the full model size in RAM.
    """
    from engine.synth.geometry import write_geometry

    cache: dict[str, object] = {}

    def make(model_name: str):
        if model_name not in cache:
            cache[model_name] = write_geometry(synth_dir / f"geometry-{model_name}.gguf", model_name)
        return cache[model_name]

    return make


@contextlib.contextmanager
def _no_extra_buffer_types() -> Iterator[None]:
    """Load llama.cpp models with ``use_extra_bufts = False``.

    The llama-cpp-python 0.3.36 build here enables the AMX/repack extra buffer types, and a
    decode through a quantized 2-D weight in them segfaults on this machine (F32/F16/BF16 and
    expert tensors are unaffected). Without them results are unchanged (llamacpp-facts.md).
    """
    import llama_cpp.llama_cpp as C

    orig = C.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = False
        return p

    C.llama_model_default_params = params
    try:
        yield
    finally:
        C.llama_model_default_params = orig


@pytest.fixture
def open_llama() -> Iterator[Callable]:
    """Factory ``open_llama(path, n_ctx=256, **kw) -> llama_cpp.Llama`` for exact comparisons.

    F32 KV cache, logits for every position, quiet, extra buffer types off (see
    ``_no_extra_buffer_types``); every model opened is closed when the test ends. Skips the test
    when llama_cpp is not installed.
    """
    llama_cpp = pytest.importorskip("llama_cpp")
    opened = []

    def make(path, n_ctx: int = 256, **kw):
        args = dict(n_ctx=n_ctx, type_k=0, type_v=0, logits_all=True, verbose=False)
        args.update(kw)
        with _no_extra_buffer_types():
            llm = llama_cpp.Llama(str(path), **args)
        opened.append(llm)
        return llm

    yield make
    for llm in opened:
        llm.close()


def set_engine_env(mp: pytest.MonkeyPatch, changes: dict):
    """``engine.config.current()`` with the variables in ``changes`` parsed over it (None: the default),
    until ``mp`` is undone: the one way tests change the engine's process-wide options. Tests use the
    ``engine_env`` fixture; a module-scoped fixture calls this with its own MonkeyPatch."""
    from engine import config

    opts = config.current().with_env(changes)
    mp.setattr(config, "_current", opts)
    return opts


@pytest.fixture
def engine_env(monkeypatch) -> Callable:
    """Factory ``engine_env({"SHARPI_X": "value" | None, ...}) -> EngineOptions`` (:func:`set_engine_env` for
    this test): changes ``engine.config.current()`` — what ``options=None`` and ``LoadOptions()`` mean, and
    what the CLI runs with. Where an API takes options (``LoadOptions.engine``, ``Session.apply``,
    ``kernel_select``'s functions), pass them instead. Choices made at import (engine.ops,
    engine.kernels.simd/bf16) do not follow: set those variables in a child interpreter's environment."""
    return lambda changes: set_engine_env(monkeypatch, changes)


LLAMA_SERVER_MODULES = ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def llama_server() -> Iterator[str]:
    """llama-cpp-python's ``llama_cpp.server`` (a third-party OpenAI-compatible server) on the demo model,
    in a child process for the whole test run; yields its base URL (``.../v1``). Skips without its modules."""
    import importlib.util
    import subprocess
    import sys
    import time

    import httpx

    from engine.demo import demo_model_path

    # found, not imported: the server runs in a child process (importing llama_cpp here leaks a file at exit)
    missing = [m for m in LLAMA_SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"llama_cpp.server needs {', '.join(missing)}")
    port = _free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(demo_model_path()), "--port", str(port)]
    p = subprocess.Popen([*cmd, "--n_ctx", "256"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert p.poll() is None and time.monotonic() < deadline, "llama_cpp.server did not start"
            time.sleep(0.1)
        yield url
    finally:
        p.terminate()
        p.wait(30)


@pytest.fixture
def silent_server() -> Iterator[str]:
    """An endpoint that lists a model, then answers a completion with stream headers and nothing more (a
    server busy on a long prompt) until the test ends."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.flush()
            release.wait(60)

        def log_message(self, *_a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    release.set()
    server.shutdown()
    server.server_close()


# -- markers by file: the everyday loop (-m "not slow") and the masked re-run (-m cpu_paths) ----------
# slow: seconds to minutes each — device calibration, the llama.cpp parity matrix and the prompt
# accuracy matrix (tests/triton marks itself: the Triton kernels in the interpreter).
SLOW_FILES = {"test_calibrate.py", "test_parity_llama.py", "test_prompt_accuracy.py"}
# cpu_paths: kernels and prompt paths whose code depends on the processor (VNNI dot steps, the bf16
# units, oneDNN's ISA). tests/suite.sh runs them again with SHARPI_NO_VNNI=1 SHARPI_BF16=0
# ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, so both paths are tested on whichever processor runs CI.
CPU_PATH_FILES = {
    "test_kernels.py",
    "test_kernels_q8.py",
    "test_kernels_moe.py",
    "test_grouped_prefill.py",
    "test_bf16_prefill.py",
    "test_host_decode.py",
    "test_engine_cpu.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if name in CPU_PATH_FILES:
            item.add_marker(pytest.mark.cpu_paths)
