"""ragged.nn.TransformerEncoder / TransformerEncoderLayer / MultiheadAttention / convert on CPU.

The oracle is torch.nn itself with the same weights: its training-mode path (plain ops;
dropout 0) and its eval path (the nested-tensor fast path where it applies). Only real
positions are compared: torch leaves unused values (or NaN, for a sequence of length 0)
at padding, where ragged must give exact zeros.
"""

from __future__ import annotations

import copy
import itertools
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ragged
from ragged import RaggedTensor

TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-5}
D, HEADS, FF = 16, 4, 32

LENGTHS = {
    "mixed": [5, 0, 9, 1],
    "ones": [1, 1, 1],
    "equal": [6, 6, 6],
    "one_long": [2, 17, 1, 3],
}


def _randomise(module: nn.Module, seed: int, scale: float = 0.3) -> None:
    """Distinct, non-trivial weights (torch.nn's encoder starts with identical layers and zero biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, p.dtype)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(scale * noise)


def _torch_encoder(*, batch_first=True, norm_first=False, activation="relu", bias=True, norm=False, layers=2,
                   dropout=0.0, dtype=torch.float32, seed=0) -> nn.TransformerEncoder:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when its nested fast path cannot apply
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=dropout, activation=activation,
                                           batch_first=batch_first, norm_first=norm_first, bias=bias, dtype=dtype)
        final = nn.LayerNorm(D, bias=bias, dtype=dtype) if norm else None
        enc = nn.TransformerEncoder(layer, layers, norm=final)
    _randomise(enc, seed)
    return enc


def _padded(lengths, seed=0, width=None, dtype=torch.float32):
    """``x [B, M, D]`` with large garbage at padding, and the bool key padding mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths, default=0) if width is None else width
    x = torch.randn((len(lengths), width, D), generator=g, dtype=torch.float64).to(dtype)
    pad = torch.arange(width).unsqueeze(0) >= torch.tensor(lengths, dtype=torch.int64).reshape(-1, 1)
    x = x.masked_fill(pad.unsqueeze(-1), 100.0)
    return x, pad


def _causal_mask(m, dtype=torch.float32):
    """torch's causal mask: float (-inf above the diagonal), or bool (True above it)."""
    mask = nn.Transformer.generate_square_subsequent_mask(m)
    return mask == float("-inf") if dtype == torch.bool else mask.to(dtype)


def _run_torch(enc, x, pad, causal, batch_first):
    m = x.shape[1]
    src = x if batch_first else x.transpose(0, 1)
    kwargs = {"mask": _causal_mask(m, torch.bool).to(x.device), "is_causal": True} if causal else {}
    out = enc(src, src_key_padding_mask=pad, **kwargs)
    return out if batch_first else out.transpose(0, 1)


def _run_ragged(enc, x, pad, causal, batch_first, how="flag"):
    src = x if batch_first else x.transpose(0, 1)
    if not causal:
        kwargs = {}
    elif how == "flag":
        kwargs = {"is_causal": True}
    else:  # detected from the mask
        kwargs = {"mask": _causal_mask(x.shape[1]).to(x.device)}
    out = enc(src, src_key_padding_mask=pad, **kwargs)
    return out if batch_first else out.transpose(0, 1)


def _check(out, expected, lengths, tol=TOL):
    """Real positions match; ragged's padding is exactly zero."""
    assert out.shape == expected.shape
    for b, n in enumerate(lengths):
        if n:
            torch.testing.assert_close(out[b, :n], expected[b, :n], **tol, msg=lambda m, b=b: f"sequence {b}: {m}")
        assert torch.all(out[b, n:] == 0), f"sequence {b}: padding is not zero"


# --------------------------------------------------------------------------------------
# Values against torch.nn


GRID = list(itertools.product([True, False], [False, True], ["relu", "gelu", "callable"], [True, False],
                              [False, True]))


@pytest.mark.parametrize("batch_first,norm_first,activation,bias,causal", GRID,
                         ids=["-".join(map(str, c)) for c in GRID])
def test_encoder_matches_torch(batch_first, norm_first, activation, bias, causal):
    act = (lambda t: F.silu(t) * 0.5) if activation == "callable" else activation
    seed = zlib.crc32(repr((batch_first, norm_first, activation, bias, causal)).encode()) % 1000
    enc = _torch_encoder(batch_first=batch_first, norm_first=norm_first, activation=act, bias=bias,
                         norm=bool(seed % 2), seed=seed)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    for case, lengths in LENGTHS.items():
        x, pad = _padded(lengths, seed=len(case))
        for training in (True, False):
            enc.train(training)
            ours.train(training)
            with torch.no_grad():
                expected = _run_torch(enc, x, pad, causal, batch_first)
                got = _run_ragged(enc=ours, x=x, pad=pad, causal=causal, batch_first=batch_first,
                                  how="flag" if training else "mask")
            _check(got, expected, lengths)


FUSED_GRID = list(itertools.product(["torch", "triton"], [False, True], ["relu", "gelu", "gelu_tanh", "callable"],
                                     [True, False]))


@pytest.mark.parametrize("backend,norm_first,activation,bias", FUSED_GRID,
                         ids=["-".join(map(str, c)) for c in FUSED_GRID])
def test_fused_per_token_path_matches_torch(monkeypatch, backend, norm_first, activation, bias):
    """The GPU layer body (bias + activation and residual + LayerNorm through the fused ops)
    run here on the CPU with the fused ops' torch reference or the Triton interpreter:
    values and every gradient against torch.nn in float32."""
    from ragged.nn import transformer as rt_mod

    if backend == "triton" and ragged.backends.triton_reason(torch.device("cpu")):
        pytest.skip("Triton cannot run on the CPU here")
    monkeypatch.setattr(rt_mod, "fused_backend", lambda x: backend)
    act = {"callable": lambda t: F.silu(t) * 0.5, "gelu_tanh": nn.GELU(approximate="tanh")}.get(activation,
                                                                                               activation)
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
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


class _TanhReLU(nn.ReLU):
    """A ReLU subclass whose forward is something else: the layer must call it."""

    def forward(self, x):
        return torch.tanh(x)


def _hooked_gelu() -> nn.GELU:
    """A GELU module with a forward hook (torch.nn calls the activation as a module, so it runs)."""
    act = nn.GELU()
    act.register_forward_hook(lambda module, args, out: out * 0.5)
    return act


ACTIVATION_MODULES = {"relu_subclass": _TanhReLU, "hooked_gelu": _hooked_gelu}


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
                torch.testing.assert_close(got[b, 7 - n:], expected[b, :n], **TOL)
            assert torch.all(got[b, :7 - n] == 0)
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
        _check(ours(x, src_key_padding_mask=pad), enc(x, src_key_padding_mask=pad), lengths,
               tol={"rtol": 1e-12, "atol": 1e-12})


# --------------------------------------------------------------------------------------
# Gradients against torch.nn


@pytest.mark.parametrize("norm_first,causal,bias,batch_first",
                         [(False, False, True, True), (True, True, True, True), (False, True, False, False),
                          (True, False, False, False)])
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


# --------------------------------------------------------------------------------------
# state_dict, from_torch, convert


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_round_trips(bias):
    enc = _torch_encoder(bias=bias, norm=True, seed=41)
    layer = ragged.nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True, bias=bias)
    ours = ragged.nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(D, bias=bias), enable_nested_tensor=True,
                                        mask_check=False)
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
    layer = ragged.nn.TransformerEncoderLayer(d_model=D, nhead=HEADS, dim_feedforward=FF, dropout=0.1,
                                              activation=F.gelu, layer_norm_eps=1e-6, batch_first=True,
                                              norm_first=True, bias=False, device="cpu", dtype=torch.float64)
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
            self.first = nn.Sequential(nn.Linear(D, D), nn.ModuleDict({
                "enc": nn.TransformerEncoder(nn.TransformerEncoderLayer(D, HEADS, FF, 0.0, batch_first=True), 2)}))
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
    assert all(p1 is not p2 and torch.equal(p1, p2) and p1.dtype == torch.float64
               for p1, p2 in zip(new.parameters(), enc.parameters()))
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
    kwargs = {"tgt_mask": _causal_mask(5, torch.bool), "src_key_padding_mask": src_pad,
              "tgt_key_padding_mask": tgt_pad, "memory_key_padding_mask": src_pad}
    with torch.no_grad():
        expected = model.train()(src, tgt, tgt_is_causal=True, **kwargs)
        got = ours(src, tgt, **kwargs)
    for b, n in enumerate(tgt_len):
        torch.testing.assert_close(got[b, :n], expected[b, :n], **TOL)


# --------------------------------------------------------------------------------------
# MultiheadAttention against torch.nn.MultiheadAttention


def _mha_pair(**kwargs):
    mha = nn.MultiheadAttention(D, HEADS, **kwargs)
    _randomise(mha, 61)
    return mha.train(), ragged.nn.MultiheadAttention.from_torch(mha, copy=True)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_mha_self_attention(batch_first, bias, causal):
    theirs, ours = _mha_pair(batch_first=batch_first, bias=bias)
    lengths = [3, 6, 1]
    x, pad = _padded(lengths, seed=15)
    src = x if batch_first else x.transpose(0, 1)
    mask = _causal_mask(6, torch.bool) if causal else None
    with torch.no_grad():
        exp, exp_w = theirs(src, src, src, key_padding_mask=pad, attn_mask=mask, is_causal=causal,
                            average_attn_weights=False)
        got, got_w = ours(src, src, src, key_padding_mask=pad, attn_mask=mask, average_attn_weights=False)
        none = ours(src, src, src, key_padding_mask=pad, is_causal=causal, need_weights=False)
    assert none[1] is None
    torch.testing.assert_close(none[0], got)
    if not batch_first:
        exp, got = exp.transpose(0, 1), got.transpose(0, 1)
    _check(got, exp, lengths)
    assert got_w.shape == exp_w.shape == (3, HEADS, 6, 6)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got_w[b, :, :n], exp_w[b, :, :n], **TOL)
        assert torch.all(got_w[b, :, n:] == 0)


@pytest.mark.parametrize("kdim,vdim,shared_kv", [(None, None, True), (None, None, False), (6, 6, True),
                                                  (6, 10, False)])
def test_mha_cross_attention(kdim, vdim, shared_kv):
    theirs, ours = _mha_pair(batch_first=True, kdim=kdim, vdim=vdim)
    lq, lk = [4, 2, 5], [3, 7, 1]
    g = torch.Generator().manual_seed(16)
    query = torch.randn(3, 5, D, generator=g)
    key = torch.randn(3, 7, kdim or D, generator=g)
    value = key if shared_kv else torch.randn(3, 7, vdim or D, generator=g)
    kpm = torch.arange(7).unsqueeze(0) >= torch.tensor(lk).unsqueeze(1)
    with torch.no_grad():
        exp, exp_w = theirs(query, key, value, key_padding_mask=kpm)
        got, got_w = ours(query, key, value, key_padding_mask=kpm)
    torch.testing.assert_close(got, exp, **TOL)  # every query row is real in padded cross-attention
    torch.testing.assert_close(got_w, exp_w, **TOL)
    # the same through RaggedTensors: queries have their own lengths
    q_rt = ragged.pack(query, lengths=lq)
    k_rt = ragged.pack(key, lengths=lk)
    v_rt = k_rt if shared_kv else ragged.pack(value, lengths=lk)
    out, w = ours(q_rt, k_rt, v_rt, need_weights=True)
    assert isinstance(out, RaggedTensor) and out.offsets is q_rt.offsets
    _check(out.to_padded(total_length=5), exp, lq)
    assert w.shape == (3, max(lq), max(lk))
    for b, n in enumerate(lq):
        torch.testing.assert_close(w[b, :n, :lk[b]], exp_w[b, :n, :lk[b]], **TOL)
    assert ours(q_rt, k_rt, v_rt, need_weights=False)[1] is None


def test_mha_ragged_self_attention_gradients():
    theirs, ours = _mha_pair(batch_first=True, dropout=0.0)
    lengths = [4, 1, 6]
    x, pad = _padded(lengths, seed=18)
    w, _ = _padded(lengths, seed=19)
    w = w.masked_fill(pad.unsqueeze(-1), 0.0)
    xt = x.clone().requires_grad_(True)
    (theirs(xt, xt, xt, key_padding_mask=pad, need_weights=False)[0] * w).sum().backward()
    rt = ragged.pack(x.clone().requires_grad_(True), lengths=lengths)
    rt.values.retain_grad()
    out, _ = ours(rt, rt, rt, need_weights=False)
    (out.to_padded() * w).sum().backward()
    torch.testing.assert_close(rt.values.grad, xt.grad[~pad], **GRAD_TOL)
    theirs_p = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs_p[name].grad, **GRAD_TOL)


# --------------------------------------------------------------------------------------
# torch.compile and autocast


@pytest.mark.parametrize("causal", [False, True])
def test_compile_fullgraph_on_ragged_input(causal):
    torch._dynamo.reset()
    enc = _torch_encoder(norm=True, seed=67).train()
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    lengths = [3, 0, 8, 5]
    x, _ = _padded(lengths, seed=20)
    rt = ragged.pack(x, lengths=lengths)

    def run(module, values):
        return module(rt.with_values(values), is_causal=causal).values

    compiled = torch.compile(lambda v: run(ours, v), fullgraph=True, backend="aot_eager")
    v1 = rt.values.clone().requires_grad_(True)
    v2 = rt.values.clone().requires_grad_(True)
    out, ref = compiled(v1), run(ours, v2)
    torch.testing.assert_close(out, ref, **TOL)
    up = torch.randn_like(out)
    (g1,) = torch.autograd.grad(out, v1, up)
    (g2,) = torch.autograd.grad(ref, v2, up)
    torch.testing.assert_close(g1, g2, **GRAD_TOL)
    # and the module called on a RaggedTensor built outside
    out_rt = torch.compile(ours, fullgraph=True, backend="aot_eager")(rt, is_causal=causal)
    assert isinstance(out_rt, RaggedTensor)
    torch.testing.assert_close(out_rt.values, ref.detach(), **TOL)


@pytest.mark.parametrize("training", [True, False], ids=["train", "infer"])
def test_compile_fullgraph_fused_path(monkeypatch, training):
    """The GPU layer body (fused per-token ops and their backend choices) traced by dynamo
    with no graph break, here with the fused ops' torch reference: nothing on that path
    (pointer checks, cached choices) may need a value dynamo cannot see."""
    from ragged.nn import transformer as rt_mod

    torch._dynamo.reset()
    monkeypatch.setattr(rt_mod, "fused_backend", lambda x: "torch")
    enc = _torch_encoder(activation="gelu", norm=True, seed=73)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True).train(training)
    lengths = [3, 0, 6, 1]
    x, _ = _padded(lengths, seed=73)
    rt = ragged.pack(x, lengths=lengths)
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    v1 = rt.values.clone().requires_grad_(training)
    v2 = rt.values.clone().requires_grad_(training)
    with torch.set_grad_enabled(training):
        out = compiled(rt.with_values(v1), is_causal=True).values
        ref = ours(rt.with_values(v2), is_causal=True).values
    torch.testing.assert_close(out, ref, **TOL)
    if training:
        up = torch.randn_like(out)
        (g1,) = torch.autograd.grad(out, v1, up)
        (g2,) = torch.autograd.grad(ref, v2, up)
        torch.testing.assert_close(g1, g2, **GRAD_TOL)


def test_autocast_cpu_bfloat16():
    enc = _torch_encoder(seed=71).train()
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    lengths = [4, 7, 2]
    x, pad = _padded(lengths, seed=21)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = enc(x, src_key_padding_mask=pad)
        got = ours(x, src_key_padding_mask=pad)
        got_rt = ours(ragged.pack(x, lengths=lengths))
    assert got.dtype == expected.dtype
    _check(got.float(), expected.float(), lengths, tol={"rtol": 0.05, "atol": 0.05})
    torch.testing.assert_close(got_rt.to_padded(), got)


# --------------------------------------------------------------------------------------
# Bad inputs


def test_bad_inputs_raise_clear_errors():
    enc = ragged.nn.TransformerEncoder(ragged.nn.TransformerEncoderLayer(D, HEADS, FF, batch_first=True), 1).eval()
    x, pad = _padded([3, 5], seed=22)
    fn = r"ragged\.nn\.TransformerEncoder\.forward\(\)"
    with pytest.raises(ValueError, match=fn + ".*src_key_padding_mask of shape"):
        enc(x, src_key_padding_mask=pad[:, :4])
    with pytest.raises(TypeError, match=fn + ".*src_key_padding_mask of dtype"):
        enc(x, src_key_padding_mask=pad.long())
    with pytest.raises(NotImplementedError, match=fn + ".*src_key_padding_mask must hold 0"):
        enc(x, src_key_padding_mask=pad.float())  # a 0/1 float mask is an additive bias in torch
    with pytest.raises(NotImplementedError, match=fn + ".*mask is not a causal mask"):
        enc(x, mask=torch.rand(5, 5) > 0.5)
    with pytest.raises(NotImplementedError, match=fn + ".*mask is not a causal mask"):
        enc(x, mask=_causal_mask(5).T.contiguous())
    with pytest.raises(NotImplementedError, match=fn + ".*mask of shape"):
        enc(x, mask=torch.zeros(2 * HEADS, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=fn + ".*mask of shape"):
        enc(x, mask=_causal_mask(4))
    with pytest.raises(TypeError, match=fn + ".*mask of dtype"):
        enc(x, mask=torch.zeros(5, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=fn + ".*src of shape"):
        enc(torch.randn(2, 5, D + 1))
    rt = ragged.pack(x, lengths=[3, 5])
    with pytest.raises(ValueError, match=fn + ".*src_key_padding_mask applies to padded inputs"):
        enc(rt, src_key_padding_mask=pad)
    # a causal mask is recognised (bool or float), on RaggedTensors too
    torch.testing.assert_close(enc(x, mask=_causal_mask(5, torch.bool)), enc(x, is_causal=True))
    torch.testing.assert_close(enc(x, mask=_causal_mask(5), is_causal=False), enc(x, is_causal=True))
    torch.testing.assert_close(enc(rt, mask=_causal_mask(6)).values, enc(rt, is_causal=True).values)
    with pytest.raises(ValueError, match="activation 'relu', 'gelu' or a callable"):
        ragged.nn.TransformerEncoderLayer(D, HEADS, activation="tanh")
    with pytest.raises(TypeError, match=r"ragged\.nn\.TransformerEncoder\(\).*encoder_layer"):
        ragged.nn.TransformerEncoder(nn.Linear(D, D), 2)


def test_mha_bad_inputs():
    fn = r"ragged\.nn\.MultiheadAttention"
    with pytest.raises(NotImplementedError, match=fn + r"\(\).*add_bias_kv"):
        ragged.nn.MultiheadAttention(D, HEADS, add_bias_kv=True)
    with pytest.raises(NotImplementedError, match=fn + r"\(\).*add_zero_attn"):
        ragged.nn.MultiheadAttention(D, HEADS, add_zero_attn=True)
    with pytest.raises(ValueError, match=fn + r"\(\).*divisible"):
        ragged.nn.MultiheadAttention(D, 5)
    mha = ragged.nn.MultiheadAttention(D, HEADS, batch_first=True)
    x, pad = _padded([3, 5], seed=24)
    rt = ragged.pack(x, lengths=[3, 5])
    fn += r"\.forward\(\)"
    with pytest.raises(TypeError, match=fn + ".*all RaggedTensors or all padded"):
        mha(rt, x, x)
    with pytest.raises(ValueError, match=fn + ".*key_padding_mask of shape"):
        mha(x, x, x, key_padding_mask=pad.T)
    with pytest.raises(TypeError, match=fn + ".*key_padding_mask of dtype"):
        mha(x, x, x, key_padding_mask=pad.int())
    with pytest.raises(NotImplementedError, match=fn + ".*attn_mask is not a causal mask"):
        mha(x, x, x, attn_mask=torch.zeros(5, 5).masked_fill(torch.eye(5, dtype=torch.bool), float("-inf")))
    with pytest.raises(NotImplementedError, match=fn + ".*causal cross-attention on padded inputs"):
        mha(x, x.clone(), x.clone(), is_causal=True)
    with pytest.raises(ValueError, match=fn + ".*key_padding_mask applies to padded inputs"):
        mha(rt, rt, rt, key_padding_mask=pad)
    with pytest.raises(ValueError, match=fn + ".*same batch size"):
        mha(rt, rt[:1], rt[:1])
    with pytest.raises(ValueError, match=fn + r".*values of shape \[T, 16\]"):
        mha(rt.with_values(rt.values[:, :8]), rt, rt)


# --------------------------------------------------------------------------------------
# GPU (pytest -m gpu): the Triton / CUDA attention kernels behind the modules

GPU_D, GPU_HEADS = 128, 2  # head dim 64
GPU_LENGTHS = [37, 0, 130, 1, 64]


def _gpu_pair(dtype, dropout=0.0, norm_first=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = nn.TransformerEncoderLayer(GPU_D, GPU_HEADS, 2 * GPU_D, dropout=dropout, activation="gelu",
                                           batch_first=True, norm_first=norm_first, device="cuda", dtype=dtype)
        enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(GPU_D, device="cuda", dtype=dtype))
    _randomise(enc, 83, scale=GPU_D ** -0.5)
    return enc, ragged.nn.TransformerEncoder.from_torch(enc, copy=True)


def _gpu_input(dtype, lengths=GPU_LENGTHS):
    g = torch.Generator().manual_seed(84)
    width = max(lengths)
    x = torch.randn(len(lengths), width, GPU_D, generator=g).to("cuda", dtype)
    pad = torch.arange(width).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
    return x, pad.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_gpu_encoder_matches_torch(dtype, causal, norm_first):
    """Both run against a float64 copy of the torch model on the GPU: ragged's error is at
    most three times torch.nn's own in the same dtype (plus a small floor), for values
    and, in fp32, every gradient. The float64 reference always takes torch.nn's plain ops
    (train mode, dropout 0): in eval mode torch.nn's GPU fast path differs from them by
    about 1e-3 in fp32, and ragged follows the plain ops."""
    enc, ours = _gpu_pair(dtype, norm_first=norm_first)
    ref = copy.deepcopy(enc).double()
    x, pad = _gpu_input(dtype)
    floor = 2e-5 if dtype == torch.float32 else 2e-3

    def close(got, theirs, want, what):
        ours_err = (got.double() - want).abs().max().item()
        torch_err = (theirs.double() - want).abs().max().item()
        assert ours_err <= 3 * torch_err + floor * max(1.0, want.abs().max().item()), (what, ours_err, torch_err)

    real = ~pad.unsqueeze(-1)
    for training in (True, False):
        for m in (enc, ours):
            m.train(training)
        ref.train()
        with torch.no_grad():  # torch.nn's rows of an empty sequence are NaN: compare real positions
            want = torch.where(real, _run_torch(ref, x.double(), pad, causal, True), 0.0)
            theirs = torch.where(real, _run_torch(enc, x, pad, causal, True), 0.0)
            got = _run_ragged(ours, x, pad, causal, True)
        assert torch.all(got[~real.expand_as(got)] == 0), "padding is not zero"
        close(got, theirs, want, f"values, training={training}")
    if dtype != torch.float32:
        return
    # gradients (no empty sequence: torch's NaN rows would poison its gradients)
    lengths = [37, 3, 130, 1, 64]
    x, pad = _gpu_input(dtype, lengths)
    w = torch.randn_like(x).masked_fill(pad.unsqueeze(-1), 0.0)
    leaves = {}
    for name, m, inp in (("ref", ref, x.double()), ("torch", enc, x), ("ours", ours, x)):
        m.train()
        m.zero_grad()
        leaf = inp.clone().requires_grad_(True)
        run = _run_ragged if name == "ours" else _run_torch
        (run(m, leaf, pad, causal, True) * w.to(leaf.dtype)).sum().backward()
        leaves[name] = (leaf.grad, dict(m.named_parameters()))
    close(leaves["ours"][0], leaves["torch"][0], leaves["ref"][0], "d input")
    for name, p in leaves["ours"][1].items():
        close(p.grad, leaves["torch"][1][name].grad, leaves["ref"][1][name].grad, f"d {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_ragged_input_does_not_sync(dtype):
    """Training (with dropout) and inference on a RaggedTensor input never read the GPU."""
    _, ours = _gpu_pair(dtype, dropout=0.1)
    rt = ragged.pack([torch.randn(n, GPU_D, device="cuda", dtype=dtype) for n in GPU_LENGTHS])
    for mode in (True, False):  # first calls: kernel compilation and tuning may read the GPU
        ours.train(mode)
        out = ours(rt, is_causal=True)
        if mode:
            out.values.float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours.train()
        out = ours(rt, is_causal=True)
        out.values.float().sum().backward()
        ours.eval()
        with torch.no_grad():
            ours(rt, is_causal=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_gpu_compile_and_autocast():
    torch._dynamo.reset()
    enc, ours = _gpu_pair(torch.float32)
    ours.train()
    rt = ragged.pack([torch.randn(n, GPU_D, device="cuda") for n in GPU_LENGTHS])
    compiled = torch.compile(ours, fullgraph=True)
    v = rt.values.clone().requires_grad_(True)
    out = compiled(rt.with_values(v), is_causal=True)
    ref = ours(rt, is_causal=True)
    torch.testing.assert_close(out.values, ref.values, rtol=2e-4, atol=2e-4)
    out.values.sum().backward()
    assert torch.isfinite(v.grad).all()
    x, pad = _gpu_input(torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        got = ours(x, src_key_padding_mask=pad)
        expected = enc.train()(x, src_key_padding_mask=pad)
    assert got.dtype == expected.dtype
    _check(got.float(), expected.float(), GPU_LENGTHS, tol={"rtol": 0.05, "atol": 0.05})


FUSED_BACKENDS = ["torch", "triton", "cuda", "auto"]


def _force_fused(monkeypatch, backend: str) -> None:
    """The per-token ops (residual + LayerNorm; bias + activation where it fuses) on
    ``backend``; "auto" keeps the layer's own choice. Attention stays on "auto"."""
    from ragged.nn import transformer as rt_mod

    if backend != "auto":
        monkeypatch.setattr(rt_mod, "fused_backend", lambda x: backend)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("activation", list(ACTIVATION_MODULES))
def test_gpu_fused_path_calls_custom_activation_modules(monkeypatch, backend, activation):
    """A ReLU subclass or a hooked GELU module is called, never replaced by the fused op:
    values against torch.nn (plain path) in float32, training and inference."""
    _force_fused(monkeypatch, backend)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer = nn.TransformerEncoderLayer(GPU_D, GPU_HEADS, 2 * GPU_D, dropout=0.0,
                                           activation=ACTIVATION_MODULES[activation](), batch_first=True,
                                           device="cuda")
        enc = nn.TransformerEncoder(layer, 2)
    _randomise(enc, 89, scale=GPU_D ** -0.5)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True)
    x, pad = _gpu_input(torch.float32)
    enc.train()
    for training in (True, False):
        ours.train(training)
        with torch.no_grad():
            expected = enc(x, src_key_padding_mask=pad)
            got = ours(x, src_key_padding_mask=pad)
        _check(got, expected, GPU_LENGTHS, tol={"rtol": 1e-3, "atol": 1e-3})


@pytest.mark.gpu
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_gpu_compile_inference_every_backend(monkeypatch, backend):
    """torch.compile(fullgraph=True) of inference (eval, no grad: the path that calls the
    kernels directly in eager mode) and of training, per fused-op backend, against eager."""
    torch._dynamo.reset()
    _force_fused(monkeypatch, backend)
    _, ours = _gpu_pair(torch.float32)
    rt = ragged.pack([torch.randn(n, GPU_D, device="cuda") for n in GPU_LENGTHS])
    compiled = torch.compile(ours, fullgraph=True)
    ours.eval()
    with torch.no_grad():
        out = compiled(rt, is_causal=True)
        ref = ours(rt, is_causal=True)
    torch.testing.assert_close(out.values, ref.values, rtol=2e-4, atol=2e-4)
    ours.train()
    v = rt.values.clone().requires_grad_(True)
    out = compiled(rt.with_values(v), is_causal=True)
    torch.testing.assert_close(out.values, ours(rt, is_causal=True).values, rtol=2e-4, atol=2e-4)
    out.values.sum().backward()
    assert torch.isfinite(v.grad).all()


def test_layer_hooks_fire_inside_the_encoder():
    """The encoder calls a layer's body directly only when the layer has no hooks."""
    enc = _torch_encoder(seed=31)
    ours = ragged.nn.TransformerEncoder.from_torch(enc, copy=True).eval()
    x, pad = _padded([3, 5], seed=31)
    seen = []
    handle = ours.layers[1].register_forward_hook(lambda mod, args, out: seen.append(out.values.shape))
    try:
        with torch.no_grad():
            hooked = ours(x, src_key_padding_mask=pad)
    finally:
        handle.remove()
    assert seen == [(8, D)]
    with torch.no_grad():
        torch.testing.assert_close(ours(x, src_key_padding_mask=pad), hooked, rtol=0, atol=0)
