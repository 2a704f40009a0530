"""A seeded GGUF mutator and a subprocess-isolated runner: damaged model files must end in a project error
or a correct run — never a traceback, a hang, a crash or a memory blow-up.

A base file (one of the synth writer's architectures) is parsed once into its header parts (key/value
fields with their GGUF types, the tensor table, the data); each case is ``(base, kind, seed)`` and
:func:`mutate` turns it into the bytes of a damaged file, deterministically, so a failure prints a
reproducer (``python -m tests.fuzz_gguf repro BASE KIND SEED``). :func:`run_cases` runs cases in
child interpreters (batched, each case under a time limit, the child under an address-space cap):
each case loads the file (``Session.load``), renders a chat prompt, plans a placement and generates a
few tokens; a child that dies or overruns is restarted past the case it was on.

Kinds (:data:`KINDS`): byte flips in the metadata and in the tensor table, truncation, inflated
counts and lengths, a bad alignment, duplicate tensor names, shapes and hyperparameters that disagree,
NaN/Inf weights, damaged tokenizer tables (tokens, types, merges, scores, byte tokens, special ids),
values of the wrong type, a missing key, tensor offsets and types out of range.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# GGUFValueType
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
           I64: "<q", F64: "<d"}  # fmt: skip


@dataclass
class Field:
    key: str
    vtype: int
    value: object  # scalar, str, or list
    subtype: int | None = None  # arrays


@dataclass
class TensorInfo:
    name: str
    dims: list[int]  # GGUF order (fastest first)
    ggml_type: int
    offset: int  # relative to the data section


@dataclass
class Parsed:
    version: int
    fields: list[Field]
    tensors: list[TensorInfo]
    alignment: int
    data: bytes  # the data section


def parse_bytes(raw: bytes) -> Parsed:
    """:func:`parse` of a file's bytes."""
    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(raw)
        f.flush()
        return parse(f.name)


def parse(path) -> Parsed:
    """A valid GGUF's parts (gguf-py's reader: the base files are the synth writer's)."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    fields = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        t = int(f.types[0])
        if t == ARR:
            sub = int(f.types[-1])
            if sub == STR:
                value = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                value = [x.item() for i in f.data for x in f.parts[i]]
            fields.append(Field(name, ARR, value, sub))
        elif t == STR:
            fields.append(Field(name, STR, bytes(f.parts[-1]).decode("utf-8")))
        else:
            fields.append(Field(name, t, f.parts[-1][0].item()))
    tensors = [
        TensorInfo(t.name, [int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset) - r.data_offset)
        for t in r.tensors
    ]
    data = bytes(np.asarray(r.data[r.data_offset :]))
    return Parsed(int(r.fields["GGUF.version"].parts[0][0]), fields, tensors, r.alignment, data)


def _s(text: str | bytes) -> bytes:
    b = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value, subtype=None) -> bytes:
    if vtype == STR:
        return _s(value)
    if vtype == ARR:
        head = struct.pack("<IQ", subtype, len(value))
        if subtype == STR:
            return head + b"".join(_s(v) for v in value)
        if subtype in _SCALAR:
            return head + np.asarray(value, dtype=np.dtype(_SCALAR[subtype])).tobytes()
        return head + b"".join(_value(ARR, v[1], v[0]) for v in value)  # nested arrays (never written by synth)
    return struct.pack(_SCALAR[vtype], value)


def serialize(p: Parsed, *, n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    out = [b"GGUF", struct.pack("<I", p.version)]
    out.append(
        struct.pack("<QQ", len(p.tensors) if n_tensors is None else n_tensors, len(p.fields) if n_kv is None else n_kv)
    )
    for f in p.fields:
        out += [_s(f.key), struct.pack("<I", f.vtype), _value(f.vtype, f.value, f.subtype)]
    for t in p.tensors:
        out += [_s(t.name), struct.pack("<I", len(t.dims)), struct.pack(f"<{len(t.dims)}Q", *t.dims)]
        out.append(struct.pack("<IQ", t.ggml_type, t.offset))
    head = b"".join(out)
    pad = -len(head) % p.alignment if p.alignment > 0 else 0
    return head + b"\0" * pad + p.data


# -- mutations ------------------------------------------------------------------------------------
TOKENIZER_KINDS = ("tok_tokens", "tok_types", "tok_merges", "tok_scores", "tok_bytes", "tok_special")
KINDS = (
    "flip_meta", "flip_tensor_table", "truncate", "inflate_count", "inflate_length", "alignment",
    "duplicate_name", "shape", "hparam", "nan_weights", "inf_weights", *TOKENIZER_KINDS,
    "wrong_type", "drop_key", "tensor_offset", "tensor_type",
)  # fmt: skip


def _field(p: Parsed, key: str) -> Field | None:
    return next((f for f in p.fields if f.key == key), None)


def _header_len(p: Parsed) -> tuple[int, int]:
    """(end of the key/value fields, end of the tensor table) in the serialized file."""
    kv_end = 24 + sum(len(_s(f.key)) + 4 + len(_value(f.vtype, f.value, f.subtype)) for f in p.fields)
    tt = sum(len(_s(t.name)) + 4 + 8 * len(t.dims) + 12 for t in p.tensors)
    return kv_end, kv_end + tt


def _pick(rng, options: list):
    """One of ``options`` as given (numpy's choice would turn 2**64 - 1 into a float)."""
    return options[int(rng.integers(0, len(options)))]


def _weird_int(rng) -> int:
    return _pick(rng, [0, 1, -1, 2, 3, 7, 255, 256, 65535, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1])


def _weird_str(rng) -> str:
    return _pick(
        rng,
        ["", " ", "<0x>", "<0xZZ>", "<0x1>", "<0x100>", "a b c", "\u2581", "<|im_end|>", "\x00", "ab" * 5000,
         "<s>", "</s>", "\u2581\u2581\u2581", "x" * 70000, "ab" * (1 << 19)],
    )  # fmt: skip


def mutate(base: Parsed, kind: str, seed: int) -> bytes:
    """The bytes of ``base`` damaged by ``kind``, chosen by ``seed`` (deterministic)."""
    rng = np.random.default_rng([seed, KINDS.index(kind)])
    p = Parsed(
        base.version,
        [
            Field(f.key, f.vtype, list(f.value) if isinstance(f.value, list) else f.value, f.subtype)
            for f in base.fields
        ],
        [TensorInfo(t.name, list(t.dims), t.ggml_type, t.offset) for t in base.tensors],
        base.alignment,
        base.data,
    )
    arch = _field(p, "general.architecture").value
    if kind in ("flip_meta", "flip_tensor_table"):
        raw = bytearray(serialize(p))
        kv_end, tt_end = _header_len(p)
        lo, hi = (24, kv_end) if kind == "flip_meta" else (kv_end, tt_end)
        for _ in range(int(rng.integers(1, 9))):
            raw[int(rng.integers(lo, hi))] ^= 1 << int(rng.integers(0, 8))
        return bytes(raw)
    if kind == "truncate":
        raw = serialize(p)
        return raw[: int(rng.integers(0, len(raw)))]
    if kind == "inflate_count":
        which = rng.integers(0, 2)
        big = _pick(rng, [len(p.fields) + 1, 1 << 20, 1 << 40, (1 << 64) - 1])
        return serialize(p, n_kv=big) if which else serialize(p, n_tensors=big)
    if kind == "inflate_length":
        raw = bytearray(serialize(p))
        f = p.fields[int(rng.integers(0, len(p.fields)))]
        # the key's own length, or the value's length / array count, set huge
        pos = 24
        for g in p.fields:
            if g is f:
                break
            pos += len(_s(g.key)) + 4 + len(_value(g.vtype, g.value, g.subtype))
        big = _pick(rng, [1 << 20, 1 << 32, 1 << 62, (1 << 64) - 1])
        if f.vtype in (STR, ARR) and rng.integers(0, 2):
            at = pos + len(_s(f.key)) + 4 + (4 if f.vtype == ARR else 0)
        else:
            at = pos
        raw[at : at + 8] = struct.pack("<Q", big)
        return bytes(raw)
    if kind == "alignment":
        v = _pick(rng, [0, 1, 3, 7, 48, 1 << 20, (1 << 32) - 1])
        f = _field(p, "general.alignment")
        if f is None:
            p.fields.append(Field("general.alignment", U32, v))
        else:
            f.value = v
        return serialize(p)
    if kind == "duplicate_name":
        i, j = rng.choice(len(p.tensors), 2, replace=False)
        p.tensors[int(j)].name = p.tensors[int(i)].name
        return serialize(p)
    if kind == "shape":
        t = p.tensors[int(rng.integers(0, len(p.tensors)))]
        op = int(rng.integers(0, 4))
        if op == 0:
            t.dims[int(rng.integers(0, len(t.dims)))] = _pick(rng, [0, 1, 32, 256, 1 << 31])
        elif op == 1:
            t.dims = t.dims[::-1]
        elif op == 2:
            t.dims = t.dims + [_pick(rng, [1, 2])]
        else:
            t.dims = t.dims[:-1] or [1]
        return serialize(p)
    if kind == "hparam":
        cands = [f for f in p.fields if f.key.startswith(arch + ".") and f.vtype != ARR]
        f = cands[int(rng.integers(0, len(cands)))]
        if f.vtype in (F32, F64):
            f.value = _pick(rng, [0.0, -1.0, np.nan, np.inf, 1e30, 1e-30])
        elif f.vtype == BOOL:
            f.value = not f.value
        elif f.vtype == STR:
            f.value = _weird_str(rng)
        else:
            f.vtype, f.value = U32, _pick(rng, [0, 1, 2, 3, 5, 1000, 1 << 20, (1 << 32) - 1])
        return serialize(p)
    if kind in ("nan_weights", "inf_weights"):
        data = bytearray(p.data)
        t = p.tensors[int(rng.integers(0, len(p.tensors)))]
        bad = {"nan_weights": (b"\x00\x7e", b"\x00\x00\xc0\x7f"), "inf_weights": (b"\x00\x7c", b"\x00\x00\x80\x7f")}[
            kind
        ]
        # f16 specials land in f16/quant-scale halves; f32 specials in f32 tensors; either way, in the tensor's bytes
        end = min(len(data), t.offset + max(16, _nbytes(t)))
        for _ in range(int(rng.integers(1, 6))):
            v = bad[1] if t.ggml_type == 0 else bad[0]
            at = t.offset + int(rng.integers(0, max(1, end - t.offset - len(v)))) // len(v) * len(v)
            data[at : at + len(v)] = v
        p.data = bytes(data)
        return serialize(p)
    if kind in TOKENIZER_KINDS:
        return serialize(_mutate_tokenizer(p, kind, rng))
    if kind == "wrong_type":
        f = p.fields[int(rng.integers(0, len(p.fields)))]
        choice = int(rng.integers(0, 5))
        if choice == 0:
            f.vtype, f.value, f.subtype = STR, _weird_str(rng), None
        elif choice == 1:
            f.vtype, f.value, f.subtype = I32, _pick(rng, [-1, 0, 7]), None
        elif choice == 2:
            f.vtype, f.value, f.subtype = F32, _pick(rng, [np.nan, 0.5, -3.0]), None
        elif choice == 3:
            f.vtype, f.value, f.subtype = ARR, [1, 2, 3], I32
        else:
            f.vtype, f.value, f.subtype = BOOL, True, None
        return serialize(p)
    if kind == "drop_key":
        del p.fields[int(rng.integers(0, len(p.fields)))]
        return serialize(p)
    if kind == "tensor_offset":
        t = p.tensors[int(rng.integers(0, len(p.tensors)))]
        t.offset = _pick(rng, [1, 3, len(p.data), len(p.data) - 32, 1 << 40, (1 << 64) - 32]) // 1
        return serialize(p)
    if kind == "tensor_type":
        t = p.tensors[int(rng.integers(0, len(p.tensors)))]
        t.ggml_type = _pick(rng, [2, 3, 6, 8, 10, 11, 16, 20, 30, 39, 40, 1000])
        return serialize(p)
    raise ValueError(f"unknown mutation kind {kind!r}")


def _nbytes(t: TensorInfo) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    return int(np.prod(t.dims)) // block * size


def _mutate_tokenizer(p: Parsed, kind: str, rng) -> Parsed:
    toks = _field(p, "tokenizer.ggml.tokens")
    n = len(toks.value)
    op = int(rng.integers(0, 6))
    if kind == "tok_tokens":
        v = toks.value
        if op == 0:
            v[int(rng.integers(0, n))] = _weird_str(rng)
        elif op == 1:
            del v[int(rng.integers(0, n)) :]
        elif op == 2:
            v[int(rng.integers(0, n))] = v[int(rng.integers(0, n))]  # duplicate
        elif op == 3:
            for _ in range(int(rng.integers(1, 50))):
                v[int(rng.integers(0, n))] = ""
        elif op == 4:
            v.extend(_weird_str(rng) + str(k) for k in range(int(rng.integers(1, 20))))
        else:
            toks.subtype, toks.value = I32, list(range(n))
    elif kind == "tok_types":
        f = _field(p, "tokenizer.ggml.token_type")
        if f is None:
            f = Field("tokenizer.ggml.token_type", ARR, [1] * n, I32)
            p.fields.append(f)
        if op == 0:
            for _ in range(int(rng.integers(1, 30))):
                f.value[int(rng.integers(0, n))] = _pick(rng, [0, 2, 3, 4, 5, 6, 7, -1, 1000])
        elif op == 1:
            del f.value[int(rng.integers(0, n)) :]
        elif op == 2:
            f.value = [6] * n  # every token a byte token
        elif op == 3:
            f.value = [int(x) for x in rng.choice([1, 2, 3, 4, 5, 6], n)]
        elif op == 4:
            f.subtype, f.value = STR, ["1"] * n
        else:
            f.vtype, f.value, f.subtype = I32, 3, None
    elif kind == "tok_merges":
        f = _field(p, "tokenizer.ggml.merges")
        if f is None:
            f = Field("tokenizer.ggml.merges", ARR, [], STR)
            p.fields.append(f)
        m = f.value
        if op == 0:
            for _ in range(int(rng.integers(1, 30))):
                if m:
                    m[int(rng.integers(0, len(m)))] = _weird_str(rng)
        elif op == 1:
            f.subtype, f.value = I32, list(range(len(m) or 3))
        elif op == 2:
            m.extend(f"{toks.value[int(rng.integers(0, n))]} {toks.value[int(rng.integers(0, n))]}" for _ in range(200))
        elif op == 3:
            f.value = m[::-1]
        elif op == 4:
            f.value = ["a " * 3000] * 5 + m
        else:
            f.vtype, f.value, f.subtype = STR, "a b", None
    elif kind == "tok_scores":
        f = _field(p, "tokenizer.ggml.scores")
        if f is None:
            f = Field("tokenizer.ggml.scores", ARR, [0.0] * n, F32)
            p.fields.append(f)
        if op == 0:
            for _ in range(int(rng.integers(1, 30))):
                f.value[int(rng.integers(0, n))] = _pick(rng, [np.nan, np.inf, -np.inf, 1e38])
        elif op == 1:
            del f.value[int(rng.integers(0, n)) :]
        elif op == 2:
            f.value = [0.0] * n  # every score tied
        elif op == 3:
            f.value = [float(x) for x in rng.standard_normal(n)]
        elif op == 4:
            f.subtype, f.value = STR, ["0"] * n
        else:
            f.value = [float("nan")] * n
    elif kind == "tok_bytes":
        v = toks.value
        ids = [i for i, t in enumerate(v) if t.startswith("<0x")] or list(range(min(n, 300)))
        types = _field(p, "tokenizer.ggml.token_type")
        for _ in range(int(rng.integers(1, 20))):
            i = ids[int(rng.integers(0, len(ids)))]
            v[i] = _pick(rng, ["<0x>", "<0xZZ>", "<0x1>", "<0x100>", "", "<0x4", "<0x-1>", "<0x 1>", f"tok{i}"])
            if types is not None and types.subtype != STR and i < len(types.value):
                types.value[i] = 6
        if op == 0 and types is not None:  # and some ordinary tokens typed as bytes
            for _ in range(20):
                i = int(rng.integers(0, min(n, len(types.value))))
                types.value[i] = 6
    elif kind == "tok_special":
        key = _pick(rng, ["bos_token_id", "eos_token_id", "eot_token_id", "unknown_token_id", "padding_token_id"])
        f = _field(p, "tokenizer.ggml." + key)
        value = _weird_int(rng)
        if f is None:
            p.fields.append(Field("tokenizer.ggml." + key, U64, value & ((1 << 64) - 1)))
        else:
            f.vtype, f.value = U64, value & ((1 << 64) - 1)
        if op == 0:
            p.fields.append(Field("tokenizer.ggml.add_bos_token", BOOL, True))
        if op == 1:
            f2 = _field(p, "tokenizer.ggml.pre")
            if f2 is not None:
                f2.value = _weird_str(rng)
        if op == 2:
            f2 = _field(p, "tokenizer.ggml.model")
            f2.value = _pick(rng, ["gpt2", "llama", "bert", ""])
    return p


# -- base files -----------------------------------------------------------------------------------
# (arch, weight type, synth keywords): the synth writer's architectures and the quant types the kernels serve
BASES = (
    ("qwen3moe", "Q4_K", {}),
    ("qwen2moe", "Q8_0", {}),
    ("olmoe", "Q5_K", {}),
    ("llama", "Q4_0", {"experts": 4}),  # Mixtral-style, SentencePiece vocabulary
    ("llama", "Q6_K", {}),  # dense
    ("qwen3", "F16", {}),
    ("qwen35moe", "F32", {}),
)


def base_name(i: int) -> str:
    arch, qtype, kw = BASES[i]
    return f"{arch}-{qtype}" + ("-moe" if kw.get("experts") else "")


def write_bases(folder) -> list[Path]:
    """The base files, written once into ``folder`` (seed 0, the synth writer's tiny geometries)."""
    from engine.synth import write_model

    out = []
    for i, (arch, qtype, kw) in enumerate(BASES):
        path = Path(folder) / f"{base_name(i)}.gguf"
        if not path.exists():
            write_model(path, arch, weight_type=qtype, seed=0, **kw)
        out.append(path)
    return out


# -- the child: one case after another ------------------------------------------------------------
OK, ERROR, TRACEBACK, HANG, CRASH = "ok", "error", "traceback", "hang", "crash"


def exercise(path: str) -> str:
    """Load, render a chat, plan and generate 4 tokens; the outcome ("ok" or "error: ...") — a Python
    exception other than the project's propagates."""
    from engine.api import LoadOptions, Session
    from engine.errors import SharpIError
    from engine.generate import SamplingParams
    from engine.plan import PlanRequest

    try:
        with Session.load(path, LoadOptions(n_ctx=64, device="cpu")) as s:
            s.plan(PlanRequest(ctx=64))
            msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi <|im_end|> there"}]
            for m in (msgs, None):
                kw = {"messages": m} if m else {"prompt": "The quick brown fox"}
                try:
                    for _ in s.generate(**kw, params=SamplingParams(seed=1, max_tokens=4)):
                        pass
                except SharpIError as e:  # a template error leaves the raw prompt to run
                    if m is None:
                        raise
                    last = e
            s.detokenize(list(range(min(s.tokenizer.n_vocab, 300))))
        return OK if "last" not in locals() else f"{ERROR}: {type(last).__name__}"
    except SharpIError as e:
        return f"{ERROR}: {type(e).__name__}"


def _child(mem_cap: int) -> None:
    """Read case paths from stdin, one a line; write ``START i`` then ``DONE i outcome-json`` for each."""
    import resource
    import traceback

    if mem_cap:
        resource.setrlimit(resource.RLIMIT_AS, (mem_cap, mem_cap))
    import engine.api  # noqa: F401  (imports before the first case's clock)

    for i, line in enumerate(sys.stdin):
        path = line.rstrip("\n")
        print(f"START {i}", flush=True)
        try:
            outcome = exercise(path)
        except BaseException as e:  # noqa: BLE001 — the finding
            outcome = f"{TRACEBACK}: " + "".join(traceback.format_exception(e))[-3000:]
        print(f"DONE {i} {json.dumps(outcome)}", flush=True)


@dataclass
class Result:
    base: int
    kind: str
    seed: int
    outcome: str  # ok | error: <class> | traceback: ... | hang | crash: ...

    @property
    def status(self) -> str:
        return self.outcome.split(":", 1)[0]

    def reproducer(self) -> str:
        return f"python -m tests.fuzz_gguf repro {self.base} {self.kind} {self.seed}"


def run_cases(
    cases,
    bases: list[Parsed],
    *,
    timeout: float = 30.0,
    mem_cap: int = 6 << 30,
    batch: int = 40,
    workers: int | None = None,
) -> list[Result]:
    """Run ``cases`` ((base index, kind, seed), ...) in child interpreters; one :class:`Result` each,
    in the order of ``cases``.

    A case gets ``timeout`` seconds (the first of a child also its imports); one over it is a hang, a
    child that dies mid-case a crash; the child is then restarted at the next case. ``workers`` children
    run side by side (default: one per core, at most two), each over its own contiguous share."""
    cases = list(cases)
    workers = max(1, min(workers or min(os.cpu_count() or 1, 2), len(cases) or 1))
    with tempfile.TemporaryDirectory(prefix="sharpi-fuzz-") as tmp:
        if workers == 1:
            return _run_share(cases, 0, bases, Path(tmp), timeout, mem_cap, batch)
        from concurrent.futures import ThreadPoolExecutor

        step = -(-len(cases) // workers)
        with ThreadPoolExecutor(workers) as pool:
            parts = pool.map(
                lambda k: _run_share(cases[k : k + step], k, bases, Path(tmp), timeout, mem_cap, batch),
                range(0, len(cases), step),
            )
            return [r for part in parts for r in part]


def _run_share(cases, first: int, bases, tmp: Path, timeout: float, mem_cap: int, batch: int) -> list[Result]:
    results: list[Result] = []
    k = 0
    while k < len(cases):  # a batch's files are written before it runs and deleted after (10,000 cases
        chunk = []  # of up to ~30 MB each would not fit a disk at once)
        for j, (b, kind, seed) in enumerate(cases[k : k + batch]):
            path = tmp / f"case{first + k + j}.gguf"
            path.write_bytes(mutate(bases[b], kind, seed))
            chunk.append(path)
        outcomes = _run_batch(chunk, timeout, mem_cap)
        for j, outcome in enumerate(outcomes):
            b, kind, seed = cases[k + j]
            results.append(Result(b, kind, seed, outcome))
        for path in chunk:
            path.unlink(missing_ok=True)
        k += len(outcomes)
    return results


def _run_batch(paths, timeout: float, mem_cap: int) -> list[str]:
    """Outcomes of a prefix of ``paths`` (at least one): stops after a hang or a crash."""
    import selectors

    from tests.triton_data import die_with_parent

    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 — a file, not a pipe: a chatty child must never block
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fuzz_gguf", "child", str(mem_cap)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        env=env,
        preexec_fn=die_with_parent,
    )
    proc.stdin.write("".join(f"{p}\n" for p in paths))
    proc.stdin.close()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    outcomes: list[str] = []
    deadline = time.monotonic() + timeout + 30  # the first case also pays the imports
    try:
        while len(outcomes) < len(paths):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                outcomes.append(HANG)
                break
            line = proc.stdout.readline()
            if not line:
                proc.wait()
                err.seek(0)
                outcomes.append(f"{CRASH}: exit {proc.returncode}: {err.read()[-2000:]}")
                break
            if line.startswith("START"):
                deadline = time.monotonic() + timeout
            elif line.startswith("DONE"):
                outcomes.append(json.loads(line.split(" ", 2)[2]))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        sel.close()
        proc.stdout.close()
        err.close()
    return outcomes


def sample(n: int, seed: int = 0) -> list[tuple[int, str, int]]:
    """``n`` cases spread evenly over kinds and bases (seeded)."""
    rng = np.random.default_rng(seed)
    nk = len(KINDS)
    return [((k + k // nk) % len(BASES), KINDS[k % nk], int(rng.integers(0, 1 << 31))) for k in range(n)]


def summary(results: list[Result]) -> dict[str, dict[str, int]]:
    """{kind: {status: count}}."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        d = out.setdefault(r.kind, {})
        d[r.status] = d.get(r.status, 0) + 1
    return out


def main(argv: list[str]) -> None:
    if argv[0] == "child":
        _child(int(argv[1]))
        return
    folder = Path(os.environ.get("SHARPI_FUZZ_DIR", Path(tempfile.gettempdir()) / "sharpi-fuzz-bases"))
    folder.mkdir(parents=True, exist_ok=True)
    bases = [parse(p) for p in write_bases(folder)]
    if argv[0] == "repro":  # BASE KIND SEED: write the case and run it here, in this process
        b, kind, seed = int(argv[1]), argv[2], int(argv[3])
        path = folder / f"repro-{b}-{kind}-{seed}.gguf"
        path.write_bytes(mutate(bases[b], kind, seed))
        print(path)
        print(exercise(str(path)))
    elif argv[0] == "run":  # N [SEED]: N cases in child processes, counts per kind, failures' reproducers
        n, seed = int(argv[1]), int(argv[2]) if len(argv) > 2 else 0
        results = run_cases(sample(n, seed), bases)
        print(json.dumps(summary(results), indent=1, sort_keys=True))
        for r in results:
            if r.status in (TRACEBACK, HANG, CRASH):
                print(r.reproducer(), r.outcome[-600:].replace("\n", "\n    "))


if __name__ == "__main__":
    main(sys.argv[1:])
