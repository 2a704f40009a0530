"""The model library: the GGUF files on this machine, each with the planner's verdict before loading —
whether it can run here, how it would be placed, and its predicted decode speed.

Folders scanned by default (those that exist): the Hugging Face hub cache (``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), LM Studio's model folders (``~/.lmstudio/models``,
``~/.cache/lm-studio/models``), Ollama's blob store (``~/.ollama/models/blobs``: files without a
``.gguf`` name, recognised by the GGUF magic) and ``~/models``. Each file is judged from its header
alone (no weight is read): :func:`engine.preflight.refusal` (no weights; more than RAM + GPU memory),
an architecture the engine runs, then the planner's placement at the model's default context for this
machine's GPU memory (none: everything on the CPU) and that placement's predicted tok/s.

    for entry in scan(default_folders(environment)):
        print(entry.name, entry.verdict, entry.predicted_tok_s)
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class LibraryEntry:
    path: str
    name: str
    architecture: str = ""
    file_size: int = 0
    quant: str = ""  # the weight type holding most bytes
    n_ctx_train: int = 0
    runnable: bool = False
    verdict: str = ""  # a few words: why not, or how it would be placed
    detail: str = ""  # the verdict in full (a refusal's whole reason)
    predicted_tok_s: float | None = None  # the placement's predicted decode speed
    speeds: str = ""  # where the prediction's speeds come from ("measured speeds", "uncalibrated: ...")
    calibrated: bool = False  # the prediction rests on speeds measured on this machine for this file


def default_folders(env: Mapping[str, str], home: Path | None = None) -> list[Path]:
    """The usual places models are downloaded to, those that exist. ``env``: the process environment
    the caller read (``HF_HOME``, ``HF_HUB_CACHE`` are the Hugging Face hub's own variables)."""
    home = Path.home() if home is None else home
    hf = Path(env["HF_HOME"]) / "hub" if env.get("HF_HOME") else home / ".cache" / "huggingface" / "hub"
    candidates = [
        Path(env["HF_HUB_CACHE"]) if env.get("HF_HUB_CACHE") else hf,
        home / ".lmstudio" / "models",
        home / ".cache" / "lm-studio" / "models",
        home / ".ollama" / "models" / "blobs",
        home / "models",
    ]
    seen, out = set(), []
    for c in candidates:
        if c.is_dir() and c.resolve() not in seen:
            seen.add(c.resolve())
            out.append(c)
    return out


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def find_files(folders: Iterable[Path], limit: int = 2000) -> Iterator[Path]:
    """GGUF files under ``folders``: ``*.gguf`` names, and name-less blobs that start with the GGUF
    magic (Ollama's store); each real file once (the Hugging Face cache links snapshots to blobs)."""
    seen: set[Path] = set()
    n = 0
    for folder in folders:
        for root, _dirs, files in os.walk(folder, followlinks=False):
            for f in sorted(files):
                p = Path(root) / f
                if not (f.lower().endswith(".gguf") or (f.startswith("sha256") and _is_gguf(p))):
                    continue
                try:
                    real = p.resolve()
                    if real in seen or not real.is_file():
                        continue
                except OSError:
                    continue
                seen.add(real)
                yield p
                n += 1
                if n >= limit:
                    return


def judge(
    path: str | os.PathLike, ram: int | None = None, vram: int | None = None, profile=None, cpu_profile=None
) -> LibraryEntry:
    """The verdict on one file from its header: can it run here, how it would be placed, how fast.
    ``profile``: the speeds to plan with (None: the defaults); ``cpu_profile``: path -> this machine's
    measured CPU speeds for that file, or None — used for a verdict without a GPU when ``profile`` is None
    (``engine.bench.calibrate_host.cached_cpu_profile``). A prediction not from speeds measured here says so:
    ``speeds`` starts "uncalibrated" or "partly calibrated" and ``calibrated`` is False."""
    from engine.errors import SharpIError
    from engine.gguf import open_gguf
    from engine.modelinfo import describe
    from engine.plan import DeviceProfile, ModelSpec, PlanError, PlanRequest, default_ctx, plan
    from engine.plan.profile import profile_source
    from engine.preflight import check, gpu_bytes

    path = Path(path)
    entry = LibraryEntry(path=str(path), name=path.name)
    try:
        with open_gguf(path) as gf:
            info = describe(gf)
            spec = ModelSpec.from_gguf(gf) if info.supported else None
    except (SharpIError, OSError, ValueError) as e:
        return replace(entry, verdict="cannot run: not a usable GGUF", detail=str(e))
    quant = max(info.bytes_by_type.items(), key=lambda kv: kv[1])[0] if info.bytes_by_type else ""
    entry = replace(
        entry,
        name=info.name or path.stem,
        architecture=info.architecture,
        file_size=info.file_size,
        quant=quant,
        n_ctx_train=int(info.hparams.get("n_ctx_train", 0) or 0),
    )
    if not info.supported:
        return replace(entry, verdict="cannot run: not supported", detail=info.unsupported_reason)
    vram = gpu_bytes() if vram is None else vram
    kind, reason = check(path, ram=ram, vram=vram)
    if kind:
        return replace(entry, verdict=f"cannot run: {kind}", detail=reason)
    base = profile or (cpu_profile(path) if cpu_profile is not None and not vram else None) or DeviceProfile()
    ctx = default_ctx(spec.n_ctx_train)
    try:
        p = plan(spec, replace(base, vram_bytes=vram), PlanRequest(ctx=ctx, n_gpu_layers=-1 if vram else 0))
    except PlanError as e:
        return replace(entry, verdict="cannot be placed", detail=str(e))
    if p.n_gpu_layers:
        where = f"{p.n_gpu_layers}/{p.n_layer} layers on the GPU, experts: {p.moe_mode}"
    else:
        where = "everything on the CPU" + ("" if vram else " (no GPU)")
    tok_s = p.predicted_tok_s.get(p.moe_mode)
    source = profile_source(base, cpu_only=not p.n_gpu_layers)
    if source == "measured":
        speeds = "measured speeds"
    elif source == "partly measured":
        speeds = "partly calibrated: this CPU's fixed costs are measured, this file's matrix shapes are not"
    else:
        speeds = (
            "uncalibrated: default speeds, not measured here (`sharpi bench calibrate --device host` measures them)"
        )
    verdict = f"runs: {where}, context {ctx:,}"
    return replace(
        entry,
        runnable=True,
        verdict=verdict,
        detail=verdict,
        predicted_tok_s=tok_s,
        speeds=speeds,
        calibrated=source == "measured",
    )


def scan(folders: Iterable[Path], ram: int | None = None, vram: int | None = None, profile=None, cpu_profile=None):
    """:func:`judge` over every GGUF file under ``folders``."""
    for path in find_files(folders):
        yield judge(path, ram=ram, vram=vram, profile=profile, cpu_profile=cpu_profile)
