"""Hyperparameters shared by every architecture family, read from GGUF metadata.

Each architecture module subclasses :class:`ModelArgs` (frozen) and builds it with
``from_gguf(gf)``; quirks are named fields, not flags sprinkled through the math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import MetadataError
from engine.gguf import keys
from engine.gguf.reader import GGUFFile


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    n_layer: int
    n_embd: int  # D
    n_head: int  # H (query heads)
    n_head_kv: int  # Hkv
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_neox: bool  # rotate halves (NEOX) vs adjacent pairs (normal)
    n_ff: int = 0  # dense FFN width (0 for pure-MoE layers)
    n_expert: int = 0  # E (0 = dense model)
    n_expert_used: int = 0  # K
    n_ff_exp: int = 0  # routed expert FFN width
    n_ff_shexp: int = 0  # shared expert FFN width (0 = none)
    norm_topk: bool = False  # renormalise the top-k routing weights
    rope_scale: float = 1.0  # linear RoPE scaling factor (positions divided by it)
    tied_output: bool = False  # no output.weight: logits use token_embd

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one position's K (or V) for one layer: ``n_head_kv * head_dim``."""
        return self.n_head_kv * self.head_dim

    # Sliding-window attention (Gemma 3, gpt-oss): positions a sliding layer sees (its own included), 0 for none;
    # and llama.cpp's set_swa_pattern(n): in every n layers the last is global, the others slide.
    sliding_window: int = 0
    swa_pattern: int = 0

    def is_sliding(self, i: int) -> bool:
        return self.sliding_window > 0 and self.swa_pattern > 0 and i % self.swa_pattern < self.swa_pattern - 1

    def layer_window(self, i: int) -> int:
        """The positions layer i's attention sees (its own included) where it slides, else 0: what its K/V
        cache keeps (``kv_layout.kv_rows``)."""
        return self.sliding_window if self.is_sliding(i) else 0

    def kv_windows(self) -> dict[int, int]:
        """{layer: window} of the sliding-window layers."""
        return {i: w for i in range(self.n_layer) if (w := self.layer_window(i))}

    def describe(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def _int(gf: GGUFFile, key: str, default: int | None = None) -> int:
    v = gf.get(key, default)
    if v is None:
        raise MetadataError(f"missing metadata key {key!r}", gf.path)
    if isinstance(v, bool) or not isinstance(v, int):
        raise MetadataError(f"metadata {key!r} = {v!r} is not an integer", gf.path)
    return int(v)


def _float(gf: GGUFFile, key: str, default: float) -> float:
    v = gf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise MetadataError(f"metadata {key!r} = {v!r} is not a number", gf.path)
    return float(v)


def common_fields(gf: GGUFFile, arch: str) -> dict[str, Any]:
    """Fields every family reads the same way; checked for consistency."""

    def k(template: str) -> str:
        return keys.arch_key(template, arch)

    n_embd = _int(gf, k(keys.EMBEDDING_LENGTH))
    n_head = _int(gf, k(keys.HEAD_COUNT))
    n_head_kv = _int(gf, k(keys.HEAD_COUNT_KV), n_head)
    if n_head <= 0 or n_embd <= 0:
        raise MetadataError(f"head count {n_head} and embedding length {n_embd} must be positive", gf.path)
    head_dim = _int(gf, k(keys.KEY_LENGTH), n_embd // n_head)
    value_dim = _int(gf, k(keys.VALUE_LENGTH), head_dim)
    n_layer = _int(gf, k(keys.BLOCK_COUNT))
    tokens = gf.get(keys.TOKENIZER_TOKENS)
    embd = gf.tensors.get("token_embd.weight")
    default_vocab = len(tokens) if isinstance(tokens, list) and tokens else (embd.shape[0] if embd else 0)
    n_vocab = _int(gf, k(keys.VOCAB_SIZE), default_vocab)  # a tokens table of the wrong type: the tokenizer says
    eps = _float(gf, k(keys.LAYERNORM_RMS_EPS), 1e-6)
    rope_base = _float(gf, k(keys.ROPE_FREQ_BASE), 10000.0)
    rope_dim = _int(gf, k(keys.ROPE_DIMENSION_COUNT), head_dim)
    rope_scale = 1.0
    if gf.get(k(keys.ROPE_SCALING_TYPE)) == "linear":
        factor = _float(gf, k(keys.ROPE_SCALING_FACTOR), 1.0)
        rope_scale = factor if factor > 0 else 1.0
    checks = [
        # The tensor table bounds the layer count: a corrupted count must not drive a huge loop.
        (0 < n_layer <= len(gf.tensors), f"block count {n_layer} is impossible for {len(gf.tensors)} tensors"),
        (n_embd <= 1 << 18 and n_head <= 1 << 12, f"embedding length {n_embd} / head count {n_head} are implausible"),
        (
            n_head_kv > 0 and n_head % n_head_kv == 0,
            f"head count {n_head} is not a multiple of KV heads {n_head_kv}",
        ),
        (head_dim > 0 and head_dim % 2 == 0, f"head dim {head_dim} must be positive and even"),
        (value_dim == head_dim, f"value length {value_dim} differs from key length {head_dim} (unsupported)"),
        (
            0 < rope_dim <= head_dim and rope_dim % 2 == 0,
            f"rope dimension {rope_dim} invalid for head dim {head_dim}",
        ),
        (n_vocab > 0, "vocabulary size is unknown or zero"),
        (0 < eps < 1, f"rms epsilon {eps} out of range"),
        (rope_base > 0, f"rope base {rope_base} must be positive"),
    ]
    for ok, msg in checks:
        if not ok:
            raise MetadataError(msg, gf.path)
    return dict(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_vocab=n_vocab,
        n_ctx_train=_int(gf, k(keys.CONTEXT_LENGTH), 4096),
        rms_eps=eps,
        rope_base=rope_base,
        rope_dim=rope_dim,
        rope_scale=rope_scale,
        tied_output="output.weight" not in gf.tensors,
    )


def moe_fields(gf: GGUFFile, arch: str, n_ff_exp_key: str, n_ff_exp_default: int | None = None) -> dict[str, Any]:
    """Expert count, experts used per token and expert FFN width, checked."""
    n_expert = _int(gf, keys.arch_key(keys.EXPERT_COUNT, arch), 0)
    n_used = _int(gf, keys.arch_key(keys.EXPERT_USED_COUNT, arch), 0)
    n_ff_exp = _int(gf, keys.arch_key(n_ff_exp_key, arch), n_ff_exp_default)
    if n_expert <= 0 or n_expert > 1 << 16:
        raise MetadataError(
            f"{arch} needs {keys.arch_key(keys.EXPERT_COUNT, arch)} in 1..65536, got {n_expert}", gf.path
        )
    if not 0 < n_used <= n_expert:
        raise MetadataError(f"experts used per token ({n_used}) must be in 1..{n_expert}", gf.path)
    if n_ff_exp <= 0:
        raise MetadataError(f"expert feed-forward length {n_ff_exp} must be positive", gf.path)
    return dict(n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp)


@dataclass(frozen=True)
class HybridArgs(ModelArgs):
    """A Gated DeltaNet hybrid (Qwen3.5, Qwen3-Next): ``recurrent[i]`` says whether layer i is linear
    attention; the others are gated full attention. Key heads ``ssm_n_group`` of ``ssm_d_state`` dims,
    value heads ``ssm_dt_rank`` sharing ``ssm_d_inner`` dims, a depthwise conv of ``ssm_d_conv`` taps."""

    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_dt_rank: int = 0
    ssm_n_group: int = 0
    recurrent: tuple[bool, ...] = ()
    n_layer_nextn: int = 0  # MTP blocks stored after the trunk (not run by the trunk)

    @property
    def head_v_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_dt_rank

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_n_group * self.ssm_d_state + self.ssm_d_inner

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if not self.recurrent[i]]

    @property
    def state_bytes(self) -> int:
        """One linear-attention layer's recurrent state (``engine.kv_cache.RecurrentState``), float32: the conv
        window [ssm_d_conv − 1, conv_dim] and the delta-rule state [ssm_dt_rank, head_v_dim, ssm_d_state]."""
        return 4 * ((self.ssm_d_conv - 1) * self.conv_dim + self.ssm_dt_rank * self.head_v_dim * self.ssm_d_state)


def hybrid_moe_fields(gf: GGUFFile, arch: str) -> dict[str, Any]:
    """A Gated-DeltaNet hybrid's routed and shared experts: :func:`moe_fields` (the expert width defaults to
    the FFN length over the experts used, as llama.cpp reads it) and ``n_ff_shexp`` (default: the FFN length)."""
    used = gf.get(keys.arch_key(keys.EXPERT_USED_COUNT, arch)) or 1
    ff = gf.get(keys.arch_key(keys.FEED_FORWARD_LENGTH, arch))
    fallback = ff // used if isinstance(ff, int) and isinstance(used, int) and used > 0 else None
    m = moe_fields(gf, arch, keys.EXPERT_FEED_FORWARD_LENGTH, fallback)
    m["n_ff_shexp"] = _int(
        gf, keys.arch_key(keys.EXPERT_SHARED_FEED_FORWARD_LENGTH, arch), ff if isinstance(ff, int) else 0
    )
    return m


def hybrid_fields(gf: GGUFFile, arch: str, sections: bool) -> dict[str, Any]:
    """The linear-attention hyperparameters as llama.cpp reads them (``load_arch_hparams`` of qwen35,
    qwen35moe, qwen3next), checked; ``n_layer`` is the trunk (block count less the MTP blocks).
    sections: the file's attention uses interleaved multi-section RoPE (Qwen3.5), whose sections must
    give every rotated pair the token's position (text positions; a pair on the fourth section would
    rotate by position 0, which this engine does not model)."""

    def k(template: str) -> str:
        return keys.arch_key(template, arch)

    f = dict(
        ssm_d_conv=_int(gf, k(keys.SSM_CONV_KERNEL)),
        ssm_d_inner=_int(gf, k(keys.SSM_INNER_SIZE)),
        ssm_d_state=_int(gf, k(keys.SSM_STATE_SIZE)),
        ssm_dt_rank=_int(gf, k(keys.SSM_TIME_STEP_RANK)),
        ssm_n_group=_int(gf, k(keys.SSM_GROUP_COUNT)),
    )
    n_all = _int(gf, k(keys.BLOCK_COUNT))
    nextn = _int(gf, k(keys.NEXTN_PREDICT_LAYERS), 0)
    interval = _int(gf, k(keys.FULL_ATTENTION_INTERVAL), 4)
    per_layer = gf.get(k(keys.RECURRENT_LAYERS))  # llama.cpp prefers it to the interval when present
    checks = [
        (all(v > 0 for v in f.values()), f"linear-attention sizes must be positive: {f}"),
        (f["ssm_dt_rank"] % f["ssm_n_group"] == 0, "value heads (time_step_rank) must be a multiple of group_count"),
        (f["ssm_d_inner"] % f["ssm_dt_rank"] == 0, "inner_size must split evenly over the value heads"),
        (f["ssm_d_inner"] // max(f["ssm_dt_rank"], 1) == f["ssm_d_state"], "value head dim must equal state_size"),
        (0 <= nextn < n_all, f"nextn_predict_layers {nextn} must be below the block count {n_all}"),
        (interval > 0, f"full_attention_interval {interval} must be positive"),
    ]
    for ok, msg in checks:
        if not ok:
            raise MetadataError(msg, gf.path)
    n_layer = n_all - nextn
    if isinstance(per_layer, (bool, int)):  # one value for every layer (get_key_or_arr)
        per_layer = [per_layer] * n_layer
    if per_layer is not None:
        if not isinstance(per_layer, (list, tuple)) or len(per_layer) < n_layer:
            raise MetadataError(f"{k(keys.RECURRENT_LAYERS)} must list at least {n_layer} layers", gf.path)
        recurrent = tuple(bool(x) for x in per_layer[:n_layer])
    else:
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    if sections:
        sec = gf.get(keys.arch_key(keys.ROPE_DIMENSION_SECTIONS, arch))
        if not isinstance(sec, (list, tuple)) or len(sec) < 3 or sum(int(s) for s in sec[:4]) <= 0:
            raise MetadataError(f"{arch} needs rope.dimension_sections (4 integers), got {sec!r}", gf.path)
        sec = [int(s) for s in sec[:4]] + [0] * (4 - len(sec[:4]))
        rope_dim = _int(gf, k(keys.ROPE_DIMENSION_COUNT), 0)
        total = sum(sec)
        for i in range(rope_dim // 2):  # ggml's interleaved M-RoPE sector choice
            s = i % total
            if not any(s % 3 == j and s < 3 * sec[j] for j in range(3)):
                raise MetadataError(f"rope section layout {sec} rotates pair {i} by a non-text position", gf.path)
    return dict(
        **f,
        n_layer=n_layer,
        n_layer_nextn=nextn,
        recurrent=recurrent,
    )
