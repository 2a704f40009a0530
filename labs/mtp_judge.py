"""What automatic MTP decides on a model: the demo questions as separate conversations of one session with
``EngineOptions.mtp`` left automatic, and after each reply the session's DraftJudge (verify passes, timed plain
steps, plain step time over drafting's time a token, whether drafting is off).

  PYTHONPATH=. python3 labs/mtp_judge.py [FILE]   # default: the bundled GDN demo

Results (2-core dev machine, 2026-11-29): docs/benchmarks.md, "Trained GDN demo: MTP acceptance and speedup".
"""

import sys
from dataclasses import replace
from pathlib import Path

from engine.api import LoadOptions, Session
from engine.config import EngineOptions
from engine.generate import SamplingParams

QUESTIONS = [
    "Explain the for statement.", "What is a decorator?", "What is None?", "Explain the with statement.",
    "How does the while statement work in Python?", "What is a lambda?",
]  # fmt: skip


def main(path: str) -> None:
    s = Session.load(path, LoadOptions(n_ctx=256, engine=replace(EngineOptions(), mtp=None)))
    with s:
        print(f"{Path(path).name}: {s.mtp} drafts a step (auto)")
        for q in QUESTIONS:
            s.reset()
            last = list(s.generate(messages=[{"role": "user", "content": q}], params=SamplingParams.greedy(64)))[-1]
            j = s.draft_judge
            speed = "-" if j.speedup is None else f"{j.speedup:.2f}"
            print(
                f"{q:48s} tokens {last.n_generated:3d}, verify passes {last.mtp_passes:3d} | judge: passes "
                f"{j.spec_passes}, plain probes {j.plain_steps}, plain ÷ drafting a token {speed}, off {j.off}"
            )


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / "resources" / "models" / "sharpi-demo-gdn-q8_0.gguf"
    main(sys.argv[1] if len(sys.argv) > 1 else str(default))
