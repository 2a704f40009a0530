"""Routing traces (engine.routes): the .npz format's round trip and its refusals, and recording a model's routes
from every placement without changing what it computes."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from engine.api import LoadOptions, Session
from engine.cli.main import main
from engine.errors import TraceError, UsageError
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


def _run(s, tokens, n_decode, forced=None):
    """Logits of a prompt and n_decode decoded tokens (greedy, or ``forced`` tokens) on a fresh session's cache
    (placed where its layers are)."""
    cache = s.cache
    rows = [s.model.forward(tokens, 0, cache, all_logits=False)[-1].numpy()]
    fed = []
    for i in range(n_decode):
        t = int(np.argmax(rows[-1])) if forced is None else forced[i]
        fed.append(t)
        rows.append(s.model.forward([t], len(tokens) + i, cache).numpy()[-1])
    return np.stack(rows), fed


@pytest.mark.parametrize("where", ["host", "device-graph-step-cache", "device-graph-step-cpu-experts"])
def test_replay_changes_routing_only(model, where, engine_env):
    """Replaying a trace recorded from the same run computes the same logits (only routing is replaced), and
    replaying another trace computes exactly the trace's experts, with their weights."""
    from engine.routes.replay import RouteReplayer

    engine_env({"SHARPI_CUDA_GRAPH": "eager"})  # on the simulated device: the decode graph's static step, uncaptured
    opts = {
        "host": LoadOptions(n_ctx=CTX, device="cpu"),
        "device-graph-step-cache": LoadOptions(n_ctx=CTX, device="cpu", placement=PlanRequest(ctx=CTX, moe="cache")),
        "device-graph-step-cpu-experts": LoadOptions(
            n_ctx=CTX, device="cpu", placement=PlanRequest(ctx=CTX, moe="cpu")
        ),
    }[where]
    tokens, n = [1, 5, 9, 200, 7], 4
    # each run on a fresh session: a warm expert cache serves hits on the device, whose arithmetic differs from
    # the CPU experts' within the parity tolerance
    with Session.load(model, opts) as s:
        if where != "host":
            assert s.model.decode_graph is not None
        rec = s.record_routes()
        want, fed = _run(s, tokens, n)
        own = rec.trace()
    with Session.load(model, opts) as s:
        s.replay_routes(own)
        same, _ = _run(s, tokens, n, forced=fed)
    # (recording ran the decode layer by layer, the replay runs the graph's step: the same within float rounding)
    np.testing.assert_allclose(same, want, rtol=1e-5, atol=1e-5)
    # another trace: the experts computed are the trace's (the profiler counts them), and the output moves
    rng = np.random.default_rng(1)
    E, k = own.n_expert, own.k
    ids = np.stack([[rng.choice(E, k, replace=False) for _ in range(own.n_layers)] for _ in range(own.n_tokens)])
    other = RouteTrace(ids.astype(np.int32), own.weights, own.phase, own.meta)
    with Session.load(model, opts) as s:
        rep = s.replay_routes(other)
        assert isinstance(rep, RouteReplayer)
        moved, _ = _run(s, tokens, n, forced=fed)
        calls = s.stats().calls
        last = np.stack([s.model.layers[i].moe.last_ids.numpy()[-1] for i in range(own.n_layers)])
        s.stop_recording_routes()
        assert s.model.route_tap is None and all(layer.moe.tap is None for layer in s.model.layers)
    counts = np.stack([np.bincount(ids[:, j].ravel(), minlength=E) for j in range(own.n_layers)])
    np.testing.assert_array_equal(calls, counts)
    np.testing.assert_array_equal(last, ids[-1])
    assert not np.allclose(moved, want, atol=1e-3)


def test_replay_refuses_a_trace_of_another_geometry(model):
    with Session.load(model, LoadOptions(n_ctx=CTX, device="cpu")) as s:
        a = s.model.args
        with pytest.raises(UsageError, match="MoE layers; this model has"):
            s.replay_routes(small_trace(L=a.n_layer + 1, k=a.n_expert_used, E=a.n_expert))
        with pytest.raises(UsageError, match="experts; this model routes"):
            s.replay_routes(small_trace(L=a.n_layer, k=a.n_expert_used + 1, E=a.n_expert))


def test_replay_routes_flag(model, tmp_path, capsys):
    path = tmp_path / "routes.npz"
    assert main(["run", "-m", model, "-p", "hi", "-n", "2", "--temp", "0", "--record-routes", str(path)]) == 0
    capsys.readouterr()
    assert main(["run", "-m", model, "-p", "hi", "-n", "2", "--temp", "0", "--replay-routes", str(path)]) == 0
    assert "routing replayed from" in capsys.readouterr().err
    args = ["bench", "-m", model, "--prompt", "4", "--gen", "2", "--repeat", "1", "--replay-routes", str(path)]
    assert main(args) == 0
    both = ["run", "-m", model, "-p", "hi", "-n", "1", "--replay-routes", str(path), "--record-routes", str(path)]
    assert main(both) == 2
    assert "one at a time" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("moe", ["resident", "cache", "cpu"])
def test_replay_inside_captured_cuda_graphs(model, moe):
    """On a real GPU the decode graph is captured with the replayed routing: every step computes the trace's
    experts (the graph's route record, counted by the profiler), and replaying the run's own routes gives its
    logits."""
    opts = LoadOptions(n_ctx=CTX, device="cuda", q8_act=False, placement=PlanRequest(ctx=CTX, moe=moe))
    tokens, n = [1, 5, 9, 200, 7], 12
    with Session.load(model, opts) as s:
        rec = s.record_routes()
        want, fed = _run(s, tokens, n)
        own = rec.trace()
    with Session.load(model, opts) as s:
        s.replay_routes(own)
        same, _ = _run(s, tokens, n, forced=fed)
        g = s.model.decode_graph
        assert g is not None and g.capture and g.steps == n
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(same - want).max() <= 1e-3 * scale
    rng = np.random.default_rng(2)
    ids = np.stack([[rng.choice(own.n_expert, own.k, replace=False) for _ in range(own.n_layers)]
                    for _ in range(own.n_tokens)])  # fmt: skip
    with Session.load(model, opts) as s:
        s.replay_routes(RouteTrace(ids.astype(np.int32), own.weights, own.phase, own.meta))
        _run(s, tokens, n, forced=fed)
        calls = s.stats().calls
    counts = np.stack([np.bincount(ids[:, j].ravel(), minlength=own.n_expert) for j in range(own.n_layers)])
    np.testing.assert_array_equal(calls, counts)


def test_serve_records_routes_until_it_stops(model, tmp_path, monkeypatch, capsys):
    """``sharpi serve --record-routes FILE``: the routes of what the server ran, written when it stops; the
    server never replays (its answers are the model's own)."""
    import time

    import engine.server

    def fake_serve(host, bind, port, options, on_listening=None):  # a server that answers one request and stops
        deadline = time.monotonic() + 120
        while host.session is None and not host.error and time.monotonic() < deadline:
            time.sleep(0.05)
        assert host.session is not None, host.error
        host.session.logits([1, 2, 3], batch=True)

    monkeypatch.setattr(engine.server, "serve", fake_serve)
    path = tmp_path / "served.npz"
    assert main(["serve", "-m", model, "--port", "0", "--record-routes", str(path)]) == 0
    t = load_trace(path)
    assert t.n_tokens == 3 and t.meta["source"] == "recorded"
    assert f"routes: {path}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "-m", model, "--replay-routes", str(path)])
