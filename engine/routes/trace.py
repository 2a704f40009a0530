"""The routing trace file: a NumPy ``.npz`` holding

========  =============================  ==================================================================
``ids``      int32 ``[tokens, layers, k]``  the experts each token chose in each MoE layer (distinct per row)
``weights``  float32, the same shape        their routing weights (what the experts' outputs are scaled by)
``phase``    uint8 ``[tokens]``             0 prompt, 1 decode
``meta``     a JSON string                  ``model``, ``n_expert`` (experts per layer), ``k``, ``layers`` (the
                                            model's layer index of each trace layer), ``source``, free keys
========  =============================  ==================================================================

Tokens are in the order the model ran them (a prompt's tokens, then each decoded token, then the next
prompt...). :func:`load_trace` reads only arrays (never pickles), checks each array's header before reading
its data, and refuses a file that contradicts itself with a :class:`~engine.errors.TraceError` saying what.
Other tools' traces convert by building a :class:`RouteTrace` and calling :func:`save_trace`.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import TraceError

PHASE_PROMPT, PHASE_DECODE = 0, 1
# A trace this large (ids elements) is refused before its data is read: 2^28 int32 = 1 GiB per array,
# ~690k tokens of a 48-layer, top-8 model.
MAX_ELEMENTS = 1 << 28
MAX_META_CHARS = 1 << 20
_ARRAYS = {"ids": np.int32, "weights": np.float32, "phase": np.uint8, "meta": None}


@dataclass(frozen=True)
class RouteTrace:
    """A routing trace in memory (see the module docstring for the arrays)."""

    ids: np.ndarray  # int32 [T, L, k]
    weights: np.ndarray  # float32 [T, L, k]
    phase: np.ndarray  # uint8 [T]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def n_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def k(self) -> int:
        return self.ids.shape[2]

    @property
    def n_expert(self) -> int:
        return int(self.meta["n_expert"])

    def validate(self, where: str = "trace") -> RouteTrace:
        """Self; a :class:`TraceError` naming the first contradiction otherwise."""
        ids, w, ph, meta = self.ids, self.weights, self.phase, self.meta
        for name, a in (("ids", ids), ("weights", w), ("phase", ph)):
            if not isinstance(a, np.ndarray) or a.dtype != _ARRAYS[name]:
                raise TraceError(f"{where}: {name} must be a {np.dtype(_ARRAYS[name]).name} array")
        if ids.ndim != 3 or 0 in ids.shape:
            raise TraceError(f"{where}: ids must be [tokens, layers, k] with none empty, not {list(ids.shape)}")
        if w.shape != ids.shape:
            raise TraceError(f"{where}: weights {list(w.shape)} must have the shape of ids {list(ids.shape)}")
        if ph.shape != ids.shape[:1]:
            raise TraceError(f"{where}: phase {list(ph.shape)} must be [tokens] = [{ids.shape[0]}]")
        if not isinstance(meta, dict):
            raise TraceError(f"{where}: meta must be a JSON object")
        E, k = meta.get("n_expert"), meta.get("k")
        if not isinstance(E, int) or isinstance(E, bool) or not 1 <= E <= 1 << 16:
            raise TraceError(f"{where}: meta.n_expert must be an integer in 1..65536, not {E!r}")
        if k != ids.shape[2]:
            raise TraceError(f"{where}: meta.k = {k!r} but ids has k = {ids.shape[2]}")
        if k > E:
            raise TraceError(f"{where}: k = {k} experts per token but only {E} experts per layer")
        layers = meta.get("layers")
        if layers is not None and (
            not isinstance(layers, list)
            or len(layers) != ids.shape[1]
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
        ):
            raise TraceError(f"{where}: meta.layers must list {ids.shape[1]} layer indices (integers >= 0)")
        if not isinstance(meta.get("model", ""), str):
            raise TraceError(f"{where}: meta.model must be a string")
        if ids.min() < 0 or ids.max() >= E:
            raise TraceError(f"{where}: expert ids must be in 0..{E - 1}, found {int(ids.min())}..{int(ids.max())}")
        s = np.sort(ids, axis=2)
        dup = np.nonzero((s[..., 1:] == s[..., :-1]).any(axis=2))
        if dup[0].size:
            t, layer = int(dup[0][0]), int(dup[1][0])
            raise TraceError(
                f"{where}: token {t}, layer {layer} chose an expert twice: {sorted(ids[t, layer].tolist())}"
            )
        if not np.isfinite(w).all():
            raise TraceError(f"{where}: weights must be finite")
        if ph.size and ph.max() > PHASE_DECODE:
            raise TraceError(f"{where}: phase must be 0 (prompt) or 1 (decode), found {int(ph.max())}")
        return self

    def layer(self, j: int) -> np.ndarray:
        """int32 [T, k]: the experts each token chose in trace layer ``j``."""
        return self.ids[:, j]


def save_trace(trace: RouteTrace, path: str | Path) -> Path:
    """Write ``trace`` (validated first) to ``path`` (compressed ``.npz``; the suffix is added if missing)."""
    trace.validate()
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    meta = json.dumps(trace.meta, sort_keys=True)
    with open(path, "wb") as f:
        np.savez_compressed(f, ids=trace.ids, weights=trace.weights, phase=trace.phase, meta=np.array(meta))
    return path


def _header(zf: zipfile.ZipFile, member: str, where: str) -> tuple[tuple[int, ...], np.dtype]:
    try:
        with zf.open(member) as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)  # the header only: no data, no pickle
    except (ValueError, OSError, zipfile.BadZipFile, EOFError, SyntaxError) as e:
        raise TraceError(f"{where}: {member} is not a NumPy array ({e})") from None
    return tuple(shape), dtype


def load_trace(path: str | Path) -> RouteTrace:
    """The trace in ``path``; a :class:`TraceError` saying what is wrong with a file that is not one."""
    path = Path(path)
    where = str(path)
    try:
        zf = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise TraceError(f"{where}: no such file") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise TraceError(f"{where}: not a .npz routing trace ({e})") from None
    with zf:
        members = {n.removesuffix(".npy"): n for n in zf.namelist()}
        missing = sorted(set(_ARRAYS) - set(members))
        extra = sorted(set(members) - set(_ARRAYS))
        if missing or extra:
            raise TraceError(
                f"{where}: a routing trace holds exactly ids, weights, phase and meta"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; unexpected {', '.join(extra)}" if extra else "")
            )
        arrays: dict[str, Any] = {}
        for name, want in _ARRAYS.items():
            shape, dtype = _header(zf, members[name], where)
            if name == "meta":
                if shape != () or dtype.kind != "U" or dtype.itemsize // 4 > MAX_META_CHARS:
                    raise TraceError(f"{where}: meta must be one JSON string of at most {MAX_META_CHARS} characters")
            else:
                if dtype != want:
                    raise TraceError(f"{where}: {name} is {dtype}, not {np.dtype(want).name}")
                if int(np.prod(shape, dtype=np.int64)) > MAX_ELEMENTS:
                    raise TraceError(f"{where}: {name} {list(shape)} is larger than {MAX_ELEMENTS} elements")
            with zf.open(members[name]) as f:
                try:
                    arrays[name] = np.lib.format.read_array(f, allow_pickle=False)
                except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
                    raise TraceError(f"{where}: {name} cannot be read ({e})") from None
    try:
        meta = json.loads(str(arrays["meta"]))
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: meta is not JSON ({e})") from None
    return RouteTrace(arrays["ids"], arrays["weights"], arrays["phase"], meta).validate(where)


class RouteRecorder:
    """Collects a model's routes as it runs: each MoE layer hands its routing of the tokens of a forward pass to
    :meth:`route` (kept by :meth:`observe`), the model closes the pass (:meth:`end_pass`, T tokens; one token is a
    decode step, more a prompt), and :meth:`trace` stacks what was seen. The same object serves any placement:
    the model sends every route through the layers' own routing while one is attached."""

    def __init__(self, n_expert: int, k: int, model: str = "", **meta: Any):
        self.meta = {"model": model, "n_expert": int(n_expert), "k": int(k), "source": "recorded", **meta}
        self._pass: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._ids: list[np.ndarray] = []
        self._weights: list[np.ndarray] = []
        self._phase: list[np.ndarray] = []
        self.layers: list[int] | None = None

    layerwise = True  # the model runs each token layer by layer while recording (see DecoderModel.set_route_tap)

    def begin_pass(self, n_tokens: int) -> None:
        pass

    def route(self, layer: int, r):
        """The tap: record layer ``layer``'s routing ``r`` (a Route) and leave it as it is."""
        self.observe(layer, r.ids, r.weights)
        return r

    def observe(self, layer: int, ids, weights) -> None:
        """``ids``, ``weights`` [T, k] (numpy or torch, any device): layer ``layer``'s routes in this pass."""
        self._pass[layer] = (_host(ids).astype(np.int32), _host(weights).astype(np.float32))

    def end_pass(self, n_tokens: int) -> None:
        if not self._pass:
            return
        layers = sorted(self._pass)
        if self.layers is None:
            self.layers = layers
        elif layers != self.layers:
            raise TraceError(f"a forward pass routed layers {layers}, the earlier ones {self.layers}")
        self._ids.append(np.stack([self._pass[i][0] for i in layers], axis=1))
        self._weights.append(np.stack([self._pass[i][1] for i in layers], axis=1))
        phase = PHASE_DECODE if n_tokens == 1 else PHASE_PROMPT
        self._phase.append(np.full(self._ids[-1].shape[0], phase, np.uint8))
        self._pass.clear()

    @property
    def n_tokens(self) -> int:
        return sum(len(p) for p in self._phase)

    def trace(self) -> RouteTrace:
        if not self._ids:
            raise TraceError("no routes were recorded (a dense model, or nothing ran)")
        meta = dict(self.meta, layers=list(self.layers or []))
        return RouteTrace(
            np.concatenate(self._ids), np.concatenate(self._weights), np.concatenate(self._phase), meta
        ).validate("recorded routes")


def _host(a) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().to("cpu").numpy()
    return np.asarray(a)
