"""Constrained sampling: a grammar (JSON schema, Lark) decides which tokens may come next, via llguidance.

llguidance (Microsoft's, the engine behind llama.cpp's ``--llguidance`` and vLLM's ``guidance``
backend) walks the vocabulary as a trie against the grammar's lexer, so a step costs ~tens of µs on
a 150k vocabulary rather than a pass over every token (``labs/grammar_mask_bench.py``,
docs/benchmarks.md). :class:`GrammarConstraint` is the decode loop's
:class:`~engine.generate.loop.TokenConstraint`: ``mask`` sets forbidden logits to -inf from the
matcher's bitmask, ``accept`` advances the matcher. :meth:`GrammarConstraint.reference_mask` asks the
matcher token by token (the specification the bitmask path is tested against: it allows a subset,
never a token the grammar refuses).

The vocabulary is handed over as each token's bytes (:meth:`Tokenizer.token_to_piece`), control
tokens marked with a leading 0xFF as llguidance expects, and the model's end-of-generation tokens as
its EOS set: when the grammar is complete only those are allowed, so generation ends as usual.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np

from engine.errors import UsageError

# Compact JSON (no free whitespace): a small model cannot pad an answer with endless blank lines.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> llguidance.LLTokenizer
_cache_lock = threading.Lock()


class _VocabWrapper:
    """What ``llguidance.LLTokenizer`` reads from a tokenizer: token bytes, EOS, special ids, encode."""

    def __init__(self, tok):
        self._tok = tok
        self.tokens = [
            (b"\xff" + tok.token_to_piece(i)) if tok.is_special(i) else tok.token_to_piece(i)
            for i in range(tok.n_vocab)
        ]
        eog = sorted(tok.eog_ids)
        self.eos_token_id = eog[0] if eog else tok.eos_id
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(tok.n_vocab) if tok.is_special(i)]

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tok.encode(text, add_bos=False, parse_special=False, add_eos=False)


def ll_tokenizer(tokenizer):
    """The llguidance tokenizer of an engine :class:`~engine.tokenizer.Tokenizer` (built once, ~1 s on 150k)."""
    import llguidance

    with _cache_lock:
        out = _cache.get(tokenizer)
        if out is None:
            w = _VocabWrapper(tokenizer)
            eos = sorted(tokenizer.eog_ids) or None
            out = llguidance.LLTokenizer(llguidance.TokenizerWrapper(w), n_vocab=tokenizer.n_vocab, eos_token=eos)
            _cache[tokenizer] = out
        return out


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """The grammar of JSON text valid against ``schema`` (``{"type": "object"}``: any JSON object)."""
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise UsageError(f"the JSON schema is not usable: {e}") from None


def lark_grammar(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


def _json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule body: JSON text valid against ``schema``, compact (:data:`JSON_OPTIONS`)."""
    return f'%json {{ "x-guidance": {json.dumps(JSON_OPTIONS)}, "allOf": [{json.dumps(schema)}] }}'


def tool_call_grammar(tools: list[dict[str, Any]]) -> str:
    """Exactly one Qwen3/Hermes tool call to one of ``tools`` (OpenAI function declarations)::

    <tool_call>\\n{"name": "NAME", "arguments": {...per the function's parameters}}\\n</tool_call>
    """
    variants = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") or {"type": "object"}
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    return lark_grammar(f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {_json_rule(schema)}\n')


def harmony_call_grammar(tools: list[dict[str, Any]], open_message: bool = False) -> str:
    """Exactly one harmony (gpt-oss) tool call to one of ``tools`` (OpenAI function declarations): the message
    the reasoning splitter (:mod:`engine.generate.reasoning`) reads as a call to NAME with the body as its
    arguments, ended by the ``<|call|>`` token (an end-of-generation token: generation ends with it), after an
    optional analysis message (the reasoning gpt-oss is trained to write before a call; its text holds no ``<|``,
    so no harmony marker the splitter would read, spelled out or as a token)::

    [<|channel|>analysis<|message|>TEXT<|end|><|start|>assistant]
    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...per the function's parameters}<|call|>

    It continues a prompt whose generation prompt opened the message (gpt-oss's ``<|start|>assistant``);
    ``open_message``: begin with ``<|start|>assistant`` (a prompt that did not). The ``<|…|>`` markers are the
    vocabulary's special tokens, never their text spelled out (a vocabulary without them: the grammar is not
    usable, :class:`UsageError` when the constraint is built)."""
    opener = '<|start|> "assistant" ' if open_message else ""
    lines = [f"start: {opener}<|channel|> (analysis <|channel|>)? call <|call|>"]
    lines.append('analysis: "analysis" <|message|> thought <|end|> <|start|> "assistant"')
    lines.append(r"thought: /([^<]|<+[^<|])*<*/")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, t in enumerate(tools):
        fn = t["function"]
        head = json.dumps(f"commentary to=functions.{fn['name']} ")
        lines.append(f'call_{i}: {head} <|constrain|> "json" <|message|> args_{i}')
        lines.append(f"args_{i}: {_json_rule(fn.get('parameters') or {'type': 'object'})}")
    return lark_grammar("\n".join(lines) + "\n")


class GrammarConstraint:
    """A grammar over one tokenizer's vocabulary, advanced token by token (one generation's worth). ``split``: the
    grammar forces text in the model's reasoning format, which the decode loop splits (``TokenConstraint``)."""

    def __init__(self, tokenizer, grammar: str, split: bool = False):
        import llguidance

        self.split = split
        self.n_vocab = tokenizer.n_vocab
        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
        if self.matcher.is_error():
            raise UsageError(f"the grammar is not usable: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """float32 [V] -> a copy with disallowed tokens at -inf."""
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def reference_mask(self) -> np.ndarray:
        """bool [V]: every token the grammar accepts next, asked token by token (slow; the specification).
        :meth:`allowed` is a subset: llguidance leaves out a token that would only split text the grammar
        forces, where the vocabulary has the whole piece (a lone ``"`` where ``":`` must follow)."""
        out = np.zeros(self.n_vocab, dtype=bool)
        for t in range(self.n_vocab):
            probe = self.matcher.deep_copy()
            out[t] = probe.try_consume_tokens([t]) == 1
        return out

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(int(token_id)):
            raise UsageError(f"the grammar refused token {token_id}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The text so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()
