"""attn_implementation="ragged": what reaches ragged.varlen_attention (GQA, scale, causal,
dropout in training only, head dims, direct calls), sliding windows, and the features it
refuses with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from hf_attention_cases import (
    LENGTHS,
    _assert_grads,
    _bert_pair,
    _close,
    _flat,
    _ids,
    _padded,
    _pair,
    _per_sequence_loss,
)

import ragged  # noqa: E402
import ragged.integrations.transformers  # noqa: E402,F401  (registers "ragged")
from ragged.nn.hf import attention as attn  # noqa: E402

# --------------------------------------------------------------------------------------
# What reaches ragged.varlen_attention


def _spy(monkeypatch):
    calls = []
    real = ragged.varlen_attention

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=None, dropout_p=0.0, **kwargs):
        calls.append(
            dict(
                heads=q.shape[1],
                kv_heads=k.shape[1],
                max_q=max_q,
                max_k=max_k,
                causal=causal,
                scale=scale,
                dropout_p=dropout_p,
                **kwargs,
            )
        )
        return real(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, dropout_p=dropout_p, **kwargs)

    monkeypatch.setattr(ragged, "varlen_attention", spy)
    return calls


def test_gqa_scale_causal_and_dropout_reach_the_kernel(monkeypatch):
    calls = _spy(monkeypatch)
    model, _ = _pair("llama", attention_dropout=0.25)
    model.train()
    model(**_flat(_ids([2, 4], seed=11), return_flash_attn_kwargs=True))
    model.eval()
    model(**_flat(_ids(LENGTHS, seed=11), return_flash_attn_kwargs=True))
    assert len(calls) == 4
    for call, rate, longest in zip(calls, (0.25, 0.25, 0.0, 0.0), (4, 4, 33, 33)):
        assert (call["heads"], call["kv_heads"]) == (4, 2)  # the key/value heads are not repeated
        assert call["causal"] is True
        assert call["scale"] == pytest.approx(16**-0.5)
        assert call["dropout_p"] == rate
        assert (call["max_q"], call["max_k"]) == (longest, longest)
        assert "window_size" not in call
    bert, _ = _bert_pair()
    calls.clear()
    bert(input_ids=torch.ones(2, 5, dtype=torch.long))
    assert [c["causal"] for c in calls] == [False, False]


def test_attention_dropout_drops_in_training_only():
    model, reference = _pair("llama", attention_dropout=0.5)
    batch = _flat(_ids([3, 6], seed=12), return_flash_attn_kwargs=True)
    torch.manual_seed(0)
    a = model(**batch).logits
    torch.manual_seed(0)
    b = model(**batch).logits
    torch.manual_seed(1)
    c = model(**batch).logits
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    model.eval(), reference.eval()
    flat = model(**batch).logits[0]
    _close(flat[:3], reference(input_ids=batch["input_ids"][:, :3]).logits[0])


def test_value_head_dim_narrower_than_query():
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(2, 4, 9, 16, generator=gen)
    k = torch.randn(2, 2, 9, 16, generator=gen)
    v = torch.randn(2, 2, 9, 8, generator=gen)
    module = torch.nn.Module()
    module.is_causal = True
    out, weights = attn.attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 9, 4, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=True, scale=0.3
    )
    _close(out, expected.transpose(1, 2).float())


def test_direct_call_with_empty_sequences_and_a_padded_mask():
    """Lengths 0 in a flattened batch and all-padding rows in a padded one, against float64 SDPA."""
    gen = torch.Generator().manual_seed(14)
    module = torch.nn.Module()
    module.is_causal = True
    lengths = [0, 1, 7, 0, 12]
    total = sum(lengths)
    q = torch.randn(1, 4, total, 16, generator=gen)
    k = torch.randn(1, 2, total, 16, generator=gen)
    v = torch.randn(1, 2, total, 16, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, _ = attn.attention_forward(
        module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12
    )
    start = 0
    for n in lengths:
        if n:
            part = slice(start, start + n)
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, part].double(),
                k[:, :, part].double().repeat_interleave(2, 1),
                v[:, :, part].double().repeat_interleave(2, 1),
                is_causal=True,
            )
            _close(out[:, part], expected.transpose(1, 2).float())
        start += n
    for batch in (0, 2):  # no tokens at all
        out, _ = attn.attention_forward(module, *(torch.randn(batch, h, 0, 16) for h in (4, 2, 2)), None)
        assert out.shape == (batch, 0, 4, 16)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    q, k, v = (torch.randn(3, h, 4, 16, generator=gen) for h in (4, 2, 2))
    nan = ~mask[:, None, :, None]
    out, _ = attn.attention_forward(
        module,
        q.masked_fill(nan, float("nan")),
        k.masked_fill(nan, float("nan")),
        v.masked_fill(nan, float("nan")),
        mask,
    )
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    for b in (0, 2):
        n = int(mask[b].sum())
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1, :, :n].double(),
            k[b : b + 1, :, :n].double().repeat_interleave(2, 1),
            v[b : b + 1, :, :n].double().repeat_interleave(2, 1),
            is_causal=True,
        )
        _close(out[b, :n], expected[0].transpose(0, 1).float())


# --------------------------------------------------------------------------------------
# Sliding windows


def _windowed_reference(
    q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=None, dropout_p=0.0, window_size=(-1, -1), **_
):
    """Attention with flash-attn's window rule, per sequence, in float64 (differentiable): query
    ``i`` (aligned to the end of the keys) sees key ``j`` iff ``i - left <= j <= i + right``."""
    left, right = window_size
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    outs = []
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qb = q[cq[b] : cq[b + 1]].double().transpose(0, 1)
        kb = k[ck[b] : ck[b + 1]].double().transpose(0, 1).repeat_interleave(group, 0)
        vb = v[ck[b] : ck[b + 1]].double().transpose(0, 1).repeat_interleave(group, 0)
        lq, lk = qb.shape[1], kb.shape[1]
        i = torch.arange(lq).unsqueeze(1) + (lk - lq)
        j = torch.arange(lk).unsqueeze(0)
        seen = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            seen &= j <= i
        if left >= 0:
            seen &= j >= i - left
        if right >= 0:
            seen &= j <= i + right
        s = (qb @ kb.transpose(1, 2) * scale).masked_fill(~seen, float("-inf"))
        outs.append((torch.softmax(s, -1).nan_to_num(0.0) @ vb).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def _windowed_kernel(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setattr(ragged, "varlen_attention", _windowed_reference)
    elif not attn._window_param(ragged.varlen_attention):
        pytest.skip("ragged.varlen_attention takes no window_size yet")


@pytest.fixture(params=["reference", "ragged"])
def windowed(request, monkeypatch):
    """ "reference": a float64 windowed attention stands in for the kernels (checks what
    attention_forward passes); "ragged": ragged's own kernels, once they take a window."""
    _windowed_kernel(request, monkeypatch)
    return request.param


def test_mistral_sliding_window_flattened(windowed):
    model, reference = _pair("mistral", sliding_window=4)
    ids = _ids(LENGTHS, seed=15)
    loss = model(**_flat(ids, return_flash_attn_kwargs=True)).loss
    loss.backward()
    expected = _per_sequence_loss(reference, ids)
    expected.backward()
    _close(loss, expected)
    _assert_grads(model, reference)


@pytest.mark.parametrize("side", ["right", "left"])
def test_mistral_sliding_window_padded(windowed, side):
    model, reference = _pair("mistral", sliding_window=6)
    model.eval(), reference.eval()
    ids, mask = _padded([3, 17, 9, 1], side, seed=16)
    real = mask.bool()
    got = model(input_ids=ids, attention_mask=mask).logits
    expected = reference(input_ids=ids, attention_mask=mask).logits
    _close(got[real], expected[real])


def test_window_longer_than_every_sequence_is_not_passed(monkeypatch):
    calls = _spy(monkeypatch)
    model, reference = _pair("mistral", sliding_window=33)
    ids = _ids(LENGTHS, seed=17)
    loss = model(**_flat(ids, return_flash_attn_kwargs=True)).loss
    assert calls and all("window_size" not in c for c in calls)
    _close(loss, _per_sequence_loss(reference, ids))


def test_window_without_kernel_support_raises(monkeypatch):
    real = ragged.varlen_attention
    monkeypatch.setattr(
        ragged,
        "varlen_attention",
        lambda q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=None, dropout_p=0.0: real(
            q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p
        ),
    )
    model, _ = _pair("mistral", sliding_window=8)
    with pytest.raises(NotImplementedError, match=r"MistralAttention attends within a sliding window of 8 tokens"):
        model(**_flat(_ids(LENGTHS, seed=18), return_flash_attn_kwargs=True))


def test_window_over_a_mask_with_holes_raises():
    model, _ = _pair("mistral", sliding_window=4)
    ids, mask = _padded([9, 6], "right", seed=21)
    mask[0, 2] = 0
    with (
        pytest.raises(NotImplementedError, match="sliding window of 4 tokens with a padding mask whose tokens"),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        model(input_ids=ids, attention_mask=mask)


# --------------------------------------------------------------------------------------
# Refusals


def _module(causal=True):
    module = torch.nn.Module()
    module.is_causal = causal
    return module


def _qkv(batch=1, length=5):
    return torch.randn(batch, 4, length, 16), torch.randn(batch, 2, length, 16), torch.randn(batch, 2, length, 16)


@pytest.mark.parametrize(
    "key,value,feature",
    [
        ("softcap", 30.0, "soft-capping"),
        ("s_aux", torch.zeros(4), "attention sinks"),
        ("sinks", torch.zeros(4), "attention sinks"),
        ("head_mask", torch.ones(4), "head_mask"),
        ("position_bias", torch.zeros(1, 4, 5, 5), "position bias"),
        ("output_attentions", True, "output_attentions"),
    ],
)
def test_unsupported_features_are_refused(key, value, feature):
    match = rf"ragged\.nn\.hf\.attention\.attention_forward\(\): Module .*{feature}"
    with pytest.raises(NotImplementedError, match=match):
        attn.attention_forward(_module(), *_qkv(), None, **{key: value})


def test_output_attentions_through_a_model():
    model, _ = _pair("llama")
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(input_ids=torch.ones(1, 4, dtype=torch.long), output_attentions=True)


def test_a_4d_mask_is_refused():
    model, _ = _pair("llama")
    mask = torch.zeros(2, 1, 4, 4)
    with pytest.raises(NotImplementedError, match=r"LlamaAttention got an attention mask Tensor\(shape=\(2, 1, 4, 4\)"):
        model(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=mask)


def test_mask_and_flattened_kwargs_together_are_refused():
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="either a padding mask or cu_seq_lens_q/k"):
        attn.attention_forward(
            _module(),
            *_qkv(),
            torch.ones(1, 5, dtype=torch.bool),
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=3,
            max_length_k=3,
        )
    with pytest.raises(ValueError, match="missing max_length_q, max_length_k"):
        attn.attention_forward(_module(), *_qkv(), None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    with pytest.raises(TypeError, match="expected max_length_q to be an int, got 3.0"):
        attn.attention_forward(
            _module(), *_qkv(), None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=3.0, max_length_k=3
        )
    with pytest.raises(ValueError, match=r"expected a padding mask of shape \[1, 5\]"):
        attn.attention_forward(_module(), *_qkv(), torch.ones(2, 5, dtype=torch.bool))


def test_overlaid_mask_functions_are_refused():
    from transformers.masking_utils import create_causal_mask

    model, _ = _pair("llama")
    embeds = torch.zeros(1, 4, 64)
    with pytest.raises(NotImplementedError, match="LlamaConfig overlays a custom mask function"):
        create_causal_mask(
            model.config, embeds, torch.ones(1, 4, dtype=torch.long), None, or_mask_function=lambda b, h, q, kv: q == kv
        )


def test_import_ragged_does_not_import_transformers():
    probe = (
        "import json, sys; import ragged, ragged.nn; "
        "mods = ['transformers', 'ragged.integrations.transformers', 'ragged.nn.hf.attention']; "
        "print(json.dumps([m for m in mods if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "", "PYTHONPATH": ":".join(p for p in sys.path if p)},
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert transformers.AttentionInterface._global_mapping["ragged"] is attn.attention_forward
    assert transformers.AttentionMaskInterface._global_mapping["ragged"] is attn.padding_mask


def test_the_integration_has_one_name():
    """``attn_implementation="ragged"`` is registered by ``ragged.integrations.transformers``; the
    old name ``ragged.hf``, beside the unrelated model adapters ``ragged.nn.hf``, is gone."""
    import importlib.util

    assert importlib.util.find_spec("ragged.hf") is None
    assert importlib.util.find_spec("ragged.integrations.transformers") is not None


def test_autocast_takes_q_k_v_in_autocasts_dtype():
    """Under autocast, rotary embeddings computed in float32 can leave q and k in float32 beside
    a bfloat16 v (TRL's bf16 training through accelerate does): the attention runs in autocast's
    dtype, as torch's SDPA does, instead of refusing the mixed dtypes."""
    model, _ = _pair("llama")
    module = model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 4, 9, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 4, 9, 16, generator=gen).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attn.attention_forward(module, q, k, v, None, is_causal=True)
    assert out.dtype == torch.bfloat16
    low = [t.to(torch.bfloat16).float() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*low, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
