"""Routing traces (engine.routes): the .npz format's round trip and its refusals, and recording a model's routes
from every placement without changing what it computes."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from engine.api import LoadOptions, Session
from engine.cli.main import main
from engine.errors import TraceError
from engine.plan import PlanRequest
from engine.routes import RouteTrace, load_trace, save_trace

CTX = 64


def small_trace(T=5, L=3, k=2, E=6, seed=0) -> RouteTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.choice(E, k, replace=False) for _ in range(L)] for _ in range(T)]).astype(np.int32)
    w = rng.random(ids.shape, dtype=np.float32)
    phase = np.array([0] * 2 + [1] * (T - 2), np.uint8)
    return RouteTrace(ids, w, phase, {"model": "m", "n_expert": E, "k": k, "layers": list(range(L))})


def test_round_trip(tmp_path):
    t = small_trace()
    path = save_trace(t, tmp_path / "r")
    assert path.name == "r.npz"
    u = load_trace(path)
    np.testing.assert_array_equal(u.ids, t.ids)
    np.testing.assert_array_equal(u.weights, t.weights)
    np.testing.assert_array_equal(u.phase, t.phase)
    assert u.meta == t.meta and (u.n_tokens, u.n_layers, u.k, u.n_expert) == (5, 3, 2, 6)


def _write(path, **arrays):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    return path


def _good(**over):
    t = small_trace()
    a = dict(ids=t.ids, weights=t.weights, phase=t.phase, meta=np.array(json.dumps(t.meta)))
    a.update(over)
    return {k: v for k, v in a.items() if v is not None}


@pytest.mark.parametrize(
    ("arrays", "says"),
    [
        (_good(meta=None), "missing meta"),
        (_good(extra=np.zeros(2)), "unexpected extra"),
        (_good(ids=small_trace().ids.astype(np.int64)), "ids is int64, not int32"),
        (_good(weights=np.zeros((5, 3, 3), np.float32)), "must have the shape of ids"),
        (_good(phase=np.zeros(4, np.uint8)), "phase [4] must be [tokens]"),
        (_good(phase=np.full(5, 2, np.uint8)), "phase must be 0 (prompt) or 1 (decode)"),
        (_good(ids=np.full((5, 3, 2), 6, np.int32)), "expert ids must be in 0..5"),
        (_good(ids=np.zeros((5, 3, 2), np.int32)), "chose an expert twice: [0, 0]"),
        (_good(weights=np.full((5, 3, 2), np.nan, np.float32)), "weights must be finite"),
        (_good(meta=np.array("{not json")), "meta is not JSON"),
        (_good(meta=np.array(json.dumps({"n_expert": 6, "k": 3}))), "meta.k = 3 but ids has k = 2"),
        (_good(meta=np.array(json.dumps({"n_expert": "6", "k": 2}))), "meta.n_expert must be an integer"),
        (_good(meta=np.array(json.dumps({"n_expert": 6, "k": 2, "layers": [0]}))), "meta.layers must list 3"),
        (_good(meta=np.array(json.dumps({"n_expert": 6, "k": 2, "model": 3}))), "meta.model must be a string"),
        (_good(meta=np.array([1, 2])), "meta must be one JSON string"),
        (_good(ids=np.zeros((0, 3, 2), np.int32)), "with none empty"),
    ],
)
def test_hostile_files_are_refused_with_a_reason(tmp_path, arrays, says):
    path = _write(tmp_path / "bad.npz", **arrays)
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert says in str(e.value) and str(path) in str(e.value)


def test_files_that_are_not_traces(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "missing.npz")
    (tmp_path / "text.npz").write_text("hello")
    with pytest.raises(TraceError, match="not a .npz routing trace"):
        load_trace(tmp_path / "text.npz")
    # a pickled object array is never unpickled
    obj = np.array([{"a": 1}], dtype=object)
    with pytest.raises(TraceError, match="ids is object"):
        load_trace(_write(tmp_path / "pickle.npz", **_good(ids=obj)))
    # a member that is not an array at all
    with zipfile.ZipFile(tmp_path / "junk.npz", "w") as z:
        for name in ("ids", "weights", "phase", "meta"):
            z.writestr(name + ".npy", b"junk")
    with pytest.raises(TraceError, match="ids.npy is not a NumPy array"):
        load_trace(tmp_path / "junk.npz")


def test_a_huge_declared_shape_is_refused_before_reading(tmp_path, monkeypatch):
    import engine.routes.trace as tr

    monkeypatch.setattr(tr, "MAX_ELEMENTS", 20)
    with pytest.raises(TraceError, match="larger than 20 elements"):
        load_trace(_write(tmp_path / "big.npz", **_good()))


@pytest.fixture(scope="module")
def model(synth_model):
    return str(synth_model("qwen3moe", "Q8_0", vocab=1024).path)


def _record(path, opts, tokens, n_decode):
    """Logits of a prompt and n_decode greedy tokens, with the routes recorded or not."""
    out = {}
    for record in (False, True):
        with Session.load(path, opts) as s:
            rec = s.record_routes() if record else None
            cache = s.model.new_cache(CTX)
            rows = [s.model.forward(tokens, 0, cache, all_logits=False)[-1].numpy()]
            for i in range(n_decode):
                t = int(np.argmax(rows[-1]))
                rows.append(s.model.forward([t], len(tokens) + i, cache).numpy()[-1])
            calls = s.stats().calls
            out[record] = (np.stack(rows), rec.trace() if rec else None, calls)
    return out


@pytest.mark.parametrize(
    "where",
    ["host", "device-cpu-experts", "device-cache"],
)
def test_recording_sees_every_route_and_changes_nothing(model, where):
    opts = {
        "host": LoadOptions(n_ctx=CTX, device="cpu"),
        "device-cpu-experts": LoadOptions(n_ctx=CTX, device="cpu", placement=PlanRequest(ctx=CTX, moe="cpu")),
        "device-cache": LoadOptions(n_ctx=CTX, device="cpu", placement=PlanRequest(ctx=CTX, moe="cache")),
    }[where]
    tokens = [1, 5, 9, 200, 7]
    out = _record(model, opts, tokens, n_decode=4)
    np.testing.assert_array_equal(out[True][0], out[False][0])  # the same logits
    t = out[True][1]
    L, E = out[True][2].shape
    assert t.ids.shape == (len(tokens) + 4, L, t.k) and t.meta["layers"] == list(range(L))
    assert t.phase.tolist() == [0] * len(tokens) + [1] * 4
    # every route the profiler counted is in the trace (and nothing else)
    counts = np.stack([np.bincount(t.ids[:, j].ravel(), minlength=E) for j in range(L)])
    np.testing.assert_array_equal(counts, out[True][2])
    np.testing.assert_array_equal(out[False][2], out[True][2])  # the same routes as an unrecorded run
    assert np.allclose(t.weights.sum(axis=2), 1, atol=1e-5) or (t.weights > 0).all()


def test_record_routes_flag(model, tmp_path):
    path = tmp_path / "routes.npz"
    assert main(["run", "-m", model, "-p", "hello there", "-n", "3", "--temp", "0", "--record-routes", str(path)]) == 0
    t = load_trace(path)
    assert t.meta["source"] == "recorded" and t.phase[-1] == 1 and (t.phase == 1).sum() >= 2
    bench = tmp_path / "bench.npz"
    args = ["bench", "-m", model, "--prompt", "4", "--gen", "2", "--repeat", "1", "--record-routes", str(bench)]
    assert main(args) == 0
    assert load_trace(bench).n_tokens >= 6
