"""The tensor tables architectures declare: names, numpy-order shapes, and roles.

A role says where bytes belong when placing a model: ``trunk`` (attention, norms, router, shared
expert, embeddings, output) or ``expert`` (routed ``ffn_*_exps``). Shapes are numpy order
(innermost last): a linear layer is ``(out, in)``, stacked experts ``(E, out, in)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import MissingTensorError, TensorShapeError
from engine.gguf.reader import GGUFFile
from engine.models.args import ModelArgs

TRUNK = "trunk"
EXPERT = "expert"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    role: str = TRUNK
    required: bool = True
    layer: int | None = None  # None for model-level tensors


def blk(i: int, name: str) -> str:
    return f"blk.{i}.{name}"


def global_specs(a: ModelArgs, output_required: bool = False) -> list[TensorSpec]:
    return [
        TensorSpec("token_embd.weight", (a.n_vocab, a.n_embd)),
        TensorSpec("output_norm.weight", (a.n_embd,)),
        TensorSpec("output.weight", (a.n_vocab, a.n_embd), required=output_required),
    ]


def attention_specs(i: int, a: ModelArgs, qk_norm: str | None = None, qkv_bias: bool = False) -> list[TensorSpec]:
    """Pre-norm GQA attention. ``qk_norm``: ``"head"`` (per head, Qwen3) or ``"proj"`` (whole
    projection, OLMoE) or None."""
    D, Q, KV = a.n_embd, a.q_dim, a.kv_dim
    specs = [
        TensorSpec(blk(i, "attn_norm.weight"), (D,), layer=i),
        TensorSpec(blk(i, "attn_q.weight"), (Q, D), layer=i),
        TensorSpec(blk(i, "attn_k.weight"), (KV, D), layer=i),
        TensorSpec(blk(i, "attn_v.weight"), (KV, D), layer=i),
        TensorSpec(blk(i, "attn_output.weight"), (D, Q), layer=i),
    ]
    if qk_norm == "head":
        specs += [
            TensorSpec(blk(i, "attn_q_norm.weight"), (a.head_dim,), layer=i),
            TensorSpec(blk(i, "attn_k_norm.weight"), (a.head_dim,), layer=i),
        ]
    elif qk_norm == "proj":
        specs += [
            TensorSpec(blk(i, "attn_q_norm.weight"), (Q,), layer=i),
            TensorSpec(blk(i, "attn_k_norm.weight"), (KV,), layer=i),
        ]
    if qkv_bias:
        specs += [
            TensorSpec(blk(i, "attn_q.bias"), (Q,), required=False, layer=i),
            TensorSpec(blk(i, "attn_k.bias"), (KV,), required=False, layer=i),
            TensorSpec(blk(i, "attn_v.bias"), (KV,), required=False, layer=i),
        ]
    return specs


def dense_ffn_specs(i: int, a: ModelArgs, norm: str = "ffn_norm") -> list[TensorSpec]:
    D, F = a.n_embd, a.n_ff
    return [
        TensorSpec(blk(i, f"{norm}.weight"), (D,), layer=i),
        TensorSpec(blk(i, "ffn_gate.weight"), (F, D), layer=i),
        TensorSpec(blk(i, "ffn_up.weight"), (F, D), layer=i),
        TensorSpec(blk(i, "ffn_down.weight"), (D, F), layer=i),
    ]


def moe_specs(i: int, a: ModelArgs, norm: str = "ffn_norm") -> list[TensorSpec]:
    D, E, F = a.n_embd, a.n_expert, a.n_ff_exp
    return [
        TensorSpec(blk(i, f"{norm}.weight"), (D,), layer=i),
        TensorSpec(blk(i, "ffn_gate_inp.weight"), (E, D), layer=i),
        TensorSpec(blk(i, "ffn_gate_exps.weight"), (E, F, D), role=EXPERT, layer=i),
        TensorSpec(blk(i, "ffn_up_exps.weight"), (E, F, D), role=EXPERT, layer=i),
        TensorSpec(blk(i, "ffn_down_exps.weight"), (E, D, F), role=EXPERT, layer=i),
    ]


def shared_expert_specs(i: int, a: ModelArgs, gated: bool = True) -> list[TensorSpec]:
    """The shared expert's gate/up/down; ``gated``: with its sigmoid gate vector (Qwen2-MoE; GLM-4.5 adds the
    shared expert ungated)."""
    D, F = a.n_embd, a.n_ff_shexp
    gate = [TensorSpec(blk(i, "ffn_gate_inp_shexp.weight"), (D,), layer=i)] if gated else []
    return gate + [
        TensorSpec(blk(i, "ffn_gate_shexp.weight"), (F, D), layer=i),
        TensorSpec(blk(i, "ffn_up_shexp.weight"), (F, D), layer=i),
        TensorSpec(blk(i, "ffn_down_shexp.weight"), (D, F), layer=i),
    ]


def gated_attention_specs(i: int, a: ModelArgs) -> list[TensorSpec]:
    """Qwen3.5 / Qwen3-Next full attention: q gives each head its query and its output gate (2·H·hd rows),
    per-head q/k norms, no biases."""
    D, Q, KV = a.n_embd, a.q_dim, a.kv_dim
    return [
        TensorSpec(blk(i, "attn_norm.weight"), (D,), layer=i),
        TensorSpec(blk(i, "attn_q.weight"), (2 * Q, D), layer=i),
        TensorSpec(blk(i, "attn_k.weight"), (KV, D), layer=i),
        TensorSpec(blk(i, "attn_v.weight"), (KV, D), layer=i),
        TensorSpec(blk(i, "attn_output.weight"), (D, Q), layer=i),
        TensorSpec(blk(i, "attn_q_norm.weight"), (a.head_dim,), layer=i),
        TensorSpec(blk(i, "attn_k_norm.weight"), (a.head_dim,), layer=i),
    ]


def delta_net_specs(i: int, a, fused_input: bool = False) -> list[TensorSpec]:
    """A Gated DeltaNet layer (``a``: :class:`~engine.models.args.HybridArgs`): split projections
    ``attn_qkv``/``attn_gate``/``ssm_beta``/``ssm_alpha`` or, fused_input, Qwen3-Next's ``ssm_in``/``ssm_ba``."""
    D, Hv, dv = a.n_embd, a.ssm_dt_rank, a.head_v_dim
    V = Hv * dv
    specs = [TensorSpec(blk(i, "attn_norm.weight"), (D,), layer=i)]
    if fused_input:
        specs += [
            TensorSpec(blk(i, "ssm_in.weight"), (a.conv_dim + V, D), layer=i),
            TensorSpec(blk(i, "ssm_ba.weight"), (2 * Hv, D), layer=i),
        ]
    else:
        specs += [
            TensorSpec(blk(i, "attn_qkv.weight"), (a.conv_dim, D), layer=i),
            TensorSpec(blk(i, "attn_gate.weight"), (V, D), layer=i),
            TensorSpec(blk(i, "ssm_beta.weight"), (Hv, D), layer=i),
            TensorSpec(blk(i, "ssm_alpha.weight"), (Hv, D), layer=i),
        ]
    return specs + [
        TensorSpec(blk(i, "ssm_conv1d.weight"), (a.conv_dim, a.ssm_d_conv), layer=i),
        TensorSpec(blk(i, "ssm_dt.bias"), (Hv,), layer=i),
        TensorSpec(blk(i, "ssm_a"), (Hv,), layer=i),
        TensorSpec(blk(i, "ssm_norm.weight"), (dv,), layer=i),
        TensorSpec(blk(i, "ssm_out.weight"), (D, V), layer=i),
    ]


def validate_tensors(gf: GGUFFile, specs: list[TensorSpec]) -> None:
    """Every required tensor present, every present tensor of the declared shape."""
    for s in specs:
        t = gf.tensors.get(s.name)
        if t is None:
            if s.required:
                raise MissingTensorError(f"tensor {s.name!r} is missing (expected shape {s.shape})", gf.path)
            continue
        if tuple(t.shape) != s.shape:
            raise TensorShapeError(
                f"tensor {s.name!r} has shape {tuple(t.shape)}, expected {s.shape} from the hyperparameters",
                gf.path,
            )
