"""ragged.nn.graphed on the CPU: the bucketing, the padded batch the graphs see (run eagerly here:
``Graphed(..., capture=False)``), the outputs cut back to the caller's batch, and the errors.
The graphs themselves are captured in tests/test_gpu_graphed.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_convert_cases import _model  # the CPU tests' HuggingFace models

import ragged

D, HEADS = 32, 4


def _encoder(seed=0, layers=2):
    torch.manual_seed(seed)
    layer = ragged.nn.TransformerEncoderLayer(
        D, HEADS, 2 * D, dropout=0.0, activation="gelu", batch_first=True, dtype=torch.float64
    )
    return ragged.nn.TransformerEncoder(layer, layers).eval()


def _batch(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return ragged.pack([torch.randn(n, D, generator=g, dtype=torch.float64) for n in lengths])


def _poison(g: ragged.nn.Graphed) -> None:
    """NaN in every static buffer of floating dtype: the rows a call does not copy stay NaN."""
    for buf in g._static_buffers.values():
        if buf.is_floating_point():
            buf.fill_(float("nan"))


@pytest.mark.parametrize("lengths", [[5, 0, 1, 9], [1], [0, 0, 3], [63], [7, 11, 2, 13, 1, 30, 4]])
def test_padded_bucket_equals_eager(lengths):
    enc = _encoder()
    g = ragged.nn.Graphed(enc, 128, 8, capture=False)
    x = _batch(lengths)
    with torch.no_grad():
        want = enc(x)
    g(x)  # creates the bucket's buffers
    _poison(g)  # spare rows and the buffers' old contents are NaN: nothing real may read them
    got = g(x)
    assert isinstance(got, ragged.RaggedTensor)
    assert got.offsets is x.offsets and got.max_len == x.max_len
    assert got.values.shape == want.values.shape
    torch.testing.assert_close(got.values, want.values, rtol=1e-10, atol=1e-10)
    assert not got.requires_grad


def test_static_buffers_are_not_module_buffers():
    """The static inputs are the wrapper's own cache, not registered buffers: after a call the
    state_dict and named_buffers are the wrapped module's, under ``module.``."""
    g = ragged.nn.Graphed(_encoder(), 128, 8, capture=False)
    before = list(g.state_dict())
    g(_batch([5, 3]))
    assert list(g.state_dict()) == before
    assert [name for name, _ in g.named_buffers()] == [f"module.{n}" for n, _ in g.module.named_buffers()]


def test_buckets_are_shared_and_keyed():
    enc = _encoder()
    g = ragged.nn.Graphed(enc, 256, 16, capture=False)
    for lengths in ([3, 4], [2, 5], [1, 6]):  # 7 tokens, 2 sequences, longest <= 16: one bucket
        g(_batch(lengths))
    assert g.num_graphs == 1
    g(_batch([40, 1]))  # the longest sequence moves to another bucket
    g(_batch([1] * 9))  # more sequences
    assert g.num_graphs == 3
    g.reset()
    assert g.num_graphs == 0


def test_default_buckets_waste_at_most_an_eighth():
    for top in (64, 1000, 4096, 33000):
        b = ragged.nn.Graphed(_encoder(), top, 4, capture=False).token_buckets
        assert b[0] == 64 and b[-1] == top and list(b) == sorted(set(b))
        for n in range(1, top + 1, 7):
            t = next(x for x in b if x >= n)
            assert t <= max(64, 1.125 * n) or t == top


def test_bucket_choice():
    g = ragged.nn.Graphed(_encoder(), 1000, 100, capture=False)
    assert g.token_buckets[:10] == (64, 72, 80, 88, 96, 104, 112, 120, 128, 144)
    assert g.token_buckets[-4:] == (768, 832, 896, 960, 1000)[1:] and len(g.token_buckets) == 33
    assert g.batch_buckets == (1, 2, 4, 8, 16, 32, 64, 100)
    assert g.bucket(64, 4, 20) == (64, 4, 32)
    assert g.bucket(700, 64, 20) == (704, 64, 32)
    # sequences are added (3 -> 4) and the tokens fill the bucket: one more row is kept
    assert g.bucket(64, 3, 20) == (72, 4, 32)
    assert g.bucket(1000, 100, 5) == (1000, 100, 16)
    assert g.bucket(1001, 1, 5) is None and g.bucket(5, 101, 5) is None
    assert g.bucket(0, 1, 0) == (64, 1, 16)
    custom = ragged.nn.Graphed(
        _encoder(), 300, 8, token_buckets=[100, 200], batch_buckets=[8], length_buckets=[50], capture=False
    )
    assert custom.token_buckets == (100, 200, 300) and custom.batch_buckets == (8,)
    assert custom.length_buckets == (50, 300)


def test_over_the_largest_bucket_runs_eagerly_with_one_warning():
    enc = _encoder()
    g = ragged.nn.Graphed(enc, 64, 4, capture=False)
    x = _batch([40, 30])
    with pytest.warns(UserWarning, match="over the largest bucket"):
        got = g(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(x)  # the warning is given once, whatever the size
        g(_batch([50, 41, 2]))
    with torch.no_grad():
        torch.testing.assert_close(got.values, enc(x).values)
    assert g.num_graphs == 0


def test_cpu_inputs_with_capture_run_eagerly_with_a_warning():
    enc = _encoder()
    g = ragged.nn.graphed(enc, max_tokens=64, max_batch_size=4)
    x = _batch([3, 5])
    with pytest.warns(UserWarning, match="CUDA graphs need CUDA tensors"):
        got = g(x)
    with torch.no_grad():
        torch.testing.assert_close(got.values, enc(x).values)


def test_errors():
    enc = _encoder()
    with pytest.raises(TypeError, match=r"ragged.nn.graphed\(\): expected module"):
        ragged.nn.graphed("encoder", max_tokens=64, max_batch_size=4)
    with pytest.raises(ValueError, match=r"ragged.nn.graphed\(\): expected max_tokens >= 1, got 0"):
        ragged.nn.graphed(enc, max_tokens=0, max_batch_size=4)
    with pytest.raises(TypeError, match=r"expected max_batch_size to be an int"):
        ragged.nn.graphed(enc, max_tokens=64, max_batch_size=4.0)
    with pytest.raises(ValueError, match=r"expected token_buckets of ints in 1..64"):
        ragged.nn.graphed(enc, max_tokens=64, max_batch_size=4, token_buckets=[128])
    g = ragged.nn.Graphed(enc, 64, 4, capture=False)
    x = _batch([3, 5])
    with pytest.raises(
        TypeError,
        match=r"ragged.nn.Graphed.forward\(\): expected RaggedTensor arguments, "
        r"per-sequence tensors and constants .* got \[1, 2\] for argument 1",
    ):
        g(x, [1, 2])
    with pytest.raises(TypeError, match="expected at least one RaggedTensor"):
        g(x.values)
    with pytest.raises(TypeError, match="expected at least one RaggedTensor"):
        g(src=None)
    with pytest.raises(ValueError, match="of the first one's batch"):
        g(x, _batch([3]))
    with pytest.raises(
        ValueError,
        match=r"expected tensor argument 'mask' to hold one entry per sequence "
        r"\(shape \[2, \.\.\.\] on cpu\), got shape \(3,\)",
    ):
        g(x, mask=torch.zeros(3))
    enc.train()
    with pytest.warns(UserWarning, match="training mode under torch.no_grad"), torch.no_grad():
        got = g(x)  # eagerly: the training graphs capture a backward
    assert g.num_graphs == 0 and torch.isfinite(got.values).all()


FAMILIES = ["bert", "roberta", "distilbert"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", ["base", "sequence", "token"])
def test_converted_hf_models(family, kind):
    model = _model(family, kind, seed=3)[0]
    g = ragged.nn.Graphed(model, 256, 8, capture=False)
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 1, 0, 19]
    ids = ragged.pack([torch.randint(5, 50, (n,), generator=gen) for n in lengths])
    with torch.no_grad():
        want = model(input_ids=ids)
    g(input_ids=ids)
    _poison(g)
    got = g(input_ids=ids)
    assert type(got) is type(want)
    for name in want.keys():
        a, b = got[name], want[name]
        if isinstance(b, ragged.RaggedTensor):
            assert isinstance(a, ragged.RaggedTensor) and a.offsets is ids.offsets
            a, b = a.values, b.values
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_position_and_sequence_ids_past_the_last_offset():
    # values with rows past offsets[-1] (a graphed bucket's spare rows)
    off = torch.tensor([0, 3, 3, 7, 7], dtype=torch.int32)
    rt = ragged.RaggedTensor(torch.zeros(12, 2), off, 4)
    assert rt.position_ids().tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 3]
    assert rt.seq_ids().tolist() == [0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 4]
    full = ragged.pack([torch.zeros(n, 2) for n in (2, 0, 5, 1)])
    want = torch.cat([torch.arange(n) for n in (2, 0, 5, 1)])
    assert torch.equal(full.position_ids(), want)
    assert torch.equal(full.seq_ids(), torch.repeat_interleave(torch.arange(4), torch.tensor([2, 0, 5, 1])))


def test_attention_weights_with_spare_rows_past_the_last_offset():
    """MultiheadAttention's weights (need_weights, torch's default) on a bucket's layout: rows past
    offsets[-1] have sequence id B; they must land nowhere (out of range before: an IndexError
    here, an out-of-bounds scatter inside a graph), and the real weights stay those of the batch."""
    from ragged.padding import PaddedLayout

    torch.manual_seed(3)
    mha = ragged.nn.MultiheadAttention(D, HEADS, batch_first=True, dtype=torch.float64).eval()
    x = _batch([5, 0, 1, 9])
    spare = 7
    values = torch.cat([x.values, torch.full((spare, D), float("nan"), dtype=torch.float64)])
    padded = ragged.RaggedTensor.from_offsets(values, x.offsets, max_len=x.max_len, validate=False)
    assert padded.num_tokens == x.num_tokens + spare
    for causal in (False, True):
        with torch.no_grad():
            _, q, k = mha._attend(x, x, x, causal)
            want = mha._weights(q, k, x, x, PaddedLayout(x.max_len), PaddedLayout(x.max_len), causal, False)
            junk = torch.full((spare, *q.shape[1:]), float("nan"), dtype=q.dtype)
            qs, ks = torch.cat([q, junk]), torch.cat([k, junk])
            got = mha._weights(qs, ks, padded, padded, PaddedLayout(x.max_len), PaddedLayout(x.max_len), causal, False)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
