"""The layer step's ops for one token on the device: what a decode CUDA graph captures.

:class:`DeviceStepOps` implements :class:`engine.models.ops.Ops` for one token at a *device* position
(``pos``, an int64 tensor) over a static attention length (positions past the token masked): no host
sync, so ``DecoderLayer.step`` on these ops can be captured, and replayed for any position of the bucket.
Where the fused step kernels serve (``step_kernels.enabled``) the glue between matrices is few, larger
launches — q/k norm + rope + K/V write in one, residual add + norm (+ x̂) in one, one token's attention
(+ o's x̂) in one or two, routing (+ the resident pool's slot lookup) in one; else torch's own ops, the
reference the tests hold those kernels to. Matrices are ``DeviceLinear`` (Triton GEMVs on the raw
blocks), routed experts the backend's device half; a MoE layer whose backend has a host half leaves
its hand-over in :attr:`DeviceStepOps.cut` for the decode graph (``engine.runtime.graph_decode``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from math import inf
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.models.layers import apply_rope_table, attention_static, rms_norm_fused, route, silu_mul
from engine.models.ops import Route, TorchOps
from engine.runtime import step_kernels

if TYPE_CHECKING:
    from engine.kv_cache import KVCache


class Cut(NamedTuple):
    """What a MoE layer's host half needs after the replay: the normed row h float32 [1, D], and its
    routing ids int64 [1, K], weights float32 [1, K] (device tensors of the step)."""

    h: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


class DeviceStepOps:
    """Ops for one token at ``pos`` (int64 [1], on the device) over the first ``length`` positions of
    ``cache`` (≥ pos + 1). cos, sin float32 [1, hd], perm int64 [hd]: the token's rope rows
    (``layers.rope_tables``); kpos int64 [≥ length]: 0, 1, 2, … (the torch attention's mask).

    routes: MoE layer -> int64 [1, K] row where its chosen ids go (the graph's record of the step);
    consts: values made once per graph decoder, kept across steps (so a capture does not record them);
    fused: the step kernels serve this device; attend: ``step_attention.attend`` where it serves every
    layer's cache, else None."""

    q8 = True
    taps_routes = True  # route() hands the routing to a route tap, so the graph's record holds the tap's

    def __init__(
        self,
        pos: torch.Tensor,
        length: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        perm: torch.Tensor,
        kpos: torch.Tensor,
        cache: KVCache,
        *,
        routes: dict[int, torch.Tensor],
        consts: dict,
        fused: bool,
        attend: Callable | None = None,
    ):
        self.pos, self.length, self.cos, self.sin, self.perm, self.kpos = pos, length, cos, sin, perm, kpos
        self.cache, self.routes, self.consts = cache, routes, consts
        self.fused, self._attend = fused, attend
        self.cut: Cut | None = None  # set by a MoE layer whose backend's host half runs after this step
        self._masks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (window, rows) -> (row, bias)

    @cached_property
    def bias(self) -> torch.Tensor:
        """float32 [L]: 0 up to pos, -inf after — the mask of torch's attention (``attention_static``),
        made on its first use in a step: where ``attend`` serves every layer, never."""
        return torch.zeros(self.length, dtype=torch.float32, device=self.pos.device).masked_fill(
            self.kpos[: self.length] > self.pos, -inf
        )

    def _window(self, attn) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A sliding-window layer's (K/V row of the token int64 [1], attention bias float32 [rows], rows): in a
        ring (``KVCache.rings``: its window and a slack) row pos mod rows, where ring row r holds position
        pos − ((pos − r) mod rows), attended when that is ≥ 0 and within the window; else rows = length, row pos,
        positions p attended where pos − window < p ≤ pos. Made once a step per (window, rows)."""
        window, rows = self.cache.rings.get(attn.i, (attn.window, 0))
        key = (window, rows)
        if key not in self._masks:
            if rows:
                r = self.kpos[:rows]
                p = self.pos - torch.remainder(self.pos - r, rows)
                seen = (p >= 0) & (self.pos - p < window)
                row = torch.remainder(self.pos, rows)
            else:
                p = self.kpos[: self.length]
                seen = (p <= self.pos) & (self.pos - p < window)
                row = self.pos
            bias = torch.zeros(seen.shape, dtype=torch.float32, device=self.pos.device).masked_fill(~seen, -inf)
            self._masks[key] = (row, bias)
        row, bias = self._masks[key]
        return row, bias, bias.shape[0]

    def add_norm(self, x, y, w, eps, q8=False):
        if not self.fused:
            x = x if y is None else x + y
            return x, rms_norm_fused(x, w, eps), None
        if q8 and x.shape[-1] % 32 == 0:  # x̂ from the same launch
            return step_kernels.add_rms_norm(x, y, w, eps, q8=True)
        return (*step_kernels.add_rms_norm(x, y, w, eps), None)

    def rms_norm(self, x, w, eps):
        return rms_norm_fused(x, w, eps)

    def linears(self, ws, x, xq=None):
        return [w(x) if xq is None else w(x, xq) for w in ws]

    def rope_store(self, attn, q, k, v, head_norms):
        a, i = attn.a, attn.i
        H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
        sk, sv = self.cache.k[i], self.cache.v[i]
        row = self._window(attn)[0] if attn.window else self.pos  # the K/V row: a ring's wraps
        if self.fused and sk.kv_type in ("f32", "bf16"):  # one launch
            qn, kn = head_norms if head_norms is not None else (None, None)
            return step_kernels.qk_rope_kv(
                q, k, v, qn, kn, a.rms_eps, self.cos, self.sin, self.perm, row, sk.q, sv.q, H, Hkv, hd
            )
        qk = torch.cat([q, k], dim=1).reshape(1, H + Hkv, hd)
        if head_norms is not None:  # per head, q's and k's weights side by side
            w = self.consts.get(("qk_norm", i))
            if w is None:
                w = self.consts["qk_norm", i] = torch.cat([head_norms[0].expand(H, hd), head_norms[1].expand(Hkv, hd)])
            qk = rms_norm_fused(qk, None, a.rms_eps) * w
        qk = apply_rope_table(qk, self.cos, self.sin, self.perm)
        sk.write_at(row, qk[:, H:].reshape(1, -1))
        sv.write_at(row, v)
        return qk[:, :H]

    def attend(self, attn, q, q8=False):
        a, i = attn.a, attn.i
        H, Hkv, hd = a.n_head, a.n_head_kv, a.head_dim
        sk, sv = self.cache.k[i], self.cache.v[i]
        if attn.window or attn.sinks is not None or attn.scale is not None:  # torch's ops (gpt-oss' layers)
            L, bias = self.length, self.bias
            if attn.window:
                _, bias, L = self._window(attn)
            shape = (L, Hkv, hd)
            K, V = sk.read(L).reshape(shape), sv.read(L).reshape(shape)
            sinks = None if attn.sinks is None else self._const(("sinks", i), attn.sinks)
            return attention_static(q, K, V, bias, attn.scale, sinks), None
        if self._attend is not None:  # one or two launches
            if q8:  # o's x̂ from the attention launch
                return self._attend(q, sk.q, sv.q, self.pos, self.length, H, Hkv, hd, q8=True)
            return self._attend(q, sk.q, sv.q, self.pos, self.length, H, Hkv, hd), None
        shape = (self.length, Hkv, hd)
        K, V = sk.read(self.length).reshape(shape), sv.read(self.length).reshape(shape)
        return attention_static(q, K, V, self.bias), None

    def silu_mul(self, g, u):
        return silu_mul(g, u)

    # The gated attention's output gate is the reference's own method (torch ops, no host sync: it captures).
    sigmoid_mul = TorchOps.sigmoid_mul

    def delta_net(self, dn, qkv, b, a):
        if not self.fused or qkv.shape[0] != 1:  # the reference's torch ops: no host sync, so they capture too
            return TorchOps.delta_net(self, dn, qkv, b, a)
        st = self.cache.recurrent[dn.i]
        st.steps = None  # one token keeps no roll-back points (TorchOps.delta_net: only T > 1 does)
        w = self._gdn_consts(dn)
        return step_kernels.delta_net_step(
            qkv, b, a, st.conv, st.ssm, w[0], w[1], w[2], dn.n_k_heads, dn.head_k, dn.n_v_heads, dn.head_v,
            dn.grouping, dn.eps,
        )  # fmt: skip

    def gated_norm(self, dn, o, z):
        if not self.fused or o.shape[0] != 1:
            return TorchOps.gated_norm(self, dn, o, z)
        return step_kernels.gated_norm(o, z, self._gdn_consts(dn)[3], dn.n_v_heads, dn.head_v, dn.eps)

    def _const(self, key, t: torch.Tensor) -> torch.Tensor:
        """t as contiguous float32 on the step's device, made once per graph decoder (outside a capture)."""
        c = self.consts.get(key)
        if c is None:
            c = self.consts[key] = t.to(device=self.pos.device, dtype=torch.float32).contiguous()
        return c

    def _gdn_consts(self, dn) -> tuple[torch.Tensor, ...]:
        """The layer's conv kernels [C, K], dt_bias, A [Hv] and norm [dv] as step constants (:meth:`_const`)."""
        return tuple(self._const(("gdn", dn.i, n), getattr(dn, n)) for n in ("conv_w", "dt_bias", "A", "norm"))

    def sigmoid_gate(self, s, x, w):
        return s * torch.sigmoid(x @ w)[:, None]

    def route(self, moe, logits):
        r, record = moe.routing, self.routes.get(moe.i)
        table = moe.experts.step_plan(moe.i).slot_table
        tap = getattr(moe, "tap", None)  # engine.routes' recorder or replayer (MoE.tap)
        if record is not None and table is not None and self.fused and r.kind == "softmax" and tap is None:
            # one fused kernel: routing, the ids into the record, the pinned pool's slot offsets
            weights, off = step_kernels.route(logits, r.k, r.renormalise, table, record)
            return Route(record, weights, off)
        ids, weights = route(logits, r)  # [1, K] x2
        if tap is not None:  # recorded, or replaced by a trace's
            ids, weights = tap.route(moe.i, Route(ids, weights))[:2]
        if record is not None:  # the graph's record of the routes
            record.copy_(ids)
        return Route(ids, weights)

    def experts(self, moe, h, hq, r):
        plan = moe.experts.step_plan(moe.i)
        if plan.host:  # the host half runs after this step, on the hand-over
            self.cut = Cut(h, r.ids, r.weights)
        if not plan.device:
            return None
        return moe.experts.device_part(moe.i, h, r.ids, r.weights, hq, r.slot_off)
