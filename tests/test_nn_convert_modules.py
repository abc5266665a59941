"""ragged.nn's modules from torch.nn's: state_dict round trips, the torch constructor's
arguments, from_torch sharing or copying, and convert on nested models and a full Transformer."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformer_cases import (
    FF,
    HEADS,
    TOL,
    D,
    _causal_mask,
    _check,
    _padded,
    _randomise,
    _torch_encoder,
)

import ragged

# state_dict, from_torch, convert


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trips(bias):
    enc = _torch_encoder(bias=bias, norm=True, seed=41)
    layer = ragged.nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True, bias=bias)
    ours = ragged.nn.TransformerEncoder(
        layer, 2, norm=nn.LayerNorm(D, bias=bias), enable_nested_tensor=True, mask_check=False
    )
    assert list(ours.state_dict()) == list(enc.state_dict())
    ours.load_state_dict(enc.state_dict())
    for (k1, v1), (k2, v2) in zip(ours.state_dict().items(), enc.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    back = _torch_encoder(bias=bias, norm=True, seed=43)
    back.load_state_dict(ours.state_dict())
    x, pad = _padded([3, 5], seed=12)
    with torch.no_grad():
        _check(ours(x, src_key_padding_mask=pad), back.train()(x, src_key_padding_mask=pad), [3, 5])
    mha = ragged.nn.MultiheadAttention(D, HEADS, kdim=8, vdim=12)
    assert list(mha.state_dict()) == list(nn.MultiheadAttention(D, HEADS, kdim=8, vdim=12).state_dict())


def test_constructor_takes_torch_arguments():
    layer = ragged.nn.TransformerEncoderLayer(
        d_model=D,
        nhead=HEADS,
        dim_feedforward=FF,
        dropout=0.1,
        activation=F.gelu,
        layer_norm_eps=1e-6,
        batch_first=True,
        norm_first=True,
        bias=False,
        device="cpu",
        dtype=torch.float64,
    )
    assert layer.linear1.weight.dtype == torch.float64 and layer.norm1.eps == 1e-6
    assert layer.activation_relu_or_gelu == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enc = ragged.nn.TransformerEncoder(layer, num_layers=3, norm=None, enable_nested_tensor=True, mask_check=True)
    assert len(enc.layers) == 3 and enc.layers[0] is not enc.layers[1]
    # a torch.nn layer is converted (copied) first
    enc = ragged.nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF), 2)
    assert isinstance(enc.layers[1], ragged.nn.TransformerEncoderLayer)


def test_from_torch_shares_or_copies():
    enc = _torch_encoder(norm=True, seed=47)
    enc.layers[1].norm2.eps = 1e-3
    enc.layers[0].dropout1.p = 0.25
    shared = ragged.nn.TransformerEncoder.from_torch(enc)
    for (n1, p1), (n2, p2) in zip(shared.named_parameters(), enc.named_parameters()):
        assert n1 == n2 and p1 is p2
    assert shared.layers[1].norm2.eps == 1e-3 and shared.layers[0].dropout1.p == 0.25
    assert shared.layers[0].self_attn.dropout == 0.0
    copied = ragged.nn.TransformerEncoder.from_torch(enc.double(), copy=True)
    for (n1, p1), (n2, p2) in zip(copied.named_parameters(), enc.named_parameters()):
        assert p1 is not p2 and torch.equal(p1, p2) and p1.dtype == torch.float64
    assert not any(t.is_meta for t in itertools.chain(copied.parameters(), copied.buffers()))
    mha = nn.MultiheadAttention(D, HEADS, kdim=6, vdim=10, bias=False)
    ours = ragged.nn.MultiheadAttention.from_torch(mha)
    assert ours.k_proj_weight is mha.k_proj_weight and ours.in_proj_bias is None
    with pytest.raises(TypeError, match="TransformerEncoder.from_torch"):
        ragged.nn.TransformerEncoder.from_torch(mha)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.proj = nn.Linear(D, D)

    def forward(self, x, pad):
        return self.proj(self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0])


class _MyLayer(nn.TransformerEncoderLayer):
    """A subclass (could override forward): convert must leave it alone."""


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.first = nn.Sequential(
                nn.Linear(D, D),
                nn.ModuleDict(
                    {"enc": nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF, 0.0, batch_first=True), 2)}
                ),
            )
            self.layer = nn.TransformerEncoderLayer(D, HEADS, FF, 0.0, batch_first=True, norm_first=True)
            self.again = self.layer  # one module at two places
            self.block = _Block()
            self.custom = _MyLayer(D, HEADS, FF, 0.0, batch_first=True)

    def forward(self, x, pad):
        h = self.first[1]["enc"](self.first[0](x), src_key_padding_mask=pad)
        h = self.again(self.layer(h, src_key_padding_mask=pad), src_key_padding_mask=pad)
        h = self.custom(self.block(h, pad), src_key_padding_mask=pad)
        return h


def test_convert_nested_model():
    torch.manual_seed(0)
    model = _Net()
    _randomise(model, 53)
    reference = copy.deepcopy(model).train()
    params_before = {id(p) for p in model.parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = ragged.nn.convert(model)
    assert out is model
    assert type(model.first[1]["enc"]) is ragged.nn.TransformerEncoder
    assert type(model.first[1]["enc"].layers[0].self_attn) is ragged.nn.MultiheadAttention
    assert type(model.layer) is ragged.nn.TransformerEncoderLayer and model.again is model.layer
    assert type(model.block.attn) is ragged.nn.MultiheadAttention
    assert type(model.custom) is _MyLayer and type(model.custom.self_attn) is ragged.nn.MultiheadAttention
    assert {id(p) for p in model.parameters()} == params_before  # the same Parameter objects
    lengths = [4, 7, 1]
    x, pad = _padded(lengths, seed=14)
    with torch.no_grad():
        got, expected = model(x, pad), reference(x, pad)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got[b, :n], expected[b, :n], **TOL)
    # the optimizer built before the swap still trains the converted model
    before = model.block.proj.weight.detach().clone()
    model(x, pad)[~pad].sum().backward()
    opt.step()
    assert not torch.equal(before, model.block.proj.weight)


def test_convert_copy_and_top_level():
    enc = _torch_encoder(seed=59, dtype=torch.float64)
    new = ragged.nn.convert(enc, copy=True)
    assert type(new) is ragged.nn.TransformerEncoder and type(enc) is nn.TransformerEncoder
    assert all(
        p1 is not p2 and torch.equal(p1, p2) and p1.dtype == torch.float64
        for p1, p2 in zip(new.parameters(), enc.parameters())
    )
    mha = nn.MultiheadAttention(D, HEADS)
    assert type(ragged.nn.convert(mha)) is ragged.nn.MultiheadAttention
    with pytest.warns(UserWarning, match="add_bias_kv"):
        kept = ragged.nn.convert(nn.Sequential(nn.MultiheadAttention(D, HEADS, add_bias_kv=True)))
    assert type(kept[0]) is nn.MultiheadAttention


def test_convert_full_transformer():
    """nn.Transformer: the encoder is swapped whole, the decoder's attention modules one by one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Transformer(D, HEADS, 2, 2, FF, dropout=0.0, batch_first=True)
    _randomise(model, 57)
    ours = ragged.nn.convert(copy.deepcopy(model))
    assert type(ours.encoder) is ragged.nn.TransformerEncoder
    assert type(ours.decoder.layers[1].multihead_attn) is ragged.nn.MultiheadAttention
    src_len, tgt_len = [7, 3, 5], [5, 2, 4]
    src, src_pad = _padded(src_len, seed=25)
    tgt, tgt_pad = _padded(tgt_len, seed=26)
    kwargs = {
        "tgt_mask": _causal_mask(5, torch.bool),
        "src_key_padding_mask": src_pad,
        "tgt_key_padding_mask": tgt_pad,
        "memory_key_padding_mask": src_pad,
    }
    with torch.no_grad():
        expected = model.train()(src, tgt, tgt_is_causal=True, **kwargs)
        got = ours(src, tgt, **kwargs)
    for b, n in enumerate(tgt_len):
        torch.testing.assert_close(got[b, :n], expected[b, :n], **TOL)
