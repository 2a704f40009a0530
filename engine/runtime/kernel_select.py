"""Which device kernel runs, on which activation rounding, with which launch settings: the one place.

Every choice is a function of (device, quant type(s), tokens, step mode, :class:`~engine.config.EngineOptions`):

- **Kernel family** — :func:`fused`: the Triton kernels straight from the quantized blocks, or the torch
  references (``engine.runtime.references``); :func:`step_kernels`: the fused one-token step kernels
  (``step_kernels``, ``step_attention``) or torch ops. Triton serves a CUDA device, or the CPU through
  Triton's interpreter (``TRITON_INTERPRET=1``, the tests' simulated device), unless
  ``SHARPI_DEVICE_KERNELS=reference``.
- **Activation rounding** — :func:`act_mode` (an explicit ``act``, else ``SHARPI_DEVICE_ACT``, else exact
  float), :func:`trunk_act` (a trunk matrix), :func:`moe_act` (a layer's routed experts). ``"q8"`` (x
  rounded to 8-bit blocks like llama.cpp, integer dp4a kernels) is chosen only for a model that rounds
  its activations (``q8_act``), on a compiled CUDA device, for the lean Q4_K kernels, in a
  :data:`CAPTURED` step: there it measured faster (H100: the MoE in 1/1.63 of the exact-float kernels'
  time, decode 1.11–1.15× faster; q 6.1 → 3.8 µs with x̂ from the norm); launched from Python it did
  not, and the general q8 kernels never beat the float ones, so everything else is ``"f32"``.
- **Prompt precision** — :func:`prefill_precision`: the tiled prompt kernels multiply bfloat16 operands on
  the tensor cores (the default on a compiled CUDA device) or float32 ones (tf32x3: the reference-equivalent
  path; ``SHARPI_PREFILL_PRECISION=f32``, and the interpreter's default).
- **Which launch** — :func:`decode_kernels` (GEMV / fused-MoE decode kernels up to :data:`TRITON_MAX_T`
  tokens, the tiled ``grouped`` kernels beyond), :func:`matmul_kernel` (``triton_gemv.matmul``: ``gemv``
  | ``gemv_q8`` | ``gemv_q4k``) and :func:`moe_kernels`
  (``triton_moe.moe_decode``'s gate/up and down launches). The names are the launch tables' kernels.
- **Launch settings** — :func:`launch`: data, the JSON files of ``engine/runtime/launch/`` (keyed
  ``"<kernel>:<qtype>:<shape class>"``; ``README.md`` there gives each entry's rationale), loaded once
  into read-only mappings: ``SHARPI_LAUNCH_TABLE``'s file first, then the GPU's table
  (``device=<name>.json``), then the installed Triton's (``triton=<major.minor>.json``, the newest not
  newer than it; ``SHARPI_TRITON_TABLE`` picks another), then ``default.json``.

**Step mode.** :data:`EAGER` — launched from Python, one call at a time; :data:`CAPTURED` — inside a
CUDA-graph step: being captured, or the eager warm-up right before a capture
(``triton_qblocks.graph_warmup``), which must launch what the capture records. Every choice takes
``step`` explicitly; ``None`` asks :func:`step_mode`, the one place that reads the implicit state
(the warm-up context variable and ``torch.cuda.is_current_stream_capturing``).

``options=None`` means ``engine.config.current()``; the runtime passes the session's options.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from types import MappingProxyType

import torch

from engine import config
from engine.config import ACT_MODES, PREFILL_PRECISIONS, EngineOptions
from engine.quant.formats import QType
from engine.runtime import triton_q4k_gemv, triton_q4k_moe
from engine.runtime import triton_qblocks as qb

EAGER, CAPTURED = "eager", "captured"
STEP_MODES = (EAGER, CAPTURED)
TRITON_MAX_T = 8  # tokens up to which the GEMV / fused-MoE decode kernels serve; beyond, the tiled (tl.dot) ones
DEFAULT_ACT = "f32"  # on a compiled CUDA device, outside the lean kernels' graph steps (measured faster there)


def _opts(options: EngineOptions | None) -> EngineOptions:
    return config.current() if options is None else options


# The types the integer (q8-activation) kernels decode (triton_q8.q8_block); the others take the exact-float
# kernels in q8 mode too.
Q8_TYPES = (QType.Q4_0, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K)


# -- kernel family ------------------------------------------------------------------------------------
def available() -> bool:
    """Triton is installed."""
    return qb.triton is not None


def compiled(device: torch.device, options: EngineOptions | None = None) -> bool:
    """Triton compiles for ``device``: a CUDA device, not Triton's interpreter."""
    return qb.compiled(device, _opts(options))


def _triton_serves(device: torch.device, o: EngineOptions) -> bool:
    return available() and o.device_kernels != "reference" and (device.type == "cuda" or o.triton_interpret)


def fused(device: torch.device, qtype: QType, options: EngineOptions | None = None) -> bool:
    """Whether the Triton GEMV / fused-MoE kernels serve ``qtype`` on ``device`` (else the torch
    references: dequantize, then matmul): the types ``triton_qblocks`` decodes, on a compiled CUDA device those
    of them checked there (``triton_qblocks.CUDA_CHECKED``)."""
    o = _opts(options)
    return _triton_serves(device, o) and QType(qtype) in (qb.CUDA_CHECKED if compiled(device, o) else qb.SUPPORTED)


def step_kernels(device: torch.device, options: EngineOptions | None = None) -> bool:
    """Whether the fused one-token step kernels (norms, rope + KV write, routing, attention, the Gated DeltaNet
    core and its gated norm) serve ``device``."""
    return _triton_serves(device, _opts(options))


# -- step mode ------------------------------------------------------------------------------------------
def step_mode() -> str:
    """:data:`CAPTURED` while launches go into a CUDA graph step (capturing, or the warm-up before a
    capture: ``triton_qblocks.graph_warmup``), else :data:`EAGER`."""
    return CAPTURED if qb.in_graph_step() else EAGER


def _step(step: str | None) -> str:
    if step is None:
        return step_mode()
    if step not in STEP_MODES:
        raise ValueError(f"step mode {step!r}: expected one of {STEP_MODES}")
    return step


# -- activation rounding --------------------------------------------------------------------------------
def act_mode(device: torch.device, act: str | None = None, options: EngineOptions | None = None) -> str:
    """``act`` if given, else ``SHARPI_DEVICE_ACT``, else :data:`DEFAULT_ACT` on a compiled CUDA device
    and ``"f32"`` otherwise (Triton's interpreter, the simulated device)."""
    o = _opts(options)
    mode = (act or o.device_act or "").strip().lower()
    if not mode:
        mode = DEFAULT_ACT if compiled(device, o) else "f32"
    if mode not in ACT_MODES:
        raise ValueError(f"device activation mode {mode!r}: expected one of {ACT_MODES}")
    return mode


def graph_act(
    device: torch.device, eligible: bool, step: str | None = None, options: EngineOptions | None = None
) -> str:
    """The activation mode of a one-token launch the lean q8 kernels could serve: ``SHARPI_DEVICE_ACT``
    when set; else ``"q8"`` where ``eligible`` (the caller's test: a model that rounds its activations like
    llama.cpp, a compiled CUDA device, a kernel that applies) in a :data:`CAPTURED` step; else ``"f32"``."""
    o = _opts(options)
    if o.device_act:
        return act_mode(device, None, o)
    if not eligible:
        return "f32"
    return "q8" if _step(step) == CAPTURED else "f32"


def trunk_act(
    device: torch.device,
    q8_act: bool,
    qtype: QType,
    n: int,
    step: str | None = None,
    own_quant_bytes: int | None = None,
    options: EngineOptions | None = None,
) -> str:
    """:func:`graph_act` for a trunk matrix multiplying one token: eligible for a model that rounds its
    activations like llama.cpp (``q8_act``) and a Q4_K matrix (``triton_q4k_gemv``) on a compiled CUDA
    device. ``own_quant_bytes``: the matrix's bytes when x̂ is not handed to it (the call then quantizes
    x in a launch of its own): under ``triton_q4k_gemv.MIN_BYTES_OWN_QUANT`` that launch costs more than
    q8 saves, so exact float."""
    small = own_quant_bytes is not None and own_quant_bytes < triton_q4k_gemv.MIN_BYTES_OWN_QUANT
    eligible = q8_act and compiled(device, options) and triton_q4k_gemv.applies(qtype, n, 1) and not small
    return graph_act(device, eligible, step, options)


def moe_act(
    device: torch.device, q8_act: bool, roles: dict, step: str | None = None, options: EngineOptions | None = None
) -> str:
    """The activation mode a layer's routed experts (``roles``: {"gate"|"up"|"down": (offset, qtype, rows,
    n)}) decode with: :func:`graph_act`, eligible for a model that rounds like llama.cpp (``q8_act``, the
    default) where the lean Q4_K gate/up kernel applies (``triton_q4k_moe``) on a compiled CUDA device.
    Eager launches keep the exact-float kernels: the q8 path is two launches more a layer, and from
    Python (the 12 GiB cache placement) it measured no faster."""
    eligible = q8_act and compiled(device, options) and triton_q4k_moe.applies_gate_up(roles)
    return graph_act(device, eligible, step, options)


def prefill_precision(device: torch.device, options: EngineOptions | None = None) -> str:
    """The operands of the tiled prompt kernels (``triton_moe.one_matrix``, ``moe_prefill``):
    ``SHARPI_PREFILL_PRECISION`` if set, else ``"bf16"`` on a compiled CUDA device (x rounded to bfloat16
    once, weights dequantized to bfloat16 in registers, tensor-core MMA with float32 accumulation: on
    Hopper ~6× the rate of tf32x3) and ``"f32"`` elsewhere (Triton's interpreter: the simulated device
    keeps the reference-equivalent path, float32 operands, tf32x3 on CUDA)."""
    o = _opts(options)
    mode = o.prefill_precision or ("bf16" if compiled(device, o) else "f32")
    if mode not in PREFILL_PRECISIONS:
        raise ValueError(f"prefill precision {mode!r}: expected one of {PREFILL_PRECISIONS}")
    return mode


# -- which launch ---------------------------------------------------------------------------------------
def decode_kernels(tokens: int) -> bool:
    """Whether ``tokens`` rows of x go to the GEMV / fused-MoE decode kernels (``triton_gemv.matmul``,
    ``triton_moe.moe_decode``); more go to the tiled kernels (``grouped``: ``triton_moe.one_matrix``,
    ``moe_prefill``; launch settings ``grouped``, or ``grouped_bf16`` for :func:`prefill_precision` bf16),
    which read each weight tile once for a tile of tokens."""
    return tokens <= TRITON_MAX_T


def matmul_kernel(qtype: QType, n: int, tokens: int, act: str) -> str:
    """The kernel ``triton_gemv.matmul`` launches for ``tokens`` (≤ :data:`TRITON_MAX_T`) rows of x on a
    ``qtype`` matrix of width ``n``: in q8 mode ``"gemv_q4k"`` (Q4_K, one token) or ``"gemv_q8"``; else
    ``"gemv"`` (exact float)."""
    if act == "q8" and QType(qtype) in Q8_TYPES:
        return "gemv_q4k" if triton_q4k_gemv.applies(qtype, n, tokens) else "gemv_q8"
    return "gemv"


def moe_kernels(roles: dict, act: str) -> tuple[str, str]:
    """(gate/up kernel, down kernel) ``triton_moe.moe_decode`` launches for these expert roles: in q8 mode
    the lean Q4_K gate/up (``triton_q4k_moe``) with its own down when the down is Q4_K too, else h in float
    into the exact-float down; other q8 cases the general integer kernels (``triton_q8_moe``; F a multiple
    of 32); else the exact-float kernels."""
    if act == "q8" and triton_q4k_moe.applies_gate_up(roles):
        return "moe_q4k_gate_up", "moe_q4k_down" if triton_q4k_moe.applies(roles) else "moe_down"
    if act == "q8" and roles["gate"][2] % 32 == 0 and all(QType(r[1]) in Q8_TYPES for r in roles.values()):
        return "moe_q8_gate_up", "moe_q8_down"
    return "moe_gate_up", "moe_down"


# -- launch settings ------------------------------------------------------------------------------------
LAUNCH_DIR = Path(__file__).with_name("launch")
# Shape classes: by the number of output rows a launch computes (rows × pairs).
CLASSES = ((1024, "S"), (4096, "M"), (1 << 62, "L"))
# K walks of at most this many tile steps are unrolled (qb.acc_rows STEPS); a launch setting "UNROLL"
# overrides it (0: always a runtime loop).
UNROLL = qb.UNROLL

Table = Mapping[str, Mapping[str, int | str]]


def _read(path: Path) -> Table:
    table = json.loads(path.read_text())
    return MappingProxyType({k: MappingProxyType(v) for k, v in table.items()})


def _version(stem: str) -> tuple[int, int]:
    major, minor = stem.split("=", 1)[1].split(".")
    return int(major), int(minor)


DEFAULT: Table = _read(LAUNCH_DIR / "default.json")
BY_TRITON: Mapping[tuple[int, int], Table] = MappingProxyType(
    {_version(p.stem): _read(p) for p in sorted(LAUNCH_DIR.glob("triton=*.json"))}
)
# Keyed by torch.cuda.get_device_name() with spaces as underscores (the file names).
BY_DEVICE: Mapping[str, Table] = MappingProxyType(
    {p.stem.split("=", 1)[1]: _read(p) for p in sorted(LAUNCH_DIR.glob("device=*.json"))}
)


def device_table(device_name: str) -> Table:
    """The GPU's own table (``device=<name>.json``), or {}."""
    return BY_DEVICE.get(device_name.replace(" ", "_"), {}) if device_name else {}


@cache
def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton; (0, 0) without one."""
    if qb.triton is None:
        return (0, 0)
    major, minor = qb.triton.__version__.split(".")[:2]
    return int(major), int(minor)


def triton_table_version(
    version: tuple[int, int] | None = None, options: EngineOptions | None = None
) -> tuple[int, int] | None:
    """The :data:`BY_TRITON` key that applies to ``version`` — the newest not newer than it — or None.
    Default: ``SHARPI_TRITON_TABLE`` ((0, 0) for "none": the defaults alone), else the installed Triton."""
    if version is None:
        version = _opts(options).triton_table
    v = triton_version() if version is None else version
    return max((k for k in BY_TRITON if k <= v), default=None)


def triton_table(version: tuple[int, int] | None = None, options: EngineOptions | None = None) -> Table:
    """The :data:`BY_TRITON` table :func:`triton_table_version` picks, or {}."""
    key = triton_table_version(version, options)
    return BY_TRITON[key] if key else {}


def shape_class(out_rows: int) -> str:
    return next(name for limit, name in CLASSES if out_rows <= limit)


def launch(
    kernel: str, qtype: QType, out_rows: int, device_name: str = "", options: EngineOptions | None = None
) -> dict:
    """The launch settings for ``kernel`` on ``qtype`` computing ``out_rows`` rows (a fresh dict): per table
    — ``SHARPI_LAUNCH_TABLE``'s, the GPU's, the Triton version's, the default — the first of the keys
    ``kernel:qtype:class``, ``kernel:qtype:*``, ``kernel:*:class``, ``kernel:*:*`` that it holds."""
    o = _opts(options)
    cls, name = shape_class(out_rows), QType(qtype).name
    keys = (f"{kernel}:{name}:{cls}", f"{kernel}:{name}:*", f"{kernel}:*:{cls}", f"{kernel}:*:*")
    for table in (o.launch_table or {}, device_table(device_name), triton_table(None, o), DEFAULT):
        for k in keys:
            if k in table:
                return dict(table[k])
    raise KeyError(f"no launch settings for {kernel}")


def device_name(device: torch.device) -> str:
    """The name the GPU tables are keyed by (``torch.cuda.get_device_name``); "" off CUDA. Asked once per
    device: every kernel launch looks its settings up by it, and torch's query costs ~15 µs of host time."""
    return (
        _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else ""
    )


@cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)
