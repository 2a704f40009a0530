"""engine.bench.read_floor: the pure-read kernel behind the bench's read floor reads every word of its
buffer exactly once (the XOR of each program's words), tail included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.bench import read_floor as rf


@pytest.mark.parametrize("nwords", [rf.PER, 3 * rf.PER - 77], ids=["whole programs", "a ragged tail"])
def test_read_kernel_reads_every_word_once(nwords, device):
    gen = np.random.default_rng((3, nwords))
    w = torch.from_numpy(gen.integers(-(2**31), 2**31 - 1, nwords, dtype=np.int64).astype(np.int32)).to(device)
    grid = -(-nwords // rf.PER)
    y = torch.zeros(grid, dtype=torch.int32, device=device)
    rf._read_kernel[(grid,)](w, w.view(torch.uint8), y, nwords, 0, 0, STEPS=rf.STEPS, NT=rf.NT, PDL=0)
    pad = np.zeros(grid * rf.PER, dtype=np.int32)
    pad[:nwords] = w.cpu().numpy()
    want = np.bitwise_xor.reduce(pad.reshape(grid, rf.PER), axis=1)
    assert np.array_equal(y.cpu().numpy(), want), (y, want)
