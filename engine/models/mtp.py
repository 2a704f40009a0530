"""The MTP (multi-token prediction, "NextN") head of the Gated-DeltaNet hybrids: a draft model inside the file.

As llama.cpp loads and runs it (``load_arch_tensors`` / ``graph_mtp`` of qwen35moe, qwen35, qwen3next): the
``nextn_predict_layers`` blocks after the trunk (block ``n_layer``; one block is run, as llama.cpp does) are a
gated full-attention decoder layer with the trunk's FFN kind (routed experts + gated shared expert, or dense),
fed by

    x = eh_proj · [ enorm(embed(t_{p+1})) ; hnorm(h_p) ]

where ``h_p`` is the trunk's last hidden state at position p after ``output_norm`` (llama.cpp's ``h_nextn``,
which the LM head reads too) and ``t_{p+1}`` the token after position p; the layer's output, normed by
``nextn.shared_head_norm`` (else ``output_norm``), is both the next draft step's ``h`` and, through
``nextn.shared_head_head`` (else the output matrix), the logits of the token at p + 2. The rows are laid at
the hidden state's position p (vLLM's convention for MTP drafting), in the head's own one-layer K/V cache.

The head runs on the host with the host weights and its own host expert backend, whichever placement the trunk
has (the runtime refuses MTP only where the trunk's hidden state does not come back to the host: the CUDA-graph
decode step). :func:`mtp_reference` is the float64 numpy step-by-step form beside it.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.experts import CpuExperts, ExpertStacks
from engine.kv_cache import KVCache
from engine.models.blocks import Attention, DecoderLayer, DenseFFN, MoE
from engine.models.layers import rms_norm
from engine.models.weights import Embedding

HOST = torch.device("cpu")


def nextn(i: int, name: str) -> str:
    return f"blk.{i}.nextn.{name}.weight"


class MTPHead:
    """The first NextN block of a loaded hybrid ``model`` (its ``args.n_layer_nextn`` > 0)."""

    def __init__(self, model):
        a, w = model.args, model.w
        i = self.i = a.n_layer
        self.model, self.args = model, a
        if getattr(model, "moe", False):
            names = [f"blk.{i}.ffn_{r}_exps.weight" for r in ("gate", "up", "down")]
            stacks = ExpertStacks(*(w.resident(n) for n in names))
            self.experts = CpuExperts({i: stacks}, q8_act=w.q8_act)
            ffn = MoE(w, i, a, self.experts, shared_expert=True)
        else:
            self.experts = None
            ffn = DenseFFN(w, i)
        mixer = Attention(w, i, a, qk_norm="head", q_gate=True)
        self.layer = DecoderLayer(w, i, a, mixer, ffn, ffn_norm="post_attention_norm")
        self.eh_proj = w.linear(nextn(i, "eh_proj"))
        self.enorm, self.hnorm = w.vector(nextn(i, "enorm")), w.vector(nextn(i, "hnorm"))
        self.head_norm = w.optional_vector(nextn(i, "shared_head_norm"))
        if self.head_norm is None:
            self.head_norm = w.vector("output_norm.weight")
        self.head = w.linear(nextn(i, "shared_head_head")) if w.has(nextn(i, "shared_head_head")) else None
        name = nextn(i, "embed_tokens")
        self.embed = Embedding(w.gf.tensor(name)) if w.has(name) else model.embed

    def new_cache(self, n_ctx: int) -> KVCache:
        """The head's K/V (its one attention layer, float32 on the host)."""
        return KVCache({self.i: HOST}, n_ctx, self.args.kv_dim)

    @torch.inference_mode()
    def forward(self, h: torch.Tensor, next_tokens, start: int, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """h float32 [T, D] (the trunk's normed hidden states at positions start … start+T−1, or the head's own
        from the previous draft step) and the tokens after them int [T] -> (logits [T, V], the head's normed
        hidden states [T, D], the next draft step's ``h``). Writes the head's K/V rows start … start+T−1."""
        a = self.args
        tokens = np.asarray(next_tokens, dtype=np.int64)
        e = self.embed(tokens)
        if self.model.embed_scale is not None:
            e = e * np.float32(self.model.embed_scale)
        x = torch.cat([rms_norm(e, self.enorm, a.rms_eps), rms_norm(h.to(HOST), self.hnorm, a.rms_eps)], dim=-1)
        x = self.eh_proj(x.contiguous())
        cos, sin = self.model._rope(np.arange(start, start + len(tokens)), HOST)
        x = self.layer(x, start, cache, cos, sin)
        hn = rms_norm(x, self.head_norm, a.rms_eps)
        logits = self.head(hn) if self.head is not None else self.model.output(hn)
        return logits.to(HOST), hn


def mtp_reference(gf, a, h: np.ndarray, next_tokens, start: int, past_kv=None):
    """The MTP block of GGUF ``gf`` (args ``a``) in float64 numpy, step by step: h [T, D], tokens [T] at positions
    start … -> (logits [T, V], normed hidden [T, D], (K, V) of every position so far [start+T, kv_dim]).
    ``past_kv``: the (K, V) this returned for the positions before ``start`` (None at 0). Weights are
    dequantized from the file; routed experts softmax top-k, renormalised where ``a.norm_topk``."""
    from engine.quant.reference import dequantize

    i = a.n_layer

    def t(name):
        r = gf.tensor(name)
        return np.asarray(dequantize(r.data, r.qtype), dtype=np.float64).reshape(r.shape)

    def has(name):
        return name in gf.tensors

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + a.rms_eps) * w

    p = f"blk.{i}."
    tokens = np.asarray(next_tokens, dtype=np.int64)
    T = len(tokens)
    embd = t(nextn(i, "embed_tokens")) if has(nextn(i, "embed_tokens")) else t("token_embd.weight")
    x = np.concatenate([norm(embd[tokens], t(nextn(i, "enorm"))), norm(h, t(nextn(i, "hnorm")))], -1)
    x = x @ t(nextn(i, "eh_proj")).T
    # gated attention: q and gate per head, per-head RMS norms on q and k, RoPE on the first rope_dim dims
    hd, H, Hkv = a.head_dim, a.n_head, a.n_head_kv
    y = norm(x, t(p + "attn_norm.weight"))
    qg = (y @ t(p + "attn_q.weight").T).reshape(T, H, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, H * hd)
    k = (y @ t(p + "attn_k.weight").T).reshape(T, Hkv, hd)
    v = (y @ t(p + "attn_v.weight").T).reshape(T, Hkv * hd)
    q, k = norm(q, t(p + "attn_q_norm.weight")), norm(k, t(p + "attn_k_norm.weight"))
    pos = np.arange(start, start + T, dtype=np.float64)
    rd = a.rope_dim
    inv = a.rope_base ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
    ang = pos[:, None] / a.rope_scale * inv[None, :]  # [T, rd/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(z):  # NEOX: pairs (j, j + rd/2) of the rotated part
        z = z.copy()
        x0, x1 = z[..., : rd // 2].copy(), z[..., rd // 2 : rd].copy()
        z[..., : rd // 2] = x0 * cos - x1 * sin
        z[..., rd // 2 : rd] = x0 * sin + x1 * cos
        return z

    q, k = rope(q), rope(k).reshape(T, Hkv * hd)
    K = k if past_kv is None else np.concatenate([past_kv[0], k])
    V = v if past_kv is None else np.concatenate([past_kv[1], v])
    Kh, Vh = K.reshape(-1, Hkv, hd), V.reshape(-1, Hkv, hd)
    out = np.zeros((T, H, hd))
    g = H // Hkv
    for tt in range(T):
        P = start + tt + 1  # causal: positions 0 … start+tt
        for hh in range(H):
            s = Kh[:P, hh // g] @ q[tt, hh] / np.sqrt(hd)
            s = np.exp(s - s.max())
            out[tt, hh] = (s / s.sum()) @ Vh[:P, hh // g]
    att = out.reshape(T, H * hd) / (1 + np.exp(-gate))
    x = x + att @ t(p + "attn_output.weight").T
    y = norm(x, t(p + "post_attention_norm.weight"))
    if has(p + "ffn_gate_inp.weight"):
        logits = y @ t(p + "ffn_gate_inp.weight").T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        G, U, Dn = t(p + "ffn_gate_exps.weight"), t(p + "ffn_up_exps.weight"), t(p + "ffn_down_exps.weight")
        f = np.zeros_like(y)
        for tt in range(T):
            ids = np.argsort(-probs[tt], kind="stable")[: a.n_expert_used]
            wts = probs[tt, ids] / (probs[tt, ids].sum() if a.norm_topk else 1.0)
            for e, wt in zip(ids, wts):
                gg, uu = G[e] @ y[tt], U[e] @ y[tt]
                f[tt] += wt * (Dn[e] @ (gg / (1 + np.exp(-gg)) * uu))
        gs, us = y @ t(p + "ffn_gate_shexp.weight").T, y @ t(p + "ffn_up_shexp.weight").T
        sh = (gs / (1 + np.exp(-gs)) * us) @ t(p + "ffn_down_shexp.weight").T
        sh *= 1 / (1 + np.exp(-(y @ t(p + "ffn_gate_inp_shexp.weight"))))[:, None]
        f += sh
    else:
        gs, us = y @ t(p + "ffn_gate.weight").T, y @ t(p + "ffn_up.weight").T
        f = (gs / (1 + np.exp(-gs)) * us) @ t(p + "ffn_down.weight").T
    x = x + f
    hn_w = t(nextn(i, "shared_head_norm")) if has(nextn(i, "shared_head_norm")) else t("output_norm.weight")
    hn = norm(x, hn_w)
    if has(nextn(i, "shared_head_head")):
        W = t(nextn(i, "shared_head_head"))
    else:
        W = t("output.weight") if has("output.weight") else t("token_embd.weight")
    return hn @ W.T, hn, (K, V)
