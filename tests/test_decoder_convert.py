"""ragged.nn.convert of HuggingFace decoders (Llama, Mistral, Qwen2, Qwen3, Gemma 1-3): outputs,
losses and gradients against the unconverted model, float64, padded (right and left) and packed."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_decoder_core import MODELS, V, _config  # noqa: E402

import ragged  # noqa: E402
import ragged.nn  # noqa: E402

CAUSAL = {
    name: "Gemma3ForCausalLM" if cls == "Gemma3TextModel" else cls.replace("Model", "ForCausalLM")
    for name, cls in MODELS.items()
}


def _pair(name, kind="causal"):
    torch.manual_seed(len(name) + 7)
    cls = CAUSAL[name] if kind == "causal" else MODELS[name]
    ref = getattr(transformers, cls)(_config(name)).double()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return ref, ragged.nn.convert(copy.deepcopy(ref))


def _padded(side):
    g = torch.Generator().manual_seed(3)
    lengths = [7, 2, 9]
    ids = torch.randint(0, V, (3, 9), generator=g)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, 9 - n :] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


# HF's rotary tables are float32 and its loss upcasts the logits to float32 only
TOL = dict(atol=3e-6, rtol=3e-6)


def _oracle(ref, ids, mask, labels, num_items=None):
    """The model's own forward on each row's real tokens alone (no padding for HF's eager
    attention to turn into NaN), at the padded columns as positions (as HF numbers a padded row);
    the next-token loss over the real tokens (HF's over the padded rows also counts a left pad
    predicting the first token), in float32 as HF's loss."""
    rows, losses, count = [], 0.0, 0
    for i in range(ids.shape[0]):
        cols = mask[i].nonzero()[:, 0]
        logits = ref(input_ids=ids[i, cols][None], position_ids=cols[None]).logits[0]
        rows.append(logits)
        target = torch.cat([labels[i, cols][1:], torch.tensor([-100])])
        losses = losses + torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum")
        count += int((target != -100).sum())
    return torch.cat(rows), losses / (count if num_items is None else num_items)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_logits_loss_and_gradients(name, side):
    ref, mine = _pair(name)
    assert type(mine) is type(ref) and mine.state_dict().keys() == ref.state_dict().keys()
    ids, mask, labels = _padded(side)
    keep = mask.bool()
    ref.eval(), mine.eval()
    want_logits, want_loss = _oracle(ref, ids, mask, labels)
    got = mine(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits[keep], want_logits, **TOL)
    assert (got.logits[~keep] == 0).all()
    torch.testing.assert_close(got.loss, want_loss, **TOL)
    # the model's own padded forward (no pad predicts a token): the same loss; with a sliding
    # window a padded query seeing only padding turns HF's eager rows to NaN
    if side == "right" and name not in ("mistral", "gemma2", "gemma3", "embeddinggemma"):
        torch.testing.assert_close(got.loss, ref(input_ids=ids, attention_mask=mask, labels=labels).loss, **TOL)
    # training: the loss from the hidden states, no logits; every gradient as the model's own
    ref.train(), mine.train()
    items = torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)
    _, want = _oracle(ref, ids, mask, labels, items)
    got = mine(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
    assert got.logits is None
    torch.testing.assert_close(got.loss.float(), want.float(), **TOL)
    want.backward()
    got.loss.backward()
    for (n, p), q in zip(ref.named_parameters(), mine.parameters()):
        scale = max(p.grad.abs().max().item(), 1e-3)
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5 * scale, rtol=1e-4, msg=n)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gemma3"])
def test_ragged_input_and_labels_equal_each_sequence(name):
    ref, mine = _pair(name)
    ref.eval(), mine.eval()
    g = torch.Generator().manual_seed(5)
    lengths = [4, 1, 0, 11]
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    rt = ragged.RaggedTensor.from_lengths(torch.cat(seqs), lengths)
    got = mine(input_ids=rt, labels=rt)
    assert isinstance(got.logits, ragged.RaggedTensor)
    total, count = 0.0, 0
    for seq, part in zip(seqs, got.logits.unbind()):
        if len(seq) == 0:
            continue
        want = ref(input_ids=seq[None]).logits[0]
        torch.testing.assert_close(part, want, **TOL)
        if len(seq) > 1:
            total = total + torch.nn.functional.cross_entropy(want[:-1].float(), seq[1:], reduction="sum")
            count += len(seq) - 1
    torch.testing.assert_close(got.loss, total / count, **TOL)


def test_base_model_hidden_states():
    ref, mine = _pair("qwen2", kind="base")
    ids, mask, _ = _padded("right")
    keep = mask.bool()
    want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    got = mine(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    torch.testing.assert_close(got.last_hidden_state[keep], want.last_hidden_state[keep], **TOL)
    assert len(got.hidden_states) == len(want.hidden_states)
    for a, b in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(a[keep], b[keep], **TOL)


def test_generation_stays_on_the_models_own_forward():
    ref, mine = _pair("llama")
    ref.eval(), mine.eval()
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(9))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(mine.generate(ids, **kw), ref.generate(ids, **kw))


def test_refused_models_stay_as_they_were():
    soft = transformers.Gemma2ForCausalLM(_config("gemma2", attn_logit_softcapping=50.0))
    with pytest.raises(NotImplementedError, match="soft-capping.*unchanged"):
        ragged.nn.convert(soft)
    assert "forward" not in soft.__dict__


@pytest.mark.parametrize("name", ["llama", "gemma2", "embeddinggemma"])
def test_graphed_training_equals_eager_off_the_gpu(name):
    """ragged.nn.graphed of a converted causal LM in train mode, its graphs emulated off the GPU
    (graph_switch.emulated: each graph is the Python it would capture): loss and every gradient
    as the eager converted model's, step after step, from a captured training bucket."""
    from ragged.nn import graph_switch

    _, mine = _pair(name)
    eager = copy.deepcopy(mine)
    mine.train(), eager.train()
    step = ragged.nn.graphed(mine, max_tokens=64, max_batch_size=4)
    g = torch.Generator().manual_seed(11)
    with graph_switch.emulated():
        for lengths in ([5, 7], [9, 1, 3], [5, 7]):
            rt = ragged.RaggedTensor.from_lengths(torch.randint(0, V, (sum(lengths),), generator=g), lengths)
            mine.zero_grad(), eager.zero_grad()
            got = step(input_ids=rt, labels=rt)
            want = eager(input_ids=rt, labels=rt)
            got.loss.backward()
            want.loss.backward()
            torch.testing.assert_close(got.loss, want.loss, atol=1e-12, rtol=1e-12)
            for (n, p), q in zip(eager.named_parameters(), mine.parameters()):
                torch.testing.assert_close(q.grad, p.grad, atol=1e-12, rtol=1e-10, msg=n)
    assert any(key[1] for key in step._graphs), "no training bucket was captured"


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("problem", ["single_label_classification", "regression"])
def test_sequence_classification(name, problem):
    cls = getattr(transformers, CAUSAL[name].replace("ForCausalLM", "ForSequenceClassification"))
    torch.manual_seed(3)
    config = _config(name, num_labels=1 if problem == "regression" else 3, pad_token_id=0, problem_type=problem)
    ref = cls(config).double()
    mine = ragged.nn.convert(copy.deepcopy(ref))
    ids, mask, _ = _padded("right")
    ids = ids.clamp_min(1).masked_fill(mask == 0, 0)  # the pad id at padding only, as HF finds the last token
    labels = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64) if problem == "regression" else torch.tensor([2, 0, 1])
    rows = []
    for i in range(3):  # each row alone (HF's padded eager rows can turn to NaN under windows)
        cols = mask[i].nonzero()[:, 0]
        rows.append(ref(input_ids=ids[i, cols][None]).logits)
    want_logits = torch.cat(rows)
    want_loss = ref.loss_function(logits=want_logits, labels=labels, pooled_logits=want_logits, config=ref.config)
    got = mine(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, want_logits, **TOL)
    torch.testing.assert_close(got.loss, want_loss, **TOL)
    want_loss.backward()
    got.loss.backward()
    for (n, p), q in zip(ref.named_parameters(), mine.parameters()):
        scale = max(p.grad.abs().max().item(), 1e-3)
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5 * scale, rtol=1e-4, msg=n)
    # a RaggedTensor batch with an empty sequence: zeros for it, the others as before
    seqs = [ids[i, mask[i].bool()] for i in range(3)]
    rt = ragged.RaggedTensor.from_lengths(torch.cat(seqs[:1] + seqs[1:]), [len(seqs[0]), 0, len(seqs[1]), len(seqs[2])])
    out = mine(input_ids=rt).logits
    assert out.shape == (4, config.num_labels) and (out[1] == 0).all()
    torch.testing.assert_close(out[[0, 2, 3]], want_logits, **TOL)


def test_flattened_rows_as_the_collators_make_them():
    """DataCollatorWithFlattening / TRL padding_free batches (one row, cu_seq_lens, positions that
    restart, -100 at each sequence's first label): the same logits and loss as the unconverted
    model under attn_implementation="ragged" on the same batch."""
    import ragged.integrations.transformers  # noqa: F401  (registers "ragged")

    ref, mine = _pair("qwen3")
    ref.set_attn_implementation("ragged")
    g = torch.Generator().manual_seed(8)
    lengths = [5, 1, 9]
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), s[1:]]) for s in seqs])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    kw = dict(position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    ref.eval(), mine.eval()
    want = ref(input_ids=ids, labels=labels, **kw)
    got = mine(input_ids=ids, labels=labels, **kw)
    assert got.logits.shape == want.logits.shape == (1, 15, V)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    mine.train()
    items = torch.tensor(12)
    got = mine(input_ids=ids, labels=labels, num_items_in_batch=items, **kw)
    ref.train()
    want = ref(input_ids=ids, labels=labels, num_items_in_batch=items, **kw)
    assert got.logits is None
    torch.testing.assert_close(got.loss.float(), want.loss, **TOL)


def test_autocast_keeps_the_residual_stream_in_its_dtype():
    """Under autocast (as Trainer's bf16 runs) the Linears return bfloat16 while the float32
    residual stream, norms and loss stay float32, as in HF's layers: the converted model's loss
    follows the model's own under the same autocast."""
    ref, mine = _pair("qwen3")
    ref.float(), mine.float()
    ref.eval(), mine.eval()
    ids, mask, labels = _padded("right")
    keep = mask.bool()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mine(input_ids=ids, attention_mask=mask, labels=labels)
        rows = [ref(input_ids=ids[i, keep[i]][None]).logits[0] for i in range(3)]
    want = torch.cat(rows)
    assert got.logits.dtype == want.dtype
    err = (got.logits[keep].float() - want.float()).abs().max().item()
    assert err < 0.05 * want.float().abs().max().item(), err
