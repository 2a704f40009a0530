"""The demo model in trainable torch: the ``qwen3moe`` math of ``engine/models`` (llama.cpp's
``llm_build_qwen3moe``), batched, with a load-balancing loss, and its export to GGUF tensors.

Per layer: x += Wo·attn(rope(qnorm(Wq·n(x))), rope(knorm(Wk·n(x))), Wv·n(x)) with RMS norms
over each head's 32 values, NEOX RoPE (halves rotated), causal GQA softmax scaled 1/sqrt(hd);
then x += Σ_k w_k · down_e(silu(gate_e·n(x)) ⊙ up_e·n(x)) over the top-k experts of
softmax(router·n(x)), the k weights renormalised to sum 1. Final RMS norm and an untied output.
``tests/test_demo_model.py`` holds this module to the engine: same logits on an exported file.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DemoConfig:
    """Geometry of the demo model (names follow ``engine.synth`` geometry keywords)."""

    layers: int = 6
    hidden: int = 192  # D
    heads: int = 6  # H
    kv_heads: int = 2  # Hkv
    head_dim: int = 32  # hd
    experts: int = 8  # E
    experts_used: int = 2  # K
    expert_ff: int = 192  # F
    vocab: int = 3072  # V
    ctx: int = 256  # the training rows are 256 tokens long
    rope_base: float = 10000.0
    rms_eps: float = 1e-6

    def geometry(self) -> dict:
        """Keyword arguments for ``engine.synth.write_model``."""
        return asdict(self) | {"ff": self.expert_ff, "tied_output": False}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] / sqrt(mean(x²) + eps) * w [n]."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(positions: torch.Tensor, hd: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [..., hd/2] for integer positions [...]: theta_i = p · base^(-2i/hd)."""
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float64, device=positions.device) / hd)  # [hd/2]
    theta = positions.to(torch.float64)[..., None] * inv
    return torch.cos(theta).float(), torch.sin(theta).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX RoPE: x [B, heads, T, hd], pairs (i, i + hd/2); cos/sin [B, 1, T, hd/2]."""
    h = x.shape[-1] // 2
    x0, x1 = x[..., :h], x[..., h:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, c: DemoConfig):
        super().__init__()
        D, hd, E, Fe = c.hidden, c.head_dim, c.experts, c.expert_ff
        self.c = c
        self.attn_norm = nn.Parameter(torch.ones(D))
        self.wq = nn.Parameter(torch.empty(c.heads * hd, D))
        self.wk = nn.Parameter(torch.empty(c.kv_heads * hd, D))
        self.wv = nn.Parameter(torch.empty(c.kv_heads * hd, D))
        self.wo = nn.Parameter(torch.empty(D, c.heads * hd))
        self.q_norm = nn.Parameter(torch.ones(hd))
        self.k_norm = nn.Parameter(torch.ones(hd))
        self.ffn_norm = nn.Parameter(torch.ones(D))
        self.router = nn.Parameter(torch.empty(E, D))
        self.gate = nn.Parameter(torch.empty(E, Fe, D))
        self.up = nn.Parameter(torch.empty(E, Fe, D))
        self.down = nn.Parameter(torch.empty(E, D, Fe))

    def attention(self, x: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        c = self.c
        B, T, _ = x.shape
        q = (x @ self.wq.T).view(B, T, c.heads, c.head_dim)
        k = (x @ self.wk.T).view(B, T, c.kv_heads, c.head_dim)
        v = (x @ self.wv.T).view(B, T, c.kv_heads, c.head_dim)
        q = rms_norm(q, self.q_norm, c.rms_eps).transpose(1, 2)  # [B, H, T, hd]
        k = rms_norm(k, self.k_norm, c.rms_eps).transpose(1, 2)  # [B, Hkv, T, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        g = c.heads // c.kv_heads
        k = k.repeat_interleave(g, dim=1)  # query head h reads KV head h // g
        v = v.transpose(1, 2).repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(c.head_dim))
        return o.transpose(1, 2).reshape(B, T, -1) @ self.wo.T

    def moe(self, x: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (y [N, D], balance loss); ``live`` bool [N] marks tokens counted in the loss."""
        c = self.c
        probs = torch.softmax(x @ self.router.T, dim=-1)  # [N, E]
        w, ids = torch.topk(probs, c.experts_used, dim=-1)  # [N, K]
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        flat = ids.reshape(-1)  # [N*K]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=c.experts).tolist()
        tok = order // c.experts_used  # token of each (token, slot) pair, grouped by expert
        wts = w.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n:
                t, we = tok[start : start + n], wts[start : start + n, None]
                xe = x[t]  # [n, D]
                h = F.silu(xe @ self.gate[e].T) * (xe @ self.up[e].T)  # [n, F]
                y = y.index_add(0, t, (h @ self.down[e].T) * we)
            start += n
        # Switch-style balance: E · Σ_e (share of routed slots) · (mean router probability).
        m = live.float()[:, None]
        share = (F.one_hot(ids, c.experts).float().sum(1) * m).sum(0) / (m.sum() * c.experts_used).clamp(min=1)
        mean_p = (probs * m).sum(0) / m.sum().clamp(min=1)
        return y, c.experts * (share * mean_p).sum()

    def forward(self, x, cos, sin, mask, live):
        x = x + self.attention(rms_norm(x, self.attn_norm, self.c.rms_eps), cos, sin, mask)
        B, T, D = x.shape
        y, aux = self.moe(rms_norm(x, self.ffn_norm, self.c.rms_eps).reshape(B * T, D), live.reshape(-1))
        return x + y.view(B, T, D), aux


class DemoModel(nn.Module):
    """Trainable qwen3moe. ``forward(tokens [B, T], positions [B, T], segments [B, T])`` ->
    (logits float32 [B, T, V], mean balance loss). Tokens attend to earlier tokens of their own
    segment only, so packed samples behave as separate sequences starting at their position 0."""

    def __init__(self, c: DemoConfig, seed: int = 0):
        super().__init__()
        self.c = c
        self.embed = nn.Parameter(torch.empty(c.vocab, c.hidden))
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.out_norm = nn.Parameter(torch.ones(c.hidden))
        self.output = nn.Parameter(torch.empty(c.vocab, c.hidden))
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """GPT-2-style init: N(0, 0.02), residual projections scaled by 1/sqrt(2·layers)."""
        g = torch.Generator().manual_seed(seed)
        resid = 0.02 / math.sqrt(2 * self.c.layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    std = resid if name.endswith(("wo", "down")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, tokens, positions, segments, live=None):
        c = self.c
        if live is None:
            live = torch.ones_like(tokens, dtype=torch.bool)
        T = tokens.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        mask = (segments[:, :, None] == segments[:, None, :]) & causal  # [B, T, T]
        cos, sin = rope_tables(positions, c.head_dim, c.rope_base)  # [B, T, hd/2]
        cos, sin = cos[:, None], sin[:, None]
        x = self.embed[tokens]  # [B, T, D]
        aux = x.new_zeros(())
        for b in self.blocks:
            x, a = b(x, cos, sin, mask[:, None], live)
            aux = aux + a
        return rms_norm(x, self.out_norm, c.rms_eps) @ self.output.T, aux / c.layers

    @torch.no_grad()
    def logits(self, ids: list[int]) -> np.ndarray:
        """float32 [T, V] logits of one sequence starting at position 0."""
        t = torch.tensor([ids])
        pos = torch.arange(len(ids))[None]
        out, _ = self(t, pos, torch.zeros_like(t))
        return out[0].float().numpy()

    def gguf_parameters(self) -> dict[str, nn.Parameter]:
        """{GGUF tensor name: parameter}; shapes are GGUF's numpy (out, in) order."""
        w = {"token_embd.weight": self.embed, "output_norm.weight": self.out_norm, "output.weight": self.output}
        for i, b in enumerate(self.blocks):
            p = f"blk.{i}."
            w |= {
                p + "attn_norm.weight": b.attn_norm,
                p + "attn_q.weight": b.wq,
                p + "attn_k.weight": b.wk,
                p + "attn_v.weight": b.wv,
                p + "attn_q_norm.weight": b.q_norm,
                p + "attn_k_norm.weight": b.k_norm,
                p + "attn_output.weight": b.wo,
                p + "ffn_norm.weight": b.ffn_norm,
                p + "ffn_gate_inp.weight": b.router,
                p + "ffn_gate_exps.weight": b.gate,
                p + "ffn_up_exps.weight": b.up,
                p + "ffn_down_exps.weight": b.down,
            }
        return w

    def gguf_weights(self) -> dict[str, np.ndarray]:
        """{GGUF tensor name: float32 array} for ``engine.synth.write_model``."""
        return {k: p.detach().float().cpu().numpy().copy() for k, p in self.gguf_parameters().items()}

    @torch.no_grad()
    def load_gguf_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Set every parameter from {GGUF tensor name: float array} (e.g. a file's dequantized tensors)."""
        params = self.gguf_parameters()
        if set(weights) != set(params):
            raise ValueError(f"tensor names differ: {sorted(set(weights) ^ set(params))}")
        for k, p in params.items():
            p.copy_(torch.from_numpy(np.array(weights[k], dtype=np.float32)).reshape(p.shape))  # a writable copy
