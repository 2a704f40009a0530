"""Preallocated KV cache written by position, in f32, bf16 or q8_0, and the fixed-size recurrent state
of linear-attention layers (:class:`RecurrentState`) beside it.

q8_0 stores int8 codes plus one fp16 scale per 32 values (34 bytes per 32 elements, the size the
planner prices); values are rounded like ggml's ``quantize_row_q8_0_ref`` (d = amax/127).
"""

from __future__ import annotations

import torch

from engine.errors import UsageError
from engine.kv_layout import check_kv_geometry, kv_layer_bytes, kv_rows, resolve_kv_type


def _q8_0_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [T, width] -> (int8 codes [T, width], fp16 scales [T, width/32]) as ggml's
    quantize_row_q8_0_ref (d = amax/127, codes round(x/d))."""
    T = x.shape[0]
    xb = x.reshape(T, -1, 32)
    amax = xb.abs().amax(dim=-1)  # [T, nb]
    d = (amax / 127).to(torch.float16)
    iscale = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(xb * iscale[..., None]).clamp(-127, 127).to(torch.int8).reshape(T, -1), d


class _Store:
    """One tensor of the cache ([n_ctx, width]) in the chosen dtype."""

    def __init__(self, n_ctx: int, width: int, kv_type: str, device: torch.device):
        self.kv_type = kv_type
        if kv_type == "q8_0":
            self.q = torch.zeros(n_ctx, width, dtype=torch.int8, device=device)
            self.d = torch.zeros(n_ctx, width // 32, dtype=torch.float16, device=device)
        else:
            dt = torch.float32 if kv_type == "f32" else torch.bfloat16
            self.q = torch.zeros(n_ctx, width, dtype=dt, device=device)

    def rounded(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, width] f32 as a write then a read would return it (the store's rounding)."""
        if self.kv_type == "f32":
            return x
        if self.kv_type != "q8_0":
            return x.to(self.q.dtype).to(torch.float32)
        q, d = _q8_0_rows(x)
        T = x.shape[0]
        return (q.to(torch.float32).reshape(T, -1, 32) * d.to(torch.float32)[..., None]).reshape(T, -1)

    def write_ring(self, start: int, x: torch.Tensor) -> None:
        """x [T, width] f32 at positions start … start+T−1 of a ring of ``rows`` rows (position p in row p mod
        rows; of more than ``rows`` positions only the last ones are kept)."""
        R, T = self.q.shape[0], x.shape[0]
        if T > R:
            start, x = start + T - R, x[T - R :]
            T = R
        rows = torch.arange(start, start + T, device=self.q.device) % R
        self.write_at(rows, x)

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:  # [n, width] f32 of the given rows
        if self.kv_type != "q8_0":
            return self.q[rows].to(torch.float32)
        q = self.q[rows].to(torch.float32).reshape(len(rows), -1, 32)
        return (q * self.d[rows].to(torch.float32)[..., None]).reshape(len(rows), -1)

    def write(self, start: int, x: torch.Tensor) -> None:  # x [T, width] f32
        T = x.shape[0]
        if self.kv_type != "q8_0":
            self.q[start : start + T] = x.to(self.q.dtype)
            return
        q, d = _q8_0_rows(x)
        self.q[start : start + T] = q
        self.d[start : start + T] = d

    def write_at(self, pos: torch.Tensor, x: torch.Tensor) -> None:
        """x [T, width] f32 at the positions in the device tensor ``pos`` int64 [T] (no host
        sync: the write a CUDA graph captures), rounded as :meth:`write`."""
        if self.kv_type != "q8_0":
            self.q.index_copy_(0, pos, x.to(self.q.dtype))
            return
        q, d = _q8_0_rows(x)
        self.q.index_copy_(0, pos, q)
        self.d.index_copy_(0, pos, d)

    def read(self, end: int) -> torch.Tensor:  # [end, width] f32
        if self.kv_type != "q8_0":
            return self.q[:end].to(torch.float32)
        q = self.q[:end].to(torch.float32).reshape(end, -1, 32)
        return (q * self.d[:end].to(torch.float32)[..., None]).reshape(end, -1)

    @property
    def nbytes(self) -> int:
        n = self.q.numel() * self.q.element_size()
        if self.kv_type == "q8_0":
            n += self.d.numel() * self.d.element_size()
        return n


class RecurrentState:
    """One Gated DeltaNet layer's state: the conv window ``conv`` float32 [K−1, C] (the last K−1 inputs of
    its depthwise conv) and the delta-rule state ``ssm`` float32 [Hv, dv, dk]. Its size is fixed: it
    does not grow with the context. Both tensors are written in place only (:meth:`assign`, :meth:`reset`),
    so a decode CUDA graph that captured their addresses keeps reading and writing the live state."""

    def __init__(self, conv_rows: int, conv_dim: int, heads: int, dv: int, dk: int, device: torch.device):
        self.conv = torch.zeros(conv_rows, conv_dim, dtype=torch.float32, device=device)
        self.ssm = torch.zeros(heads, dv, dk, dtype=torch.float32, device=device)
        # The last step's roll-back points where it kept them (KVCache.keep_steps): (its conv inputs after the
        # window before [K−1+T, C], the delta-rule state before it and after each of its T tokens).
        self.steps: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def rewind(self, n: int) -> None:
        """Back to the state after the first ``n`` tokens (0 … T) of the last step, which kept its steps."""
        inputs, states = self.steps
        K1 = self.conv.shape[0]
        self.assign(inputs[n : n + K1], states[n])

    @torch.inference_mode()
    def assign(self, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """The state after a step: conv [K−1, C], ssm [Hv, dv, dk] copied into the state's own tensors."""
        self.conv.copy_(conv)
        self.ssm.copy_(ssm)

    @torch.inference_mode()
    def reset(self) -> None:
        # Under inference mode: the tensors may have been made under it (a cache built inside a forward pass).
        self.conv.zero_()
        self.ssm.zero_()

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * 4 + self.ssm.numel() * 4


class KVCache:
    """K and V for ``layers`` (layer index → device), each [n_ctx, kv_dim]; ``recurrent``: the state of
    each linear-attention layer (layer index → :class:`RecurrentState`), at position :attr:`state_pos`;
    ``windows``: layer → the window of a sliding-window layer, whose K and V are a ring of
    ``kv_layout.kv_rows(n_ctx, window)`` rows (the window and a slack), read by :meth:`window_span`."""

    def __init__(
        self,
        layers: dict[int, torch.device],
        n_ctx: int,
        kv_dim: int,
        kv_type: str | dict[int, str] | None = None,
        charge=None,
        recurrent: dict[int, RecurrentState] | None = None,
        windows: dict[int, int] | None = None,
    ):
        """kv_type: one dtype for every layer (None: f32), or per layer; charge(layer, nbytes) is called before
        each layer's K and V are allocated (the runtime's device arena)."""
        # a bare cache is the exact one (f32); sessions pass their resolved type (DEFAULT_KV_TYPE unless asked)
        types = kv_type if isinstance(kv_type, dict) else dict.fromkeys(layers, resolve_kv_type(kv_type or "f32"))
        for t in set(types.values()):
            check_kv_geometry(t, kv_dim)  # the planner's guard: q8_0 rows split into 32-blocks
        self.n_ctx, self.kv_dim = n_ctx, kv_dim
        self.kv_types = types
        self.kv_type = types[min(types)] if types else "f32"  # the first layer's (device) dtype
        self.k, self.v = {}, {}
        self.recurrent: dict[int, RecurrentState] = dict(recurrent or {})
        self.state_pos = 0  # the position the recurrent states have consumed up to
        # Set by a caller about to run a verify pass (speculative decoding): each step of several tokens keeps
        # every token's recurrent state, so that :meth:`rollback` can return to the last accepted token.
        self.keep_steps = False
        self._step_start = 0
        # Sliding-window layers whose ring is shorter than the context (layer → (window, rows)).
        self.rings: dict[int, tuple[int, int]] = {}
        for i, w in (windows or {}).items():
            if i in layers and kv_rows(n_ctx, w) < n_ctx:
                self.rings[i] = (w, kv_rows(n_ctx, w))
        for i, dev in layers.items():
            rows = self.rings[i][1] if i in self.rings else n_ctx
            if charge is not None:
                charge(i, kv_layer_bytes(types[i], kv_dim, rows))  # the planner's price (sizing.layer_cache_bytes)
            self.k[i] = _Store(rows, kv_dim, types[i], dev)
            self.v[i] = _Store(rows, kv_dim, types[i], dev)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v [T, kv_dim] at positions start … start+T−1."""
        end = start + k.shape[0]
        if end > self.n_ctx:
            raise UsageError(f"context full: position {end} exceeds the context of {self.n_ctx}")
        if layer in self.rings:
            self.k[layer].write_ring(start, k)
            self.v[layer].write_ring(start, v)
            return
        self.k[layer].write(start, k)
        self.v[layer].write(start, v)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions 0 … end−1 [end, kv_dim] (f32); a ring layer's: :meth:`window_span` instead."""
        if layer in self.rings:
            raise UsageError(f"layer {layer} keeps a sliding window of K/V: read it with window_span")
        return self.k[layer].read(end), self.v[layer].read(end)

    def window_span(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [T, kv_dim] at positions start … start+T−1 of a sliding-window layer and return what its
        queries there attend over: (first position p0, K, V [start+T−p0, kv_dim] f32 of positions p0 …
        start+T−1), p0 the first position the window of the query at ``start`` sees. The positions before
        ``start`` are read before the write (a long prompt's own rows may overwrite them in a ring); the new
        ones as the store rounds them."""
        window, rows = self.rings.get(layer, (0, self.n_ctx))
        p0 = max(0, start - window + 1) if window else 0
        if layer not in self.rings:
            self.write(layer, start, k, v)
            K, V = self.read(layer, start + k.shape[0])
            return p0, K[p0:], V[p0:]
        ks, vs = self.k[layer], self.v[layer]
        old = torch.arange(p0, start, device=ks.q.device) % rows
        K0, V0 = ks.read_rows(old), vs.read_rows(old)
        self.write(layer, start, k, v)
        return p0, torch.cat([K0, ks.rounded(k)]), torch.cat([V0, vs.rounded(v)])

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [T, kv_dim] at positions start.. and return all K, V [start+T, kv_dim] (f32)."""
        self.write(layer, start, k, v)
        return self.read(layer, start + k.shape[0])

    def reusable_prefix(self, keep: int, held: int) -> int:
        """How many of the ``held`` cached positions a new prompt sharing ``keep`` of them can reuse:
        ``keep`` where only K/V are cached (they are written by position), but recurrent states hold
        every position they consumed and cannot step back: all of them or nothing; a sliding-window layer's
        ring holds its last rows only: ``keep`` where the window before it is still there, else nothing."""
        for window, rows in self.rings.values():
            if max(0, keep - window + 1) < held - rows:
                return 0
        return keep if not self.recurrent or keep == held == self.state_pos else 0

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Host copies of every recurrent state (conv, ssm), layer by layer, at :attr:`state_pos` (a checkpoint)."""
        return [(s.conv.to("cpu", copy=True), s.ssm.to("cpu", copy=True)) for s in self.recurrent.values()]

    def restore(self, snap: list[tuple[torch.Tensor, torch.Tensor]], pos: int) -> None:
        """The recurrent states back to ``snap`` (a :meth:`snapshot` taken at position ``pos``), in place; K/V
        rows below ``pos`` are the caller's to know valid (they are written by position and kept)."""
        for s, (conv, ssm) in zip(self.recurrent.values(), snap, strict=True):
            s.assign(conv, ssm)
        self.state_pos = pos

    def rollback(self, pos: int) -> None:
        """After a step of several tokens run with :attr:`keep_steps`: the recurrent states back to position
        ``pos`` (from the step's start to its end), as if only the tokens before ``pos`` had been processed.
        K/V rows from ``pos`` on are left to be overwritten (they are written by position)."""
        start = self._step_start
        kept = all(s.steps is not None for s in self.recurrent.values())
        if not (kept and start <= pos <= self.state_pos):
            raise UsageError(
                f"cannot roll the recurrent state back to position {pos}: the last step kept its states for "
                f"positions {start} … {self.state_pos}"
                if kept
                else "the last step kept no states (keep_steps)"
            )
        for s in self.recurrent.values():
            s.rewind(pos - start)
        self.state_pos = pos

    def enter(self, start: int, T: int) -> None:
        """A step of T tokens at ``start`` begins: recurrent states restart at position 0 and otherwise
        continue only from where they are (a :class:`UsageError` for any other start)."""
        if not self.recurrent:
            return
        if start == 0:
            for s in self.recurrent.values():
                s.reset()
        elif start != self.state_pos:
            raise UsageError(
                f"the recurrent state is at position {self.state_pos} and cannot continue at {start}: "
                "linear-attention layers cannot step back (process the prompt again from position 0)"
            )
        for s in self.recurrent.values():
            s.steps = None  # the previous step's roll-back points no longer apply
        self._step_start, self.state_pos = start, start + T

    @property
    def nbytes(self) -> int:
        n = sum(s.nbytes for s in self.k.values()) + sum(s.nbytes for s in self.v.values())
        return n + sum(s.nbytes for s in self.recurrent.values())

    def storage_dtype(self) -> torch.dtype:
        """The dtype really stored (tests use it to prove no silent f32 fallback)."""
        return next(iter(self.k.values())).q.dtype
