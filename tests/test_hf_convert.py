"""ragged.nn.convert on HuggingFace BERT-family models, against the unconverted model.

Tiny float64 models (2 layers, hidden 32, 4 heads, vocabulary 50) with random weights, for
every family and head: outputs at real positions, losses and every parameter's gradient
equal HuggingFace's on right-, left- and scattered-padded batches and on RaggedTensors
(lengths 1 to 17, one sequence of length 0 where the model allows it); what is kept
(module tree, Parameters, state_dict keys, save_pretrained round trip, deepcopy, pickle);
what is refused, with the model untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")

from hf_convert_cases import (  # noqa: E402
    FAMILIES,
    KINDS,
    LENGTHS,
    PAD,
    TOL,
    VOCAB,
    D,
    _batch,
    _model,
    _ragged,
    _real,
)

# --------------------------------------------------------------------------------------
# Outputs


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_outputs_match_hf(family, kind):
    ours, hf = _model(family, kind)
    token_level = kind not in ("sequence",)
    for side in ("right", "left"):
        ids, mask = _batch(LENGTHS, side)
        with torch.no_grad():
            got, want = ours(input_ids=ids, attention_mask=mask), hf(input_ids=ids, attention_mask=mask)
        assert type(got) is type(want) and list(got.keys()) == list(want.keys())
        for key in want.keys():
            if key == "pooler_output" or (not token_level and key == "logits"):
                if side == "right":  # HuggingFace reads column 0: padding when left-padded
                    torch.testing.assert_close(got[key], want[key], **TOL)
                continue
            assert got[key].shape == want[key].shape, key
            torch.testing.assert_close(_real(got[key], mask), _real(want[key], mask), **TOL)
            assert torch.all(got[key][~mask.bool()] == 0), f"{key}: padding is not zero"
    # a RaggedTensor in: token-level outputs ragged, sequence-level ones [B, ...]
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        got, want = ours(input_ids=_ragged(ids, mask)), hf(input_ids=ids, attention_mask=mask)
    for key in want.keys():
        if isinstance(got[key], ragged.RaggedTensor):
            assert got[key].host_lengths() == LENGTHS
            torch.testing.assert_close(got[key].values, _real(want[key], mask), **TOL)
        else:
            assert key == "pooler_output" or kind == "sequence", key
            torch.testing.assert_close(got[key], want[key], **TOL)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_scattered_mask_and_full_rows(family):
    ours, hf = _model(family)
    ids, mask = _batch([6, 6, 6])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).last_hidden_state, hf(ids).last_hidden_state, **TOL)
    mask = mask.clone()
    mask[0, 2] = mask[2, 0] = 0  # holes: tokens are no single run at either end
    ids = ids.masked_fill(mask == 0, PAD)  # RoBERTa's positions match HuggingFace's when padding holds the pad id
    with torch.no_grad():
        got, want = ours(input_ids=ids, attention_mask=mask), hf(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(_real(got.last_hidden_state, mask), _real(want.last_hidden_state, mask), **TOL)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_garbage_at_padding_does_not_leak(family):
    """Any id at padding (and NaN embeddings at padding) leaves the real positions as they were."""
    ours, _ = _model(family, "token")
    ids, mask = _batch(LENGTHS, "left")
    dirty = torch.where(mask.bool(), ids, torch.randint(0, VOCAB, ids.shape))
    with torch.no_grad():
        clean = ours(input_ids=ids, attention_mask=mask).logits
        got = ours(input_ids=dirty, attention_mask=mask).logits
        torch.testing.assert_close(got, clean, rtol=0, atol=0)
        emb = ours.get_input_embeddings()(ids)
        poisoned = emb.masked_fill(~mask.bool().unsqueeze(-1), float("nan"))
        a = ours(inputs_embeds=emb, attention_mask=mask).logits
        b = ours(inputs_embeds=poisoned, attention_mask=mask).logits
    torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_embeddings_token_types_and_positions(family):
    ours, hf = _model(family)
    ids, mask = _batch(LENGTHS)
    g = torch.Generator().manual_seed(5)
    extra = {}
    if family != "distilbert":
        extra["token_type_ids"] = torch.randint(0, 2, ids.shape, generator=g) * mask
    with torch.no_grad():
        emb = hf.get_input_embeddings()(ids)
        for kw in ({"input_ids": ids}, {"inputs_embeds": emb}):
            want = hf(attention_mask=mask, **kw, **extra).last_hidden_state
            got = ours(attention_mask=mask, **kw, **extra).last_hidden_state
            torch.testing.assert_close(_real(got, mask), _real(want, mask), **TOL)
            # RaggedTensor in: inputs_embeds, token types and explicit positions as RaggedTensors
            rkw = {k: _ragged(v, mask) for k, v in kw.items()}
            rextra = {k: _ragged(v, mask) for k, v in extra.items()}
            got = ours(**rkw, **rextra).last_hidden_state
            torch.testing.assert_close(got.values, _real(want, mask), **TOL)
        # explicit position ids, padded [B, M] and broadcast [1, M], and ragged
        pos = torch.arange(3, 3 + ids.shape[1]).unsqueeze(0)
        want = hf(input_ids=ids, attention_mask=mask, position_ids=pos.expand_as(ids), **extra).last_hidden_state
        got = ours(input_ids=ids, attention_mask=mask, position_ids=pos, **extra).last_hidden_state
        torch.testing.assert_close(_real(got, mask), _real(want, mask), **TOL)
        got = ours(
            input_ids=_ragged(ids, mask),
            position_ids=_ragged(pos.expand_as(ids), mask),
            **{k: _ragged(v, mask) for k, v in extra.items()},
        ).last_hidden_state
        torch.testing.assert_close(got.values, _real(want, mask), **TOL)


def test_hidden_states_and_tuples():
    ours, hf = _model("electra")
    ids, mask = _batch(LENGTHS)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = ours(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        assert len(got.hidden_states) == len(want.hidden_states) == 3
        for a, b in zip(got.hidden_states, want.hidden_states):
            torch.testing.assert_close(_real(a, mask), _real(b, mask), **TOL)
        rt = ours(input_ids=_ragged(ids, mask), output_hidden_states=True).hidden_states
        for a, b in zip(rt, want.hidden_states):
            torch.testing.assert_close(a.values, _real(b, mask), **TOL)
        # a selection of layers, as HuggingFace selects
        sel = ours(input_ids=ids, attention_mask=mask, output_hidden_states=[1]).hidden_states
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=[1]).hidden_states
        assert [h is None for h in sel] == [h is None for h in ref]
        torch.testing.assert_close(_real(sel[1], mask), _real(ref[1], mask), **TOL)
        # HuggingFace's own output-capturing hooks (now on hf's layers) do not stop a conversion
        assert any(layer._forward_hooks for layer in hf.encoder.layer)
        again = ragged.nn.convert(copy.deepcopy(hf))
        torch.testing.assert_close(
            again(input_ids=ids, attention_mask=mask).last_hidden_state, got.last_hidden_state, rtol=0, atol=0
        )
        # return_dict=False: HuggingFace's tuple
        t_ours = ours(input_ids=ids, attention_mask=mask, return_dict=False)
        t_hf = hf(input_ids=ids, attention_mask=mask, return_dict=False)
    assert isinstance(t_ours, tuple) and len(t_ours) == len(t_hf)
    clf, clf_hf = _model("bert", "sequence")
    with torch.no_grad():
        a = clf(ids, mask, return_dict=False)  # positional arguments in HuggingFace's order
        b = clf_hf(ids, mask, return_dict=False)
    assert len(a) == len(b) == 1
    torch.testing.assert_close(a[0], b[0], **TOL)


def test_empty_sequences_and_empty_batch():
    ours, hf = _model("bert")
    lengths = [3, 0, 5]
    ids, mask = _batch(lengths, width=6)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask)
        rt = ours(input_ids=_ragged(ids, mask))
        want = hf(input_ids=ids[[0, 2]], attention_mask=mask[[0, 2]])
    torch.testing.assert_close(_real(got.last_hidden_state, mask), _real(want.last_hidden_state, mask[[0, 2]]), **TOL)
    assert rt.last_hidden_state.host_lengths() == lengths
    torch.testing.assert_close(rt.pooler_output[[0, 2]], want.pooler_output, **TOL)
    empty = ragged.RaggedTensor.from_lengths(torch.zeros(0, dtype=torch.long), [])
    with torch.no_grad():
        out = ours(input_ids=empty)
    assert out.last_hidden_state.values.shape == (0, D) and out.pooler_output.shape == (0, D)
