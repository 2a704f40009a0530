"""ModelSpec: the plain-data footprint of a model that the planner and the runtime size from.

Built from a GGUF header (real tensor types and byte counts from the tensor table) by
:meth:`ModelSpec.from_gguf`, or from hyperparameters and a type rule by :meth:`ModelSpec.from_args`
(what-if sizing). Which tensors exist comes from ``engine.models``' tensor tables; this module only
groups their bytes:

- per layer, trunk bytes by component (:data:`COMPONENTS`): attention q/k/v/o, norms, biases,
  router, shared expert and its gate, dense FFN;
- per layer, one routed expert's bytes per role (``gate``/``up``/``down``) and the expert count;
- model-level: token embeddings, output norm, output matrix (``token_embd`` when tied), rope factors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from engine.errors import MissingTensorError
from engine.models import ModelArgs, TensorSpec, model_tensor_specs, read_args
from engine.models.tensors import EXPERT
from engine.quant.formats import QType, tensor_bytes

# Trunk components of a layer, in display order.
ATTN_Q, ATTN_K, ATTN_V, ATTN_O = "attn_q", "attn_k", "attn_v", "attn_o"
NORMS, BIAS, ROUTER, SHEXP, SHEXP_GATE, FFN = "norms", "bias", "router", "shexp", "shexp_gate", "ffn"
SSM = "ssm"  # a Gated DeltaNet layer's projections, conv kernels and gates (linear attention)
COMPONENTS: tuple[str, ...] = (ATTN_Q, ATTN_K, ATTN_V, ATTN_O, SSM, NORMS, BIAS, ROUTER, SHEXP, SHEXP_GATE, FFN)
# Roles of a routed expert, in slot order.
ROLES: tuple[str, ...] = ("gate", "up", "down")

# Layer tensor name (without "blk.N.") → trunk component or expert role.
_TRUNK_OF: dict[str, str] = {
    "attn_q.weight": ATTN_Q,
    "attn_k.weight": ATTN_K,
    "attn_v.weight": ATTN_V,
    "attn_output.weight": ATTN_O,
    "attn_norm.weight": NORMS,
    "ffn_norm.weight": NORMS,
    "post_attention_norm.weight": NORMS,
    "post_ffw_norm.weight": NORMS,
    "attn_q_norm.weight": NORMS,
    "attn_k_norm.weight": NORMS,
    "attn_q.bias": BIAS,
    "attn_k.bias": BIAS,
    "attn_v.bias": BIAS,
    "attn_output.bias": BIAS,
    "attn_sinks.weight": BIAS,  # gpt-oss: a sink logit per head
    "ffn_gate_inp.bias": ROUTER,
    # gpt-oss's per-expert biases: small ([E, F], [E, D] float32), held with the layer's trunk
    "ffn_gate_exps.bias": BIAS,
    "ffn_up_exps.bias": BIAS,
    "ffn_down_exps.bias": BIAS,
    "ffn_gate_inp.weight": ROUTER,
    "exp_probs_b.bias": ROUTER,
    "ffn_gate_inp_shexp.weight": SHEXP_GATE,
    "ffn_gate_shexp.weight": SHEXP,
    "ffn_up_shexp.weight": SHEXP,
    "ffn_down_shexp.weight": SHEXP,
    "ffn_gate.weight": FFN,
    "ffn_up.weight": FFN,
    "ffn_down.weight": FFN,
    **dict.fromkeys(
        (
            "attn_qkv.weight",
            "attn_gate.weight",
            "ssm_in.weight",
            "ssm_ba.weight",
            "ssm_beta.weight",
            "ssm_alpha.weight",
            "ssm_conv1d.weight",
            "ssm_dt.bias",
            "ssm_a",
            "ssm_norm.weight",
            "ssm_out.weight",
        ),
        SSM,
    ),
}
_ROLE_OF: dict[str, str] = {
    "ffn_gate_exps.weight": "gate",
    "ffn_up_exps.weight": "up",
    "ffn_down_exps.weight": "down",
}


class TensorInfo(NamedTuple):
    """What sizing needs of a tensor: ggml type, numpy-order shape, bytes."""

    qtype: QType
    shape: tuple[int, ...]
    nbytes: int


class _HasSize(Protocol):
    qtype: QType
    shape: tuple[int, ...]
    nbytes: int


DEFAULT_CTX_MAX = 4096  # an automatic context is the training context, at most this (its KV memory)


def default_ctx(n_ctx_train: int) -> int:
    """The context a model gets when none is asked for, in the CLI (``sharpi run``, ``sharpi plan``)
    and the app alike: the context it was trained for, at most :data:`DEFAULT_CTX_MAX` tokens."""
    return max(8, min(int(n_ctx_train) or DEFAULT_CTX_MAX, DEFAULT_CTX_MAX))


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's bytes.

    trunk: {component: bytes} for the tensors that stay with the layer (see :data:`COMPONENTS`).
    expert_role_bytes: {role: bytes of one routed expert's matrix} (empty for a dense layer).
    state_bytes: a linear-attention layer's fixed-size recurrent state (it then has no K/V); 0 for attention.
    kv_window: a sliding-window layer's window (its K/V a ring of ``kv_layout.kv_rows`` positions); 0: all of them.
    """

    index: int
    trunk: dict[str, int]
    n_expert: int = 0
    expert_role_bytes: dict[str, int] = field(default_factory=dict)
    state_bytes: int = 0
    kv_window: int = 0

    @property
    def has_kv(self) -> bool:
        """Whether the layer keeps K and V per position (attention); else its cache is ``state_bytes``."""
        return self.state_bytes == 0

    @property
    def trunk_bytes(self) -> int:
        return sum(self.trunk.values())

    @property
    def expert_bytes(self) -> int:
        """One routed expert (gate + up + down) in this layer."""
        return sum(self.expert_role_bytes.values())

    @property
    def routed_bytes(self) -> int:
        """All routed experts of this layer."""
        return self.n_expert * self.expert_bytes

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


@dataclass(frozen=True)
class ModelSpec:
    """A model's geometry and bytes, all the planner reads. Plain data: no file handle.

    ``output_bytes`` is the output matrix as the runtime holds it: ``output.weight``, or
    ``token_embd`` when the output is tied to the embeddings.
    """

    name: str
    arch: str
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # routed expert FFN width (0 for dense)
    n_ff_dense: int  # widest non-routed FFN: dense FFN or shared expert (0 if none)
    layers: tuple[LayerSpec, ...]
    token_embd_bytes: int
    output_bytes: int
    output_norm_bytes: int
    rope_freqs_bytes: int = 0
    tied_output: bool = False
    # Gated DeltaNet layers (0 without): the conv's width (q | k | v), the value heads and their total width.
    ssm_conv_dim: int = 0
    ssm_heads: int = 0
    ssm_inner: int = 0
    # Derived in __post_init__: prefix sums of layer trunk bytes (len n_layer + 1), and the
    # largest bytes of one routed expert per role over all layers.
    trunk_prefix: tuple[int, ...] = field(init=False, repr=False, compare=False)
    expert_role_max: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prefix = [0]
        for layer in self.layers:
            prefix.append(prefix[-1] + layer.trunk_bytes)
        object.__setattr__(self, "trunk_prefix", tuple(prefix))
        role_max = {r: max((lay.expert_role_bytes.get(r, 0) for lay in self.layers), default=0) for r in ROLES}
        object.__setattr__(self, "expert_role_max", {r: b for r, b in role_max.items() if b})

    # -- geometry -------------------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def kv_dim(self) -> int:
        """Width of one position's K (or V) in one layer: ``n_head_kv * head_dim``."""
        return self.n_head_kv * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def is_moe(self) -> bool:
        return any(lay.is_moe for lay in self.layers)

    @property
    def trunk_bytes(self) -> int:
        """All layers' trunk bytes (no embeddings, no output)."""
        return self.trunk_prefix[-1]

    @property
    def routed_bytes(self) -> int:
        """Every routed expert of every layer."""
        return sum(lay.routed_bytes for lay in self.layers)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("layers", "trunk_prefix")}
        d["n_layer"] = self.n_layer
        d["layers"] = [
            {
                "index": lay.index,
                "trunk": dict(lay.trunk),
                "n_expert": lay.n_expert,
                "expert_role_bytes": dict(lay.expert_role_bytes),
                "state_bytes": lay.state_bytes,
                "kv_window": lay.kv_window,
            }
            for lay in self.layers
        ]
        return d

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gf) -> ModelSpec:
        """From an open :class:`~engine.gguf.GGUFFile`: types and bytes from its tensor table.

        Raises the loader's errors for an unsupported architecture, inconsistent hyperparameters,
        or a missing or misshapen tensor (a geometry-only file with a sparse data region is fine).
        """
        from engine.gguf import keys
        from engine.models.tensors import validate_tensors

        args = read_args(gf)
        specs = model_tensor_specs(args)
        validate_tensors(gf, specs)
        return cls.from_tensors(args, gf.tensors, specs=specs, name=str(gf.get(keys.NAME, "") or ""))

    @classmethod
    def from_args(cls, args: ModelArgs, qtype_of: Callable[[TensorSpec], QType | int], name: str = "") -> ModelSpec:
        """From hyperparameters alone: every tensor of ``args``' table, typed by ``qtype_of(spec)``.

        Optional tensors (biases, ``output.weight``, ``rope_freqs``) are included only when
        ``qtype_of`` returns a type for them rather than ``None``.
        """
        specs = model_tensor_specs(args)
        table: dict[str, TensorInfo] = {}
        for s in specs:
            q = qtype_of(s)
            if q is None:
                continue
            table[s.name] = TensorInfo(QType(q), s.shape, tensor_bytes(q, s.shape))
        return cls.from_tensors(args, table, specs=specs, name=name)

    @classmethod
    def from_tensors(
        cls,
        args: ModelArgs,
        tensors: Mapping[str, _HasSize],
        *,
        specs: list[TensorSpec] | None = None,
        name: str = "",
    ) -> ModelSpec:
        """Group the bytes of ``tensors`` (name → object with qtype/shape/nbytes) by layer and
        component, following ``args``' tensor table (tensors not in the table are not loaded by
        the runtime and are not counted)."""
        specs = model_tensor_specs(args) if specs is None else specs
        trunk: list[dict[str, int]] = [{} for _ in range(args.n_layer)]
        roles: list[dict[str, int]] = [{} for _ in range(args.n_layer)]
        n_exp = [0] * args.n_layer
        glob: dict[str, int] = {}
        for s in specs:
            t = tensors.get(s.name)
            if t is None:
                if s.required:
                    raise MissingTensorError(f"tensor {s.name!r} is missing")
                continue
            if s.layer is None:
                glob[s.name] = int(t.nbytes)
                continue
            base = s.name.split(".", 2)[2]
            if s.role == EXPERT:
                E = int(t.shape[0])  # [E, out, in]
                roles[s.layer][_ROLE_OF[base]] = int(t.nbytes) // E
                n_exp[s.layer] = E
            else:
                comp = _TRUNK_OF.get(base)
                if comp is None:
                    raise AssertionError(f"tensor {s.name!r} has no sizing component; add it to _TRUNK_OF")
                trunk[s.layer][comp] = trunk[s.layer].get(comp, 0) + int(t.nbytes)
        recurrent = getattr(args, "recurrent", ())  # Gated DeltaNet hybrids: which layers hold a state, not K/V
        layers = tuple(
            LayerSpec(
                i,
                {c: trunk[i][c] for c in COMPONENTS if c in trunk[i]},
                n_exp[i],
                roles[i],
                args.state_bytes if i < len(recurrent) and recurrent[i] else 0,
                args.layer_window(i),
            )
            for i in range(args.n_layer)
        )
        embd = glob.get("token_embd.weight", 0)
        tied = "output.weight" not in glob
        return cls(
            name=name,
            arch=args.arch,
            n_embd=args.n_embd,
            n_head=args.n_head,
            n_head_kv=args.n_head_kv,
            head_dim=args.head_dim,
            n_vocab=args.n_vocab,
            n_ctx_train=args.n_ctx_train,
            n_expert=args.n_expert,
            n_expert_used=args.n_expert_used,
            n_ff_exp=args.n_ff_exp,
            n_ff_dense=max(args.n_ff, args.n_ff_shexp),
            layers=layers,
            token_embd_bytes=embd,
            output_bytes=embd if tied else glob["output.weight"],
            output_norm_bytes=glob.get("output_norm.weight", 0),
            rope_freqs_bytes=glob.get("rope_freqs.weight", 0),
            tied_output=tied,
            ssm_conv_dim=args.conv_dim if recurrent else 0,
            ssm_heads=args.ssm_dt_rank if recurrent else 0,
            ssm_inner=args.ssm_d_inner if recurrent else 0,
        )
