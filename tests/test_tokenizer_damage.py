"""Damaged tokenizer tables give a MetadataError naming the key and the entry, never a traceback at load
or later (detokenizing every id); a long SentencePiece entry does not make construction quadratic."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from engine.errors import MetadataError
from engine.gguf import open_gguf
from engine.tokenizer import Tokenizer, read_vocab
from engine.tokenizer.spm import derive_merges, token_splits
from tests.test_tokenizer import load, vocab_dir  # noqa: F401 (fixtures)

ROOT_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tables(load):  # noqa: F811
    """{"bpe": metadata, "spm": metadata} of the trained test vocabularies (copies per use)."""
    out = {}
    for kind, name in (("bpe", "qwen2"), ("spm", "spm")):
        path, _ = load(name)
        with open_gguf(path) as gf:
            out[kind] = {k: (list(v) if isinstance(v, list) else v) for k, v in gf.metadata.items()}
    return out


def _copy(meta: dict) -> dict:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in meta.items()}


def _all_pieces(meta: dict) -> None:
    tok = Tokenizer(read_vocab(meta))
    tok.decode(list(range(tok.n_vocab)))
    tok.decode(tok.encode("Hello <|im_end|> wörld 😀"))


@pytest.mark.parametrize("text", ["<0x>", "<0xZZ>", "<0x1>", "<0x100>", "<0x4", "PT", ""])
@pytest.mark.parametrize("kind", ["bpe", "spm"])
def test_a_byte_token_that_is_not_0xXX_is_a_load_error(tables, kind, text):
    meta = _copy(tables[kind])
    n = len(meta["tokenizer.ggml.tokens"])
    types = meta.get("tokenizer.ggml.token_type") or [1] * n
    meta["tokenizer.ggml.token_type"] = types
    i = 100
    meta["tokenizer.ggml.tokens"][i] = text or "tok-renamed"  # "" is renamed [EMPTY_i] by the reader
    types[i] = 6
    with pytest.raises(MetadataError, match=r"token 100 is typed as a byte token"):
        _all_pieces(meta)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("tokenizer.ggml.merges", [7, 8], r"tokenizer\.ggml\.merges\[0\] = 7 is not a string"),
        ("tokenizer.ggml.pre", ["qwen2"], r"tokenizer\.ggml\.pre = \['qwen2'\] is not a string"),
        ("tokenizer.ggml.add_bos_token", "yes", r"add_bos_token = 'yes' is not a boolean"),
    ],
)
def test_bpe_tables_of_the_wrong_type_name_the_key(tables, key, value, match):
    meta = _copy(tables["bpe"])
    meta[key] = value
    with pytest.raises(MetadataError, match=match):
        read_vocab(meta)


def test_token_types_and_scores_of_the_wrong_type_name_the_entry(tables):
    meta = _copy(tables["spm"])
    n = len(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.token_type"] = [1] * (n - 1) + ["1"]
    with pytest.raises(MetadataError, match=rf"token_type\[{n - 1}\] = '1'"):
        read_vocab(meta)
    meta = _copy(tables["spm"])
    meta["tokenizer.ggml.scores"][5] = float("nan")
    with pytest.raises(MetadataError, match=r"scores\[5\] = nan is not a number"):
        read_vocab(meta)
    meta["tokenizer.ggml.scores"] = ["0"] * n
    with pytest.raises(MetadataError, match=r"scores\[0\] = '0' is not a number"):
        read_vocab(meta)


def test_unknown_token_types_and_odd_special_ids_still_load(tables):
    """What llama.cpp accepts stays accepted: unknown type numbers are 'undefined', a special id out of
    range falls back to the default (with a warning)."""
    for kind in ("bpe", "spm"):
        meta = _copy(tables[kind])
        n = len(meta["tokenizer.ggml.tokens"])
        meta["tokenizer.ggml.token_type"] = [7 if i % 97 == 0 else 1 for i in range(n)]
        meta["tokenizer.ggml.eos_token_id"] = 1 << 40
        _all_pieces(meta)


def _brute_splits(tokens):
    ids = set(tokens)
    return [(i, c) for i, t in enumerate(tokens) for c in range(1, len(t)) if t[:c] in ids and t[c:] in ids]


def test_token_splits_equal_every_cut_tried():
    rng = np.random.default_rng(3)
    for _ in range(20):
        words = {"".join(rng.choice(list("ab▁x"), int(rng.integers(1, 9)))) for _ in range(300)}
        words |= {"a" * int(k) for k in rng.integers(60, 200, 8)} | {"ab" * 40, "ab" * 41}
        tokens = tuple(sorted(words))
        assert token_splits(tokens) == _brute_splits(tokens)
    scores = np.arange(len(tokens), dtype=np.float32)[::-1].copy()
    merges = derive_merges(tokens, scores)
    assert len(merges) == len(_brute_splits(tokens))


@pytest.mark.slow
def test_a_one_mebibyte_sentencepiece_entry_loads():
    """Was 286 s (every cut of the entry tried); the child's limit is a hang guard, not a benchmark."""
    script = textwrap.dedent(
        """
        from engine.synth.tokenizer import spm_vocab
        from engine.tokenizer import Tokenizer, read_vocab
        v = spm_vocab(512)
        tokens = list(v.tokens); tokens[-1] = "ab" * (1 << 19)
        meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.scores": list(v.scores), "tokenizer.ggml.token_type": list(v.token_types)}
        tok = Tokenizer(read_vocab(meta))
        print(len(tok.encode("ab" * 1000)))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT_DIR, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
