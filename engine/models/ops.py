"""The ops contract a decoder layer's step is written against, and its torch reference.

The layer math lives once, in the ``step`` methods of :mod:`engine.models.blocks`; what it runs on is
an :class:`Ops` implementation that also carries where the step is — the positions, the KV cache,
the rope rows:

- :class:`TorchOps` (here): the reference, torch on any device, T tokens at host positions — the
  eager path, prefill and decode, on the host or a device;
- :class:`FusedTorchOps` (here): the same math in fewer, larger torch launches, what a device layer runs
  eagerly (a prompt on a GPU is bound by the host's launches, not the GPU's work);
- ``engine.models.host.HostOps``: numpy arrays through the numba twins (``engine.kernels.host_layers``),
  for layers whose matrices are all in host memory;
- ``engine.runtime.step_ops.DeviceStepOps``: one token at a device position over a static cache
  length, no host sync — what a decode CUDA graph captures (the fused step kernels, ``DeviceLinear``).

Activations are whatever array type the implementation uses (``torch.Tensor`` or ``np.ndarray``),
shaped [T, width]. ``q8`` copies — x̂, an activation rounded to ``triton_q8``'s format by the
kernel that made it — are explicit values: an op that can hand one out is asked for it (``q8=True``)
and returns it or None; a matrix that takes it gets it through :meth:`Ops.linears`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from engine.models.layers import (
    apply_rope,
    attention,
    attention_fused,
    causal_conv1d,
    delta_gates,
    expand_heads,
    gated_delta_chunked,
    gated_delta_rule,
    gated_rms_norm,
    gelu_mul,
    l2_norm,
    rms_norm,
    rms_norm_fused,
    route,
    silu_mul,
)

if TYPE_CHECKING:
    from engine.kv_cache import KVCache

Array = Any  # torch.Tensor or np.ndarray [T, width], per implementation
Q8 = Any  # x̂: (XQ int32 [T, w/4], XD float32 [T, w/32], XS float32 [T, w/16]) on the device, or None


class Route(NamedTuple):
    """A MoE layer's routing of T tokens: ids int64 [T, K], weights float32 [T, K]; slot_off int64
    [T, K]: each pair's slot byte offset in a resident pool where the routing looked it up too, else None."""

    ids: Array
    weights: Array
    slot_off: Array | None = None


class Ops(Protocol):
    """What a layer step computes with. ``attn`` / ``moe`` arguments are the layer's blocks (their
    weights and quirks); the implementation holds the step's positions, KV cache and rope rows."""

    q8: bool  # whether add_norm and attend can hand out q8 copies (the device step)

    def add_norm(self, x: Array, y: Array | None, w, eps: float, q8: bool = False) -> tuple[Array, Array, Q8]:
        """(x + y, rms_norm(x + y)·w, its q8 copy when asked and made, else None); y None: no add."""

    def rms_norm(self, x: Array, w, eps: float) -> Array:
        """rms_norm(x)·w over the last dimension (ggml_rms_norm, ggml_mul)."""

    def linears(self, ws: tuple, x: Array, xq: Q8 = None) -> list[Array]:
        """[x·Wᵀ (+ b) for W in ws]: one activation rounding shared where the kernels allow; xq: x's q8 copy."""

    def rope_store(self, attn, q: Array, k: Array, v: Array, head_norms: tuple | None) -> Array:
        """q [T, H·hd], k, v [T, Hkv·hd] -> q normed per head (head_norms: (q_norm, k_norm) [hd] or None)
        and rotated at the step's positions; k normed and rotated, and v, written into layer attn.i's cache."""

    def attend(self, attn, q: Array, q8: bool = False) -> tuple[Array, Q8]:
        """Causal GQA attention of the rotated q over the cache up to the step's positions -> (o [T, H·hd],
        its q8 copy when asked and made, else None)."""

    def silu_mul(self, g: Array, u: Array) -> Array:
        """silu(g) ⊙ u (ggml_swiglu_split)."""

    def gelu_mul(self, g: Array, u: Array) -> Array:
        """gelu(g) ⊙ u, GELU's tanh form as ggml computes it (``layers.gelu_mul``, ggml_geglu_split)."""

    def sigmoid_mul(self, x: Array, g: Array) -> Array:
        """x ⊙ sigmoid(g), both [T, n] (the gated attention's output gate)."""

    def delta_net(self, dn, qkv: Array, b: Array, a: Array) -> Array:
        """A Gated DeltaNet layer's recurrent core over the step's tokens: qkv [T, C] (rows q | k | v) through
        the causal conv with layer dn.i's conv state, silu, L2-normed q, k, and the gated delta rule with its
        delta-rule state (β from b, decay from a [T, Hv]) -> o [T, Hv·dv]; both states advanced."""

    def gated_norm(self, dn, o: Array, z: Array) -> Array:
        """rms_norm(o)·dn.norm ⊙ silu(z) per value head: o, z [T, Hv·dv] -> [T, Hv·dv]."""

    def sigmoid_gate(self, s: Array, x: Array, w) -> Array:
        """s · sigmoid(x·w): s [T, D], x [T, D], w [D] (Qwen2-MoE's shared-expert gate)."""

    # Whether route() itself hands its routing to the layer's route tap (``moe.tap``), else the layer does.
    taps_routes: bool

    def route(self, moe, logits: Array) -> Route:
        """The layer's routing (``moe.routing``) of router logits [T, E]."""

    def experts(self, moe, h: Array, hq: Q8, r: Route) -> Array | None:
        """Σ_k weights · expert(h) through the layer's expert backend: [T, D], or None where nothing of it
        is computed in this step (a decode graph's host half adds it after the replay)."""


def plus(y: Array | None, s: Array | None) -> Array | None:
    """y + s with None as zero (a step's partial sums)."""
    if y is None:
        return s
    return y if s is None else y + s


class TorchOps:
    """The reference: torch on any device, T tokens at positions start … start+T−1 of ``cache``.
    cos, sin float32 [T, rope_dim/2] on the activations' device."""

    q8 = False
    taps_routes = False

    def __init__(self, start: int, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor):
        self.start, self.cache, self.cos, self.sin = start, cache, cos, sin

    def add_norm(self, x, y, w, eps, q8=False):
        x = x if y is None else x + y
        return x, rms_norm(x, w, eps), None

    def rms_norm(self, x, w, eps):
        return rms_norm(x, w, eps)

    def linears(self, ws, x, xq=None):
        return [w(x) for w in ws]

    def rope_store(self, attn, q, k, v, head_norms):
        a, T = attn.a, q.shape[0]
        q = q.reshape(T, a.n_head, a.head_dim)
        k = k.reshape(T, a.n_head_kv, a.head_dim)
        if head_norms is not None:  # per head (Qwen3)
            q, k = rms_norm(q, head_norms[0], a.rms_eps), rms_norm(k, head_norms[1], a.rms_eps)
        q, k = apply_rope(q, self.cos, self.sin, a.rope_neox), apply_rope(k, self.cos, self.sin, a.rope_neox)
        self._store(attn, k.reshape(T, -1), v)
        return q

    def _store(self, attn, k, v) -> None:
        """k, v [T, kv_dim] into layer attn.i's cache; a sliding-window layer keeps what its queries see
        (``KVCache.window_span``: its ring may overwrite rows they need) for :meth:`_keys`."""
        if attn.window:
            self._span = self.cache.window_span(attn.i, self.start, k, v)
        else:
            self.cache.write(attn.i, self.start, k, v)

    def _keys(self, attn, end: int):
        """(first position, K, V [end − first, Hkv, hd]) the layer's queries up to ``end`` attend over."""
        a = attn.a
        if attn.window:
            p0, K, V = self._span
        else:
            p0, (K, V) = 0, self.cache.read(attn.i, end)
        shape = (end - p0, a.n_head_kv, a.head_dim)
        return p0, K.reshape(shape), V.reshape(shape)

    def attend(self, attn, q, q8=False):
        p0, K, V = self._keys(attn, self.start + q.shape[0])
        return attention(q, K, V, self.start, attn.window, attn.scale, attn.sinks, p0), None

    def silu_mul(self, g, u):
        return silu_mul(g, u)

    def gelu_mul(self, g, u):
        return gelu_mul(g, u)

    def sigmoid_mul(self, x, g):
        return x * torch.sigmoid(g)

    def delta_net(self, dn, qkv, b, a):
        # Any device, and no host sync for one token: the device step (DeviceStepOps) runs this same method.
        st = self.cache.recurrent[dn.i]
        T = qkv.shape[0]
        keep = self.cache.keep_steps and T > 1  # a verify pass: every token's state kept for a roll-back
        if keep:
            inputs, states = torch.cat([st.conv, qkv]), [st.ssm.clone()]  # [K-1+T, C]; the state before
        c, conv = causal_conv1d(qkv, dn.conv_w.to(qkv.device), st.conv)
        c = torch.nn.functional.silu(c)
        kd = dn.n_k_heads * dn.head_k
        q = l2_norm(c[:, :kd].reshape(T, dn.n_k_heads, dn.head_k), dn.eps)
        k = l2_norm(c[:, kd : 2 * kd].reshape(T, dn.n_k_heads, dn.head_k), dn.eps)
        v = c[:, 2 * kd :].reshape(T, dn.n_v_heads, dn.head_v)
        q, k = expand_heads(q, dn.n_v_heads, dn.grouping), expand_heads(k, dn.n_v_heads, dn.grouping)
        beta, g = delta_gates(b, a, dn.dt_bias.to(b.device), dn.A.to(b.device))
        if T == 1 or keep:  # decode and verify passes: the recurrence
            o, S = gated_delta_rule(q, k, v, g, beta, st.ssm, states if keep else None)
        else:  # prompts: chunks
            o, S = gated_delta_chunked(q, k, v, g, beta, st.ssm)
        st.steps = (inputs, states) if keep else None
        st.assign(conv, S)  # in place: a decode graph holds the state's addresses
        return o.reshape(T, -1)

    def gated_norm(self, dn, o, z):
        T = o.shape[0]
        shape = (T, dn.n_v_heads, dn.head_v)
        return gated_rms_norm(o.reshape(shape), z.reshape(shape), dn.norm.to(o.device), dn.eps).reshape(T, -1)

    def sigmoid_gate(self, s, x, w):
        return s * torch.sigmoid(x @ w)[:, None]

    def route(self, moe, logits):
        return Route(*route(logits, moe.routing))

    def experts(self, moe, h, hq, r):
        moe.last_ids = r.ids
        return moe.experts.forward(moe.i, h, r.ids, r.weights)


class FusedTorchOps(TorchOps):
    """:class:`TorchOps`'s math in fewer launches, equal up to float32 rounding (tests/test_ops.py holds the
    two together): one-kernel norms (torch's ``rms_norm``), q and k head-normed and rotated as one tensor,
    attention in torch's ``scaled_dot_product_attention`` (:func:`engine.models.layers.attention_fused`).
    What device layers run eagerly: a prompt's layer is ~100 small launches, and on a GPU their host cost,
    not the kernels, sets its time."""

    def add_norm(self, x, y, w, eps, q8=False):
        x = x if y is None else x + y
        return x, rms_norm_fused(x, w, eps), None

    def rms_norm(self, x, w, eps):
        return rms_norm_fused(x, w, eps)

    def rope_store(self, attn, q, k, v, head_norms):
        a, T = attn.a, q.shape[0]
        H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
        qk = torch.cat([q.reshape(T, H, hd), k.reshape(T, Hkv, hd)], dim=1)  # [T, H + Hkv, hd]
        if head_norms is not None:  # per head (Qwen3): q's weights on q's heads, k's on k's
            w = torch.cat([head_norms[0].expand(H, hd), head_norms[1].expand(Hkv, hd)])
            qk = rms_norm_fused(qk, None, a.rms_eps) * w
        qk = apply_rope(qk, self.cos, self.sin, a.rope_neox)
        self._store(attn, qk[:, H:].reshape(T, -1), v)
        return qk[:, :H]

    def attend(self, attn, q, q8=False):
        p0, K, V = self._keys(attn, self.start + q.shape[0])
        return attention_fused(q, K, V, self.start, attn.window, attn.scale, attn.sinks, p0), None
