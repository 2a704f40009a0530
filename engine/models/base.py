"""The decoder model skeleton shared by every architecture: embed → layers → norm → logits."""

from __future__ import annotations

import numpy as np
import torch

from engine.experts import CpuExperts, ExpertBackend, ExpertStacks
from engine.kv_cache import KVCache
from engine.models.args import ModelArgs
from engine.models.layers import rms_norm, rope_cos_sin
from engine.models.weights import Embedding, Weights
from engine.profiler import ExpertProfiler


class DecoderModel:
    """A loaded model. Architecture modules subclass it and implement :meth:`make_layer`."""

    def __init__(self, w: Weights, args: ModelArgs, experts: ExpertBackend | None = None):
        self.w, self.args = w, args
        a = args
        if experts is None and a.is_moe:
            experts = CpuExperts(self.expert_stacks(), q8_act=w.q8_act)
        self.experts = experts
        self.profiler = ExpertProfiler(a.n_layer, a.n_expert)
        if experts is not None:
            experts.profiler = self.profiler
        self.embed = Embedding(w.gf.tensor("token_embd.weight"))
        self.layers = [self.make_layer(i) for i in range(a.n_layer)]
        self.out_norm = w.vector("output_norm.weight")
        self.output = w.linear("output.weight" if w.has("output.weight") else "token_embd.weight")
        rf = w.optional_vector("rope_freqs.weight")
        self.freq_factors = rf.numpy() if rf is not None else None

    def make_layer(self, i: int):
        raise NotImplementedError

    def expert_stacks(self) -> dict[int, ExpertStacks]:
        w = self.w
        return {
            i: ExpertStacks(*(w.prepared(f"blk.{i}.ffn_{r}_exps.weight") for r in ("gate", "up", "down")))
            for i in range(self.args.n_layer)
        }

    def new_cache(self, n_ctx: int, kv_type: str | None = None) -> KVCache:
        dev = torch.device("cpu")
        return KVCache({i: dev for i in range(self.args.n_layer)}, n_ctx, self.args.kv_dim, kv_type)

    @torch.inference_mode()
    def forward(self, tokens, start: int, cache: KVCache, all_logits: bool = True) -> torch.Tensor:
        """tokens int [T] at positions start..start+T-1 -> logits float32 [T, V] (or [1, V] for the
        last position when ``all_logits`` is False). Writes K/V of these positions into ``cache``."""
        a = self.args
        tokens = np.asarray(tokens, dtype=np.int64)
        T = len(tokens)
        self.profiler.begin_step()
        x = self.embed(tokens)  # [T, D]
        cos, sin = rope_cos_sin(np.arange(start, start + T), a.rope_dim, a.rope_base, a.rope_scale, self.freq_factors)
        for layer in self.layers:
            x = layer(x, start, cache, cos, sin)
        if not all_logits:
            x = x[-1:]
        logits = self.output(rms_norm(x, self.out_norm, a.rms_eps))
        self.profiler.end_step(T)
        return logits
