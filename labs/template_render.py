"""What the chat-template limits cost a normal render (CPU; docs/robustness.md).

    PYTHONPATH=. python3 labs/template_render.py [--messages 11] [--rounds 9]

Renders ChatML over a conversation in the plain jinja2 sandbox (what rendering was before the limits),
through ChatTemplate.render (the limits: block ticks, intercepted binops, streamed output) and through
ChatTemplate.render_with_spans (a second render between markers, for the user-text ranges); prints the
best of ``rounds`` means, in microseconds a render.
"""

from __future__ import annotations

import argparse
import time

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.tokenizer.chat import CHATML, ChatTemplate


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--messages", type=int, default=11)
    p.add_argument("--rounds", type=int, default=9)
    a = p.parse_args()
    roles = ("user", "assistant")
    msgs = [{"role": "system", "content": "You are helpful."}]
    msgs += [{"role": roles[i % 2], "content": "hello there " * 20} for i in range(a.messages - 1)]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    before = plain.from_string(CHATML)
    t = ChatTemplate(CHATML)
    cases = {
        "plain sandbox render": (lambda: before.render(messages=msgs, add_generation_prompt=True), 2000),
        "ChatTemplate.render (limits)": (lambda: t.render(msgs), 2000),
        "ChatTemplate.render_with_spans": (lambda: t.render_with_spans(msgs), 500),
    }
    best = {k: float("inf") for k in cases}
    for _ in range(a.rounds):
        for name, (f, n) in cases.items():
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            best[name] = min(best[name], (time.perf_counter() - t0) / n * 1e6)
    for name, us in best.items():
        print(f"{name:34s} {us:8.1f} us")


if __name__ == "__main__":
    main()
