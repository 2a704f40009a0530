"""A plain-data summary of a GGUF model: what ``sharpi inspect`` prints and the app's model card shows."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.errors import SharpIError
from engine.gguf import keys
from engine.gguf.reader import GGUFFile

_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.")


def is_routed_expert(name: str) -> bool:
    """Routed (``ffn_*_exps``) tensors; shared experts (``*_shexp``) belong to the trunk."""
    return _EXPERT_RE.match(name) is not None


@dataclass(frozen=True)
class ModelInfo:
    path: str
    file_size: int
    gguf_version: int
    architecture: str
    name: str
    supported: bool
    unsupported_reason: str
    hparams: dict[str, Any]
    tokenizer_model: str  # "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    tokenizer_pre: str
    vocab_size: int
    has_chat_template: bool
    tensor_count: int
    n_parameters: int
    bytes_by_type: dict[str, int]
    trunk_bytes: int
    expert_bytes: int  # all routed experts
    expert_bytes_per_layer: dict[int, int] = field(default_factory=dict)
    # One expert's gate+up+down bytes, the largest over layers, and per role.
    per_expert_bytes: int = 0
    per_expert_role_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(gf: GGUFFile) -> ModelInfo:
    from engine.models import read_args

    arch = str(gf.get(keys.ARCHITECTURE, "?"))
    supported, reason, hparams = True, "", {}
    try:
        hparams = read_args(gf).describe()
    except SharpIError as e:
        supported, reason = False, str(e)

    by_type: dict[str, int] = defaultdict(int)
    trunk = experts = n_params = 0
    per_layer: dict[int, int] = defaultdict(int)
    role_max: dict[str, int] = defaultdict(int)
    per_expert_layer: dict[int, int] = defaultdict(int)
    for t in gf.tensors.values():
        by_type[t.qtype.name] += t.nbytes
        n_params += t.n_elements
        m = _EXPERT_RE.match(t.name)
        if m:
            layer, role = int(m.group(1)), m.group(2)
            experts += t.nbytes
            per_layer[layer] += t.nbytes
            one = t.nbytes // t.shape[0]  # [E, out, in]: bytes of one expert's matrix
            role_max[role] = max(role_max[role], one)
            per_expert_layer[layer] += one
        else:
            trunk += t.nbytes
    tokens = gf.get(keys.TOKENIZER_TOKENS) or []
    return ModelInfo(
        path=gf.path,
        file_size=gf.file_size,
        gguf_version=gf.version,
        architecture=arch,
        name=str(gf.get(keys.NAME, "")),
        supported=supported,
        unsupported_reason=reason,
        hparams=hparams,
        tokenizer_model=str(gf.get(keys.TOKENIZER_MODEL, "")),
        tokenizer_pre=str(gf.get(keys.TOKENIZER_PRE, "")),
        vocab_size=len(tokens) if isinstance(tokens, list) else 0,  # a table of the wrong type: none
        has_chat_template=bool(gf.get(keys.CHAT_TEMPLATE)),
        tensor_count=len(gf.tensors),
        n_parameters=n_params,
        bytes_by_type=dict(sorted(by_type.items())),
        trunk_bytes=trunk,
        expert_bytes=experts,
        expert_bytes_per_layer=dict(sorted(per_layer.items())),
        per_expert_bytes=max(per_expert_layer.values(), default=0),
        per_expert_role_bytes=dict(role_max),
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
