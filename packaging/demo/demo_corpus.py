"""The demo model's training text: Python's own documentation (``pydoc_data.topics``).

Two kinds of samples come out of it:

* **chat samples**: a question about one documented subject and, as the answer, the first
  paragraph(s) of its section, reflowed onto one line (grammar blocks, tables, notes and version
  remarks skipped, at most ``MAX_ANSWER_WORDS`` words, cut at a sentence end). Every section gets
  several phrasings ("Explain the for statement.", "What is the for statement?", ...), and a
  short hand-written alias table adds questions about concepts that live inside a section
  ("What is a decorator?" -> the decorator paragraph of "Function definitions").
* **raw text**: every topic in full, for plain language modelling.

The topics differ between Python releases, so the corpus is pinned to ``PYTHON_VERSION``.
Pure functions of the pinned text: no randomness here (sampling lives in the trainer).
"""

from __future__ import annotations

import builtins
import re
import sys
from dataclasses import dataclass

PYTHON_VERSION = (3, 11)  # the corpus: pydoc_data.topics of this Python release
MAX_ANSWER_WORDS = 70
MIN_ANSWER_WORDS = 12
GENERIC_TITLES = frozenset({"Overview"})  # titles that name no subject on their own
_UNDERLINE = re.compile(r"^([*=\-~^])\1*$")
_EMPHASIS = re.compile(r"\*{1,2}([A-Za-z_][\w .\-]*?)\*{1,2}")
_SKIP_PARAGRAPH = re.compile(r"^(Note:|See also:|Changed in version|New in version|Added in version|Deprecated)")


@dataclass(frozen=True)
class Section:
    """One titled section of a topic: ``key`` is the pydoc topic it came from."""

    key: str
    title: str
    body: str


@dataclass(frozen=True)
class ChatGroup:
    """Questions that share one answer (a section's opening, or an alias's paragraph)."""

    title: str
    questions: tuple[str, ...]
    answer: str


# (section title, paragraph that starts with this text or None for the opening, subjects)
# Concepts users ask about by name whose documentation is a paragraph inside a section.
ALIASES: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("Function definitions", "A function definition may be wrapped", ("a decorator", "decorators")),
    ("Generator functions", None, ("a generator", "generators", "a generator function")),
    ('Mapping Types — "dict"', None, ("a dictionary", "dictionaries", "a dict", "a mapping")),
    ("Lists", None, ("a list", "lists")),
    ("Tuples", None, ("a tuple", "tuples")),
    ("Ranges", None, ("a range", "the range type")),
    ("Set types", None, ("a set", "sets")),
    ("The Null Object", None, ("None", "the None object")),
    ("The Ellipsis Object", None, ("Ellipsis", "the ellipsis")),
    ("Lambdas", None, ("a lambda", "lambda expressions", "a lambda function")),
    ("Slicings", None, ("slicing", "a slice")),
    ("Coroutine function definition", None, ("a coroutine", "coroutines", "async functions")),
    ("With Statement Context Managers", None, ("a context manager", "context managers")),
    ("Exceptions", None, ("an exception", "exceptions")),
    ("Class definitions", None, ("a class", "classes")),
    ("Metaclasses", None, ("a metaclass",)),
    ("Implementing Descriptors", None, ("a descriptor", "descriptors")),
    ("Modules", None, ("a module", "modules")),
    ("Methods", None, ("a method", "methods")),
    ("Truth Value Testing", None, ("truthiness", "truth value testing")),
    ("Operator precedence", None, ("operator precedence", "the precedence of operators")),
    ('"pdb" — The Python Debugger', None, ("the Python debugger", "pdb")),
    ('The "match" statement', None, ("pattern matching", "match statements")),
    ("Integer literals", None, ("an integer literal", "integers")),
    ("Floating point literals", None, ("a float literal", "floating point numbers")),
    ("Identity comparisons", None, ("the is operator", "identity comparisons")),
    ("Membership test operations", None, ("the in operator", "membership tests")),
    ("String Methods", None, ("string methods", "str methods")),
    ("Await expression", None, ("await", "the await expression")),
)


def check_python() -> None:
    """Fail unless this is the pinned Python release (other releases ship other topics)."""
    if sys.version_info[:2] != PYTHON_VERSION:
        want = ".".join(map(str, PYTHON_VERSION))
        raise SystemExit(f"the demo corpus is pinned to Python {want}; this is {sys.version.split()[0]}")


def topics() -> dict[str, str]:
    from pydoc_data.topics import topics as t

    return dict(t)


def sections(tops: dict[str, str] | None = None) -> list[Section]:
    """Every titled section of every topic (sorted keys), first occurrence of each title only."""
    tops = tops if tops is not None else topics()
    out: dict[str, Section] = {}
    for key in sorted(tops):
        lines = tops[key].split("\n")
        heads = [
            i
            for i in range(len(lines) - 1)
            if lines[i].strip() and _UNDERLINE.match(lines[i + 1]) and len(lines[i + 1]) == len(lines[i])
        ]
        for n, i in enumerate(heads):
            end = heads[n + 1] if n + 1 < len(heads) else len(lines)
            title = lines[i].strip()
            if title not in out:
                out[title] = Section(key, title, "\n".join(lines[i + 2 : end]).strip("\n"))
    return list(out.values())


def paragraphs(body: str) -> list[tuple[str, bool]]:
    """(reflowed text, is prose) for each blank-line separated block of a section body.

    Not prose: indented blocks (grammar, code, method signatures), tables, bullet lists,
    decorative rules, notes and version remarks, and one- or two-word lead-ins ("Syntax:").
    """
    out = []
    for block in re.split(r"\n\s*\n", body):
        if not block.strip():
            continue
        text = _EMPHASIS.sub(r"\1", " ".join(line.strip() for line in block.split("\n")))
        prose = not (
            block.startswith((" ", "+", "|", "*"))
            or _UNDERLINE.match(block.strip())
            or _SKIP_PARAGRAPH.match(block)
            or (len(text.split()) <= 2 and text.endswith(":"))
        )
        out.append((text, prose))
    return out


def sentences(text: str) -> list[str]:
    """Split prose at sentence ends (a period, ! or ? followed by space and a capital or quote)."""
    return re.split(r"(?<=[.!?])\s+(?=[A-Z\"“(])", text)


def answer_text(body: str, start: str | None = None) -> str:
    """The opening prose of ``body`` (or from its paragraph beginning with ``start``).

    Prose paragraphs are taken until a skipped block follows at least ``MIN_ANSWER_WORDS``
    words, or a paragraph would pass ``MAX_ANSWER_WORDS``. A final sentence announcing a skipped
    block ("... is equivalent to:") is dropped, or its colon made a period if it is the only one.
    """
    paras = paragraphs(body)
    if start is not None:
        at = next(i for i, (t, _) in enumerate(paras) if t.startswith(start))
        paras = paras[at:]
    taken: list[str] = []
    n = 0
    for text, prose in paras:
        if not prose:
            if n >= MIN_ANSWER_WORDS:
                break
            continue
        if taken and n + len(text.split()) > MAX_ANSWER_WORDS:
            break
        if not re.search(r"[.!?:][\"”)]?$", text):
            # A lead-in to a code block without a colon ("For example, the statements"): keep the
            # whole sentences before it and stop.
            taken += sentences(text)[:-1]
            break
        taken.append(text)
        n += len(text.split())
    sents = [x for t in taken for x in sentences(t) if not (len(x.split()) <= 2 and x.endswith(":"))]
    if len(sents) > 1 and sents[-1].endswith(":"):
        sents.pop()
    answer = " ".join(sents)
    if answer.endswith(":"):
        answer = answer[:-1] + "."
    return _cut(answer)


def _cut(text: str) -> str:
    """At most MAX_ANSWER_WORDS words, cut after the last sentence end that fits (if any)."""
    words = text.split()
    if len(words) <= MAX_ANSWER_WORDS:
        return text
    head = " ".join(words[:MAX_ANSWER_WORDS])
    ends = [m.end() for m in re.finditer(r"[.!?][\"”)]?(?=\s)", head)]
    return head[: ends[-1]] if ends else head


def subjects(title: str) -> list[str]:
    """Noun phrases a question can use for a section title.

    'The "for" statement' -> ['the for statement']; 'Mapping Types — "dict"' -> ['mapping types',
    'dict']; 'Identifiers (Names)' -> ['identifiers'].
    """
    out = []
    for part in title.split(" — "):
        part = re.sub(r"\s*\(.*?\)", "", part).replace('"', "").strip()
        if not part:
            continue
        words = part.split()
        capitalised = words[0][0].isupper() and words[0][1:].islower() and not hasattr(builtins, words[0])
        if words[0] in ("The", "A", "An") or capitalised:
            words[0] = words[0].lower()
        out.append(" ".join(words))
    return out


def _plural(s: str) -> bool:
    last = s.split()[-1]
    return last.endswith("s") and not last.endswith(("ss", "us", "is", "__")) and not s.startswith(("a ", "an "))


def questions_for(subject: str) -> list[str]:
    """Question phrasings about one subject."""
    be, do = ("are", "do") if _plural(subject) else ("is", "does")
    qs = [
        f"Explain {subject}.",
        f"What {be} {subject}?",
        f"How {do} {subject} work in Python?",
        f"Tell me about {subject}.",
        f"Describe {subject}.",
        f"What does the Python documentation say about {subject}?",
        f"Can you explain {subject}?",
        f"What should I know about {subject}?",
        f"Give me an overview of {subject}.",
        f"{subject[0].upper()}{subject[1:]}?",
    ]
    m = re.fullmatch(r"the (\S+) statement", subject)
    if m:
        kw = m.group(1)
        qs += [f"What does the {kw} statement do?", f"What is the {kw} keyword for?", f"How do I use {kw} in Python?"]
    return qs


def chat_groups(secs: list[Section] | None = None) -> list[ChatGroup]:
    """One group per alias, then one per section with an answer (first-come for each question)."""
    secs = secs if secs is not None else sections()
    by_title = {s.title: s for s in secs}
    todo = [(title, start, [q for x in subj for q in questions_for(x)]) for title, start, subj in ALIASES]
    todo += [(s.title, None, [q for x in subjects(s.title) for q in questions_for(x)]) for s in secs]
    merged: dict[str, list[str]] = {}  # answer -> questions; a question has one answer, aliases first
    seen: set[str] = set()
    titles = {}
    for title, start, qs in todo:
        answer = answer_text(by_title[title].body, start)
        if len(answer.split()) < 5 or title in GENERIC_TITLES:
            continue
        merged.setdefault(answer, []).extend(q for q in dict.fromkeys(qs) if q.lower() not in seen)
        seen.update(q.lower() for q in qs)
        titles.setdefault(answer, title)
    return [ChatGroup(titles[a], tuple(qs), a) for a, qs in merged.items() if qs]


def raw_texts(tops: dict[str, str] | None = None) -> list[str]:
    """Every topic's full text, sorted by key."""
    tops = tops if tops is not None else topics()
    return [tops[k] for k in sorted(tops)]


def chatml(question: str) -> str:
    """The prompt the engine renders for one user message (ChatML, generation prompt added)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def tokenizer_texts() -> list[str]:
    """What the BPE vocabulary is trained on: the raw topics and every chat question and answer."""
    groups = chat_groups()
    return raw_texts() + [q for g in groups for q in g.questions] + [g.answer for g in groups]
