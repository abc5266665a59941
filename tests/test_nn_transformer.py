"""ragged.nn.TransformerEncoder / TransformerEncoderLayer / MultiheadAttention / convert on CPU.

The oracle is torch.nn itself with the same weights: its training-mode path (plain ops;
dropout 0) and its eval path (the nested-tensor fast path where it applies). Only real
positions are compared: torch leaves unused values (or NaN, for a sequence of length 0)
at padding, where ragged must give exact zeros.
"""

from __future__ import annotations

import itertools
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformer_cases import (
    ACTIVATION_MODULES,
    FF,
    GRAD_TOL,
    HEADS,
    LENGTHS,
    TOL,
    D,
    _causal_mask,
    _check,
    _padded,
    _randomise,
    _run_ragged,
    _run_torch,
    _torch_encoder,
)

import ragged
from ragged import RaggedTensor

# --------------------------------------------------------------------------------------
# Values against torch.nn


GRID = list(itertools.product([True, False], [False, True], ["relu", "gelu", "callable"], [True, False], [False, True]))


@pytest.mark.parametrize(
    "batch_first,norm_first,activation,bias,causal", GRID, ids=["-".join(map(str, c)) for c in GRID]
)
def test_encoder_matches_torch(batch_first, norm_first, activation, bias, causal):
    act = (lambda t: F.silu(t) * 0.5) if activation == "callable" else activation
    seed = zlib.crc32(repr((batch_first, norm_first, activation, bias, causal)).encode()) % 1000
    enc = _torch_encoder(
        batch_first=batch_first, norm_first=norm_first, activation=act, bias=bias, norm=bool(seed % 2), seed=seed
    )
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    for case, lengths in LENGTHS.items():
        x, pad = _padded(lengths, seed=len(case))
        for training in (True, False):
            enc.train(training)
            ours.train(training)
            with torch.no_grad():
                expected = _run_torch(enc, x, pad, causal, batch_first)
                got = _run_ragged(
                    enc=ours, x=x, pad=pad, causal=causal, batch_first=batch_first, how="flag" if training else "mask"
                )
            _check(got, expected, lengths)


FUSED_GRID = list(
    itertools.product(["torch", "triton"], [False, True], ["relu", "gelu", "gelu_tanh", "callable"], [True, False])
)


@pytest.mark.parametrize(
    "backend,norm_first,activation,bias", FUSED_GRID, ids=["-".join(map(str, c)) for c in FUSED_GRID]
)
def test_fused_per_token_path_matches_torch(monkeypatch, backend, norm_first, activation, bias):
    """The GPU layer body (bias + activation and residual + LayerNorm through the fused ops)
    run here on the CPU with the fused ops' torch reference or the Triton interpreter:
    values and every gradient against torch.nn in float32."""
    from ragged.nn import transformer as rt_mod

    if backend == "triton" and ragged.backends.triton_reason(torch.device("cpu")):
        pytest.skip("Triton cannot run on the CPU here")
    monkeypatch.setattr(rt_mod, "fused_backend", lambda x: backend)
    act = {"callable": lambda t: F.silu(t) * 0.5, "gelu_tanh": nn.GELU(approximate="tanh")}.get(activation, activation)
    seed = zlib.crc32(repr((backend, norm_first, activation, bias)).encode()) % 1000
    enc = _torch_encoder(norm_first=norm_first, activation=act, bias=bias, norm=bool(seed % 2), seed=seed)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    lengths = LENGTHS["mixed"] if backend == "torch" else [3, 1, 5]
    x, pad = _padded(lengths, seed=seed)
    enc.train()
    ours.train()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).masked_fill(pad.unsqueeze(-1), 0.0)
    xt, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    expected = _run_torch(enc, xt, pad, False, True)
    got = _run_ragged(ours, xr, pad, False, True)
    _check(got.detach(), expected.detach(), lengths, tol={"rtol": 1e-4, "atol": 1e-4})
    (expected * w).sum().backward()
    (got * w).sum().backward()
    real = ~pad.unsqueeze(-1)
    torch.testing.assert_close(xr.grad * real, xt.grad * real, rtol=1e-4, atol=1e-4)
    theirs = dict(enc.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("activation", list(ACTIVATION_MODULES))
def test_fused_path_calls_custom_activation_modules(monkeypatch, backend, activation):
    """The fused bias + activation takes exact nn.ReLU / nn.GELU modules without hooks only;
    a subclass (its own forward) or a hooked module is called as torch.nn calls it."""
    from ragged.nn import transformer as rt_mod

    if backend == "triton" and ragged.backends.triton_reason(torch.device("cpu")):
        pytest.skip("Triton cannot run on the CPU here")
    monkeypatch.setattr(rt_mod, "fused_backend", lambda x: backend)
    enc = _torch_encoder(activation=ACTIVATION_MODULES[activation](), seed=37)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    lengths = [3, 1, 5]
    x, pad = _padded(lengths, seed=37)
    enc.train()  # torch.nn's plain path (dropout 0) calls the activation module
    for training in (True, False):
        ours.train(training)
        with torch.no_grad():
            expected = _run_torch(enc, x, pad, False, True)
            got = _run_ragged(ours, x, pad, False, True)
        _check(got, expected, lengths, tol={"rtol": 1e-4, "atol": 1e-4})


@pytest.mark.parametrize("norm", [False, True])
def test_final_norm_and_ragged_input(norm):
    """A RaggedTensor in gives a RaggedTensor out, equal to the padded path at real positions."""
    enc = _torch_encoder(norm=norm, seed=7)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True).eval()
    lengths = LENGTHS["mixed"]
    x, pad = _padded(lengths, seed=3)
    rt = ragged.pack(x, lengths=lengths)
    out = ours(rt)
    assert isinstance(out, RaggedTensor)
    assert out.offsets is rt.offsets and out.max_len == rt.max_len
    with torch.no_grad():
        expected = enc.train()(x, src_key_padding_mask=pad)
    _check(out.to_padded(), expected, lengths)
    torch.testing.assert_close(out.to_padded(), ours(x, src_key_padding_mask=pad))


def test_no_mask_means_full_rows():
    enc = _torch_encoder(seed=11).train()
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    x, _ = _padded([6, 6, 6], seed=1)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), enc(x), **TOL)


def test_float_left_and_scattered_padding_masks():
    enc = _torch_encoder(seed=13).train()
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    lengths = [4, 0, 7, 2]
    x, pad = _padded(lengths, seed=5)
    float_pad = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))
    with torch.no_grad():
        expected = enc(x, src_key_padding_mask=pad)
        _check(ours(x, src_key_padding_mask=float_pad), expected, lengths)
        # left padding: the same tokens at the end of each row
        left_x = torch.stack([torch.roll(x[b], 7 - n, dims=0) for b, n in enumerate(lengths)])
        left_pad = torch.stack([torch.roll(pad[b], 7 - n) for b, n in enumerate(lengths)])
        got = ours(left_x, src_key_padding_mask=left_pad)
        for b, n in enumerate(lengths):
            if n:
                torch.testing.assert_close(got[b, 7 - n :], expected[b, :n], **TOL)
            assert torch.all(got[b, : 7 - n] == 0)
        # scattered: padding between tokens (order of the tokens kept)
        perm = torch.tensor([0, 4, 1, 5, 2, 6, 3])
        sx, spad = x[:, perm], pad[:, perm]
        got = ours(sx, src_key_padding_mask=spad)
        ref = enc(sx, src_key_padding_mask=spad)
        assert torch.all(got[spad] == 0)
        keep = ~spad
        keep[1] = False  # the empty sequence: NaN in torch
        torch.testing.assert_close(got[keep], ref[keep], **TOL)


def test_empty_sequences_give_zeros():
    """torch.nn gives NaN for a fully padded row; ragged gives zeros and finite gradients."""
    enc = _torch_encoder(seed=17).train()
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    x, pad = _padded([0, 3, 0], seed=2)
    x.requires_grad_(True)
    out = ours(x, src_key_padding_mask=pad)
    assert torch.all(out[0] == 0) and torch.all(out[2] == 0)
    out.sum().backward()
    assert torch.all(torch.isfinite(x.grad)) and torch.all(x.grad[0] == 0)
    assert all(torch.all(torch.isfinite(p.grad)) for p in ours.parameters())
    # every sequence empty, and an empty batch
    x0, pad0 = _padded([0, 0], width=4)
    assert torch.all(ours(x0, src_key_padding_mask=pad0) == 0)
    assert ours(ragged.pack([torch.zeros(0, D)] * 2)).num_tokens == 0


def test_unbatched_input():
    enc = _torch_encoder(batch_first=False, seed=19).train()
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    x, _ = _padded([5], seed=4)
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), enc(x[0]), **TOL)
        pad = torch.tensor([False, False, False, True, True])
        got = ours(x[0], src_key_padding_mask=pad)
        torch.testing.assert_close(got[:3], enc(x[0], src_key_padding_mask=pad)[:3], **TOL)
        assert torch.all(got[3:] == 0)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_layer_alone_matches_torch(batch_first, causal):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, activation="gelu", batch_first=batch_first)
    _randomise(layer, 23)
    ours = ragged.nn.TransformerEncoderLayer.from_torch(layer, copy=True)
    lengths = [3, 8, 1]
    x, pad = _padded(lengths, seed=6)
    src = x if batch_first else x.transpose(0, 1)
    kwargs = {"src_mask": _causal_mask(8, torch.bool), "is_causal": True} if causal else {}
    with torch.no_grad():
        expected = layer.train()(src, src_key_padding_mask=pad, **kwargs)
        got = ours(src, src_key_padding_mask=pad, **({"is_causal": True} if causal else {}))
    if not batch_first:
        expected, got = expected.transpose(0, 1), got.transpose(0, 1)
    _check(got, expected, lengths)
    rt_out = ours(ragged.pack(x, lengths=lengths), is_causal=causal)
    assert isinstance(rt_out, RaggedTensor)
    _check(rt_out.to_padded(), expected, lengths)


def test_float64():
    enc = _torch_encoder(dtype=torch.float64, seed=29).train()
    ours = ragged.nn.TransformerEncoder.from_torch(enc)
    lengths = [4, 9, 2]
    x, pad = _padded(lengths, dtype=torch.float64)
    with torch.no_grad():
        _check(
            ours(x, src_key_padding_mask=pad),
            enc(x, src_key_padding_mask=pad),
            lengths,
            tol={"rtol": 1e-12, "atol": 1e-12},
        )


# --------------------------------------------------------------------------------------
# Gradients against torch.nn


@pytest.mark.parametrize(
    "norm_first,causal,bias,batch_first",
    [(False, False, True, True), (True, True, True, True), (False, True, False, False), (True, False, False, False)],
)
def test_gradients_match_torch(norm_first, causal, bias, batch_first):
    enc = _torch_encoder(norm_first=norm_first, bias=bias, norm=True, batch_first=batch_first, seed=31).train()
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    lengths = [5, 1, 9, 3]  # no empty sequence: torch's NaN rows would poison its gradients
    x, pad = _padded(lengths, seed=8)
    w, _ = _padded(lengths, seed=9)
    w = w.masked_fill(pad.unsqueeze(-1), 0.0)
    xt, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (_run_torch(enc, xt, pad, causal, batch_first) * w).sum().backward()
    (_run_ragged(ours, xr, pad, causal, batch_first) * w).sum().backward()
    torch.testing.assert_close(xr.grad, xt.grad, **GRAD_TOL)
    assert torch.all(xr.grad[pad] == 0)
    theirs = dict(enc.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, **GRAD_TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_dropout_changes_training_outputs_only():
    enc = _torch_encoder(dropout=0.2, seed=37)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    x, pad = _padded([4, 7, 2], seed=10)
    ours.train()
    a = ours(x, src_key_padding_mask=pad)
    b = ours(x, src_key_padding_mask=pad)
    assert not torch.equal(a, b)
    assert torch.all(a[pad] == 0)
    a.sum().backward()
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(x, src_key_padding_mask=pad), ours(x, src_key_padding_mask=pad))
        _check(ours(x, src_key_padding_mask=pad), enc.eval()(x, src_key_padding_mask=pad), [4, 7, 2])
    # attention dropout alone (dropout_p of ragged.attention) also acts in training
    ours.train()
    for layer in ours.layers:
        layer.dropout.p = layer.dropout1.p = layer.dropout2.p = 0.0
    assert not torch.equal(ours(x, src_key_padding_mask=pad), ours(x, src_key_padding_mask=pad))
