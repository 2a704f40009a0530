"""Routed experts computed from the expert pool's slots on the device: the fused Triton kernels that
read each slot's quantized bytes in place (``triton_moe``), and the torch references beside them
(dequantize the slots' matrices, then batched matmuls) where the kernels do not serve a layer's types.

Every function takes slots or slot byte offsets already chosen (``engine.runtime.expert_pool``); which
experts run here, and which on the CPU, is the backend's business (``engine.runtime.expert_cache``).
"""

from __future__ import annotations

import torch

from engine import config
from engine.config import EngineOptions
from engine.experts import ExpertStacks
from engine.models.layers import expert_glu
from engine.runtime import kernel_select as ks
from engine.runtime import triton_gemv, triton_moe
from engine.runtime.device import TRITON_MAX_T, fused_kernels
from engine.runtime.expert_pool import ROLES, ExpertPool
from engine.runtime.references import dequantize


class PoolCompute:
    """The expert math over ``pool``'s slots for the layers of ``stacks``; ``q8_act``: the model rounds
    its activations like llama.cpp (``kernel_select.moe_act``); ``options``: the kernel choice
    (default ``config.current()``)."""

    def __init__(
        self, pool: ExpertPool, stacks: dict[int, ExpertStacks], q8_act: bool, options: EngineOptions | None = None
    ):
        self.pool, self.stacks, self.q8_act = pool, stacks, q8_act
        self.options = options if options is not None else config.current()
        self.device = pool.device
        # Layers whose three roles' types the Triton kernels serve; of those, plain SwiGLU experts take the fused
        # kernels (``fused``), biased, clamped ones (gpt-oss's) a GEMV a role with the biases and activation in torch
        # between them (``gemv_glu``); the rest the torch references.
        served = {
            i: all(fused_kernels(self.device, getattr(s, r).qtype, self.options) for r in ROLES)
            for i, s in stacks.items()
        }
        self.fused = {i: ok and stacks[i].glu is None for i, ok in served.items()}
        self.gemv_glu = {i: ok and stacks[i].glu is not None for i, ok in served.items()}
        self._glu: dict[int, tuple] = {}  # layer -> its ExpertGLU's biases on the device

    def roles(self, layer: int) -> dict:
        """{role: (byte offset in a slot, qtype, rows, n)} for the fused kernels."""
        s, off = self.stacks[layer], self.pool.layout_of(layer).role_offset
        return {r: (off[r], getattr(s, r).qtype, getattr(s, r).rows, getattr(s, r).n) for r in ROLES}

    def decode_act(self, layer: int) -> str:
        """The activation mode the fused decode kernels run ``layer`` with now ("q8" | "f32")."""
        return ks.moe_act(self.device, self.q8_act, self.roles(layer), options=self.options)

    # -- the fused kernels (``fused[layer]``) -----------------------------------------------------------
    def fused_pairs(self, layer: int, slot_off: torch.Tensor, x: torch.Tensor, w: torch.Tensor, xq=None):
        """Σ_k w[t, k] · expert(x_t) over the pairs' slots: slot_off int64 [T, K] byte offsets (−1: skipped),
        x float32 [T, D], w float32 [T, K] -> [T, D]. Up to TRITON_MAX_T tokens the decode kernels (two
        launches; xq: x's q8 copy), beyond the grouped prefill kernel."""
        roles = self.roles(layer)
        if x.shape[0] <= TRITON_MAX_T:
            act = ks.moe_act(self.device, self.q8_act, roles, options=self.options)
            y = triton_moe.moe_decode(self.pool.pool, slot_off, x.float(), w.float(), roles, act, xq, self.options)
            return y.to(x.dtype)
        n_experts = self.stacks[layer].gate.n_experts  # bounds the slots the pairs name: the grid, no host sync
        y = triton_moe.moe_prefill(self.pool.pool, slot_off, x.float(), w.float(), roles, self.options, n_experts)
        return y.to(x.dtype)

    # -- torch references -----------------------------------------------------------------------------
    def weighted_slots(
        self, layer: int, slots: torch.Tensor, x: torch.Tensor, w: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """One token, no host sync: Σ_k w[0, k] · the output of expert ``experts[k]`` in slot ``slots[k]``
        (int64 [K]; −1: not in the pool, contributes 0) for x [1, D] -> [1, D]."""
        out = self.pair_outputs(layer, slots.clamp(min=0), x.expand(slots.shape[0], -1), experts)  # [K, D]
        out = torch.where((slots >= 0)[:, None], out * w[0][:, None], 0.0)  # slot 0 may hold anything
        return out.sum(0, keepdim=True)

    def pair_outputs(self, layer: int, slots: torch.Tensor, xp: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """down(SiLU(gate·x) · up·x) of each pair's slot, unweighted (with the layer's biases and activation where
        it has them: ``ExpertStacks.glu``): slots, experts int64 [P] (on the device: each pair's slot and expert),
        xp [P, D] each pair's token -> [P, D]."""
        if self.gemv_glu[layer]:
            return self.gemv_pairs(layer, self.pool.slot_off_dev.index_select(0, slots), xp, experts)
        g, u, d = self.slot_matrices(layer, slots)  # [P, F, D], [P, F, D], [P, D, F]
        xc = xp[:, :, None]  # [P, D, 1]
        h = self._hidden(layer, experts, torch.bmm(g, xc)[:, :, 0], torch.bmm(u, xc)[:, :, 0])
        return self._out(layer, experts, torch.bmm(d, h[:, :, None])[:, :, 0])

    def gemv_pairs(self, layer: int, off: torch.Tensor, xp: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """:meth:`pair_outputs` by the Triton GEMV on each pair's slot bytes in place (``gemv_glu[layer]``): off int64
        [P] the pairs' slot byte offsets, xp float32 [P, D] -> [P, D]. Three GEMV launches, no matrix expanded."""
        r = self.roles(layer)
        pool = self.pool.pool

        def role(name: str, x: torch.Tensor) -> torch.Tensor:
            o, qt, rows, n = r[name]
            return triton_gemv.gemv(pool, off + o, x.contiguous(), qt, rows, n, options=self.options)

        return self._ffn(layer, experts, role, xp.float())

    def expert_rows(self, layer: int, slot: int, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert ``expert``, in ``slot``, over the rows x [n, D] -> [n, D] (a prompt: each expert once). Layers of
        biased, clamped experts whose types Triton serves (``gemv_glu``) multiply the slot's bytes in place, tile
        by tile (``triton_moe.one_matrix``), instead of dequantizing its three matrices."""
        if self.gemv_glu[layer]:
            base, r = int(self.pool.slot_off_h[slot]), self.roles(layer)
            pool = self.pool.pool.reshape(-1)

            def role(name: str, X: torch.Tensor) -> torch.Tensor:
                o, qt, rows, n = r[name]
                nb = self.pool.expert_bytes[(layer, name)].shape[1]
                raw = pool[base + o : base + o + nb].view(rows, -1)
                return triton_moe.one_matrix(raw, X.float().contiguous(), qt, rows, n, options=self.options)

            return self._ffn(layer, expert, role, x)
        m = dict(zip(ROLES, self.slot_matrices(layer, torch.tensor([slot], device=self.device))))
        return self._ffn(layer, expert, lambda name, X: X @ m[name][0].T, x)

    def _ffn(self, layer: int, experts, role, x: torch.Tensor) -> torch.Tensor:
        """down(act(gate·x + bg, up·x + bu)) + bd, each product ``role(name, X)`` ("gate", "up", "down"), the
        layer's biases and activation between them (:meth:`_hidden`, :meth:`_out`)."""
        return self._out(layer, experts, role("down", self._hidden(layer, experts, role("gate", x), role("up", x))))

    def _biases(self, layer: int) -> tuple:
        """The layer's expert biases (gate, up, down; None where absent) on the device, made once."""
        if layer not in self._glu:
            glu = self.stacks[layer].glu
            dev = lambda a: None if a is None else torch.from_numpy(a).to(self.device)  # noqa: E731
            if glu is None:
                self._glu[layer] = (None, None, None)
            elif self.device.type in glu.on_device:  # the layer's own copies on this device
                self._glu[layer] = glu.on_device[self.device.type]
            else:
                self._glu[layer] = tuple(dev(b) for b in (glu.gate_bias, glu.up_bias, glu.down_bias))
        return self._glu[layer]

    def _hidden(self, layer: int, experts, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """act(g + bg, u + bu): g, u [P, F], row p of expert experts[p] (or one expert for all rows) -> [P, F]."""
        glu = self.stacks[layer].glu
        if glu is None:
            return expert_glu(None, g, u)
        bg, bu, _ = self._biases(layer)
        g = g if bg is None else g + bg[experts]
        u = u if bu is None else u + bu[experts]
        return expert_glu(glu, g, u)

    def _out(self, layer: int, experts, o: torch.Tensor) -> torch.Tensor:
        """o + bd: o [P, D] (row p of expert experts[p], or one expert for all)."""
        bd = self._biases(layer)[2] if self.stacks[layer].glu is not None else None
        return o if bd is None else o + bd[experts]

    def slot_matrices(self, layer: int, slots: torch.Tensor) -> list[torch.Tensor]:
        """Dequantized gate, up [P, F, D] and down [P, D, F] of the experts in ``slots``."""
        s, pool = self.stacks[layer], self.pool
        raw = pool.rows(layer, slots)  # [P, stride]
        mats = []
        for r in ROLES:
            w = getattr(s, r)
            nb = pool.expert_bytes[(layer, r)].shape[1]
            off = pool.layout_of(layer).role_offset[r]
            m = dequantize(raw[:, off : off + nb].reshape(len(slots) * w.rows, -1), w.qtype, w.n)
            mats.append(m.reshape(len(slots), w.rows, w.n))
        return mats
