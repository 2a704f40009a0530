"""What a synthetic model looks like: its geometry and the tensors llama.cpp expects for it.

The layout is written from llama.cpp's ``llama_model::load_tensors`` (``src/llama-model.cpp``) and
the tensor-name table of ``src/llama-arch.cpp`` (mirrored by gguf-py's ``MODEL_TENSORS``), on
purpose *independently* of ``engine.models``: synthetic files check the engine's loader, so they
must not be generated from its own tables.

Shapes are numpy order (innermost last): a linear layer is ``(out, in)``, stacked experts
``(E, out, in)``, the router ``(E, D)``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gguf.constants import MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

from engine.errors import UsageError

ARCHS: tuple[str, ...] = (
    "qwen3moe",
    "qwen2moe",
    "olmoe",
    "llama",
    "qwen3",
    "qwen35moe",
    "qwen35",
    "qwen3next",
    "gemma3",
    "glm4moe",
    "gpt-oss",
)
HYBRIDS = ("qwen35moe", "qwen35", "qwen3next")  # Gated DeltaNet + gated full attention

# Tensor kinds: how a tensor is initialised and which type it gets.
EMBEDDING = "embedding"  # token_embd [V, D]
OUTPUT = "output"  # output [V, D]
MATRIX = "matrix"  # linear layer [out, in]
EXPERTS = "experts"  # stacked routed experts [E, out, in]
NORM = "norm"  # RMSNorm weight [n] (F32)
BIAS = "bias"  # projection bias [n] (F32)
ROUTER = "router"  # ffn_gate_inp [E, D] (F32, as llama.cpp's quantizer keeps it)
SHEXP_GATE = "shexp_gate"  # qwen2moe ffn_gate_inp_shexp [D] (F32)
ROPE_FREQS = "rope_freqs"  # llama rope_freqs [head_dim / 2] (F32)
SINKS = "sinks"  # gpt-oss attn_sinks [H]: each head's sink logit (F32)
SSM_CONV = "ssm_conv"  # Gated DeltaNet depthwise conv kernels [C, K] (F32)
SSM_A = "ssm_a"  # Gated DeltaNet −exp(A_log) [Hv] (F32, negative)

QUANTIZABLE_KINDS = frozenset({EMBEDDING, OUTPUT, MATRIX, EXPERTS})


@dataclass(frozen=True)
class SynthSpec:
    """Geometry of a synthetic model. Names follow the ``sharpi synth`` flags.

    ``experts == 0`` means a dense FFN of width ``ff`` (``llama``, ``qwen3``). For ``llama`` with
    experts (Mixtral) and for ``olmoe`` the expert width is also written as ``feed_forward_length``,
    which is where llama.cpp reads it for those families.
    """

    arch: str
    layers: int = 2
    hidden: int = 256  # D
    heads: int = 4  # query heads
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 0  # E (0 = dense)
    experts_used: int = 0  # K
    expert_ff: int = 0  # routed expert FFN width
    ff: int = 0  # dense FFN width / feed_forward_length
    shared_ff: int = 0  # qwen2moe shared expert width
    vocab: int = 1024
    ctx: int = 4096
    rope_base: float = 10000.0
    rms_eps: float = 1e-6
    tied_output: bool = False  # omit output.weight (llama.cpp then uses token_embd)
    qkv_bias: bool = False  # qwen2moe q/k/v biases
    rope_freqs: bool = False  # llama: write a rope_freqs.weight factor table
    rope_dim: int = 0  # rotated dims per head (0: head_dim); the hybrids rotate part of the head
    # Gated DeltaNet hybrids (qwen35moe, qwen35, qwen3next):
    ssm_conv: int = 0  # depthwise conv taps (ssm.conv_kernel)
    ssm_state: int = 0  # key (= value) head dim (ssm.state_size)
    ssm_groups: int = 0  # key heads (ssm.group_count)
    ssm_v_heads: int = 0  # value heads (ssm.time_step_rank); ssm.inner_size = ssm_v_heads * ssm_state
    full_attn_interval: int = 0  # every n-th layer is full attention (full_attention_interval)
    sliding_window: int = 0  # gemma3: attention.sliding_window (five of six layers slide)
    # glm4moe: the first dense_lead layers have a dense FFN of width ff; shared_ff is expert_shared_count
    # experts of expert_ff; nextn NextN/MTP blocks follow the ``layers`` trunk blocks (block_count counts both).
    dense_lead: int = 0
    nextn: int = 0
    expert_scale: float = 1.0  # expert_weights_scale (the routed scaling factor)
    qk_norm: bool = False  # per-head q/k RMS norms (GLM-4.5 355B has them, Air not)
    # gpt-oss: YaRN RoPE scaling by yarn_factor from a yarn_orig_ctx-token original context (0: none)
    yarn_factor: float = 0.0
    yarn_orig_ctx: int = 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def n_rot(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def blocks(self) -> int:
        """Blocks in the file: the trunk's layers and the NextN blocks after them."""
        return self.layers + self.nextn

    @property
    def is_hybrid(self) -> bool:
        return self.arch in HYBRIDS

    def recurrent(self, i: int) -> bool:
        """Whether layer i is Gated DeltaNet (llama.cpp: (i + 1) % full_attention_interval != 0)."""
        return self.is_hybrid and i < self.layers and (i + 1) % self.full_attn_interval != 0

    @property
    def rope_sections(self) -> list[int]:
        """Interleaved M-RoPE sections giving every rotated pair the text position (qwen35*)."""
        n = -(-self.n_rot // 2 // 3)
        return [n, n, n, 0]


# Tiny defaults per architecture: hidden and FFN widths of 256 so every K-quant applies.
_DEFAULTS: dict[str, dict] = {
    "qwen3moe": dict(experts=8, experts_used=2, expert_ff=256, ff=512, rope_base=1e6),
    "qwen2moe": dict(experts=8, experts_used=2, expert_ff=256, shared_ff=512, ff=512, qkv_bias=True, rope_base=1e6),
    "olmoe": dict(kv_heads=4, experts=8, experts_used=2, expert_ff=256, rms_eps=1e-5),
    "llama": dict(ff=512, rms_eps=1e-5),
    "qwen3": dict(ff=512, rope_base=1e6),
    # Six layers: five sliding-window layers and one global, as llama.cpp's set_swa_pattern(6).
    "gemma3": dict(layers=6, ff=512, kv_heads=1, rope_base=1e6, sliding_window=8, tied_output=True),
}
# One dense layer, two MoE layers and a NextN block, partial RoPE, as GLM-4.5-Air at a small scale.
_DEFAULTS["glm4moe"] = dict(
    layers=3, dense_lead=1, nextn=1, experts=8, experts_used=3, expert_ff=256, shared_ff=256, ff=512,
    qkv_bias=True, rope_dim=32, rope_base=1e6, rms_eps=1e-5,
)  # fmt: skip
# Two layers (sliding, then global: llama.cpp's set_swa_pattern(2)), YaRN as the real files (factor 32 from 4096).
_DEFAULTS["gpt-oss"] = dict(
    layers=2, experts=8, experts_used=4, expert_ff=256, sliding_window=8, rope_base=150000.0, rms_eps=1e-5,
    yarn_factor=32.0, yarn_orig_ctx=4096,
)  # fmt: skip
_HYBRID = dict(
    layers=4, rope_dim=16, ssm_conv=4, ssm_state=32, ssm_groups=2, ssm_v_heads=4, full_attn_interval=4, rope_base=1e6
)
_DEFAULTS["qwen35moe"] = dict(_HYBRID, experts=8, experts_used=2, expert_ff=256, shared_ff=256)
_DEFAULTS["qwen3next"] = dict(_DEFAULTS["qwen35moe"])
_DEFAULTS["qwen35"] = dict(_HYBRID, ff=512)


def make_spec(arch: str, **geometry) -> SynthSpec:
    """A validated :class:`SynthSpec` from per-architecture defaults overridden by ``geometry``.

    ``None`` values are ignored (so CLI flags left unset keep the defaults). Raises
    :class:`UsageError` for an unknown architecture, an unknown field, or a geometry llama.cpp
    would reject.
    """
    if arch not in _DEFAULTS:
        raise UsageError(f"architecture {arch!r} is not supported by the synthesizer (supported: {', '.join(ARCHS)})")
    fields = {f.name for f in dataclasses.fields(SynthSpec)} - {"arch"}
    given = {k: v for k, v in geometry.items() if v is not None}
    unknown = set(given) - fields
    if unknown:
        raise UsageError(f"unknown geometry field(s) {sorted(unknown)} (known: {sorted(fields)})")
    values = dict(_DEFAULTS[arch])
    values.update(given)
    hidden, heads = values.get("hidden", 256), values.get("heads", 4)
    if arch in ("qwen2moe", "olmoe", "llama") and "head_dim" not in given:
        values["head_dim"] = hidden // heads
    if arch == "olmoe" and "kv_heads" not in given:
        values["kv_heads"] = heads
    if arch == "olmoe" or (arch == "llama" and values.get("experts")):
        # These families read the expert width from feed_forward_length.
        if "expert_ff" not in given and "ff" in given:
            values["expert_ff"] = given["ff"]
        values.setdefault("expert_ff", values.get("ff", 512))
        values["ff"] = values["expert_ff"]
    if arch == "llama" and values.get("experts"):
        values.setdefault("experts_used", 2)
    spec = SynthSpec(arch=arch, **values)
    _validate(spec)
    return spec


def _validate(s: SynthSpec) -> None:
    checks = [
        (s.layers > 0 and s.hidden > 0 and s.heads > 0 and s.vocab > 0, "sizes must be positive"),
        (s.kv_heads > 0 and s.heads % s.kv_heads == 0, f"heads {s.heads} not a multiple of kv_heads {s.kv_heads}"),
        (s.head_dim > 0 and s.head_dim % 2 == 0, f"head_dim {s.head_dim} must be even"),
        (s.experts >= 0 and 0 <= s.experts_used <= s.experts, "need 0 <= experts_used <= experts"),
        (not s.is_moe or (s.experts_used > 0 and s.expert_ff > 0), "an MoE needs experts_used > 0 and expert_ff > 0"),
        (
            s.is_moe or s.arch in ("llama", "qwen3", "qwen35", "gemma3"),
            f"{s.arch} is an MoE architecture: experts must be > 0",
        ),
        (s.is_moe or s.ff > 0, "a dense model needs ff > 0"),
        (not (s.is_moe and s.arch in ("qwen3", "qwen35", "gemma3")), f"{s.arch} is dense (no experts)"),
        (
            (s.sliding_window > 0) == (s.arch in ("gemma3", "gpt-oss")),
            "gemma3 and gpt-oss need sliding_window > 0; no other family has one",
        ),
        (not s.qkv_bias or s.arch in ("qwen2moe", "glm4moe"), "qkv_bias is a qwen2moe and glm4moe feature"),
        (s.arch == "gpt-oss" or not (s.yarn_factor or s.yarn_orig_ctx), "yarn_factor is a gpt-oss feature"),
        (s.yarn_factor >= 0 and s.yarn_orig_ctx >= 0, "yarn_factor and yarn_orig_ctx must not be negative"),
        (not s.rope_freqs or s.arch == "llama", "rope_freqs is a llama feature"),
        (
            not s.shared_ff or s.arch in ("qwen2moe", "qwen35moe", "qwen3next", "glm4moe"),
            "no shared expert in this family",
        ),
        (
            s.arch == "glm4moe" or not (s.dense_lead or s.qk_norm or s.expert_scale != 1.0),
            "dense_lead, qk_norm and expert_scale are glm4moe features",
        ),
        (s.arch == "glm4moe" or s.is_hybrid or not s.nextn, "nextn (MTP blocks) is a glm4moe and hybrid feature"),
        (s.nextn >= 0, "nextn must not be negative"),
        (0 <= s.rope_dim <= s.head_dim and s.rope_dim % 2 == 0, f"rope_dim {s.rope_dim} invalid for {s.head_dim}"),
        (not s.tied_output or s.arch not in ("qwen2moe", "olmoe"), f"llama.cpp requires output.weight for {s.arch}"),
    ]
    if s.arch in ("qwen2moe", "olmoe"):
        # llama.cpp builds attn_q/attn_output as [D, D] for these families.
        checks.append((s.q_dim == s.hidden, f"{s.arch} needs heads * head_dim == hidden ({s.q_dim} != {s.hidden})"))
    if s.arch == "olmoe":
        # llama.cpp sizes OLMoE's k-norm with the embedding length: fewer KV heads are rejected there.
        checks.append((s.kv_heads == s.heads, "olmoe needs kv_heads == heads (llama.cpp's k-norm is [D])"))
    if s.arch == "glm4moe":
        checks += [
            (0 <= s.dense_lead <= s.layers and s.nextn >= 0, "need 0 <= dense_lead <= layers and nextn >= 0"),
            (not s.dense_lead or s.ff > 0, "leading dense layers need ff > 0"),
            (s.shared_ff % s.expert_ff == 0, "glm4moe's shared expert is a whole number of experts (expert_ff)"),
            (s.expert_scale > 0, "expert_scale must be positive"),
        ]
    if s.is_hybrid:
        ssm = (s.ssm_conv, s.ssm_state, s.ssm_groups, s.ssm_v_heads, s.full_attn_interval)
        checks += [
            (min(ssm) > 0, "ssm_conv, ssm_state, ssm_groups, ssm_v_heads and full_attn_interval must be positive"),
            (s.ssm_v_heads % max(s.ssm_groups, 1) == 0, "ssm_v_heads must be a multiple of ssm_groups"),
            (s.is_moe == (s.arch != "qwen35"), f"{s.arch} {'has' if s.arch != 'qwen35' else 'has no'} experts"),
        ]
    elif s.arch not in ("glm4moe",):
        checks.append((not s.rope_dim, "rope_dim is a hybrid (qwen35*, qwen3next) and glm4moe feature"))
    for ok, msg in checks:
        if not ok:
            raise UsageError(f"invalid {s.arch} geometry: {msg}")


@dataclass(frozen=True)
class TensorDecl:
    """One tensor of the layout: GGUF name, numpy-order shape, kind (see module constants)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    layer: int | None = None

    @property
    def row(self) -> int:
        """Length of the innermost dimension (what block quantization runs along)."""
        return self.shape[-1]


def tensor_name(t: MODEL_TENSOR, suffix: str = "weight", layer: int | None = None) -> str:
    """GGUF name of a tensor from gguf-py's name table, e.g. ``blk.3.attn_q.weight``."""
    base = TENSOR_NAMES[t].format(bid=layer) if layer is not None else TENSOR_NAMES[t]
    return f"{base}.{suffix}" if suffix else base  # ssm_a has no suffix


def tensor_layout(s: SynthSpec) -> list[TensorDecl]:
    """Every tensor llama.cpp loads for ``s``, in file order (embeddings, blocks, output)."""
    T = MODEL_TENSOR
    D, V = s.hidden, s.vocab
    out = [TensorDecl(tensor_name(T.TOKEN_EMBD), (V, D), EMBEDDING)]
    if s.rope_freqs:
        out.append(TensorDecl(tensor_name(T.ROPE_FREQS), (s.head_dim // 2,), ROPE_FREQS))
    for i in range(s.blocks):

        def add(t: MODEL_TENSOR, shape: tuple[int, ...], kind: str, suffix: str = "weight", i: int = i) -> None:
            out.append(TensorDecl(tensor_name(t, suffix, i), shape, kind, i))

        if s.is_hybrid:
            _hybrid_layer(s, i, add)
            continue
        if s.arch == "glm4moe":
            _glm4moe_layer(s, i, add)
            continue
        if s.arch == "gpt-oss":
            _gpt_oss_layer(s, i, add)
            continue

        add(T.ATTN_NORM, (D,), NORM)
        add(T.ATTN_Q, (s.q_dim, D), MATRIX)
        add(T.ATTN_K, (s.kv_dim, D), MATRIX)
        add(T.ATTN_V, (s.kv_dim, D), MATRIX)
        if s.qkv_bias:
            add(T.ATTN_Q, (s.q_dim,), BIAS, "bias")
            add(T.ATTN_K, (s.kv_dim,), BIAS, "bias")
            add(T.ATTN_V, (s.kv_dim,), BIAS, "bias")
        if s.arch in ("qwen3", "qwen3moe", "gemma3"):  # per-head q/k RMSNorm
            add(T.ATTN_Q_NORM, (s.head_dim,), NORM)
            add(T.ATTN_K_NORM, (s.head_dim,), NORM)
        elif s.arch == "olmoe":  # q/k RMSNorm over the whole projection
            add(T.ATTN_Q_NORM, (s.q_dim,), NORM)
            add(T.ATTN_K_NORM, (s.kv_dim,), NORM)
        add(T.ATTN_OUT, (D, s.q_dim), MATRIX)
        if s.arch == "gemma3":  # the norm after attention
            add(T.ATTN_POST_NORM, (D,), NORM)
        add(T.FFN_NORM, (D,), NORM)
        if s.is_moe:
            E, F = s.experts, s.expert_ff
            add(T.FFN_GATE_INP, (E, D), ROUTER)
            add(T.FFN_GATE_EXP, (E, F, D), EXPERTS)
            add(T.FFN_UP_EXP, (E, F, D), EXPERTS)
            add(T.FFN_DOWN_EXP, (E, D, F), EXPERTS)
            if s.shared_ff:
                add(T.FFN_GATE_INP_SHEXP, (D,), SHEXP_GATE)
                add(T.FFN_GATE_SHEXP, (s.shared_ff, D), MATRIX)
                add(T.FFN_UP_SHEXP, (s.shared_ff, D), MATRIX)
                add(T.FFN_DOWN_SHEXP, (D, s.shared_ff), MATRIX)
        else:
            add(T.FFN_GATE, (s.ff, D), MATRIX)
            add(T.FFN_UP, (s.ff, D), MATRIX)
            add(T.FFN_DOWN, (D, s.ff), MATRIX)
        if s.arch == "gemma3":  # the norm after the FFN
            add(T.FFN_POST_NORM, (D,), NORM)
    out.append(TensorDecl(tensor_name(T.OUTPUT_NORM), (D,), NORM))
    if not s.tied_output:
        out.append(TensorDecl(tensor_name(T.OUTPUT), (V, D), OUTPUT))
    _check_names(s.arch, out)
    return out


def _glm4moe_layer(s: SynthSpec, i: int, add) -> None:
    """One block as llama.cpp's ``load_arch_tensors`` of glm4moe creates it: q/k/v biases, optional per-head
    q/k norms, ``post_attention_norm`` before the FFN; a dense FFN in the first ``dense_lead`` blocks, else the
    router, the selection bias ``exp_probs_b``, the routed experts and an ungated shared expert; blocks past the
    trunk are NextN blocks that add ``nextn.eh_proj`` [2D -> D] and its norms."""
    T = MODEL_TENSOR
    D = s.hidden
    add(T.ATTN_NORM, (D,), NORM)
    add(T.ATTN_Q, (s.q_dim, D), MATRIX)
    add(T.ATTN_K, (s.kv_dim, D), MATRIX)
    add(T.ATTN_V, (s.kv_dim, D), MATRIX)
    add(T.ATTN_Q, (s.q_dim,), BIAS, "bias")
    add(T.ATTN_K, (s.kv_dim,), BIAS, "bias")
    add(T.ATTN_V, (s.kv_dim,), BIAS, "bias")
    if s.qk_norm:
        add(T.ATTN_Q_NORM, (s.head_dim,), NORM)
        add(T.ATTN_K_NORM, (s.head_dim,), NORM)
    add(T.ATTN_OUT, (D, s.q_dim), MATRIX)
    add(T.ATTN_POST_NORM, (D,), NORM)
    if i < s.dense_lead:
        add(T.FFN_GATE, (s.ff, D), MATRIX)
        add(T.FFN_UP, (s.ff, D), MATRIX)
        add(T.FFN_DOWN, (D, s.ff), MATRIX)
    else:
        E, F, Fs = s.experts, s.expert_ff, s.shared_ff
        add(T.FFN_GATE_INP, (E, D), ROUTER)
        add(T.FFN_EXP_PROBS_B, (E,), BIAS, "bias")
        add(T.FFN_GATE_EXP, (E, F, D), EXPERTS)
        add(T.FFN_UP_EXP, (E, F, D), EXPERTS)
        add(T.FFN_DOWN_EXP, (E, D, F), EXPERTS)
        if Fs:
            add(T.FFN_GATE_SHEXP, (Fs, D), MATRIX)
            add(T.FFN_UP_SHEXP, (Fs, D), MATRIX)
            add(T.FFN_DOWN_SHEXP, (D, Fs), MATRIX)
    if i >= s.layers:
        add(T.NEXTN_EH_PROJ, (D, 2 * D), MATRIX)
        add(T.NEXTN_ENORM, (D,), NORM)
        add(T.NEXTN_HNORM, (D,), NORM)
        add(T.NEXTN_SHARED_HEAD_NORM, (D,), NORM)


def _gpt_oss_layer(s: SynthSpec, i: int, add) -> None:
    """One block as llama.cpp's ``load_arch_tensors`` of LLM_ARCH_OPENAI_MOE creates it: q/k/v/o with biases, the
    per-head sinks, ``post_attention_norm`` before the FFN, a biased router, and routed experts with a bias per
    expert and role ([E, F] for gate and up, [E, D] for down)."""
    T = MODEL_TENSOR
    D, E, F = s.hidden, s.experts, s.expert_ff
    add(T.ATTN_NORM, (D,), NORM)
    add(T.ATTN_Q, (s.q_dim, D), MATRIX)
    add(T.ATTN_K, (s.kv_dim, D), MATRIX)
    add(T.ATTN_V, (s.kv_dim, D), MATRIX)
    add(T.ATTN_OUT, (D, s.q_dim), MATRIX)
    add(T.ATTN_Q, (s.q_dim,), BIAS, "bias")
    add(T.ATTN_K, (s.kv_dim,), BIAS, "bias")
    add(T.ATTN_V, (s.kv_dim,), BIAS, "bias")
    add(T.ATTN_OUT, (D,), BIAS, "bias")
    add(T.ATTN_SINKS, (s.heads,), SINKS)
    add(T.ATTN_POST_NORM, (D,), NORM)
    add(T.FFN_GATE_INP, (E, D), ROUTER)
    add(T.FFN_GATE_INP, (E,), BIAS, "bias")
    add(T.FFN_GATE_EXP, (E, F, D), EXPERTS)
    add(T.FFN_UP_EXP, (E, F, D), EXPERTS)
    add(T.FFN_DOWN_EXP, (E, D, F), EXPERTS)
    add(T.FFN_GATE_EXP, (E, F), BIAS, "bias")
    add(T.FFN_UP_EXP, (E, F), BIAS, "bias")
    add(T.FFN_DOWN_EXP, (E, D), BIAS, "bias")


def _hybrid_layer(s: SynthSpec, i: int, add) -> None:
    """One layer of a Gated DeltaNet hybrid as llama.cpp's ``load_arch_tensors`` of qwen35moe / qwen35 /
    qwen3next creates it (numpy order: ggml's {a, b} is (b, a)). Blocks past the trunk are the MTP (NextN)
    blocks: a gated full-attention layer with the trunk's FFN kind, plus ``nextn.eh_proj`` [2D -> D], the
    ``enorm``/``hnorm`` of its two inputs and the ``shared_head_norm`` before the (shared) output matrix."""
    T = MODEL_TENSOR
    D, dk, Hk, Hv = s.hidden, s.ssm_state, s.ssm_groups, s.ssm_v_heads
    V = Hv * dk  # value heads have state_size dims
    C = 2 * Hk * dk + V  # conv channels: q | k | v
    add(T.ATTN_NORM, (D,), NORM)
    if s.recurrent(i):
        if s.arch == "qwen3next":  # the legacy fused projections llama.cpp's qwen3next reads
            add(T.SSM_IN, (C + V, D), MATRIX)
            add(T.SSM_BETA_ALPHA, (2 * Hv, D), MATRIX)
        else:
            add(T.ATTN_QKV, (C, D), MATRIX)
            add(T.ATTN_GATE, (V, D), MATRIX)
            add(T.SSM_BETA, (Hv, D), MATRIX)
            add(T.SSM_ALPHA, (Hv, D), MATRIX)
        add(T.SSM_CONV1D, (C, s.ssm_conv), SSM_CONV)
        add(T.SSM_DT, (Hv,), BIAS, "bias")
        add(T.SSM_A, (Hv,), SSM_A, "")
        add(T.SSM_NORM, (dk,), NORM)
        add(T.SSM_OUT, (D, V), MATRIX)
    else:
        add(T.ATTN_Q, (2 * s.q_dim, D), MATRIX)  # per head: query, then output gate
        add(T.ATTN_K, (s.kv_dim, D), MATRIX)
        add(T.ATTN_V, (s.kv_dim, D), MATRIX)
        add(T.ATTN_OUT, (D, s.q_dim), MATRIX)
        add(T.ATTN_Q_NORM, (s.head_dim,), NORM)
        add(T.ATTN_K_NORM, (s.head_dim,), NORM)
    add(T.ATTN_POST_NORM, (D,), NORM)
    if s.is_moe:
        E, F, Fs = s.experts, s.expert_ff, s.shared_ff
        add(T.FFN_GATE_INP, (E, D), ROUTER)
        add(T.FFN_GATE_EXP, (E, F, D), EXPERTS)
        add(T.FFN_UP_EXP, (E, F, D), EXPERTS)
        add(T.FFN_DOWN_EXP, (E, D, F), EXPERTS)
        add(T.FFN_GATE_INP_SHEXP, (D,), SHEXP_GATE)
        add(T.FFN_GATE_SHEXP, (Fs, D), MATRIX)
        add(T.FFN_UP_SHEXP, (Fs, D), MATRIX)
        add(T.FFN_DOWN_SHEXP, (D, Fs), MATRIX)
    else:
        add(T.FFN_GATE, (s.ff, D), MATRIX)
        add(T.FFN_UP, (s.ff, D), MATRIX)
        add(T.FFN_DOWN, (D, s.ff), MATRIX)
    if i >= s.layers:
        add(T.NEXTN_EH_PROJ, (D, 2 * D), MATRIX)
        add(T.NEXTN_ENORM, (D,), NORM)
        add(T.NEXTN_HNORM, (D,), NORM)
        add(T.NEXTN_SHARED_HEAD_NORM, (D,), NORM)


def _check_names(arch: str, decls: list[TensorDecl]) -> None:
    """Guard: every name belongs to the architecture's tensor table in gguf-py."""
    arch_enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH(arch_enum)]}
    if arch in HYBRIDS:  # llama.cpp loads their MTP blocks' NextN tensors; this gguf-py's table omits them
        allowed |= {TENSOR_NAMES[t] for t in MODEL_TENSOR if t.name.startswith("NEXTN_")}
    for d in decls:
        base = d.name.rsplit(".", 1)[0] if d.name.endswith((".weight", ".bias")) else d.name
        if d.layer is not None:
            base = base.replace(f"blk.{d.layer}.", "blk.{bid}.", 1)
        assert base in allowed, f"{d.name} is not a {arch} tensor"
