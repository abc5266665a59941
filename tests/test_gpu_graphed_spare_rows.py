"""ragged.nn.graphed on the GPU with a bucket's spare rows and sequences: captured graphs of
converted ModernBERT (rotary positions, sliding-window attention, its own layer) and MPNet
(a relative-position bias) models in evaluation, on batches that leave rows past
``offsets[-1]`` and empty spare sequences, against the eager model; and the losses that
average every row (regression with integer and float labels, multi-label) and a cross-entropy
through captured graphs, in evaluation (the loss) and in training (the loss and every
parameter's gradient), against the eager model.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise)."""

from __future__ import annotations

import copy

import pytest
import torch

import ragged

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

tf = pytest.importorskip("transformers")

from hf_convert_cases import _randomise

KINDS = {
    "base": "Model",
    "sequence": "ForSequenceClassification",
    "token": "ForTokenClassification",
    "masked_lm": "ForMaskedLM",
    "qa": "ForQuestionAnswering",
}
TOL = {torch.bfloat16: 3e-2, torch.float32: 2e-4}
TRAIN_TOL = 1e-3  # float32, the same kernels on more rows
# gradients: a parameter whose true gradient is (nearly) zero gets rounding noise of the size of the
# gradients that cancel in it (the key biases, which the softmax ignores; the query weights of a layer
# whose scores the position bias dominates), so each gradient is compared on the scale of the model's
# largest gradient entry as well as its own
GRAD_FLOOR = 1e-3
# every batch but the last leaves spare rows in its bucket (token buckets of 64, 72, 80, ...;
# sequence buckets 1, 2, 4, 8, 16); the last fills 64 tokens in 4 sequences exactly
BATCHES = [[37, 3, 130, 1, 64], [5, 0, 1, 9], [1], [100, 3, 7], [12] * 5, [150, 2], [16, 16, 16, 16]]
VOCAB = 50
CASES = {  # case -> (config overrides, labels for (generator, B))
    "regression-int": ({"num_labels": 1}, lambda g, b: torch.randint(0, 5, (b,), generator=g, device="cuda")),
    "regression-float": ({"num_labels": 1}, lambda g, b: torch.randn(b, generator=g, device="cuda")),
    "multi-label": ({"num_labels": 3}, lambda g, b: torch.randint(0, 2, (b, 3), generator=g, device="cuda").float()),
    "single-label": ({"num_labels": 3}, lambda g, b: torch.randint(0, 3, (b,), generator=g, device="cuda")),
}


def _model(family: str, kind: str, dtype: torch.dtype, **over):
    """A converted tiny model (head dim 64) on the GPU, in eval mode, no dropout."""
    labels = 2 if kind == "qa" else 3
    if family == "modernbert":
        if not hasattr(tf, "ModernBertModel"):
            pytest.skip("this transformers has no ModernBERT")
        config = tf.ModernBertConfig(
            **{
                "vocab_size": VOCAB,
                "hidden_size": 128,
                "intermediate_size": 192,
                "num_hidden_layers": 4,
                "num_attention_heads": 2,
                "global_attn_every_n_layers": 3,
                "local_attention": 64,
                "max_position_embeddings": 256,
                "pad_token_id": 1,
                "bos_token_id": 2,
                "eos_token_id": 3,
                "cls_token_id": 2,
                "sep_token_id": 3,
                "attention_dropout": 0.0,
                "mlp_dropout": 0.0,
                "embedding_dropout": 0.0,
                "classifier_dropout": 0.0,
                "num_labels": labels,
                **over,
            }
        )
        prefix = "ModernBert"
    else:
        config = tf.MPNetConfig(
            **{
                "vocab_size": VOCAB,
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "max_position_embeddings": 160,
                "pad_token_id": 1,
                "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0,
                "num_labels": labels,
                **over,
            }
        )
        prefix = "MPNet"
    model = getattr(tf, prefix + KINDS[kind])(config)
    _randomise(model, 21)
    if family == "mpnet":
        with torch.no_grad():  # a bias of the size of the scores
            model.base_model.encoder.relative_attention_bias.weight.normal_(0.0, 1.0)
    return ragged.nn.convert(model.to("cuda", dtype).eval())


def _ids(lengths, gen):
    return ragged.pack([torch.randint(5, VOCAB, (n,), generator=gen, device="cuda") for n in lengths])


def _close(got, want, tol, what="", floor=1e-6):
    if isinstance(want, ragged.RaggedTensor):
        got, want = got.values, want.values
    assert got.shape == want.shape, what
    scale = want.float().abs().max().item() + floor
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} over {tol * scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", ["modernbert", "mpnet"])
def test_captured_graphs_with_spare_rows_equal_eager(family, kind, dtype):
    model = _model(family, kind, dtype)
    g = ragged.nn.graphed(model, max_tokens=512, max_batch_size=16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    spare = 0
    for lengths in BATCHES:
        ids = _ids(lengths, gen)
        spare += g.bucket(ids.num_tokens, ids.batch_size, ids.max_len)[0] > ids.num_tokens
        with torch.no_grad():
            want = model(input_ids=ids)
        for _ in range(2):  # the bucket's capture (its first batch), then a replay
            got = g(input_ids=ids)
            assert type(got) is type(want) and list(got.keys()) == list(want.keys())
            for name in want:
                _close(got[name], want[name], TOL[dtype], f"{lengths}: {name}")
    assert spare == len(BATCHES) - 1
    assert g.num_graphs >= 4


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["modernbert", "mpnet"])
def test_captured_eval_losses_skip_spare_sequences(family, case):
    over, labels_fn = CASES[case]
    model = _model(family, "sequence", torch.float32, **over)
    g = ragged.nn.graphed(model, max_tokens=512, max_batch_size=16)
    gen = torch.Generator(device="cuda").manual_seed(6)
    for lengths in BATCHES:
        ids = _ids(lengths, gen)
        labels = labels_fn(gen, ids.batch_size)
        with torch.no_grad():
            want = model(input_ids=ids, labels=labels)
        got = g(input_ids=ids, labels=labels)
        _close(got.loss, want.loss, TOL[torch.float32], f"{lengths}: loss")
        _close(got.logits, want.logits, TOL[torch.float32], f"{lengths}: logits")
    assert g.num_graphs >= 4


# integer regression labels: torch's MSE backward on CUDA takes no integer target (the eager
# model's backward raises too); the CPU tests train with them (tests/test_graphed_losses.py)
@pytest.mark.parametrize("case", [c for c in CASES if c != "regression-int"])
@pytest.mark.parametrize("family", ["modernbert", "mpnet"])
def test_captured_training_losses_skip_spare_sequences(family, case):
    over, labels_fn = CASES[case]
    model = _model(family, "sequence", torch.float32, **over).train()
    mine = copy.deepcopy(model)
    g = ragged.nn.graphed(mine, max_tokens=512, max_batch_size=16)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for lengths in BATCHES:
        ids = _ids(lengths, gen)
        labels = labels_fn(gen, ids.batch_size)
        want = model(input_ids=ids, labels=labels)
        want.loss.backward()
        got = g(input_ids=ids, labels=labels)
        got.loss.backward()
        _close(got.loss, want.loss.detach(), TRAIN_TOL, f"{lengths}: loss")
        _close(got.logits.detach(), want.logits.detach(), TRAIN_TOL, f"{lengths}: logits")
        top = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
        for (name, p), q in zip(model.named_parameters(), mine.parameters()):
            if p.grad is None:
                assert q.grad is None or not q.grad.any(), name
            else:
                _close(q.grad, p.grad, TRAIN_TOL, f"{lengths}: d {name}", GRAD_FLOOR * top)
        model.zero_grad(set_to_none=True)
        mine.zero_grad(set_to_none=True)
    assert g.num_graphs >= 4
