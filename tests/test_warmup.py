"""ragged.warmup on the CPU: it runs the module's calls and changes nothing of the module."""

from __future__ import annotations

import pytest
import torch

import ragged


def _encoder():
    torch.manual_seed(0)
    layer = ragged.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.5, batch_first=True, dtype=torch.float64)
    return ragged.nn.TransformerEncoder(layer, 2)


def test_warmup_leaves_the_module_and_random_state_unchanged():
    enc = _encoder().train()
    x = ragged.pack([torch.randn(n, 16, dtype=torch.float64) for n in (3, 0, 7)])
    before = {k: v.clone() for k, v in enc.state_dict().items()}
    state = torch.random.get_rng_state()
    times = ragged.warmup(enc, x, training=True)
    assert set(times) == {"inference", "training"} and all(t >= 0 for t in times.values())
    assert enc.training  # mode put back
    assert all(p.grad is None for p in enc.parameters())  # nothing accumulated
    assert torch.equal(torch.random.get_rng_state(), state)  # dropout's draws restored
    assert all(torch.equal(before[k], v) for k, v in enc.state_dict().items())
    enc.eval()
    assert set(ragged.warmup(enc, x)) == {"inference"} and not enc.training


def test_warmup_errors():
    with pytest.raises(TypeError, match=r"ragged.warmup\(\): expected module to be a torch.nn.Module"):
        ragged.warmup(lambda x: x, torch.zeros(1))
    with pytest.raises(TypeError, match=r"ragged.warmup\(\): expected training to be a bool"):
        ragged.warmup(_encoder(), torch.zeros(1, 2, 16), training=1)
