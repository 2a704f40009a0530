"""MTP self-speculative decoding (issue #25): the NextN head against its float64 reference, greedy output identical
with MTP on and off, the verify pass's grouped experts bit-identical to the per-token kernel, the recurrent state
rolled back to the last accepted token, acceptance counted, speculative sampling keeping the distribution."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import ops
from engine.api import LoadOptions, Session
from engine.config import EngineOptions
from engine.generate import SamplingParams
from engine.generate.sampling import Sampler
from engine.generate.speculative import Speculator, accept_sampled, speculate
from engine.gguf import open_gguf
from engine.models import build_model
from engine.models.mtp import MTPHead, mtp_reference
from engine.synth.writer import write_model

N_CTX = 256
REAL_DRAFT = Speculator.draft


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    out = {a: write_model(d / f"{a}.gguf", a, seed=5, nextn=1).path for a in ("qwen35moe", "qwen35", "qwen3next")}
    out["qwen35moe-Q8_0"] = write_model(d / "q8.gguf", "qwen35moe", seed=6, nextn=1, weight_type="Q8_0").path
    return out


def _session(path, k: int) -> Session:
    return Session.load(str(path), LoadOptions(n_ctx=N_CTX, engine=replace(EngineOptions(), mtp=k)))


def _prompt(seed: int, n: int = 18) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(8, 1000, n)]


def _reply(s: Session, ids: list[int], n: int, params: SamplingParams | None = None):
    evs = list(s.generate(prompt_ids=ids, params=params or SamplingParams.greedy(max_tokens=n)))
    return [e.token_id for e in evs if e.token_id is not None], evs[-1]


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen35", "qwen3next"])
def test_head_equals_float64_reference(files, arch):
    """The MTP head (enorm/hnorm, eh_proj, gated attention with its own K/V, the FFN, shared_head_norm, the head)
    over two passes equals the float64 step-by-step form."""
    with open_gguf(files[arch]) as gf:
        m = build_model(gf)
        head = MTPHead(m)
        rng = np.random.default_rng(0)
        h = rng.standard_normal((7, m.args.n_embd)).astype(np.float32)
        toks = rng.integers(0, 1000, 7)
        cache = head.new_cache(64)
        l1, h1 = head.forward(torch.from_numpy(h[:5]), toks[:5], 0, cache)
        l2, h2 = head.forward(torch.from_numpy(h[5:]), toks[5:], 5, cache)
        r1, rh1, kv = mtp_reference(gf, m.args, h[:5].astype(np.float64), toks[:5], 0)
        r2, rh2, _ = mtp_reference(gf, m.args, h[5:].astype(np.float64), toks[5:], 5, kv)
        for ours, ref in ((l1, r1), (l2, r2), (h1, rh1), (h2, rh2)):
            assert np.abs(ours.numpy() - ref).max() <= 1e-4


def test_model_without_head_runs_plain(tmp_path):
    path = write_model(tmp_path / "plain.gguf", "qwen35moe", seed=5).path
    with _session(path, 2) as s:
        assert not s.has_mtp and s.mtp == 0
        _, last = _reply(s, _prompt(1), 6)
        assert last.mtp_passes == 0 and last.mtp_acceptance is None


@pytest.mark.parametrize("name", ["qwen35moe", "qwen35moe-Q8_0", "qwen35"])
def test_greedy_output_identical_with_mtp_on_and_off(files, name):
    """Two turns (the second continues the first's cache): the same tokens with 0, 1, 2 and 3 drafts per step,
    and the second turn processes only its new tokens."""
    outs = {}
    for k in (0, 1, 2, 3):
        with _session(files[name], k) as s:
            a, ev_a = _reply(s, _prompt(1), 20)
            b, ev_b = _reply(s, s.state.tokens + [a[-1]] + _prompt(2, 6), 14)
            assert ev_b.n_prompt == 7  # the last reply token and the new ones
            if k:
                assert ev_a.mtp_passes > 0 and ev_a.mtp_drafted > 0
            outs[k] = (a, b)
    assert all(outs[k] == outs[0] for k in outs), outs


def _oracle(reference: list[int], prompt_len: int, wrong_after: int, calls: list):
    """A scripted drafter for Speculator.draft: the true continuation for its first ``wrong_after`` drafts of a
    step, then a token that is not; every proposal is recorded in ``calls``."""

    def draft(self, tokens, k, sampler=None, history=None):
        REAL_DRAFT(self, tokens, k, sampler, history)  # the head still catches up on its rows
        n = len(tokens) - prompt_len  # reply tokens so far, the last one not yet in the cache
        out = []
        for j in range(k):
            true = reference[n + j] if n + j < len(reference) else 0
            out.append(true if j < wrong_after else (true + 1) % 1000)
        calls.append((n, out))
        return out, [None] * k

    return draft


@pytest.fixture
def scripted(monkeypatch):
    def install(draft):
        monkeypatch.setattr(Speculator, "draft", draft)

    return install


@pytest.mark.parametrize("wrong_after", [0, 1, 2, 3])
def test_scripted_drafts_counted_and_output_unchanged(files, scripted, wrong_after):
    """Drafts right for the first ``wrong_after`` of 3 each step: the reply is the plain one, and passes, drafted and
    accepted equal what the script proposed and the reference accepts (the longest agreeing prefix)."""
    prompt = _prompt(3)
    with _session(files["qwen35moe"], 0) as s:
        ref, _ = _reply(s, prompt, 24)
    calls: list = []
    scripted(_oracle(ref, len(prompt), wrong_after, calls))
    with _session(files["qwen35moe"], 3) as s:
        out, last = _reply(s, prompt, 24)
    assert out == ref
    accepted = 0
    for n, drafts in calls:
        for j, d in enumerate(drafts):
            if n + j >= len(ref) or d != ref[n + j]:
                break
            accepted += 1
    assert last.mtp_passes == len(calls) and last.mtp_drafted == sum(len(d) for _, d in calls)
    assert last.mtp_accepted == accepted
    assert accepted == sum(min(wrong_after, len(d)) for _, d in calls)
    # every pass gives its accepted drafts and one more token, which makes the reply's 23 tokens after the first
    # but for the last token where no draft fits before max_tokens (a plain one-token step)
    assert len(ref) - 1 - (last.mtp_accepted + last.mtp_passes) in (0, 1)


def test_stopping_inside_accepted_drafts_rolls_the_cache_back(files, scripted):
    """A reply closed after the first of several accepted drafts: the cache's recurrent states are rolled back to
    the tokens it recorded, and the next turn continues as a plain session would."""
    prompt = _prompt(4)
    with _session(files["qwen35moe"], 0) as s:
        ref, _ = _reply(s, prompt, 12)
        follow = _prompt(5, 5)
        plain, _ = _reply(s, s.state.tokens + [ref[-1]] + follow, 6)
    scripted(_oracle(ref, len(prompt), 3, []))
    with _session(files["qwen35moe"], 3) as s:
        gen = s.generate(prompt_ids=prompt, params=SamplingParams.greedy(max_tokens=12))
        got = []
        for ev in gen:
            got.append(ev.token_id)
            if len(got) == 3:  # the first token, then an accepted draft of the first verify pass
                break
        gen.close()
        assert got == ref[:3]
        assert s.cache.state_pos == len(s.state.tokens) == len(prompt) + 2
        # the next turn: the 12-token reply as the plain session had it, then the follow-up
        again, _ = _reply(s, prompt + ref[:11], 1)
        assert again == ref[11:12]
        more, _ = _reply(s, s.state.tokens + [again[0]] + follow, 6)
    assert more == plain


@pytest.mark.parametrize("name", ["qwen35moe", "qwen35moe-Q8_0"])
def test_verify_pass_experts_bit_identical_to_per_token(files, monkeypatch, name):
    """The verify pass runs the routed experts of its k+1 positions grouped by expert; each position's result is the
    one-token kernel's bit for bit (the quantized types of the fused grouped kernels)."""
    calls = []
    real = ops.moe_ffn

    def spy(gate, up, down, X, ids, weights, **kw):
        y = real(gate, up, down, X, ids, weights, **kw)
        if X.shape[0] > 1:
            calls.append((gate, up, down, X.copy(), ids.copy(), weights.copy(), kw, y.copy()))
        return y

    with _session(files[name], 3) as s:
        list(s.generate(prompt_ids=_prompt(6), params=SamplingParams.greedy(max_tokens=2)))  # prefill first
        monkeypatch.setattr(ops, "moe_ffn", spy)
        _reply(s, s.state.tokens + _prompt(7, 1), 6)
        verify = [c for c in calls if c[3].shape[0] == 4]
        assert verify, [c[3].shape for c in calls]
        for gate, up, down, X, ids, weights, kw, y in verify:  # while the session's weights are mapped
            for t in range(X.shape[0]):
                one = real(gate, up, down, X[t : t + 1], ids[t : t + 1], weights[t : t + 1], **kw)
                if name.endswith("Q8_0"):
                    assert np.array_equal(one, y[t : t + 1])
                else:  # F32 experts take the grouped gather GEMVs (engine.kernels.grouped): equal to rounding
                    assert np.abs(one - y[t : t + 1]).max() <= 1e-5


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_rollback_equals_a_fresh_run_to_the_accepted_position(files, scripted, accepted):
    """After a verify pass of 3 drafts of which ``accepted`` are right, every GDN layer's conv and recurrent state
    equals a fresh run over the prompt and the accepted tokens, and the next logits equal that run's."""
    prompt = _prompt(8)
    with open_gguf(files["qwen35moe"]) as gf:
        m = build_model(gf)
        cache = m.new_cache(N_CTX)
        m.keep_hidden = True
        logits = m.forward(prompt, 0, cache, all_logits=False)
        tok = int(np.argmax(logits[-1].numpy()))
        hidden = m.last_hidden
        ref_cache = m.new_cache(N_CTX)
        ref = [tok]
        m.forward(prompt, 0, ref_cache, all_logits=False)
        for _ in range(4):
            ref.append(int(np.argmax(m.forward([ref[-1]], len(prompt) + len(ref) - 1, ref_cache)[-1].numpy())))
        spec = Speculator(MTPHead(m), 3, N_CTX)
        spec.observe(0, hidden)
        calls: list = []
        scripted(_oracle(ref, len(prompt), accepted, calls))
        history = prompt + [tok]
        got, nxt, row = speculate(m, cache, spec, tok, len(prompt), 3, Sampler(SamplingParams.greedy()), history)
        assert got == ref[1 : 1 + accepted] and nxt == ref[1 + accepted]
        n = len(prompt) + 1 + accepted
        assert cache.state_pos == n and spec.end == n
        fresh = m.new_cache(N_CTX)
        fresh_logits = m.forward((prompt + ref)[:n], 0, fresh, all_logits=False)
        for i in cache.recurrent:
            a, b = cache.recurrent[i], fresh.recurrent[i]
            assert torch.allclose(a.conv, b.conv, atol=1e-5) and torch.allclose(a.ssm, b.ssm, atol=1e-5), i
        assert np.abs(row[-1].numpy() - fresh_logits[-1].numpy()).max() <= 1e-4


def test_sampled_speculation_keeps_the_distribution():
    """accept_sampled: drafts drawn from q, accepted or redrawn against p, give tokens distributed as p."""
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    q = np.array([0.1, 0.4, 0.1, 0.1, 0.1, 0.2])
    n = 40000
    counts = np.zeros(len(p))
    for _ in range(n):
        d = int(rng.choice(len(q), p=q))
        _, t = accept_sampled(p, q, d, rng)
        counts[t] += 1
    assert np.abs(counts / n - p).max() < 0.01 and counts[-1] == 0


def test_sampled_reply_runs_with_mtp(files):
    """A sampled reply drafts from the sampler's distribution and stays within the vocabulary and its length."""
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=3, max_tokens=16)
    with _session(files["qwen35moe"], 2) as s:
        out, last = _reply(s, _prompt(9), 16, params)
    assert len(out) == 16 and all(0 <= t < 1024 for t in out)
    assert last.mtp_passes > 0 and 0 <= last.mtp_accepted <= last.mtp_drafted


def test_sampler_distribution_matches_its_draws():
    """Sampler.distribution is what Sampler draws from (top-k / top-p / min-p / temperature)."""
    logits = np.random.default_rng(1).standard_normal(50).astype(np.float32) * 2
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, min_p=0.05, seed=1, max_tokens=1)
    s = Sampler(params)
    p = s.distribution(logits)
    counts = np.bincount([s(logits) for _ in range(20000)], minlength=50) / 20000
    assert abs(p.sum() - 1) < 1e-12 and np.abs(counts - p).max() < 0.015
    assert (p[counts == 0] < 0.002).all()


@pytest.mark.parametrize("n_gpu_layers", [-1, 2])
def test_placements_with_mtp_equal_the_plain_reply(files, n_gpu_layers):
    """On the simulated device (the whole trunk, or a split): the MTP head runs on the host beside the placed trunk,
    and the greedy reply is the one without MTP."""
    from engine.plan import DeviceProfile, PlanRequest

    out = {}
    for k in (0, 2):
        opts = LoadOptions(n_ctx=N_CTX, device="cpu", engine=replace(EngineOptions(), mtp=k))
        with Session.load(str(files["qwen35moe"]), opts) as s:
            plan = s.plan(PlanRequest(ctx=N_CTX, n_gpu_layers=n_gpu_layers), DeviceProfile(vram_bytes=1 << 30))
            s.apply(plan)
            out[k], last = _reply(s, _prompt(10), 12)
            assert (last.mtp_passes > 0) == (k > 0)
    assert out[2] == out[0]


def test_cli_synth_writes_the_head_and_run_reports_acceptance(tmp_path, capsys):
    """``sharpi synth --nextn 1`` writes an MTP block (and the other glm4moe/gpt-oss geometry flags reach the writer);
    ``sharpi run --mtp 2`` reports its drafts; ``--mtp -1`` is refused."""
    from engine.cli.main import main

    path = str(tmp_path / "cli.gguf")
    assert main(["synth", "--arch", "qwen35moe", "--nextn", "1", "-o", path]) == 0
    with open_gguf(path) as gf:
        assert (
            gf.get("qwen35moe.nextn_predict_layers") == 1 and "blk.4.nextn.eh_proj.weight" in gf.tensors
        )  # after the 4 trunk layers
    capsys.readouterr()
    assert main(["run", "-m", path, "-p", "hello", "-n", "8", "--temp", "0", "--mtp", "2"]) == 0
    err = capsys.readouterr().err
    assert "[mtp] " in err and "drafts accepted" in err
    assert main(["run", "-m", path, "-p", "hello", "-n", "4", "--mtp", "-1"]) != 0
    assert "mtp" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["run", "bench", "serve"])
def test_mtp_flag_on_run_bench_and_serve(cmd):
    from engine.cli.main import build_parser

    extra = ["-p", "x"] if cmd == "run" else []
    assert build_parser().parse_args([cmd, *extra, "--mtp", "3"]).mtp == 3
    assert build_parser().parse_args([cmd, *extra]).mtp is None  # unset: SHARPI_MTP or auto


def test_bench_reports_acceptance_and_the_verify_cost(files):
    """bench_session with MTP: the reply's drafts and acceptance, and one verify pass, one decode step, one draft
    step and the routed experts of K+1 positions timed."""
    from engine.bench.model import bench_session

    with _session(files["qwen35moe"], 2) as s:
        r = bench_session(s, 8, 6, 1, threads=1, bandwidth=False)
    m = r["mtp"]
    assert m["k"] == 2 and 0 < m["passes"] <= m["drafted"] <= 2 * m["passes"]
    assert 0 <= m["accepted"] <= m["drafted"] and m["acceptance"] == m["accepted"] / m["drafted"]
    assert min(m["step_ms"], m["verify_ms"], m["draft_ms"], m["experts_step_ms"], m["experts_verify_ms"]) > 0
    assert m["verify_vs_step"] == pytest.approx(m["verify_ms"] / m["step_ms"])
    with _session(files["qwen35moe"], 0) as s:
        assert bench_session(s, 8, 6, 1, threads=1, bandwidth=False)["mtp"] is None


def test_draft_judge_keeps_drafting_that_pays_and_stops_drafting_that_does_not():
    """Scripted step times: a probe every ``probe_every`` speculative steps; the decision once enough of both are
    in; a judge that turned drafting off stays off and asks for plain steps only."""
    from engine.generate.speculative import DraftJudge

    def run(pass_s: float, tokens: int, plain_s: float) -> DraftJudge:
        j = DraftJudge(probe_every=4, min_passes=8, min_probes=2)
        plain_at = []
        for step in range(40):
            if j.wants_plain():
                plain_at.append(step)
                j.record_plain(plain_s)
            else:
                j.record_pass(pass_s, tokens)
        j.plain_at = plain_at
        return j

    fast = run(pass_s=6e-3, tokens=3, plain_s=4e-3)  # 2 ms a token against 4: keep drafting
    assert not fast.off and fast.plain_at == [4, 9, 14, 19, 24, 29, 34, 39] and fast.speedup == pytest.approx(2.0)
    slow = run(pass_s=6e-3, tokens=1, plain_s=4e-3)  # every draft rejected: 6 ms a token against 4
    assert slow.off and slow.plain_at[:2] == [4, 9] and slow.plain_at[2:] == list(range(10, 40))
    assert slow.spec_passes == 8 and slow.speedup == pytest.approx(4 / 6)


def test_automatic_mtp_probes_plain_steps_and_keeps_the_output(files):
    """MTP chosen automatically (``EngineOptions.mtp`` None, the CPU): the reply is the plain one token for token
    and the session's judge timed plain steps between the drafting ones; once it turned drafting off, the
    session's next conversation runs without verify passes."""
    ids = _prompt(3)
    with _session(files["qwen35moe"], 0) as s:
        plain, _ = _reply(s, ids, 48)
    s = Session.load(str(files["qwen35moe"]), LoadOptions(n_ctx=N_CTX, engine=replace(EngineOptions(), mtp=None)))
    with s:
        assert s.mtp > 0
        toks, last = _reply(s, ids, 48)
        assert toks == plain and last.mtp_passes > 0
        judge = s.draft_judge
        assert judge is not None and s.state.speculator.judge is judge
        assert judge.plain_steps >= 1 and judge.spec_passes == last.mtp_passes
        judge.off = True  # as after slow drafting: the session's other conversations draft no more
        before = judge.spec_passes
        s.reset()
        more, last2 = _reply(s, ids, 8)
        assert more == plain[:8] and last2.mtp_passes == 0 and judge.spec_passes == before and s.draft_judge is judge
    with _session(files["qwen35moe"], 2) as s:
        assert s.draft_judge is None  # MTP asked for: every step drafts
