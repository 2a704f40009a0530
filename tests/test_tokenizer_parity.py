"""Token ids, pieces, attributes and end-of-generation set identical to llama.cpp's on the same file.

Every tokenizer kind: byte-level BPE under nine ``tokenizer.ggml.pre`` names (qwen2, llama-bpe,
olmo, default, gpt-2, qwen35, starcoder, falcon, dbrx) over one trained vocabulary, and
SentencePiece (scores without ties -> the ``tokenizers`` fast path; with ties -> the exact loop;
``add_space_prefix = false``), and the two vocabularies engine.synth writes into model files. The corpus (tests/data/tokenizer_corpus.json, 300+ strings) is
tokenized with and without special-token parsing, with and without BOS.
"""

from __future__ import annotations

import ctypes

import pytest

from tests.test_tokenizer import BPE_PRES, CORPUS, SPM_KINDS, SYNTH_KINDS, load, vocab_dir  # noqa: F401 (fixtures)

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llama

KINDS = BPE_PRES + SPM_KINDS + SYNTH_KINDS


@pytest.fixture(scope="module")
def oracle(load):  # noqa: F811 (the imported fixture)
    """``oracle(name) -> (Tokenizer, Llama)``; Llama opened with vocab_only, closed at module end."""
    opened = {}

    def get(name: str):
        if name not in opened:
            path, tok = load(name)
            opened[name] = (tok, llama_cpp.Llama(str(path), vocab_only=True, verbose=False))
        return opened[name]

    yield get
    for _, llm in opened.values():
        llm.close()


def _piece(llm, token_id: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token_id, buf, len(buf), 0, special)
    assert 0 <= n <= len(buf)
    return buf.raw[:n]


@pytest.mark.parametrize("name", KINDS)
def test_ids_match_llama_cpp(oracle, name):
    tok, llm = oracle(name)
    assert len(CORPUS) >= 200
    bad = []
    for s in CORPUS:
        for special in (True, False):
            for bos in (True, False):
                # Llama.tokenize's add_bos means "add what the file asks for" (llama_tokenize's add_special).
                want = llm.tokenize(s.encode("utf-8"), add_bos=bos, special=special)
                got = tok.encode(
                    s, add_bos=None if bos else False, add_eos=None if bos else False, parse_special=special
                )
                if got != want:
                    bad.append((s, special, bos, want, got))
    assert not bad, f"{len(bad)} mismatches, first: {bad[0]}"


@pytest.mark.parametrize("name", ["qwen2", "llama-bpe", "spm", "spm-ties", *SYNTH_KINDS])
def test_pieces_attrs_and_specials_match_llama_cpp(oracle, name):
    tok, llm = oracle(name)
    vocab = llm._model.vocab
    assert llama_cpp.llama_vocab_n_tokens(vocab) == tok.n_vocab
    assert llama_cpp.llama_vocab_bos(vocab) == tok.bos_id
    assert llama_cpp.llama_vocab_eos(vocab) == tok.eos_id
    assert llama_cpp.llama_vocab_eot(vocab) == (tok.eot_id if tok.eot_id is not None else -1)
    assert llama_cpp.llama_vocab_get_add_bos(vocab) == tok.add_bos
    for i in range(tok.n_vocab):
        assert llama_cpp.llama_vocab_get_attr(vocab, i) & 0x3F == tok.vocab.attrs[i], i
        assert llama_cpp.llama_vocab_is_eog(vocab, i) == tok.is_eog(i), i
        for special in (True, False):
            assert _piece(llm, i, special) == tok.token_to_piece(i, special), (i, special)


@pytest.mark.parametrize("name", ["qwen2", "default", "spm"])
def test_decode_matches_llama_detokenize(oracle, name):
    """Llama.detokenize as a second oracle: it drops one leading space after a leading BOS."""
    tok, llm = oracle(name)
    for s in CORPUS:
        ids = tok.encode(s, add_bos=True, parse_special=False)
        want = llm.detokenize(ids).decode("utf-8", errors="replace")
        assert tok.decode(ids, special=False) == want or (tok.kind == "bpe" and s.startswith(" ")), s
