"""ragged.nn.convert: all or nothing, and exactly what its docstring promises.

A model holds several convertible modules (in nested containers, one of them at two places)
and, after them in module order, one module convert cannot take. After convert (or its
exception) every module's class, every Parameter's identity and every value is checked, and
the model's outputs are compared with an untouched torch.nn copy on a fixed input.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune

import ragged

D, HEADS, FF = 16, 4, 32
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _randomise(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            p.copy_(1.0 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.3 * noise)


def _layer(**kwargs) -> nn.TransformerEncoderLayer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True, **kwargs)


def _encoder(layers: int = 2) -> nn.TransformerEncoder:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note about its nested-tensor fast path
        return nn.TransformerEncoder(_layer(), layers, norm=nn.LayerNorm(D))


class _Half(nn.Module):
    """A parametrization: the weight used is half the stored one."""

    def forward(self, w):
        return 0.5 * w


class _Holder(nn.Module):
    """A custom module keeping a layer as a plain attribute."""

    def __init__(self):
        super().__init__()
        self.layer = _layer(norm_first=True)

    def forward(self, x, pad):
        return self.layer(x, src_key_padding_mask=pad)


class _MyLayer(nn.TransformerEncoderLayer):
    """A subclass: convert must not swap it (it may override forward)."""


class _Model(nn.Module):
    """Convertible modules first (Sequential, ModuleDict, a custom holder, one layer at two
    places), then ``bad``, which takes ``(x, src_key_padding_mask=pad)``."""

    def __init__(self, bad: nn.Module):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.stack = nn.Sequential(_layer(), _layer(activation="gelu"))
        self.blocks = nn.ModuleDict({"enc": _encoder(), "attn": nn.MultiheadAttention(D, HEADS, batch_first=True)})
        self.holder = _Holder()
        self.again = self.stack[0]  # one module at two places
        self.bad = bad

    def forward(self, x, pad):
        h = self.embed(x)
        for layer in self.stack:
            h = layer(h, src_key_padding_mask=pad)
        h = self.blocks["enc"](h, src_key_padding_mask=pad)
        h = h + self.blocks["attn"](h, h, h, key_padding_mask=pad, need_weights=False)[0]
        h = self.again(self.holder(h, pad), src_key_padding_mask=pad)
        return self.bad(h, src_key_padding_mask=pad)


def _pruned():
    layer = _layer()
    prune.l1_unstructured(layer.linear1, "weight", 0.5)
    return layer


def _parametrized():
    layer = _layer()
    parametrize.register_parametrization(layer.linear2, "weight", _Half())
    return layer


def _parametrized_out_proj():
    layer = _layer()
    parametrize.register_parametrization(layer.self_attn.out_proj, "weight", _Half())
    return layer


def _bias_kv():
    layer = _layer()
    layer.self_attn = nn.MultiheadAttention(D, HEADS, batch_first=True, add_bias_kv=True)
    return layer


def _hooked():
    layer = _layer()
    layer.register_forward_hook(lambda module, args, out: out * 0.5)
    return layer


def _child_hooked():
    layer = _layer()
    layer.norm2.register_forward_pre_hook(lambda module, args: (args[0] * 2.0,))
    return layer


def _custom_layer_in_encoder():
    enc = _encoder(3)
    custom = _MyLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
    custom.load_state_dict(enc.layers[2].state_dict())
    enc.layers[2] = custom
    return enc


def _pruned_in_encoder():
    enc = _encoder(3)
    prune.random_unstructured(enc.layers[1].linear2, "weight", 0.3)
    return enc


def _replaced_norm():
    layer = _layer()
    layer.norm1 = nn.RMSNorm(D)
    return layer


BAD = {
    "pruned": (_pruned, "is pruned"),
    "parametrized": (_parametrized, "parametrization"),
    "parametrized_out_proj": (_parametrized_out_proj, "self_attn.out_proj has a parametrization"),
    "add_bias_kv": (_bias_kv, "add_bias_kv"),
    "forward_hook": (_hooked, "forward hooks"),
    "child_hook": (_child_hooked, "norm2 has forward pre hooks"),
    "custom_layer_in_encoder": (_custom_layer_in_encoder, "layers.2 is a _MyLayer"),
    "pruned_in_encoder": (_pruned_in_encoder, "layers.1.linear2 is pruned"),
    "replaced_norm": (_replaced_norm, "norm1 is a RMSNorm"),
}


def _build(kind: str, seed: int = 5) -> tuple[nn.Module, nn.Module]:
    """The model (train mode, dropout 0: torch.nn's plain path) and an identical one built the
    same way (a pruned module cannot be deep-copied)."""
    models = []
    for _ in range(2):
        torch.manual_seed(seed)
        model = _Model(BAD[kind][0]())
        _randomise(model, seed)
        models.append(model.train())
    return models[0], models[1]


def _input(lengths=(5, 1, 8, 3), seed=3):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    x = torch.randn(len(lengths), width, D, generator=g)
    pad = torch.arange(width).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
    return x, pad


def _snapshot(model: nn.Module) -> dict:
    """Everything convert could change: module classes and objects by name, Parameter and
    buffer objects by name, values."""
    return {
        "modules": [(name, type(m), m) for name, m in model.named_modules(remove_duplicate=False)],
        "tensors": [(name, t) for name, t in model.named_parameters(remove_duplicate=False)]
        + [(name, t) for name, t in model.named_buffers(remove_duplicate=False)],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "training": [(name, m.training) for name, m in model.named_modules(remove_duplicate=False)],
    }


def _assert_untouched(model: nn.Module, before: dict) -> None:
    after = _snapshot(model)
    assert [(n, t) for n, t, _ in after["modules"]] == [(n, t) for n, t, _ in before["modules"]]
    assert all(m1 is m2 for (_, _, m1), (_, _, m2) in zip(after["modules"], before["modules"]))
    assert [n for n, _ in after["tensors"]] == [n for n, _ in before["tensors"]]
    assert all(t1 is t2 for (_, t1), (_, t2) in zip(after["tensors"], before["tensors"]))
    assert list(after["state"]) == list(before["state"])
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())
    assert after["training"] == before["training"]


def _assert_same_outputs(model: nn.Module, reference: nn.Module, exact: bool = False) -> None:
    x, pad = _input()
    with torch.no_grad():
        got, expected = model(x, pad), reference(x, pad)
    real = ~pad
    tol = {"rtol": 0, "atol": 0} if exact else TOL
    torch.testing.assert_close(got[real], expected[real], **tol)


def _ragged_types(model: nn.Module) -> None:
    assert type(model.stack[0]) is ragged.nn.TransformerEncoderLayer and model.again is model.stack[0]
    assert type(model.stack[1]) is ragged.nn.TransformerEncoderLayer
    assert type(model.blocks["enc"]) is ragged.nn.TransformerEncoder
    assert type(model.blocks["attn"]) is ragged.nn.MultiheadAttention
    assert type(model.holder.layer) is ragged.nn.TransformerEncoderLayer


@pytest.mark.parametrize("kind", list(BAD))
def test_convert_strict_changes_nothing(kind):
    model, reference = _build(kind)
    before = _snapshot(model)
    with pytest.raises(
        NotImplementedError, match=r"ragged\.nn\.convert\(\): nothing converted.*'bad'.*" + BAD[kind][1]
    ):
        ragged.nn.convert(model, strict=True)
    _assert_untouched(model, before)
    _assert_same_outputs(model, reference, exact=True)


@pytest.mark.parametrize("kind", list(BAD))
def test_convert_leaves_what_it_cannot_take_and_converts_the_rest(kind):
    model, reference = _build(kind)
    before = _snapshot(model)
    bad = model.bad
    bad_modules = [(name, type(m), m) for name, m in bad.named_modules(remove_duplicate=False)]
    bad_tensors = [(name, t) for name, t in bad.named_parameters(remove_duplicate=False)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ragged.nn.convert(model)
    ours = [w for w in caught if "ragged.nn.convert" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    assert "left 1 module(s)" in message and "'bad'" in message and BAD[kind][1] in message, message
    assert out is model
    _ragged_types(model)
    # the module left is the same object, everything inside it too
    assert model.bad is bad
    assert [(n, type(m), m) for n, m in bad.named_modules(remove_duplicate=False)] == bad_modules
    assert all(t1 is t2 for (_, t1), (_, t2) in zip(bad.named_parameters(remove_duplicate=False), bad_tensors))
    # the same Parameter objects at the same names, the same values and keys
    tensors = dict(model.named_parameters(remove_duplicate=False))
    assert set(tensors) == {n for n, _ in before["tensors"] if n in tensors}
    assert {id(p) for p in model.parameters()} == {id(p) for n, p in before["tensors"] if isinstance(p, nn.Parameter)}
    for name, t in before["tensors"]:
        if name in tensors:
            assert tensors[name] is t, name
    state = model.state_dict()
    assert list(state) == list(before["state"])
    assert all(torch.equal(state[k], v) for k, v in before["state"].items())
    _assert_same_outputs(model, reference)


def test_convert_copy_strict_changes_nothing_and_copy_converts():
    model, reference = _build("pruned")
    before = _snapshot(model)
    with pytest.raises(NotImplementedError, match="is pruned"):
        ragged.nn.convert(model, copy=True, strict=True)
    _assert_untouched(model, before)
    with pytest.warns(UserWarning, match="is pruned"):
        ragged.nn.convert(model, copy=True)
    _ragged_types(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in before["tensors"]:
        if name.startswith("bad."):
            assert params.get(name, t) is t
        elif isinstance(t, nn.Parameter) and not name.startswith("embed."):
            assert params[name] is not t and torch.equal(params[name], t), name
    _assert_same_outputs(model, reference)


def test_convert_clean_model_warns_nothing():
    torch.manual_seed(1)
    model = _Model(_layer(activation=nn.GELU(approximate="tanh")))
    _randomise(model, 1)
    reference = copy.deepcopy(model).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ragged.nn.convert(model, strict=True)
    _ragged_types(model)
    assert type(model.bad) is ragged.nn.TransformerEncoderLayer
    _assert_same_outputs(model, reference)


def test_convert_top_level_encoder():
    enc = _encoder(3)
    _randomise(enc, 7)
    reference = copy.deepcopy(enc).train()
    params = list(enc.parameters())
    new = ragged.nn.convert(enc)
    assert type(new) is ragged.nn.TransformerEncoder and type(enc) is nn.TransformerEncoder
    assert all(p1 is p2 for p1, p2 in zip(new.parameters(), params))
    # one that cannot be taken: returned as it is (with a warning), or strict raises
    reference = copy.deepcopy(enc).train()
    for m in (enc, reference):
        prune.l1_unstructured(m.layers[2].linear1, "weight", 0.5)
    before = _snapshot(enc)
    with pytest.raises(
        NotImplementedError, match=r"the model \(TransformerEncoder\): its layers\.2\.linear1 is pruned"
    ):
        ragged.nn.convert(enc, strict=True)
    _assert_untouched(enc, before)
    with pytest.warns(UserWarning, match="layers.2.linear1 is pruned"):
        assert ragged.nn.convert(enc) is enc
    _assert_untouched(enc, before)
    x, pad = _input()
    with torch.no_grad():
        torch.testing.assert_close(
            enc(x, src_key_padding_mask=pad), reference(x, src_key_padding_mask=pad), rtol=0, atol=0
        )


def test_convert_shared_module_stays_one_module():
    """An attention module that is also a layer's self_attn: one ragged module at both places.
    One that is also part of a module left as it is: left at both places."""
    torch.manual_seed(2)
    model = nn.Module()
    model.layer = _layer()
    model.attn = model.layer.self_attn
    model.kept = _hooked()
    model.kept_attn = model.kept.self_attn
    _randomise(model, 2)
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    with pytest.warns(UserWarning, match=r"left 2 module\(s\).*'kept_attn'.*also part of 'kept'"):
        ragged.nn.convert(model)
    assert type(model.layer) is ragged.nn.TransformerEncoderLayer
    assert model.attn is model.layer.self_attn and type(model.attn) is ragged.nn.MultiheadAttention
    assert type(model.kept) is nn.TransformerEncoderLayer and model.kept_attn is model.kept.self_attn
    assert type(model.kept_attn) is nn.MultiheadAttention
    assert all(p is params[name] for name, p in model.named_parameters(remove_duplicate=False))
    # and with copies: the copied attention is still one module, with the copied layer's tensors
    model = nn.Module()
    model.layer = _layer()
    model.attn = model.layer.self_attn
    ragged.nn.convert(model, copy=True)
    assert model.attn is model.layer.self_attn and type(model.attn) is ragged.nn.MultiheadAttention


def test_convert_leaves_a_torch_encoder_subclass_whole():
    """A subclass of nn.TransformerEncoder may hand its layers torch's nested tensors
    (eval, no grad, a padding mask): its layers must stay torch.nn's."""

    class MyEncoder(nn.TransformerEncoder):
        pass

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Sequential(MyEncoder(_layer(), 2))
    _randomise(model, 9)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ragged.nn.convert(model)
    assert all(type(layer) is nn.TransformerEncoderLayer for layer in model[0].layers)
    x, pad = _input()
    model.eval()
    reference.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note about its nested tensors
        got = model[0](x, src_key_padding_mask=pad)
        expected = reference[0](x, src_key_padding_mask=pad)
    torch.testing.assert_close(got[~pad], expected[~pad], rtol=0, atol=0)


class _NoCopy(nn.Module):
    """An activation module that cannot be deep-copied."""

    def forward(self, x):
        return torch.tanh(x)

    def __deepcopy__(self, memo):
        raise TypeError("_NoCopy cannot be copied")


def test_convert_failure_while_building_leaves_the_module():
    """copy=True deep-copies each module first: a failure there is one more reason, and
    nothing is swapped (strict) or that module is left (default)."""
    torch.manual_seed(4)
    model = _Model(_layer(activation=_NoCopy())).train()
    _randomise(model, 4)
    x, pad = _input()
    with torch.no_grad():
        expected = model(x, pad)  # the model cannot be deep-copied: its outputs before
    before = _snapshot(model)
    with pytest.raises(NotImplementedError, match="_NoCopy cannot be copied"):
        ragged.nn.convert(model, copy=True, strict=True)
    _assert_untouched(model, before)
    with pytest.warns(UserWarning, match="'bad'.*_NoCopy cannot be copied"):
        ragged.nn.convert(model, copy=True)
    _ragged_types(model)
    assert model.bad is next(m for n, _, m in before["modules"] if n == "bad")
    with torch.no_grad():
        got = model(x, pad)
    torch.testing.assert_close(got[~pad], expected[~pad], **TOL)


def test_convert_keeps_the_modes_of_a_shared_activation_module():
    """The ragged layer shares a custom activation module (copy=False); converting must not
    change its training mode (nor anything else of the original modules)."""
    act = nn.Sequential(nn.Dropout(0.5), nn.Tanh())
    layer = _layer(activation=act)
    act.eval()  # the layer trains, its activation's dropout does not
    before = _snapshot(layer)
    new = ragged.nn.convert(layer)
    _assert_untouched(layer, before)
    assert new.activation is act and not act.training and new.training
    x, pad = _input()
    with torch.no_grad():
        torch.testing.assert_close(
            new(x, src_key_padding_mask=pad)[~pad], layer(x, src_key_padding_mask=pad)[~pad], **TOL
        )


def test_convert_checks_its_flags():
    with pytest.raises(TypeError, match=r"ragged\.nn\.convert\(\): expected strict to be a bool"):
        ragged.nn.convert(nn.Linear(2, 2), strict="yes")
    with pytest.raises(TypeError, match=r"ragged\.nn\.convert\(\): expected an nn\.Module"):
        ragged.nn.convert(object())
