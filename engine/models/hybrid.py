"""Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): the shared model of ``qwen35moe``, ``qwen35`` and
``qwen3next``.

Layer i is linear attention (:class:`~engine.models.blocks.GatedDeltaNet`) where ``args.recurrent[i]``, else
gated full attention (:class:`~engine.models.blocks.Attention` with ``q_gate``); each is a
:class:`~engine.models.blocks.DecoderLayer` whose second norm is ``post_attention_norm``. The KV cache holds K/V for
the attention layers only and a :class:`~engine.kv_cache.RecurrentState` per linear-attention layer.

Every placement runs them: their layers' steps are written on the ops contract (the recurrence and the
chunked prompt form in torch on any device, ``engine.models.ops.TorchOps.delta_net``), and a device layer's
state sits on the device beside the attention layers' K/V (:meth:`HybridModel.make_cache`).
"""

from __future__ import annotations

import torch

from engine.errors import UsageError
from engine.kv_cache import KVCache, RecurrentState
from engine.models.args import HybridArgs
from engine.models.base import DecoderModel
from engine.models.blocks import Attention, DecoderLayer, DenseFFN, GatedDeltaNet, MoE
from engine.models.tensors import (
    TensorSpec,
    delta_net_specs,
    dense_ffn_specs,
    gated_attention_specs,
    global_specs,
    moe_specs,
    shared_expert_specs,
)


def hybrid_tensor_specs(a: HybridArgs, *, moe: bool, fused_input: bool = False) -> list[TensorSpec]:
    specs = global_specs(a)
    for i in range(a.n_layer):
        specs += delta_net_specs(i, a, fused_input) if a.recurrent[i] else gated_attention_specs(i, a)
        if moe:
            specs += moe_specs(i, a, norm="post_attention_norm") + shared_expert_specs(i, a)
        else:
            specs += dense_ffn_specs(i, a, norm="post_attention_norm")
    return specs


class HybridModel(DecoderModel):
    """Architecture modules set ``grouping`` (how key heads serve value heads), ``fused_input`` (Qwen3-Next's
    ``ssm_in``/``ssm_ba``) and ``moe`` (routed experts with a gated shared expert, else a dense FFN)."""

    args: HybridArgs
    grouping = "tile"
    fused_input = False
    moe = True

    def make_layer(self, i: int) -> DecoderLayer:
        w, a = self.lw(i), self.args
        if a.recurrent[i]:
            mixer = GatedDeltaNet(w, i, a, self.grouping, self.fused_input)
        else:
            mixer = Attention(w, i, a, qk_norm="head", q_gate=True)
        ffn = MoE(w, i, a, self.experts_of(i), shared_expert=True) if self.moe else DenseFFN(w, i)
        return DecoderLayer(w, i, a, mixer, ffn, ffn_norm="post_attention_norm")

    def make_cache(self, devices: dict[int, torch.device], n_ctx: int, kv_type, charge=None) -> KVCache:
        """K/V for the attention layers; a fixed-size recurrent state for each linear-attention layer, on its
        layer's device (charged as the layer's cache: :meth:`DecoderModel.make_cache`)."""
        a = self.args
        geometry = (a.ssm_d_conv - 1, a.conv_dim, a.ssm_dt_rank, a.head_v_dim, a.ssm_d_state)
        states = {}
        for i in range(a.n_layer):
            if a.recurrent[i]:
                if charge is not None:
                    charge(i, a.state_bytes)  # the planner's price (LayerSpec.state_bytes)
                states[i] = RecurrentState(*geometry, devices[i])
        attn = {i: devices[i] for i in a.attention_layers}
        types = {i: kv_type[i] for i in attn} if isinstance(kv_type, dict) else kv_type
        return KVCache(attn, n_ctx, a.kv_dim, types, charge=charge, recurrent=states)

    _mtp = None

    def mtp_head(self):
        """The file's MTP (NextN) head (:class:`engine.models.mtp.MTPHead`, made on first use), or None where the
        file has none."""
        if self.args.n_layer_nextn <= 0:
            return None
        if self._mtp is None:
            from engine.models.mtp import MTPHead

            self._mtp = MTPHead(self)
        return self._mtp

    def forward(self, tokens, start: int, cache: KVCache, all_logits: bool = True) -> torch.Tensor:
        if not cache.recurrent and any(self.args.recurrent):
            raise UsageError("this cache has no recurrent state for the linear-attention layers (use new_cache)")
        cache.enter(start, len(tokens))
        return super().forward(tokens, start, cache, all_logits)
