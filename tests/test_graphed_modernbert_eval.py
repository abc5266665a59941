"""ModernBERT through ragged.nn.graphed in evaluation on the CPU (``Graphed(..., capture=False)``:
the bucketed batch the graphs see, run eagerly): a bucket's rows past ``offsets[-1]`` belong to
no sequence, and the converted layers take them as every family's do, with NaN left in the
buffers by earlier batches. Every head against the eager converted model in float64, for
batches that leave spare rows and one that fills its bucket; the public
``ragged.varlen_attention`` still refuses such offsets from its callers. The graphs themselves
are captured in tests/test_gpu_graphed_spare_rows.py."""

from __future__ import annotations

import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")
if not hasattr(tf, "ModernBertModel"):
    pytest.skip("this transformers has no ModernBERT", allow_module_level=True)

from test_hf_modernbert import _model

# spare rows and sequences, a full bucket (64 tokens in 4 sequences), windows cut (local layers
# see 4 tokens each side), empty sequences
BATCHES = [[5, 0, 1, 9], [1], [0, 0, 3], [63], [7, 11, 2, 13, 1, 30, 4], [16, 16, 16, 16]]
FIELDS = {
    "base": ("last_hidden_state",),
    "sequence": ("logits",),
    "token": ("logits",),
    "masked_lm": ("logits",),
    "qa": ("start_logits", "end_logits"),
}


def _poison(g: ragged.nn.Graphed) -> None:
    for buf in g._static_buffers.values():
        if buf.is_floating_point():
            buf.fill_(float("nan"))


def _values(x):
    return x.values if isinstance(x, ragged.RaggedTensor) else x


@pytest.mark.parametrize("kind", list(FIELDS))
def test_graphed_modernbert_in_eval_equals_eager(kind):
    model = _model(kind, seed=3)[0].eval()
    g = ragged.nn.Graphed(model, 256, 8, capture=False)
    gen = torch.Generator().manual_seed(4)
    spare = 0
    for lengths in BATCHES:
        ids = ragged.pack([torch.randint(5, 50, (n,), generator=gen) for n in lengths])
        t_b = g.bucket(ids.num_tokens, ids.batch_size, ids.max_len)[0]
        spare += t_b > ids.num_tokens
        with torch.no_grad():
            want = model(input_ids=ids, output_hidden_states=True)
        g(input_ids=ids, output_hidden_states=True)  # the bucket's buffers
        _poison(g)
        got = g(input_ids=ids, output_hidden_states=True)
        for name in (*FIELDS[kind], "hidden_states"):
            a, b = got[name], want[name]
            for x, y in zip(a, b) if name == "hidden_states" else [(a, b)]:
                if isinstance(y, ragged.RaggedTensor):
                    assert x.offsets is ids.offsets
                x, y = _values(x), _values(y)
                assert x.shape == y.shape, name
                torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10, msg=f"{lengths}: {name}")
    assert spare == len(BATCHES) - 1


def test_graphed_modernbert_with_sparse_prediction_in_eval_equals_eager():
    model = _model("masked_lm", seed=3, sparse_prediction=True)[0].eval()
    g = ragged.nn.Graphed(model, 256, 8, capture=False)
    gen = torch.Generator().manual_seed(5)
    ids = ragged.pack([torch.randint(5, 50, (n,), generator=gen) for n in [7, 1, 19, 3, 11]])
    labels = torch.randint(0, 50, (ids.num_tokens,), generator=gen)
    labels[::2] = -100
    labels = ids.with_values(labels)
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels)
        got = g(input_ids=ids, labels=labels)
    assert got.logits.shape == want.logits.shape == ((labels.values != -100).sum().item(), 50)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-10, atol=1e-10)


def test_public_varlen_attention_still_refuses_rows_past_the_offsets():
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)  # 5 rows in sequences, 8 given
    with pytest.raises(
        ValueError,
        match=r"ragged\.varlen_attention\(\): expected cu_seqlens_q\[-1\] == "
        r"q\.shape\[0\] \(8\), got 5",
    ):
        ragged.varlen_attention(q, q, q, cu, cu, 3, 3)
