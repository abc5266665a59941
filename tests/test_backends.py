"""Backend selection: argument > set_backend > RAGGED_BACKEND > auto."""

import pytest
import torch

import ragged
from ragged import backends


def _inputs():
    x = torch.randn(2, 4, 3)
    return x, torch.tensor([0, 1, 4], dtype=torch.int32)


def test_default_is_auto_and_auto_takes_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("RAGGED_BACKEND", raising=False)
    assert ragged.get_backend() == "auto"
    x, offsets = _inputs()
    assert backends.select("pack", None, x.device, x, offsets).name == "torch"


def test_precedence(monkeypatch):
    monkeypatch.setenv("RAGGED_BACKEND", "triton")
    assert ragged.get_backend() == "triton"
    ragged.set_backend("torch")
    assert ragged.get_backend() == "torch"
    with ragged.use_backend("cuda"):
        assert ragged.get_backend() == "cuda"
    assert ragged.get_backend() == "torch"
    ragged.set_backend(None)
    assert ragged.get_backend() == "triton"


def test_bad_names(monkeypatch):
    with pytest.raises(ValueError, match=r"ragged.set_backend\(\): expected backend to be one of"):
        ragged.set_backend("cudnn")
    monkeypatch.setenv("RAGGED_BACKEND", "fast")
    with pytest.raises(ValueError, match="RAGGED_BACKEND"):
        ragged.get_backend()
    monkeypatch.delenv("RAGGED_BACKEND")
    x, _ = _inputs()
    with pytest.raises(ValueError, match=r"ragged.pack\(\): expected backend to be one of"):
        ragged.pack(x, lengths=[1, 3], backend="numpy")


def test_forced_backend_that_cannot_run_says_why():
    x, _ = _inputs()
    with pytest.raises(ValueError, match=r"backend 'cuda' cannot take this input: .*CUDA tensor"):
        ragged.pack(x, lengths=[1, 3], backend="cuda")
    with ragged.use_backend("cuda"):
        with pytest.raises(ValueError, match="cannot take this input"):
            ragged.pack(x, lengths=[1, 3])


def test_explain_lists_every_implementation():
    x, offsets = _inputs()
    reasons = ragged.explain("pack", x, offsets)
    assert set(reasons) == {"torch", "triton", "cuda"}
    assert reasons["torch"] == []
    assert reasons["cuda"] and "CUDA tensor" in reasons["cuda"][0]


def test_complex_values_fall_back_to_the_reference_under_auto():
    x = torch.randn(2, 4, 3, dtype=torch.complex64)
    rt = ragged.pack(x, lengths=[1, 3])
    assert torch.equal(rt.values, torch.cat([x[0, :1], x[1, :3]]))
    reasons = ragged.explain("pack", x, rt.offsets)
    assert any("complex" in r for r in reasons["triton"])
