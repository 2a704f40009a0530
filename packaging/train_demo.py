"""Train SharpI's demo model: a tiny qwen3moe that answers questions from Python's documentation.

    python packaging/train_demo.py prepare          # vocabulary + token data      (~10 s)
    python packaging/train_demo.py train            # resumable, checkpoints        (~40 min, 2 cores)
    python packaging/train_demo.py export           # F32 check file + shipped Q8_0 GGUF
    python packaging/train_demo.py eval             # the 20 test questions, greedy, in torch
    python packaging/train_demo.py all              # the four in order

Everything is a function of ``--seed`` and the step count (the schedule counts steps, not
seconds; each step's batch is drawn from its own generator seeded by (seed, step), so a resumed
run continues exactly). The corpus is ``pydoc_data.topics`` of Python 3.11 (pinned: other
releases ship other text). Work files go to ``--work`` (default ``packaging/build/demo``); the
shipped model to ``resources/models/``. Data and helpers: ``packaging/demo/``.

``--arch qwen35moe`` trains the second demo instead: a Gated-DeltaNet hybrid with an MTP head
(``packaging/demo/demo_torch_gdn.py``) on the same corpus and vocabulary, one conversation per row, work
files in ``packaging/build/demo-gdn``, shipped as ``resources/models/sharpi-demo-gdn-q8_0.gguf``
(``resources/models/MODEL_CARD_GDN.md``). Its extra command:

    python packaging/train_demo.py mtp --arch qwen35moe   # MTP acceptance and decode tok/s, --mtp 0 vs 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "demo"))  # demo_corpus, demo_torch (not a package: `packaging` is taken)
sys.path.insert(1, str(ROOT))

import demo_corpus as corpus  # noqa: E402
import torch  # noqa: E402
from demo_torch import DemoConfig, DemoModel  # noqa: E402
from demo_torch_gdn import GdnConfig, GdnDemoModel  # noqa: E402

SHIPPED = ROOT / "resources" / "models" / "sharpi-demo-q8_0.gguf"
MODEL_NAME = "SharpI demo (pydoc, qwen3moe 6x8 experts)"
SHIPPED_GDN = ROOT / "resources" / "models" / "sharpi-demo-gdn-q8_0.gguf"
MODEL_NAME_GDN = "SharpI demo (pydoc, qwen35moe Gated DeltaNet 4x8 experts, MTP)"


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 1234
    steps: int = 1200  # 4096 tokens a step: ~20-40 min on one thread of a busy 2-core machine
    seq: int = 256  # tokens per row; chat samples are packed into rows, each its own segment
    chat_rows: int = 12  # rows of packed question->answer samples per step
    raw_rows: int = 4  # rows of raw documentation text per step
    raw_weight: float = 0.5  # loss weight of a raw-text token (answer tokens weigh 1)
    multi_turn: float = 0.35  # share of chat segments that are conversations of 2-3 turns
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 150
    weight_decay: float = 0.1
    aux_coef: float = 0.01  # load-balancing loss weight
    clip: float = 1.0
    checkpoint_every: int = 100


@dataclass(frozen=True)
class GdnTrainConfig:
    """``--arch qwen35moe``: one conversation per row (no packing: the recurrent state would need a reset at
    every segment), rows padded to the step's longest sample rounded up to 64 tokens (at most ``seq``)."""

    seed: int = 1234
    steps: int = 1000  # ~2 s a step on one thread of a busy 2-core machine
    seq: int = 256  # longest row; longer conversations are drawn again
    chat_rows: int = 16  # conversations per step
    raw_rows: int = 4  # rows of raw documentation text per step (as long as the step's chat rows)
    raw_weight: float = 0.5
    multi_turn: float = 0.35  # share of conversations of 2-3 turns
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    aux_coef: float = 0.01
    mtp_weight: float = 0.4  # weight of the MTP head's loss (predicting the token after next)
    clip: float = 1.0
    checkpoint_every: int = 50


# -- data ------------------------------------------------------------------------------------
def prepare(work: Path, cfg: DemoConfig) -> None:
    """Train the vocabulary on the corpus and write the token data (``vocab.json``, ``data.npz``)."""
    from engine.synth.tokenizer import train_bpe_vocab

    corpus.check_python()
    work.mkdir(parents=True, exist_ok=True)
    vocab = train_bpe_vocab(corpus.tokenizer_texts(), cfg.vocab, "qwen2")
    tok = vocab.hf_tokenizer()
    eos = vocab.eos_id

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    prompts, answers, owner = [], [], []
    groups = corpus.chat_groups()
    for gi, g in enumerate(groups):
        answers.append(enc(g.answer) + [eos])
        for q in g.questions:
            # Variants users type: as written, without the final mark, lower-case start.
            for v in dict.fromkeys([q, q.rstrip(".?!"), q[0].lower() + q[1:]]):
                p = enc(corpus.chatml(v))
                whole = enc(corpus.chatml(v) + g.answer)
                assert whole[: len(p)] == p, "prompt tokens must be a prefix of prompt+answer tokens"
                prompts.append(p)
                owner.append(gi)
    raw = []
    for text in corpus.raw_texts():
        raw += enc(text) + [vocab.bos_id]  # <|endoftext|> between topics
    np.savez(
        work / "data.npz",
        prompt_flat=np.concatenate([np.array(p, np.int32) for p in prompts]),
        prompt_len=np.array([len(p) for p in prompts], np.int32),
        prompt_owner=np.array(owner, np.int32),
        answer_flat=np.concatenate([np.array(a, np.int32) for a in answers]),
        answer_len=np.array([len(a) for a in answers], np.int32),
        raw=np.array(raw, np.int32),
    )
    (work / "vocab.json").write_text(json.dumps(asdict(vocab)))
    n_ans = sum(len(a) for a in answers)
    print(f"vocab {len(vocab)}; {len(groups)} answers ({n_ans} tokens), {len(prompts)} prompts; raw {len(raw)} tokens")


def load_vocab(work: Path):
    from engine.synth.tokenizer import Vocab

    d = json.loads((work / "vocab.json").read_text())
    return Vocab(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


class Batches:
    """Step ``s``'s batch, drawn from ``default_rng([seed, s])``: chat rows of packed samples
    (each a conversation of 1-3 turns: a uniformly drawn answer after one of its prompts, loss on
    answer tokens only) and raw rows (a random window of the documentation; loss on every token,
    weighted ``raw_weight``)."""

    def __init__(self, work: Path, t: TrainConfig, pad_id: int, newline_id: int):
        d = np.load(work / "data.npz")
        self.t, self.pad, self.newline = t, pad_id, newline_id
        self.prompts = np.split(d["prompt_flat"], np.cumsum(d["prompt_len"])[:-1])
        self.answers = np.split(d["answer_flat"], np.cumsum(d["answer_len"])[:-1])
        owner = d["prompt_owner"]
        self.by_answer = [np.flatnonzero(owner == a) for a in range(len(self.answers))]
        self.raw = d["raw"]

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        t = self.t
        rng = np.random.default_rng([t.seed, step])
        L, R = t.seq, t.chat_rows + t.raw_rows
        tokens = np.full((R, L + 1), self.pad, np.int64)
        weight = np.zeros((R, L), np.float32)  # weight of predicting tokens[:, 1:]
        pos = np.zeros((R, L), np.int64)
        seg = np.zeros((R, L), np.int64)
        live = np.ones((R, L), bool)  # real tokens (not row padding): counted in the balance loss
        for r in range(t.chat_rows):
            at, s, misses = 0, 0, 0
            while misses < 4:  # a few more draws to fill the row's tail
                turns = 1 if rng.random() >= t.multi_turn else int(rng.integers(2, 4))
                parts, learn = [], []
                for k in range(turns):
                    a = int(rng.integers(len(self.answers)))
                    p = self.prompts[int(rng.choice(self.by_answer[a]))]
                    if k:  # the template's "\n" after the previous <|im_end|>
                        p = np.concatenate([[self.newline], p])
                    parts += [p, self.answers[a]]
                    learn += [False, True]
                sample = np.concatenate(parts)
                n = len(sample)
                if at + n > L + 1:
                    misses += 1
                    continue
                tokens[r, at : at + n] = sample
                o = at
                for part, on in zip(parts, learn):
                    if on:  # predict the answer and its <|im_end|> (from the token before it)
                        weight[r, o - 1 : o + len(part) - 1] = 1.0
                    o += len(part)
                m = min(n, L - at)  # the row's last token is only ever a label
                pos[r, at : at + m] = np.arange(m)
                seg[r, at : at + m] = s
                at, s = at + n, s + 1
            seg[r, at:] = s  # padding: a segment of its own, never in the loss
            live[r, at:] = False
            pos[r, at:] = np.arange(L - at) if at < L else 0
        for r in range(t.chat_rows, R):
            o = int(rng.integers(len(self.raw) - L - 1))
            tokens[r] = self.raw[o : o + L + 1]
            weight[r] = t.raw_weight
            pos[r] = np.arange(L)
        return {
            "tokens": torch.from_numpy(tokens[:, :-1]),
            "labels": torch.from_numpy(tokens[:, 1:]),
            "weight": torch.from_numpy(weight),
            "pos": torch.from_numpy(pos),
            "seg": torch.from_numpy(seg),
            "live": torch.from_numpy(live),
        }


class GdnBatches(Batches):
    """Step ``s``'s batch for ``--arch qwen35moe``, from ``default_rng([seed, s])``: ``chat_rows`` rows of one
    conversation each (1-3 turns, loss on answer tokens), then ``raw_rows`` windows of the documentation
    (loss weight ``raw_weight``), all ``L`` tokens long: the longest conversation rounded up to 64, at most
    ``seq``. Padding is at the end of a row (``live`` False, weight 0)."""

    def __call__(self, step: int) -> dict[str, torch.Tensor]:
        t = self.t
        rng = np.random.default_rng([t.seed, step])
        samples = []
        while len(samples) < t.chat_rows:
            turns = 1 if rng.random() >= t.multi_turn else int(rng.integers(2, 4))
            parts, learn = [], []
            for k in range(turns):
                a = int(rng.integers(len(self.answers)))
                p = self.prompts[int(rng.choice(self.by_answer[a]))]
                if k:  # the template's "\n" after the previous <|im_end|>
                    p = np.concatenate([[self.newline], p])
                parts += [p, self.answers[a]]
                learn += [False, True]
            if sum(len(x) for x in parts) <= t.seq + 1:
                samples.append((parts, learn))
        longest = max(sum(len(x) for x in parts) for parts, _ in samples) - 1
        L = min(t.seq, -(-longest // 64) * 64)
        R = t.chat_rows + t.raw_rows
        tokens = np.full((R, L + 1), self.pad, np.int64)
        weight = np.zeros((R, L), np.float32)
        live = np.zeros((R, L), bool)
        for r, (parts, learn) in enumerate(samples):
            sample = np.concatenate(parts)
            n = len(sample)
            tokens[r, :n] = sample
            live[r, : n - 1] = True
            o = 0
            for part, on in zip(parts, learn):
                if on:
                    weight[r, o - 1 : o + len(part) - 1] = 1.0
                o += len(part)
        for r in range(t.chat_rows, R):
            o = int(rng.integers(len(self.raw) - L - 1))
            tokens[r] = self.raw[o : o + L + 1]
            weight[r] = t.raw_weight
            live[r] = True
        return {
            "tokens": torch.from_numpy(tokens[:, :-1]),
            "labels": torch.from_numpy(tokens[:, 1:]),
            "weight": torch.from_numpy(weight),
            "live": torch.from_numpy(live),
        }


# -- training --------------------------------------------------------------------------------
def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_frac`` of the peak at the last step."""
    if step < t.warmup:
        return t.lr * (step + 1) / t.warmup
    x = (step - t.warmup) / max(1, t.steps - t.warmup)
    return t.lr * (t.min_lr_frac + (1 - t.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, x))))


def make_optimizer(model: DemoModel, t: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.95), eps=1e-8)


def resume(work: Path, model, opt: torch.optim.Optimizer, t, cfg, device: str) -> int:
    """Load ``work/ckpt.pt`` into ``model`` and ``opt`` where it exists (written with the same settings, else
    SystemExit); returns the step to continue from (0: a fresh start)."""
    ckpt = work / "ckpt.pt"
    if not ckpt.exists():
        return 0
    state = torch.load(ckpt, map_location=device)
    if state["train"] != asdict(t) or state["model_config"] != asdict(cfg):
        raise SystemExit(f"{ckpt} was written with other settings; remove it to start over")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    print(f"resumed at step {state['step']}", flush=True)
    return state["step"]


def save_checkpoint(work: Path, model, opt: torch.optim.Optimizer, step: int, t, cfg) -> None:
    """``work/ckpt.pt`` for :func:`resume`, replaced atomically."""
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
    state |= {"train": asdict(t), "model_config": asdict(cfg)}
    torch.save(state, work / "ckpt.tmp")
    os.replace(work / "ckpt.tmp", work / "ckpt.pt")


def train(work: Path, cfg: DemoConfig, t: TrainConfig, device: str, log_every: int = 10) -> DemoModel:
    """Run (or resume) training to ``t.steps``; checkpoints to ``work/ckpt.pt``."""
    torch.manual_seed(t.seed)
    vocab = load_vocab(work)
    newline = vocab.hf_tokenizer().encode("\n", add_special_tokens=False).ids
    assert len(newline) == 1
    batches = Batches(work, t, vocab.pad_id, newline[0])
    model = DemoModel(cfg, seed=t.seed).to(device)
    opt = make_optimizer(model, t)
    step = resume(work, model, opt, t, cfg, device)
    t0, tokens_done = time.perf_counter(), 0
    while step < t.steps:
        b = {k: v.to(device) for k, v in batches(step).items()}
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        logits, aux = model(b["tokens"], b["pos"], b["seg"], b["live"])
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
        w = b["weight"].flatten()
        loss = (ce * w).sum() / w.sum() + t.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        opt.step()
        step += 1
        tokens_done += b["tokens"].numel()
        if step % log_every == 0 or step == t.steps:
            with torch.no_grad():
                chat = w == 1.0
                raw = (w > 0) & ~chat
                lc, lr_ = ce[chat].mean().item(), ce[raw].mean().item()
            el = time.perf_counter() - t0
            print(
                f"step {step}/{t.steps} lr {lr_at(step - 1, t):.2e} chat {lc:.3f} raw {lr_:.3f} aux {aux.item():.3f} "
                f"{tokens_done / el:.0f} tok/s {el:.0f}s",
                flush=True,
            )
        if step % t.checkpoint_every == 0 or step == t.steps:
            save_checkpoint(work, model, opt, step, t, cfg)
    return model


def train_gdn(work: Path, cfg: GdnConfig, t: GdnTrainConfig, device: str, log_every: int = 10) -> GdnDemoModel:
    """``--arch qwen35moe``: run (or resume) training to ``t.steps``; checkpoints to ``work/ckpt.pt``. Loss:
    next-token cross-entropy + ``mtp_weight`` × the MTP head's (token after next, same weights shifted by
    one) + ``aux_coef`` × balance."""
    torch.manual_seed(t.seed)
    vocab = load_vocab(work)
    newline = vocab.hf_tokenizer().encode("\n", add_special_tokens=False).ids
    assert len(newline) == 1
    batches = GdnBatches(work, t, vocab.pad_id, newline[0])
    model = GdnDemoModel(cfg, seed=t.seed).to(device)
    opt = make_optimizer(model, t)
    step = resume(work, model, opt, t, cfg, device)
    t0, tokens_done = time.perf_counter(), 0
    while step < t.steps:
        b = {k: v.to(device) for k, v in batches(step).items()}
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        logits, mtp, aux = model(b["tokens"], b["live"])
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
        w = b["weight"].flatten()
        # MTP row p predicts tokens[p+2] = labels[p+1], weighted as the trunk's prediction of it.
        ce2 = torch.nn.functional.cross_entropy(mtp.flatten(0, 1), b["labels"][:, 1:].flatten(), reduction="none")
        w2 = b["weight"][:, 1:].flatten()
        loss = (ce * w).sum() / w.sum() + t.mtp_weight * (ce2 * w2).sum() / w2.sum() + t.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip)
        opt.step()
        step += 1
        tokens_done += int(b["live"].sum())
        if step % log_every == 0 or step == t.steps:
            with torch.no_grad():
                chat, chat2 = w == 1.0, w2 == 1.0
                raw = (w > 0) & ~chat
                lc, lr_, lm = ce[chat].mean().item(), ce[raw].mean().item(), ce2[chat2].mean().item()
            el = time.perf_counter() - t0
            print(
                f"step {step}/{t.steps} lr {lr_at(step - 1, t):.2e} chat {lc:.3f} raw {lr_:.3f} mtp {lm:.3f} "
                f"aux {aux.item():.3f} L {b['tokens'].shape[1]} {tokens_done / el:.0f} tok/s {el:.0f}s",
                flush=True,
            )
        if step % t.checkpoint_every == 0 or step == t.steps:
            save_checkpoint(work, model, opt, step, t, cfg)
    return model


def load_trained(work: Path, cfg: DemoConfig | GdnConfig) -> DemoModel | GdnDemoModel:
    state = torch.load(work / "ckpt.pt", map_location="cpu")
    if isinstance(cfg, GdnConfig):
        model = GdnDemoModel(GdnConfig(**state["model_config"]))
        model.load_state_dict(state["model"])
        return model.eval()
    model = DemoModel(DemoConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    return model.eval()


# -- export and evaluation ---------------------------------------------------------------------
def export(work: Path, cfg: DemoConfig, out: Path) -> None:
    """Write ``work/demo-f32.gguf`` (the exact trained weights) and the shipped Q8_0 ``out``."""
    from engine.synth import write_model

    model, vocab = load_trained(work, cfg), load_vocab(work)
    w = model.gguf_weights()
    arch, name = ("qwen35moe", MODEL_NAME_GDN) if isinstance(cfg, GdnConfig) else ("qwen3moe", MODEL_NAME)
    for path, wt in ((work / "demo-f32.gguf", "F32"), (out, "Q8_0")):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path, arch, weights=w, tokenizer=vocab, weight_type=wt, name=name, **cfg.geometry())
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
        if wt == "F32":
            check_f32(model, path)


def check_f32(model: DemoModel | GdnDemoModel, path: Path) -> None:
    """Before quantizing: the engine's logits on the F32 file must be the torch model's (the GDN demo's
    with a float32 KV cache: the default bf16 cache rounds its gated attention's K/V)."""
    from engine.api import LoadOptions, Session

    opts = LoadOptions(n_ctx=256, kv_type="f32") if isinstance(model, GdnDemoModel) else LoadOptions(n_ctx=256)
    with Session.load(str(path), opts) as s:
        ids = s.tokenize(s.render_chat([{"role": "user", "content": "Explain the for statement."}]))
        ids += s.tokenize('The "for" statement is used to iterate over the elements of a sequence.')
        ours = s.logits(ids)
    theirs = model.logits(ids)
    err = float(np.abs(ours - theirs).max())
    print(f"F32 check: engine vs torch logits over {len(ids)} tokens, max |diff| {err:.2e}")
    if err > 1e-4 * max(1.0, float(np.abs(theirs).max())) or (ours.argmax(-1) != theirs.argmax(-1)).any():
        raise SystemExit("the engine does not compute what the training model computes")


def greedy(model: DemoModel, prompt: list[int], eos: int, n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        nxt = int(np.argmax(model.logits(ids)[-1]))
        if nxt == eos:
            break
        ids.append(nxt)
    return ids[len(prompt) :]


# Phrasings no training sample uses: how far the model generalises (reported, not required).
UNSEEN = (
    "How do I write a for loop?",
    "what's a lambda",
    "Why would I use a with statement?",
    "How are exceptions handled in Python?",
    "Please describe the while loop.",
    "What does pass do?",
    "I want to learn about dictionaries.",
    "When should I use the global keyword?",
)


def evaluate(work: Path, cfg: DemoConfig, n_tokens: int = 64) -> int:
    """Greedy answers (torch, F32) to the acceptance questions of ``tests/test_demo_model.py``,
    then to :data:`UNSEEN` phrasings; returns how many acceptance answers are on topic."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_acceptance", ROOT / "tests" / "test_demo_model.py")
    acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acc)
    model, vocab = load_trained(work, cfg), load_vocab(work)
    tok = vocab.hf_tokenizer()
    good = 0
    for q, markers in acc.QUESTIONS:
        out = greedy(model, tok.encode(corpus.chatml(q), add_special_tokens=False).ids, vocab.eos_id, n_tokens)
        answer = tok.decode(out)
        ok = acc.on_topic(answer, markers)
        good += ok
        print(f"[{'ok' if ok else '--'}] {q}\n     {answer}")
    print(f"{good}/{len(acc.QUESTIONS)} on topic")
    for q in UNSEEN:
        out = greedy(model, tok.encode(corpus.chatml(q), add_special_tokens=False).ids, vocab.eos_id, n_tokens)
        print(f"[unseen] {q}\n     {tok.decode(out)}")
    return good


def measure_mtp(path: Path, k: int, threads: int = 1, n_tokens: int = 64, repeat: int = 3) -> dict[int, dict]:
    """MTP self-speculative decoding on the exported file in the engine: the acceptance questions of
    ``tests/test_demo_model.py`` answered greedily (``n_tokens`` at most, each from a fresh conversation),
    ``repeat`` times, with ``--mtp 0`` and ``--mtp k``. Per setting: decode tok/s (all replies' tokens over
    their decode seconds, the median of the repeats), drafts accepted / drafted, tokens per verify pass, with
    ``threads`` host threads. The replies must be the same tokens both ways."""
    import importlib.util
    from dataclasses import replace

    from engine.api import LoadOptions, Session
    from engine.config import EngineOptions
    from engine.generate import SamplingParams

    spec = importlib.util.spec_from_file_location("demo_acceptance", ROOT / "tests" / "test_demo_model.py")
    acc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acc)
    results, replies = {}, {}
    for m in (0, k):
        opts = LoadOptions(n_ctx=512, engine=replace(EngineOptions(), mtp=m, host_threads=threads))
        with Session.load(str(path), opts) as s:
            rates, got = [], []
            drafted = accepted = passes = 0
            for r in range(repeat + 1):  # the first round warms up (compiles, first touches): not counted
                n = secs = 0.0
                got = []
                for q, _ in acc.QUESTIONS:
                    s.reset()
                    msgs = [{"role": "user", "content": q}]
                    evs = list(s.generate(messages=msgs, params=SamplingParams.greedy(n_tokens)))
                    got.append([e.token_id for e in evs if e.token_id is not None])
                    last = evs[-1]
                    n += last.n_generated
                    secs += last.n_generated / last.decode_tok_s if last.decode_tok_s else 0.0
                    if r:
                        drafted, accepted = drafted + last.mtp_drafted, accepted + last.mtp_accepted
                        passes += last.mtp_passes
                if r:
                    rates.append(n / secs)
            replies[m] = got
            results[m] = {
                "decode_tok_s": float(np.median(rates)),
                "tokens": int(n),
                "drafted": drafted,
                "accepted": accepted,
                "acceptance": accepted / drafted if drafted else None,
                "tokens_per_pass": (accepted + passes) / passes if passes else None,
            }
        print(f"--mtp {m}: {results[m]}", flush=True)
    if replies[0] != replies[k]:
        raise SystemExit("greedy replies differ with MTP on and off")
    print(f"decode speedup --mtp {k} vs --mtp 0: {results[k]['decode_tok_s'] / results[0]['decode_tok_s']:.2f}x")
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["prepare", "train", "export", "eval", "all", "mtp"])
    p.add_argument("--mtp", type=int, default=2, help="mtp: draft tokens a step to measure against --mtp 0")
    p.add_argument(
        "--arch",
        choices=["qwen3moe", "qwen35moe"],
        default="qwen3moe",
        help="qwen3moe: the shipped demo; qwen35moe: the Gated DeltaNet demo with an MTP head",
    )
    p.add_argument("--work", type=Path, help="default packaging/build/demo (qwen35moe: packaging/build/demo-gdn)")
    p.add_argument("--out", type=Path, help=f"default {SHIPPED.name} (qwen35moe: {SHIPPED_GDN.name})")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: fastest on a shared 2-core machine)")
    p.add_argument("--device", default="cpu")
    fields = TrainConfig.__dataclass_fields__ | GdnTrainConfig.__dataclass_fields__
    for f in fields.values():  # defaults: the chosen architecture's training config
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    gdn = a.arch == "qwen35moe"
    T = GdnTrainConfig if gdn else TrainConfig
    t = T(**{k: getattr(a, k) for k in T.__dataclass_fields__ if getattr(a, k) is not None})
    cfg = GdnConfig() if gdn else DemoConfig()
    a.work = a.work or HERE / "build" / ("demo-gdn" if gdn else "demo")
    a.out = a.out or (SHIPPED_GDN if gdn else SHIPPED)
    if a.what in ("prepare", "all"):
        prepare(a.work, cfg)
    if a.what in ("train", "all"):
        (train_gdn if gdn else train)(a.work, cfg, t, a.device)
    if a.what in ("export", "all"):
        export(a.work, cfg, a.out)
    if a.what in ("eval", "all"):
        evaluate(a.work, cfg)
    if a.what == "mtp":
        measure_mtp(a.out, a.mtp, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
