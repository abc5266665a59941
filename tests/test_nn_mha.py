"""ragged.nn.MultiheadAttention against torch.nn.MultiheadAttention (self and cross attention,
gradients), torch.compile and autocast of the modules, and bad inputs with clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformer_cases import (
    FF,
    GRAD_TOL,
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
from ragged import RaggedTensor

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
        exp, exp_w = theirs(
            src, src, src, key_padding_mask=pad, attn_mask=mask, is_causal=causal, average_attn_weights=False
        )
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


@pytest.mark.parametrize("kdim,vdim,shared_kv", [(None, None, True), (None, None, False), (6, 6, True), (6, 10, False)])
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
        torch.testing.assert_close(w[b, :n, : lk[b]], exp_w[b, :n, : lk[b]], **TOL)
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
