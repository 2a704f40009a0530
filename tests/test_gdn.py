"""Gated DeltaNet hybrids (qwen35moe, qwen35, qwen3next) on the CPU: the layer against its float64
step-by-step reference, prefill against decode, the recurrent state's rules, multi-turn reuse, and device
placements' pricing of the state. Logits against llama.cpp: tests/test_parity_llama.py; every placement equal to
the CPU path: tests/test_runtime.py and tests/test_graph_decode.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine import config
from engine.api import LoadOptions, Session
from engine.errors import MetadataError, UsageError
from engine.generate import SamplingParams
from engine.gguf import open_gguf
from engine.models import build_model
from engine.models.args import hybrid_fields
from engine.models.blocks import GatedDeltaNet
from engine.models.layers import delta_net_reference, gated_delta_chunked, gated_delta_rule, l2_norm, rms_norm
from engine.models.ops import TorchOps
from engine.plan import DeviceProfile, PlanRequest, device_bytes, kv_layer_bytes
from engine.plan.sizing import layer_cache_bytes
from engine.synth.writer import write_model

ARCHS = ["qwen35moe", "qwen35", "qwen3next"]
GROUPING = {"qwen35moe": "tile", "qwen35": "tile", "qwen3next": "interleave"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gdn")
    return {a: write_model(d / f"{a}.gguf", a, seed=11).path for a in ARCHS}


def _f(gf, name):
    t = gf.tensor(name)
    return np.asarray(t.data, dtype=np.float64).reshape(t.shape)


def _reference_params(gf, i: int, arch: str, a) -> dict:
    """Layer i's weights as delta_net_reference takes them, read from the file (the fused Qwen3-Next
    projections split here group by group, independently of the layer's own reordering)."""
    Hk, dk, Hv = a.ssm_n_group, a.ssm_d_state, a.ssm_dt_rank
    dv, r = a.ssm_d_inner // Hv, a.ssm_dt_rank // a.ssm_n_group
    p = f"blk.{i}."
    if arch == "qwen3next":
        w_in, w_ba = _f(gf, p + "ssm_in.weight"), _f(gf, p + "ssm_ba.weight")
        q, k, v, z, b, al = [], [], [], [], [], []
        G = 2 * dk + 2 * r * dv
        for g in range(Hk):
            rows = w_in[g * G : (g + 1) * G]
            q.append(rows[:dk])
            k.append(rows[dk : 2 * dk])
            v.append(rows[2 * dk : 2 * dk + r * dv])
            z.append(rows[2 * dk + r * dv :])
            b.append(w_ba[g * 2 * r : g * 2 * r + r])
            al.append(w_ba[g * 2 * r + r : (g + 1) * 2 * r])
        qkv, zw, bw, aw = np.concatenate(q + k + v), np.concatenate(z), np.concatenate(b), np.concatenate(al)
    else:
        qkv, zw = _f(gf, p + "attn_qkv.weight"), _f(gf, p + "attn_gate.weight")
        bw, aw = _f(gf, p + "ssm_beta.weight"), _f(gf, p + "ssm_alpha.weight")
    return dict(
        qkv=qkv,
        z=zw,
        b=bw,
        a=aw,
        conv=_f(gf, p + "ssm_conv1d.weight"),
        dt_bias=_f(gf, p + "ssm_dt.bias"),
        A=_f(gf, p + "ssm_a"),
        norm=_f(gf, p + "ssm_norm.weight"),
        out=_f(gf, p + "ssm_out.weight"),
        Hk=Hk,
        dk=dk,
        Hv=Hv,
        dv=dv,
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_equals_step_by_step_reference(files, arch):
    """The GDN layer on TorchOps, fed in two steps (its conv and delta-rule states carried in the cache),
    equals the float64 token-by-token reference: outputs and both states."""
    with open_gguf(files[arch]) as gf:
        m = build_model(gf)
        a = m.args
        i = a.recurrent.index(True)
        dn = m.layers[i].attn
        assert isinstance(dn, GatedDeltaNet) and dn.grouping == GROUPING[arch]
        rng = np.random.default_rng(0)
        x = rms_norm(torch.from_numpy(rng.standard_normal((12, a.n_embd), dtype=np.float32)), None, a.rms_eps)
        cache = m.new_cache(64)
        with torch.inference_mode():
            y = torch.cat([dn.step(TorchOps(s, cache, None, None), x[s:e]) for s, e in ((0, 5), (5, 12))]).numpy()
        st = cache.recurrent[i]
        p = _reference_params(gf, i, arch, a)
        conv0 = np.zeros((a.ssm_d_conv - 1, a.conv_dim))
        S0 = np.zeros((a.ssm_dt_rank, a.head_v_dim, a.ssm_d_state))
        ref, conv, S = delta_net_reference(p, x.numpy(), conv0, S0, a.rms_eps, GROUPING[arch])
    assert np.abs(y - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), np.abs(y - ref).max()
    assert np.abs(st.conv.numpy() - conv).max() <= 1e-6
    assert np.abs(st.ssm.numpy() - S).max() <= 1e-5 * max(1.0, np.abs(S).max())


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 150])
def test_chunked_delta_rule_equals_recurrence(T):
    """The chunked form (prompts) against the token-by-token recurrence (decode) from a nonzero state, with
    strong and weak decays, partial last chunks included."""
    g = torch.Generator().manual_seed(T)
    H, dk, dv = 3, 16, 24
    q, k = (l2_norm(torch.randn(T, H, dk, generator=g), 1e-6) for _ in range(2))
    v = torch.randn(T, H, dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * torch.tensor([0.01, 1.0, 5.0])
    beta = torch.rand(T, H, generator=g)
    S = torch.randn(H, dv, dk, generator=g)
    o1, S1 = gated_delta_rule(q, k, v, decay, beta, S)
    o2, S2 = gated_delta_chunked(q, k, v, decay, beta, S)
    assert (o1 - o2).abs().max() <= 1e-5 and (S1 - S2).abs().max() <= 1e-5


def _logits(m, tokens, chunks, n_ctx=128):
    cache = m.new_cache(n_ctx)
    out, pos = [], 0
    for n in chunks:
        out.append(m.forward(tokens[pos : pos + n], pos, cache).numpy())
        pos += n
    return np.concatenate(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_equals_decode(files, arch):
    """A prompt in one pass (chunked delta rule over 2+ chunks), token by token (the recurrence) and in
    uneven pieces (states carried between passes) give the same logits."""
    tokens = list(np.random.default_rng(1).integers(8, 1024, 100))
    with open_gguf(files[arch]) as gf:
        m = build_model(gf)
        whole = _logits(m, tokens, [100])
        decode = _logits(m, tokens, [1] * 100)
        chunked = _logits(m, tokens, [7, 70, 1, 22])
    assert np.abs(whole - decode).max() <= 1e-4, np.abs(whole - decode).max()
    assert np.abs(whole - chunked).max() <= 1e-4, np.abs(whole - chunked).max()


def test_state_is_per_gdn_layer_and_fixed_size(files):
    with open_gguf(files["qwen35moe"]) as gf:
        m = build_model(gf)
        a = m.args
        small, large = m.new_cache(64), m.new_cache(1024)
    gdn = [i for i in range(a.n_layer) if a.recurrent[i]]
    assert gdn and sorted(small.recurrent) == gdn and sorted(small.k) == a.attention_layers
    per_state = sum(s.nbytes for s in small.recurrent.values())
    assert per_state == sum(s.nbytes for s in large.recurrent.values())
    one = small.recurrent[gdn[0]]
    assert tuple(one.conv.shape) == (a.ssm_d_conv - 1, a.conv_dim)
    assert tuple(one.ssm.shape) == (a.ssm_dt_rank, a.head_v_dim, a.ssm_d_state)


def test_state_restarts_at_zero_and_never_steps_back(files):
    tokens = list(np.random.default_rng(2).integers(8, 1024, 12))
    with open_gguf(files["qwen35moe"]) as gf:
        m = build_model(gf)
        cache = m.new_cache(64)
        first = m.forward(tokens, 0, cache).numpy()
        with pytest.raises(UsageError, match="cannot continue at 5"):
            m.forward(tokens[5:], 5, cache)
        again = m.forward(tokens, 0, cache).numpy()  # position 0: the states restart
    assert np.array_equal(first, again)
    assert cache.reusable_prefix(12, 12) == 12 and cache.reusable_prefix(5, 12) == 0


def test_follow_up_turn_processes_only_new_tokens(files):
    with Session.load(str(files["qwen35moe"]), LoadOptions(n_ctx=256)) as s:
        calls = []
        forward = s.model.forward
        s.model.forward = lambda t, start, cache, all_logits=True: (
            calls.append((start, len(t))) or forward(t, start, cache, all_logits)
        )
        p1 = s.tokenize("hello world")
        ids = [e.token_id for e in s.generate(prompt_ids=p1, params=SamplingParams.greedy(max_tokens=5))]
        calls.clear()
        p2 = p1 + ids + s.tokenize(" and more")
        follow = [e.token_id for e in s.generate(prompt_ids=p2, params=SamplingParams.greedy(max_tokens=3))]
        assert calls[0] == (len(p1) + len(ids) - 1, len(p2) - (len(p1) + len(ids) - 1))
        # an edited history cannot reuse the state: the prompt is processed from position 0
        calls.clear()
        list(s.generate(prompt_ids=p1[:-1] + [p1[-1] + 1], params=SamplingParams.greedy(max_tokens=1)))
        assert calls[0] == (0, len(p1))
    with Session.load(str(files["qwen35moe"]), LoadOptions(n_ctx=256)) as fresh:
        assert follow == [e.token_id for e in fresh.generate(prompt_ids=p2, params=SamplingParams.greedy(max_tokens=3))]


def test_planner_places_gdn_layers_and_prices_their_fixed_state(files):
    """Every placement is open to the hybrids (placements equal the CPU path: tests/test_runtime.py,
    tests/test_graph_decode.py). A device layer's cache is its K/V (attention) or its recurrent state, priced
    at the state's real size, which does not grow with the context; the applied cache allocates exactly that."""
    with Session.load(str(files["qwen35moe"]), LoadOptions(n_ctx=128, device="cpu")) as s:
        a, spec = s.args, s.spec
        gdn = [i for i in range(a.n_layer) if a.recurrent[i]]
        assert [spec.layers[i].state_bytes for i in gdn] == [s.model.new_cache(8).recurrent[i].nbytes for i in gdn]
        assert all(spec.layers[i].has_kv for i in a.attention_layers)
        small = device_bytes(spec, n_gpu_layers=a.n_layer, ctx=64, kv_type="f32")
        large = device_bytes(spec, n_gpu_layers=a.n_layer, ctx=1024, kv_type="f32")
        per_pos = kv_layer_bytes("f32", spec.kv_dim, 1)  # one position's K and V in one attention layer
        assert large.kv - small.kv == (1024 - 64) * per_pos * len(a.attention_layers)
        assert small.kv == sum(spec.layers[i].state_bytes for i in gdn) + 64 * per_pos * len(a.attention_layers)
        auto = s.plan(PlanRequest(ctx=64, n_gpu_layers=-1), DeviceProfile(vram_bytes=1 << 30))
        assert auto.n_gpu_layers == a.n_layer, auto.layer_reason
        split = s.plan(PlanRequest(ctx=64, n_gpu_layers=2, kv_type="f32"), DeviceProfile(vram_bytes=1 << 30))
        assert split.device.kv == sum(layer_cache_bytes(spec, i, "f32", 64) for i in range(2))
        s.apply(split)
        c = s.applied.cache
        on_device = sum(c.k[i].nbytes + c.v[i].nbytes for i in c.k if i < 2) + sum(
            st.nbytes for i, st in c.recurrent.items() if i < 2
        )
        assert s.applied.arena.by_kind["kv"] == on_device == split.device.kv
        # a checkpoint of states on the device: regenerate restores it in place and gives the same reply
        greedy = SamplingParams.greedy(max_tokens=3)
        p1 = s.tokenize("still here")
        first = [e.token_id for e in s.generate(prompt_ids=p1, params=greedy)]
        p2 = p1 + first + s.tokenize(" more")
        reply = [e.token_id for e in s.generate(prompt_ids=p2, params=greedy)]
        events = list(s.generate(prompt_ids=p2, params=greedy))
        assert events[-1].n_prompt == len(p2) - (len(p1) + 2) and [e.token_id for e in events] == reply


class _Meta:
    """Just the metadata of a file, for hybrid_fields."""

    path = "meta.gguf"

    def __init__(self, **kv):
        self.kv = {f"qwen35moe.{k}": v for k, v in kv.items()}

    def get(self, key, default=None):
        return self.kv.get(key, default)


def test_layer_kinds_follow_llama_cpp_keys():
    """The recurrent_layers array wins over full_attention_interval (default 4); MTP blocks are not trunk."""
    base = {
        "ssm.conv_kernel": 4,
        "ssm.inner_size": 128,
        "ssm.state_size": 32,
        "ssm.time_step_rank": 4,
        "ssm.group_count": 2,
        "block_count": 9,
        "rope.dimension_count": 64,
        "rope.dimension_sections": [11, 11, 10, 0],
    }
    h = hybrid_fields(_Meta(**base), "qwen35moe", sections=True)
    assert h["n_layer"] == 9 and h["recurrent"] == (True, True, True, False) * 2 + (True,)
    h = hybrid_fields(_Meta(**base, nextn_predict_layers=1, full_attention_interval=2), "qwen35moe", sections=True)
    assert h["n_layer"] == 8 and h["n_layer_nextn"] == 1 and h["recurrent"] == (True, False) * 4
    flags = [1, 0, 0, 1, 1, 1, 0, 1, 0]
    h = hybrid_fields(_Meta(**base, **{"attention.recurrent_layers": flags}), "qwen35moe", sections=True)
    assert h["recurrent"] == tuple(bool(f) for f in flags)
    with pytest.raises(MetadataError, match="non-text position"):
        hybrid_fields(_Meta(**{**base, "rope.dimension_sections": [4, 4, 4, 20]}), "qwen35moe", sections=True)


def _turn(s: Session, messages: list[dict], n: int = 4) -> tuple[str, int, int]:
    """One reply as the app asks for it (fit_messages, then generate(messages=...), greedy): (text, prompt
    tokens processed, the positions the cache held before)."""
    held = len(s.state.tokens)
    msgs, _ = s.fit_messages(messages, n)
    events = list(s.generate(messages=msgs, params=SamplingParams.greedy(max_tokens=n)))
    return "".join(e.text for e in events), events[-1].n_prompt, held


def test_chat_turns_regenerate_and_edit_process_only_the_new_tokens(files):
    """A scripted 5-turn chat through the session's chat API: each turn processes only its new tokens;
    regenerate of the last turn restores the checkpoint of the previous turn's end and processes only the last
    user message, giving the same reply; an edited last message the same, with a fresh session's reply."""
    users = ["hello there", "tell me more", "and then?", "why so", "last one"]
    with Session.load(str(files["qwen35moe"]), LoadOptions(n_ctx=512)) as s:
        assert s.state.checkpoint_limit == s.engine_options.state_checkpoints > 0
        messages, ends = [], []
        for k, u in enumerate(users):
            messages.append({"role": "user", "content": u})
            ids = s.chat_ids(messages)
            # the replies so far re-render to the tokens generated (a random model's replies are chosen so)
            assert ids[: len(s.state.tokens)] == s.state.tokens, k
            text, n_prompt, held = _turn(s, messages)
            assert held == (ends[-1] if ends else 0)
            assert n_prompt == len(ids) - held, (k, n_prompt, len(ids), held)  # only the new tokens
            ends.append(len(s.state.tokens))
            messages.append({"role": "assistant", "content": text})
        assert sorted(s.state.checkpoints) == ends[-s.state.checkpoint_limit :]
        last = messages.pop()  # regenerate: the last reply dropped, the same messages again
        ids = s.chat_ids(messages)
        again, n_prompt, _ = _turn(s, messages)
        assert n_prompt == len(ids) - ends[-2]  # from the end of the turn before
        processed = s.detokenize(ids[ends[-2] :])  # the previous reply's unfed last token, then the last message
        assert users[-1] in processed and users[-2] not in processed, processed
        assert again == last["content"]
        messages[-1] = {"role": "user", "content": "an edited question"}  # edit and resend
        ids = s.chat_ids(messages)
        edited, n_prompt, _ = _turn(s, messages)
        assert n_prompt == len(ids) - ends[-2]
    with Session.load(str(files["qwen35moe"]), LoadOptions(n_ctx=512)) as fresh:
        text, n_prompt, _ = _turn(fresh, messages)
        assert n_prompt == len(ids) and text == edited  # the restored state gives the fresh session's reply


def test_checkpoints_are_bounded_and_cut_where_the_history_branches(files):
    """At most ``state_checkpoints`` snapshots (the newest); a branch before the oldest restarts from position 0;
    0 keeps none (regenerate then processes the whole prompt)."""
    tokens = list(np.random.default_rng(3).integers(8, 1024, 40))
    engine = replace(config.current(), state_checkpoints=2)
    with Session.load(str(files["qwen35"]), LoadOptions(n_ctx=256, engine=engine)) as s:
        greedy = SamplingParams.greedy(max_tokens=1)
        for n in (10, 20, 30, 40):
            list(s.generate(prompt_ids=tokens[:n], params=greedy))
        assert sorted(s.state.checkpoints) == [30, 40]
        ev = list(s.generate(prompt_ids=tokens[:35] + [7], params=greedy))[-1]
        assert ev.n_prompt == 6 and sorted(s.state.checkpoints) == [30, 36]  # from 30; 40 was past the branch
        ev = list(s.generate(prompt_ids=tokens[:12] + [7], params=greedy))[-1]
        assert ev.n_prompt == 13  # before every checkpoint: from the first token
    with Session.load(str(files["qwen35"]), LoadOptions(n_ctx=256, engine=replace(engine, state_checkpoints=0))) as s:
        list(s.generate(prompt_ids=tokens[:20], params=SamplingParams.greedy(max_tokens=1)))
        ev = list(s.generate(prompt_ids=tokens[:19] + [7], params=SamplingParams.greedy(max_tokens=1)))[-1]
        assert not s.state.checkpoints and ev.n_prompt == 20


@pytest.mark.parametrize("arch", ARCHS)
def test_a_verify_pass_rolls_the_state_back_to_the_last_accepted_token(files, arch):
    """Speculative decoding's verify pass (several drafted tokens in one step, ``KVCache.keep_steps``) gives the
    plain pass's logits, and ``KVCache.rollback`` returns the recurrent states to any position of it: the
    continuation from there equals the tokens processed without the rejected drafts."""
    tokens = list(np.random.default_rng(4).integers(8, 1024, 30))
    with open_gguf(files[arch]) as gf:
        m = build_model(gf)
        ref = _logits(m, tokens, [30])
        for accepted in (0, 2, 4):
            cache = m.new_cache(128)
            m.forward(tokens[:20], 0, cache)
            cache.keep_steps = True
            drafts = tokens[20 : 20 + accepted] + [7] * (4 - accepted)  # the rejected drafts: token 7
            verify = m.forward(drafts, 20, cache).numpy()
            cache.keep_steps = False
            assert np.abs(verify[:accepted] - ref[20 : 20 + accepted]).max(initial=0) <= 1e-4
            cache.rollback(20 + accepted)
            rest = m.forward(tokens[20 + accepted :], 20 + accepted, cache).numpy()
            assert np.abs(rest - ref[20 + accepted :]).max() <= 1e-4, (
                accepted,
                np.abs(rest - ref[20 + accepted :]).max(),
            )
            with pytest.raises(UsageError, match="kept no states"):
                cache.rollback(25)
