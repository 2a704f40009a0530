"""The Gated-DeltaNet demo model in trainable torch: the ``qwen35moe`` math of ``engine/models`` (llama.cpp's
``llm_build_qwen35moe``) with its MTP (NextN) head, batched, with a load-balancing loss, and its export to
GGUF tensors.

Layer i is Gated DeltaNet where (i + 1) % full_attn_interval != 0, else gated full attention:

* Gated DeltaNet (``engine.models.blocks.GatedDeltaNet`` / ``engine.models.layers.delta_net_reference``):
  qkv = Wqkv·n(x) through a depthwise causal conv of ``ssm_conv`` taps and silu; q, k L2-normed per key
  head; value head h reads key head h mod Hk ("tile"); β = sigmoid(Wβ·n(x)), g = softplus(Wα·n(x) + dt_bias)·A;
  the gated delta rule (``engine.models.layers.gated_delta_chunked``, called as is with the batch folded into
  the heads); then rms_norm(o)·w ⊙ silu(Wz·n(x)) per value head and the output projection.
* gated attention (``engine.models.blocks.Attention`` with ``q_gate``): per head [q | gate] from Wq, per-head
  q/k RMS norms, NEOX RoPE on the first ``rope_dim`` dims, causal GQA softmax 1/sqrt(hd), output ⊙ sigmoid(gate).

Every layer's FFN: softmax top-k routed SwiGLU experts renormalised, plus a SwiGLU shared expert scaled by
sigmoid(w·n(x)); the FFN norm is ``post_attention_norm``. Final RMS norm and an untied output.

The MTP block (``engine.models.mtp``): at position p, x = eh_proj·[enorm(embed(t_{p+1})); hnorm(h_p)] with h_p
the trunk's output-normed hidden state, one gated full-attention layer with the trunk's FFN kind at RoPE
position p, ``shared_head_norm`` and the shared output matrix -> the logits of t_{p+2}.

Rows are one conversation each, starting at position 0, padded at the end (padding follows every real token,
so it changes nothing before it; the recurrent state needs no per-segment reset). ``tests/test_demo_gdn.py``
holds this module to the engine: same logits on an exported file.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.models.layers import (
    apply_rope,
    delta_gates,
    expand_heads,
    gated_delta_chunked,
    gated_rms_norm,
    l2_norm,
    rms_norm,
    rope_theta,
)


@dataclass(frozen=True)
class GdnConfig:
    """Geometry of the GDN demo (names follow ``engine.synth`` geometry keywords)."""

    layers: int = 4  # trunk layers; full_attn_interval 4: three Gated DeltaNet, then one gated attention
    hidden: int = 160  # D
    heads: int = 4  # H (gated attention)
    kv_heads: int = 2  # Hkv
    head_dim: int = 32  # hd
    rope_dim: int = 16  # rotated dims per head
    ssm_conv: int = 4  # conv taps
    ssm_state: int = 32  # key (= value) head dim dk
    ssm_groups: int = 2  # key heads Hk
    ssm_v_heads: int = 4  # value heads Hv
    full_attn_interval: int = 4
    experts: int = 8  # E
    experts_used: int = 2  # K
    expert_ff: int = 160  # F
    shared_ff: int = 160  # shared expert width
    nextn: int = 1  # MTP blocks
    vocab: int = 3072  # V
    ctx: int = 256
    rope_base: float = 1e6
    rms_eps: float = 1e-6

    def geometry(self) -> dict:
        """Keyword arguments for ``engine.synth.write_model``."""
        return asdict(self) | {"tied_output": False}

    def recurrent(self, i: int) -> bool:
        return (i + 1) % self.full_attn_interval != 0


def rope_cos_sin(T: int, c: GdnConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [T, rope_dim/2] of positions 0 … T−1 (the engine's ``rope_theta``)."""
    theta = torch.from_numpy(rope_theta(np.arange(T), c.rope_dim, c.rope_base)).to(device)
    return torch.cos(theta), torch.sin(theta)


def _p(*shape) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))


class MoE(nn.Module):
    """Routed SwiGLU experts (softmax top-k, renormalised) plus the sigmoid-gated shared expert."""

    def __init__(self, c: GdnConfig):
        super().__init__()
        D, E, Fe, Fs = c.hidden, c.experts, c.expert_ff, c.shared_ff
        self.c = c
        self.router, self.gate, self.up, self.down = _p(E, D), _p(E, Fe, D), _p(E, Fe, D), _p(E, D, Fe)
        self.sh_gate_inp = nn.Parameter(torch.zeros(D))
        self.sh_gate, self.sh_up, self.sh_down = _p(Fs, D), _p(Fs, D), _p(D, Fs)

    def forward(self, x: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] (normed) -> (y [N, D], balance loss); ``live`` bool [N] marks tokens counted in the loss."""
        c = self.c
        probs = torch.softmax(x @ self.router.T, dim=-1)  # [N, E]
        w, ids = torch.topk(probs, c.experts_used, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=c.experts).tolist()
        tok = order // c.experts_used
        wts = w.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n:
                t, we = tok[start : start + n], wts[start : start + n, None]
                xe = x[t]
                h = F.silu(xe @ self.gate[e].T) * (xe @ self.up[e].T)
                y = y.index_add(0, t, (h @ self.down[e].T) * we)
            start += n
        sh = (F.silu(x @ self.sh_gate.T) * (x @ self.sh_up.T)) @ self.sh_down.T
        y = y + sh * torch.sigmoid(x @ self.sh_gate_inp)[:, None]
        m = live.float()[:, None]
        share = (F.one_hot(ids, c.experts).float().sum(1) * m).sum(0) / (m.sum() * c.experts_used).clamp(min=1)
        mean_p = (probs * m).sum(0) / m.sum().clamp(min=1)
        return y, c.experts * (share * mean_p).sum()

    def gguf(self, p: str) -> dict[str, nn.Parameter]:
        return {
            p + "ffn_gate_inp.weight": self.router,
            p + "ffn_gate_exps.weight": self.gate,
            p + "ffn_up_exps.weight": self.up,
            p + "ffn_down_exps.weight": self.down,
            p + "ffn_gate_inp_shexp.weight": self.sh_gate_inp,
            p + "ffn_gate_shexp.weight": self.sh_gate,
            p + "ffn_up_shexp.weight": self.sh_up,
            p + "ffn_down_shexp.weight": self.sh_down,
        }


class GatedAttention(nn.Module):
    def __init__(self, c: GdnConfig):
        super().__init__()
        D, hd = c.hidden, c.head_dim
        self.c = c
        self.wq, self.wk, self.wv = _p(2 * c.heads * hd, D), _p(c.kv_heads * hd, D), _p(c.kv_heads * hd, D)
        self.wo = _p(D, c.heads * hd)
        self.q_norm, self.k_norm = nn.Parameter(torch.ones(hd)), nn.Parameter(torch.ones(hd))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] (normed) -> [B, T, D]; causal over the row."""
        c = self.c
        B, T, _ = x.shape
        qg = (x @ self.wq.T).view(B, T, c.heads, 2, c.head_dim)
        q, gate = qg[..., 0, :], qg[..., 1, :].reshape(B, T, -1)
        k = (x @ self.wk.T).view(B, T, c.kv_heads, c.head_dim)
        v = (x @ self.wv.T).view(B, T, c.kv_heads, c.head_dim)
        q = apply_rope(rms_norm(q, self.q_norm, c.rms_eps), cos, sin, neox=True).transpose(1, 2)
        k = apply_rope(rms_norm(k, self.k_norm, c.rms_eps), cos, sin, neox=True).transpose(1, 2)
        g = c.heads // c.kv_heads
        k = k.repeat_interleave(g, dim=1)  # query head h reads KV head h // g
        v = v.transpose(1, 2).repeat_interleave(g, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(c.head_dim))
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate)
        return o @ self.wo.T

    def gguf(self, p: str) -> dict[str, nn.Parameter]:
        return {
            p + "attn_q.weight": self.wq,
            p + "attn_k.weight": self.wk,
            p + "attn_v.weight": self.wv,
            p + "attn_output.weight": self.wo,
            p + "attn_q_norm.weight": self.q_norm,
            p + "attn_k_norm.weight": self.k_norm,
        }


class DeltaNet(nn.Module):
    def __init__(self, c: GdnConfig):
        super().__init__()
        D, dk, Hk, Hv = c.hidden, c.ssm_state, c.ssm_groups, c.ssm_v_heads
        self.c = c
        self.C = 2 * Hk * dk + Hv * dk
        self.qkv, self.z, self.b, self.a = _p(self.C, D), _p(Hv * dk, D), _p(Hv, D), _p(Hv, D)
        self.conv = _p(self.C, c.ssm_conv)
        self.dt_bias = nn.Parameter(torch.zeros(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))  # the file's ssm_a is −exp(A_log)
        self.norm = nn.Parameter(torch.ones(dk))
        self.out = _p(D, Hv * dk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] (normed) -> [B, T, D], from zero conv and delta-rule states."""
        c = self.c
        B, T, _ = x.shape
        dk, Hk, Hv, K = c.ssm_state, c.ssm_groups, c.ssm_v_heads, c.ssm_conv
        qkv = x @ self.qkv.T  # [B, T, C]
        xp = F.pad(qkv, (0, 0, K - 1, 0))  # causal_conv1d: y_t = Σ_j xp[t+j]·w[:, j], zero state
        y = xp[:, 0:T] * self.conv[:, 0]
        for j in range(1, K):
            y = y + xp[:, j : j + T] * self.conv[:, j]
        y = F.silu(y).reshape(B * T, self.C)
        kd = Hk * dk
        q = expand_heads(l2_norm(y[:, :kd].reshape(B * T, Hk, dk), c.rms_eps), Hv, "tile")
        k = expand_heads(l2_norm(y[:, kd : 2 * kd].reshape(B * T, Hk, dk), c.rms_eps), Hv, "tile")
        v = y[:, 2 * kd :].reshape(B * T, Hv, dk)
        beta, g = delta_gates(x @ self.b.T, x @ self.a.T, self.dt_bias, -torch.exp(self.A_log))  # [B, T, Hv]

        def fold(t):  # [B·T, Hv, d] or [B, T, Hv] -> [T, B·Hv, ...]: rows become heads
            t = t.reshape(B, T, Hv, -1).transpose(0, 1).reshape(T, B * Hv, -1)
            return t

        S = x.new_zeros(B * Hv, dk, dk)
        o, _ = gated_delta_chunked(fold(q), fold(k), fold(v), fold(g)[..., 0], fold(beta)[..., 0], S)
        o = o.reshape(T, B, Hv, dk).transpose(0, 1)  # [B, T, Hv, dv]
        z = (x @ self.z.T).view(B, T, Hv, dk)
        return gated_rms_norm(o, z, self.norm, c.rms_eps).reshape(B, T, -1) @ self.out.T

    def gguf(self, p: str) -> dict[str, torch.Tensor]:
        return {
            p + "attn_qkv.weight": self.qkv,
            p + "attn_gate.weight": self.z,
            p + "ssm_beta.weight": self.b,
            p + "ssm_alpha.weight": self.a,
            p + "ssm_conv1d.weight": self.conv,
            p + "ssm_dt.bias": self.dt_bias,
            p + "ssm_norm.weight": self.norm,
            p + "ssm_out.weight": self.out,
        }


class Block(nn.Module):
    def __init__(self, c: GdnConfig, recurrent: bool):
        super().__init__()
        self.c = c
        self.attn_norm = nn.Parameter(torch.ones(c.hidden))
        self.mixer = DeltaNet(c) if recurrent else GatedAttention(c)
        self.post_norm = nn.Parameter(torch.ones(c.hidden))
        self.ffn = MoE(c)

    def forward(self, x, cos, sin, live):
        eps = self.c.rms_eps
        h = rms_norm(x, self.attn_norm, eps)
        x = x + (self.mixer(h) if isinstance(self.mixer, DeltaNet) else self.mixer(h, cos, sin))
        B, T, D = x.shape
        y, aux = self.ffn(rms_norm(x, self.post_norm, eps).reshape(B * T, D), live.reshape(-1))
        return x + y.view(B, T, D), aux

    def gguf(self, p: str) -> dict[str, torch.Tensor]:
        w = {p + "attn_norm.weight": self.attn_norm, p + "post_attention_norm.weight": self.post_norm}
        return w | self.mixer.gguf(p) | self.ffn.gguf(p)


class GdnDemoModel(nn.Module):
    """Trainable qwen35moe with one MTP block. ``forward(tokens [B, T], live [B, T] or None)`` -> (logits
    [B, T, V] of the next token, MTP logits [B, T−1, V] of the token after next (row p from h_p and
    tokens[:, p+1]), mean balance loss). Every row starts at position 0."""

    def __init__(self, c: GdnConfig, seed: int = 0):
        super().__init__()
        self.c = c
        self.embed = _p(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(Block(c, c.recurrent(i)) for i in range(c.layers))
        self.out_norm = nn.Parameter(torch.ones(c.hidden))
        self.output = _p(c.vocab, c.hidden)
        self.mtp = Block(c, recurrent=False)
        self.eh_proj = _p(c.hidden, 2 * c.hidden)
        self.enorm, self.hnorm = nn.Parameter(torch.ones(c.hidden)), nn.Parameter(torch.ones(c.hidden))
        self.head_norm = nn.Parameter(torch.ones(c.hidden))
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """GPT-2-style init N(0, 0.02), residual projections scaled by 1/sqrt(2·layers); norms 1; the shared
        expert's gate 0; Gated DeltaNet: conv taps U(±1/sqrt(taps)), A = −U(1, 16), dt = softplus(dt_bias)
        log-uniform in [1e-3, 0.1] (Mamba-2's init)."""
        g = torch.Generator().manual_seed(seed)
        resid = 0.02 / math.sqrt(2 * (self.c.layers + 1))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("sh_gate_inp"):
                    p.zero_()
                elif name.endswith("A_log"):
                    p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g)))
                elif name.endswith("dt_bias"):
                    dt = torch.exp(math.log(1e-3) + torch.rand(p.shape, generator=g) * (math.log(0.1) - math.log(1e-3)))
                    p.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
                elif name.endswith(".conv"):
                    p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / math.sqrt(self.c.ssm_conv))
                elif p.dim() == 1:
                    p.fill_(1.0)
                else:
                    std = resid if name.endswith(("wo", "down", ".out")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def trunk(self, tokens: torch.Tensor, live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (h [B, T, D]: the last hidden states after ``output_norm``, the LM head's input and
        the MTP block's h; summed balance loss of the trunk's layers)."""
        if live is None:
            live = torch.ones_like(tokens, dtype=torch.bool)
        cos, sin = rope_cos_sin(tokens.shape[1], self.c, tokens.device)
        x = self.embed[tokens]
        aux = x.new_zeros(())
        for b in self.blocks:
            x, a = b(x, cos, sin, live)
            aux = aux + a
        return rms_norm(x, self.out_norm, self.c.rms_eps), aux

    def mtp_head(self, h: torch.Tensor, next_tokens: torch.Tensor, live: torch.Tensor | None = None):
        """h [B, T, D] (normed, rows at positions 0 … T−1) and the tokens after them [B, T] -> (logits [B, T, V]
        of the tokens after those, the head's normed hidden states [B, T, D], balance loss)."""
        c = self.c
        if live is None:
            live = torch.ones_like(next_tokens, dtype=torch.bool)
        cos, sin = rope_cos_sin(next_tokens.shape[1], c, h.device)
        e = rms_norm(self.embed[next_tokens], self.enorm, c.rms_eps)
        m = torch.cat([e, rms_norm(h, self.hnorm, c.rms_eps)], dim=-1) @ self.eh_proj.T
        m, aux = self.mtp(m, cos, sin, live)
        hn = rms_norm(m, self.head_norm, c.rms_eps)
        return hn @ self.output.T, hn, aux

    def forward(self, tokens: torch.Tensor, live: torch.Tensor | None = None):
        if live is None:
            live = torch.ones_like(tokens, dtype=torch.bool)
        h, aux = self.trunk(tokens, live)
        mtp_logits, _, a = self.mtp_head(h[:, :-1], tokens[:, 1:], live[:, 1:])
        return h @ self.output.T, mtp_logits, (aux + a) / (self.c.layers + 1)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> np.ndarray:
        """float32 [T, V] next-token logits of one sequence starting at position 0."""
        out, _, _ = self(torch.tensor([ids]))
        return out[0].float().numpy()

    @torch.no_grad()
    def mtp_logits(self, ids: list[int]) -> np.ndarray:
        """float32 [T−1, V]: row p the MTP head's logits of ids[p+2] (from h_p and ids[p+1])."""
        _, m, _ = self(torch.tensor([ids]))
        return m[0].float().numpy()

    def gguf_parameters(self) -> dict[str, torch.Tensor]:
        """{GGUF tensor name: parameter}; shapes are GGUF's numpy (out, in) order (``ssm_a`` is made at
        :meth:`gguf_weights` from ``A_log``)."""
        w = {"token_embd.weight": self.embed, "output_norm.weight": self.out_norm, "output.weight": self.output}
        for i, b in enumerate(self.blocks):
            w |= b.gguf(f"blk.{i}.")
        n = self.c.layers
        w |= self.mtp.gguf(f"blk.{n}.")
        w |= {
            f"blk.{n}.nextn.eh_proj.weight": self.eh_proj,
            f"blk.{n}.nextn.enorm.weight": self.enorm,
            f"blk.{n}.nextn.hnorm.weight": self.hnorm,
            f"blk.{n}.nextn.shared_head_norm.weight": self.head_norm,
        }
        return w

    def gguf_weights(self) -> dict[str, np.ndarray]:
        """{GGUF tensor name: float32 array} for ``engine.synth.write_model``."""
        w = {k: p.detach().float().cpu().numpy().copy() for k, p in self.gguf_parameters().items()}
        for i, b in enumerate(self.blocks):
            if isinstance(b.mixer, DeltaNet):
                w[f"blk.{i}.ssm_a"] = (-torch.exp(b.mixer.A_log)).detach().float().numpy().copy()
        return w

    @torch.no_grad()
    def load_gguf_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Set every parameter from {GGUF tensor name: float array} (e.g. a file's dequantized tensors);
        ``A_log`` from ``ssm_a`` = −exp(A_log)."""
        params = self.gguf_parameters()
        for i, b in enumerate(self.blocks):
            if isinstance(b.mixer, DeltaNet):
                params[f"blk.{i}.ssm_a"] = None
        if set(weights) != set(params):
            raise ValueError(f"tensor names differ: {sorted(set(weights) ^ set(params))}")
        for k, p in params.items():
            x = torch.from_numpy(np.array(weights[k], dtype=np.float32))
            if p is None:
                self.blocks[int(k.split(".")[1])].mixer.A_log.copy_(torch.log(-x.reshape(-1)))
            else:
                p.copy_(x.reshape(p.shape))
