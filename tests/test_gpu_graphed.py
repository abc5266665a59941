"""ragged.nn.graphed on the GPU: graphs captured per bucket and replayed, against the eager module
on the same batch (bf16 and fp16 within the rounding of a different kernel choice; fp32 close),
buckets reused across batches, no host sync on a replay, HuggingFace-converted models, and
torch.compile(mode="reduce-overhead") over a ragged.nn encoder.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise)."""

from __future__ import annotations

import warnings

import pytest
import torch

import ragged

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

D, HEADS = 256, 4  # head dim 64
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-4}


def _encoder(dtype, layers=2, seed=0, norm_first=False):
    torch.manual_seed(seed)
    layer = ragged.nn.TransformerEncoderLayer(
        D,
        HEADS,
        4 * D,
        dropout=0.1,
        activation="gelu",
        batch_first=True,
        norm_first=norm_first,
        device="cuda",
        dtype=dtype,
    )
    return ragged.nn.TransformerEncoder(layer, layers).eval()


def _batch(lengths, dtype, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return ragged.pack([torch.randn(n, D, generator=g, device="cuda", dtype=dtype) for n in lengths])


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    scale = want.float().abs().max().item() + 1e-6
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max abs error {err:.3g} over {TOL[dtype] * scale:.3g}"


BATCHES = [[5, 0, 1, 9], [1], [31, 2, 17], [100, 3, 250, 1, 64, 7, 7], [0, 0, 4], [12] * 20]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_graphed_encoder_matches_eager(dtype, norm_first):
    enc = _encoder(dtype, norm_first=norm_first)
    g = ragged.nn.graphed(enc, max_tokens=1024, max_batch_size=32)
    for seed, lengths in enumerate(BATCHES):
        x = _batch(lengths, dtype, seed)
        with torch.no_grad():
            want = enc(x)
        got = g(x)
        assert got.offsets is x.offsets and got.values.shape == want.values.shape
        _close(got.values, want.values, dtype)
    assert g.num_graphs >= 3


def test_bucket_reuse_replays_each_batch_and_syncs_nothing():
    dtype = torch.bfloat16
    enc = _encoder(dtype)
    g = ragged.nn.graphed(enc, max_tokens=512, max_batch_size=8)
    a, b = _batch([20, 3, 9], dtype, 1), _batch([1, 30, 2, 5], dtype, 2)  # one bucket: 64 tokens, 4 seqs, len 32
    with torch.no_grad():
        want_a, want_b = enc(a).values, enc(b).values
    g(a)
    assert g.num_graphs == 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got_b = g(b)
        got_a = g(a)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert g.num_graphs == 1
    _close(got_b.values, want_b, dtype)
    _close(got_a.values, want_a, dtype)
    # the copies returned are the caller's: the next replay does not change them
    kept = got_a.values.clone()
    g(b)
    assert torch.equal(got_a.values, kept)


def test_views_without_copy_are_overwritten_by_the_next_replay():
    dtype = torch.bfloat16
    enc = _encoder(dtype)
    g = ragged.nn.graphed(enc, max_tokens=256, max_batch_size=4, copy_outputs=False)
    a, b = _batch([20, 3], dtype, 1), _batch([5, 18], dtype, 2)
    with torch.no_grad():
        want_b = enc(b).values
    got_a = g(a)
    g(b)
    _close(got_a.values, want_b, dtype)  # a view of the static output, now b's


def test_over_the_largest_bucket_warns_once_and_runs_eagerly():
    dtype = torch.bfloat16
    enc = _encoder(dtype)
    g = ragged.nn.graphed(enc, max_tokens=64, max_batch_size=4)
    x = _batch([50, 40], dtype)
    with pytest.warns(UserWarning, match="over the largest bucket"):
        got = g(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g(x)
    with torch.no_grad():
        _close(got.values, enc(x).values, dtype)
    assert g.num_graphs == 0


tf = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("kind", ["base", "sequence", "token"])
def test_graphed_hf_converted_models(family, kind):
    model = _hf(family, kind)
    g = ragged.nn.graphed(model, max_tokens=512, max_batch_size=16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for lengths in ([7, 1, 0, 19], [40, 2], [3] * 9):
        ids = ragged.pack([torch.randint(5, 50, (n,), generator=gen, device="cuda") for n in lengths])
        with torch.no_grad():
            want = model(input_ids=ids)
        got = g(input_ids=ids)
        assert type(got) is type(want)
        for name in want.keys():
            a, b = got[name], want[name]
            if isinstance(b, ragged.RaggedTensor):
                a, b = a.values, b.values
            assert a.shape == b.shape, name
            _close(a, b, torch.bfloat16)


def _hf(family: str, kind: str):
    """A converted HuggingFace model (head dim 64) in bf16 on the GPU."""
    from hf_convert_cases import FAMILIES, KINDS, _config, _randomise

    over = (
        dict(dim=128, n_heads=2, hidden_dim=256)
        if family == "distilbert"
        else dict(hidden_size=128, num_attention_heads=2, intermediate_size=256)
    )
    hf = getattr(tf, FAMILIES[family][1] + KINDS[kind])(_config(family, kind, max_position_embeddings=160, **over))
    _randomise(hf, 3)
    hf = hf.to("cuda", torch.bfloat16).eval()
    return ragged.nn.convert(hf)


def test_compile_reduce_overhead_over_an_encoder():
    dtype = torch.bfloat16
    enc = _encoder(dtype)
    compiled = torch.compile(enc, mode="reduce-overhead")
    x = _batch([20, 3, 9], dtype)
    with torch.no_grad():
        want = enc(x).values
        for _ in range(3):  # warm-up, record, replay
            got = compiled(x).values.clone()
    _close(got, want, dtype)
