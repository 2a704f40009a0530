"""Tokenizer from GGUF metadata: special-token splitting, streaming detokenization, round trips,
the SentencePiece fast path against its reference loop, metadata errors, ``sharpi tokenize``.

The vocabularies are trained here with the ``tokenizers`` library (a few tenths of a second) on a
seeded multilingual text that is not the test corpus, and written as vocab-only GGUFs. The same
files serve ``test_tokenizer_parity.py``, which holds the ids against llama.cpp.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from engine.errors import MetadataError, UsageError
from engine.gguf import open_gguf
from engine.synth.tokenizer import Vocab as SynthVocab
from engine.synth.tokenizer import write_tokenizer
from engine.tokenizer import load_tokenizer, read_vocab
from engine.tokenizer.bpe import byte_decoder
from engine.tokenizer.pretokenizers import build_pre_tokenizer, pre_tokenizer_spec
from engine.tokenizer.spm import SPACE, escape, spm_encode_reference
from engine.tokenizer.vocab import ADD_SPACE_PREFIX

CORPUS: list[str] = json.loads((Path(__file__).parent / "data" / "tokenizer_corpus.json").read_text("utf-8"))
BPE_SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("</think>", 4)]
SPM_SPECIALS = [("<|im_start|>", 3), ("<|im_end|>", 3), ("<|endoftext|>", 3), ("<think>", 4), ("</think>", 4)]
# Pre-tokenizer names the parity tests cover (each a separate file over the same trained vocabulary).
BPE_PRES = ("qwen2", "llama-bpe", "olmo", "default", "gpt-2", "qwen35", "starcoder", "falcon", "dbrx")
SPM_KINDS = ("spm", "spm-ties", "spm-noprefix")
# The vocabularies engine.synth puts into synthetic model files (trained on pydoc text, [PADn] unused rows).
SYNTH_KINDS = ("synth-qwen2", "synth-spm")

_WORDS = (  # noqa: SIM905 (a word list reads better as text)
    "the of and to in is that for it with as was on be by this are from at or have not but what all "
    "were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first "
    "been its who now people my made over did down only way find use may water long little very after "
    "words called just where most know get through back much before go good new write our used me man "
    "don't I'm you're we've they'll he'd it's isn't DON'T Can't WON'T O'Neil "
    "café naïve Ångström Straße résumé über façade piñata Ελληνικά λόγος Привет мир данные "
    "你好 世界 中文 数据 模型 日本語 テスト こんにちは カタカナ 한국어 안녕하세요 مرحبا שלום नमस्ते ภาษาไทย "
    "😀 👍 🎉 🤖 ❤️ 🐍 ✓ → ∀ ≥ € £ ™ ° ½ "
    "def return class import self None True False print len range dict list str int float "
    "( ) [ ] { } < > = == != <= >= += -> => :: ; : , . ... ! ? @ # $ % ^ & * / \\ | ~ ` ' \" - _ "
    "0 1 2 3 7 9 10 42 99 100 123 2024 3.14 1,000 0x1F 1e-9 "
).split()
_SEPS = (" ", " ", " ", " ", "  ", "\n", "\n\n", "\t", ", ", ". ", "    ", "\r\n", "")


@functools.lru_cache(maxsize=1)
def training_text() -> tuple[str, ...]:
    """Seeded random lines over a multilingual word list (shares no line with the test corpus)."""
    rng = random.Random(1234)
    lines = []
    for _ in range(2500):
        n = rng.randint(3, 14)
        lines.append("".join(rng.choice(_WORDS) + rng.choice(_SEPS) for _ in range(n)))
    return tuple(lines)


def _trained(tok: HFTokenizer) -> tuple[list[str], list[str]]:
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


@functools.lru_cache(maxsize=1)
def bpe_vocab() -> SynthVocab:
    """Byte-level BPE (qwen2 regex for training), control + user-defined specials at the end."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = build_pre_tokenizer(pre_tokenizer_spec("qwen2"))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=3000, initial_alphabet=alphabet, max_token_length=12, show_progress=False)
    tok.train_from_iterator(training_text(), trainer)
    tokens, merges = _trained(tok)
    n = len(tokens)
    return SynthVocab(
        model="gpt2",
        pre="qwen2",
        tokens=tuple(tokens + [t for t, _ in BPE_SPECIALS]),
        token_types=tuple([1] * n + [k for _, k in BPE_SPECIALS]),
        merges=tuple(merges),
        bos_id=n,
        eos_id=n + 2,
        pad_id=n,
        add_bos=False,
    )


@functools.lru_cache(maxsize=1)
def spm_vocab() -> SynthVocab:
    """SentencePiece layout: <unk> <s> </s>, 256 byte tokens, pieces by merge rank, then specials.

    The alphabet is limited, so rare characters (most CJK, emoji) go through byte fallback.
    """
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=2200, limit_alphabet=120, max_token_length=10, show_progress=False)
    tok.train_from_iterator(training_text(), trainer)
    pieces, merges = _trained(tok)
    n_chars = len(pieces) - len(merges)  # alphabet first, then one piece per merge
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(len(pieces) + j) for j in range(n_chars)] + [-float(r) for r in range(len(merges))]
    tokens += [t for t, _ in SPM_SPECIALS]
    types += [k for _, k in SPM_SPECIALS]
    scores += [0.0] * len(SPM_SPECIALS)
    return SynthVocab(
        model="llama",
        pre=None,
        tokens=tuple(tokens),
        token_types=tuple(types),
        scores=tuple(scores),
        bos_id=1,
        eos_id=2,
        unk_id=0,
        add_bos=True,
    )


def write_vocab_gguf(path: Path, v: SynthVocab, extra: dict | None = None) -> Path:
    """A vocab-only GGUF (architecture + tokenizer keys, no tensors): enough for llama.cpp's vocab_only."""
    w = GGUFWriter(str(path), "llama")
    write_tokenizer(w, v)
    for k, val in (extra or {}).items():
        w.add_bool(k, val)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def vocab_file(directory: Path, name: str) -> Path:
    """``name``: a BPE pre-tokenizer from BPE_PRES, or one of SPM_KINDS / SYNTH_KINDS. Written once per directory."""
    path = directory / f"vocab-{name}.gguf"
    if path.exists():
        return path
    if name in BPE_PRES:
        return write_vocab_gguf(path, dataclasses.replace(bpe_vocab(), pre=name))
    if name in SYNTH_KINDS:
        from engine.synth import tokenizer as synth

        return write_vocab_gguf(
            path, synth.bpe_vocab(2048, "qwen2") if name == "synth-qwen2" else synth.spm_vocab(2048)
        )
    v = spm_vocab()
    if name == "spm-ties":
        # Coarse scores: many merge results tie, so the exact merge loop must be used.
        v = dataclasses.replace(v, scores=tuple(float(int(s / 40)) for s in v.scores))
    extra = {ADD_SPACE_PREFIX: False} if name == "spm-noprefix" else None
    return write_vocab_gguf(path, v, extra)


@pytest.fixture(scope="session")
def vocab_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer_vocabs")


@pytest.fixture(scope="session")
def load(vocab_dir):
    """``load(name) -> (path, Tokenizer)``, cached for the session."""

    @functools.cache
    def _load(name: str):
        path = vocab_file(vocab_dir, name)
        with open_gguf(path) as gf:
            return path, load_tokenizer(gf)

    return _load


# -- special tokens ----------------------------------------------------------------------------------


def test_partition_longest_first_and_user_defined_always(load):
    _, tok = load("qwen2")
    im_end, think = tok.token_id("<|im_end|>"), tok.token_id("<think>")
    assert tok.partition("a<|im_end|>b<think>c") == ["a", im_end, "b", think, "c"]
    # parse_special=False: control tokens stay text, user-defined ones are still split out (llama.cpp).
    assert tok.partition("a<|im_end|>b<think>c", parse_special=False) == ["a<|im_end|>b", think, "c"]
    assert tok.partition("") == []
    assert tok.partition("<|im_end|><|im_end|>") == [im_end, im_end]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_id("<|im_start|>") and ids[-1] == im_end
    assert tok.token_id("<|im_end|>") not in tok.encode("<|im_end|>", parse_special=False)


def test_special_ids_eog_and_bos_flags(load):
    _, bpe = load("qwen2")
    assert bpe.eos_id == bpe.token_id("<|im_end|>") and bpe.bos_id == bpe.token_id("<|endoftext|>")
    assert bpe.is_eog(bpe.token_id("<|im_end|>")) and bpe.is_eog(bpe.token_id("<|endoftext|>"))
    assert not bpe.is_eog(bpe.token_id("<|im_start|>")) and not bpe.is_eog(bpe.token_id("<think>"))
    assert bpe.eot_id == bpe.token_id("<|im_end|>")  # detected by text, as llama.cpp does
    assert not bpe.add_bos and bpe.encode("hi")[0] != bpe.bos_id
    assert bpe.encode("hi", add_bos=True)[0] == bpe.bos_id
    # Without add_bos_token in the file, llama-bpe adds BOS and qwen2 does not (llama.cpp's defaults).
    assert read_vocab(_meta(**{"tokenizer.ggml.pre": "llama-bpe"})).add_bos
    assert not read_vocab(_meta()).add_bos
    _, spm = load("spm")
    assert spm.encode("")[0] == spm.bos_id and spm.encode("", add_bos=False) == []
    assert spm.is_eog(spm.eos_id) and spm.is_eog(spm.token_id("<|im_end|>"))
    assert spm.encode("x", add_eos=True)[-1] == spm.eos_id


# -- decoding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "default"])
def test_bpe_round_trip_and_streaming(load, name):
    _, tok = load(name)
    for s in CORPUS:
        for special in (True, False):
            ids = tok.encode(s, add_bos=False, parse_special=special)
            assert tok.decode(ids) == s, (s, ids)
            d = tok.detokenizer()
            deltas = [d.push(i) for i in ids] + [d.flush()]
            assert "".join(deltas) == s
            assert all("\ufffd" not in x for x in deltas)


@pytest.mark.parametrize("name", SPM_KINDS)
def test_spm_round_trip_and_streaming(load, name):
    _, tok = load(name)
    n = 0
    for s in CORPUS:
        if SPACE in s or any(isinstance(f, int) for f in tok.partition(s)):
            continue  # "▁" decodes to a space; text after a special token gets a "▁" prefix (lossy, as llama.cpp)
        for bos in (True, False):
            ids = tok.encode(s, add_bos=bos)
            assert tok.decode(ids, special=False) == s, (s, ids)
        n += 1
    assert n > 200


def test_streaming_never_emits_half_a_character(load):
    _, tok = load("qwen2")
    s = "你好😀é" * 3
    # Spell the text byte by byte (each byte is its own BPE token) so characters span tokens.
    to_char = {b: c for c, b in byte_decoder().items()}
    ids = [tok.token_id(to_char[b]) for b in s.encode("utf-8")]
    d = tok.detokenizer()
    deltas = [d.push(i) for i in ids]
    assert all("\ufffd" not in x for x in deltas)
    assert [x for x in deltas if x] == list(s)  # each character comes out once, whole
    assert "".join(deltas) + d.flush() == s and d.pending == 0
    # A stream cut inside a character holds the bytes; flush() reports them as U+FFFD.
    d = tok.detokenizer()
    assert d.push(ids[0]) == "" and d.pending == 1
    assert d.flush() == "\ufffd"


def test_spm_byte_fallback_streams_whole_characters(load):
    _, tok = load("spm")
    s = "𝟙😀"  # not in the limited alphabet: <0xXX> byte tokens
    ids = tok.encode(s, add_bos=False)
    assert all(tok.vocab.attrs[i] & 32 for i in ids[1:])  # BYTE attribute after the "▁" piece
    d = tok.detokenizer(strip_leading_space=True)
    deltas = [d.push(i) for i in ids]
    assert "".join(deltas) + d.flush() == s
    assert sum(1 for x in deltas if x) == 2  # one delta per character


def test_special_tokens_render_or_hide(load):
    _, tok = load("qwen2")
    ids = tok.encode("<|im_start|>a<think>b<|im_end|>")
    assert tok.decode(ids) == "<|im_start|>a<think>b<|im_end|>"
    assert tok.decode(ids, special=False) == "a<think>b"  # user-defined tokens always render
    assert tok.token_to_piece(tok.token_id("<|im_end|>"), special=False) == b""
    with pytest.raises(UsageError, match="outside the vocabulary"):
        tok.decode([tok.n_vocab])


# -- SentencePiece fast path vs the reference loop ---------------------------------------------------


def test_spm_fast_path_matches_reference_loop(load):
    _, tok = load("spm")
    assert not tok.uses_reference
    v = tok.vocab
    t2i = {t: i for i, t in enumerate(v.tokens)}
    byte_ids = [t2i.get(f"<0x{b:02X}>") for b in range(256)]
    for s in CORPUS:
        for frag in tok.partition(s, parse_special=False):
            if isinstance(frag, str):
                ref = spm_encode_reference(escape(frag, True), t2i, v.scores, byte_ids)
                assert tok.hf.encode(frag, add_special_tokens=False).ids == ref, frag


def test_spm_ties_select_reference_loop(load):
    _, ties = load("spm-ties")
    _, plain = load("spm")
    assert ties.uses_reference and not plain.uses_reference
    assert ties.encode("hello world") != [] and ties.decode(ties.encode("hello world"), special=False) == "hello world"


# -- metadata ----------------------------------------------------------------------------------------


def _meta(**over):
    v = bpe_vocab()
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": list(v.tokens),
        "tokenizer.ggml.token_type": list(v.token_types),
        "tokenizer.ggml.merges": list(v.merges),
    }
    md.update(over)
    return {k: val for k, val in md.items() if val is not None}


def test_metadata_errors():
    read_vocab(_meta())
    with pytest.raises(MetadataError, match="no tokenizer"):
        read_vocab(_meta(**{"tokenizer.ggml.model": None}))
    with pytest.raises(MetadataError, match="not supported"):
        read_vocab(_meta(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(MetadataError, match="pre-tokenizer 'nonsense' is not supported"):
        read_vocab(_meta(**{"tokenizer.ggml.pre": "nonsense"}))
    with pytest.raises(MetadataError, match="merges"):
        read_vocab(_meta(**{"tokenizer.ggml.merges": None}))
    toks = list(bpe_vocab().tokens)
    toks[5] = toks[4]
    with pytest.raises(MetadataError, match="duplicate token"):
        read_vocab(_meta(**{"tokenizer.ggml.tokens": toks}))
    with pytest.raises(MetadataError, match="add_bos_token is true"):
        read_vocab(_meta(**{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.tokens": toks[:4]}))


def test_missing_pre_falls_back_to_default(caplog):
    v = read_vocab(_meta(**{"tokenizer.ggml.pre": None}))
    assert v.pre == "default" and v.pre_spec.family == "default"
    assert "default" in caplog.text


def test_control_looking_normal_token_becomes_control():
    md = _meta()
    types = list(md["tokenizer.ggml.token_type"])
    im_end = md["tokenizer.ggml.tokens"].index("<|im_end|>")
    types[im_end] = 1  # stored as a normal token: llama.cpp still treats it as control and EOG
    v = read_vocab({**md, "tokenizer.ggml.token_type": types})
    assert im_end in v.special_ids and im_end in v.eog_ids


# -- CLI -----------------------------------------------------------------------------------------------


def test_cli_tokenize_json(load, capsys):
    from engine.cli.main import main

    path, tok = load("qwen2")
    text = "Hi <|im_end|> 你好"
    assert main(["tokenize", "-m", str(path), "--text", text, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == tok.encode(text)
    assert main(["tokenize", "-m", str(path), "--text", text, "--json", "--no-special"]) == 0
    assert json.loads(capsys.readouterr().out) == tok.encode(text, parse_special=False)
    assert main(["tokenize", "-m", str(path), "--text", "a b"]) == 0
    assert "->" in capsys.readouterr().out
