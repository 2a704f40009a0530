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

SHIPPED = ROOT / "resources" / "models" / "sharpi-demo-q8_0.gguf"
MODEL_NAME = "SharpI demo (pydoc, qwen3moe 6x8 experts)"


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


def train(work: Path, cfg: DemoConfig, t: TrainConfig, device: str, log_every: int = 10) -> DemoModel:
    """Run (or resume) training to ``t.steps``; checkpoints to ``work/ckpt.pt``."""
    torch.manual_seed(t.seed)
    vocab = load_vocab(work)
    newline = vocab.hf_tokenizer().encode("\n", add_special_tokens=False).ids
    assert len(newline) == 1
    batches = Batches(work, t, vocab.pad_id, newline[0])
    model = DemoModel(cfg, seed=t.seed).to(device)
    opt = make_optimizer(model, t)
    ckpt = work / "ckpt.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        if state["train"] != asdict(t) or state["model_config"] != asdict(cfg):
            raise SystemExit(f"{ckpt} was written with other settings; remove it to start over")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resumed at step {step}", flush=True)
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
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
            state |= {"train": asdict(t), "model_config": asdict(cfg)}
            torch.save(state, work / "ckpt.tmp")
            os.replace(work / "ckpt.tmp", ckpt)
    return model


def load_trained(work: Path, cfg: DemoConfig) -> DemoModel:
    state = torch.load(work / "ckpt.pt", map_location="cpu")
    model = DemoModel(DemoConfig(**state["model_config"]))
    model.load_state_dict(state["model"])
    return model.eval()


# -- export and evaluation ---------------------------------------------------------------------
def export(work: Path, cfg: DemoConfig, out: Path) -> None:
    """Write ``work/demo-f32.gguf`` (the exact trained weights) and the shipped Q8_0 ``out``."""
    from engine.synth import write_model

    model, vocab = load_trained(work, cfg), load_vocab(work)
    w = model.gguf_weights()
    for path, wt in ((work / "demo-f32.gguf", "F32"), (out, "Q8_0")):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path, "qwen3moe", weights=w, tokenizer=vocab, weight_type=wt, name=MODEL_NAME, **cfg.geometry())
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
        if wt == "F32":
            check_f32(model, path)


def check_f32(model: DemoModel, path: Path) -> None:
    """Before quantizing: the engine's logits on the F32 file must be the torch model's."""
    from engine.api import LoadOptions, Session

    with Session.load(str(path), LoadOptions(n_ctx=256)) as s:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["prepare", "train", "export", "eval", "all"])
    p.add_argument("--work", type=Path, default=HERE / "build" / "demo")
    p.add_argument("--out", type=Path, default=SHIPPED)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: fastest on a shared 2-core machine)")
    p.add_argument("--device", default="cpu")
    for f in TrainConfig.__dataclass_fields__.values():
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    t = TrainConfig(**{k: getattr(a, k) for k in TrainConfig.__dataclass_fields__})
    cfg = DemoConfig()
    if a.what in ("prepare", "all"):
        prepare(a.work, cfg)
    if a.what in ("train", "all"):
        train(a.work, cfg, t, a.device)
    if a.what in ("export", "all"):
        export(a.work, cfg, a.out)
    if a.what in ("eval", "all"):
        evaluate(a.work, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
