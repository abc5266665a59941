"""ragged.integrations.trainer.RaggedTrainer against transformers' Trainer on the unconverted model (padded
batches) and against a hand loop, on a tiny float64 BERT with random weights."""

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (
    BertConfig,
    BertForSequenceClassification,  # noqa: E402
    BertForTokenClassification,
    Trainer,
    TrainingArguments,
)

import ragged.nn  # noqa: E402
from ragged.data import collate  # noqa: E402
from ragged.integrations.trainer import RaggedTrainer  # noqa: E402

VOCAB = 50


def _config(num_labels=3):
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        num_labels=num_labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def _model(cls, seed):
    torch.manual_seed(seed)
    return cls(_config()).double()


def _dataset(n, seed, token_labels=False):
    """Distinct random sequences (lengths 1..30); token labels with some -100."""
    gen = np.random.default_rng(seed)
    items, seen = [], set()
    while len(items) < n:
        ids = gen.integers(1, VOCAB, int(gen.integers(1, 31))).tolist()
        if tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        if token_labels:
            labels = gen.integers(0, 3, len(ids))
            labels[gen.random(len(ids)) < 0.2] = -100
            labels = labels.tolist()
        else:
            labels = int(gen.integers(0, 3))
        items.append({"input_ids": ids, "token_type_ids": [0] * len(ids), "labels": labels})
    return items


def _args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        report_to=[],
        learning_rate=1e-2,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_strategy="no",
        save_strategy="no",
        seed=1234,
        use_cpu=True,
        disable_tqdm=True,
    )
    base.update(kw)
    return TrainingArguments(**base)


class _Recorder:
    """A collator that records each batch's dataset indices (by their ids) before collating."""

    def __init__(self, data):
        self.index = {tuple(x["input_ids"]): i for i, x in enumerate(data)}
        self.batches = []

    def __call__(self, features):
        self.batches.append([self.index[tuple(f["input_ids"])] for f in features])
        return collate(features)


def _pad(features):
    """A padded HF batch: ids and types padded with 0, token labels with -100."""
    width = max(len(f["input_ids"]) for f in features)
    out = {}
    for key, fill in (("input_ids", 0), ("token_type_ids", 0)):
        out[key] = torch.tensor([f[key] + [fill] * (width - len(f[key])) for f in features])
    out["attention_mask"] = torch.tensor(
        [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
    )
    labels = [f["labels"] for f in features]
    out["labels"] = (
        torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        if isinstance(labels[0], list)
        else torch.tensor(labels)
    )
    return out


class _FixedBatches(Trainer):
    """Trainer on the unconverted model, fed the given index batches (padded), in that order."""

    def __init__(self, *a, batches, **kw):
        super().__init__(*a, **kw)
        self.batches = batches

    def get_train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_dataset, batch_sampler=self.batches, collate_fn=_pad)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _assert_same_params(a, b, rtol=1e-9, atol=1e-11):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def test_train_matches_hand_loop(tmp_path):
    data = _dataset(40, seed=101)
    hf = _model(BertForSequenceClassification, seed=1)
    start = copy.deepcopy(hf)
    model = ragged.nn.convert(hf)
    initial = copy.deepcopy(start)
    rec = _Recorder(data)
    args = _args(tmp_path, num_train_epochs=2, optim="adamw_torch")
    trainer = RaggedTrainer(model, args, train_dataset=data, max_tokens=96, data_collator=rec)
    trainer.train()
    assert trainer.state.global_step == len(rec.batches)

    ref = ragged.nn.convert(start)
    ref.train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for batch in rec.batches:
        ref(**collate([data[i] for i in batch])).loss.backward()
        opt.step()
        opt.zero_grad()
    _assert_same_params(_params(model), _params(ref))
    assert any(not torch.allclose(v, _params(initial)[k]) for k, v in _params(model).items())


@pytest.mark.parametrize("cls,token", [(BertForSequenceClassification, False), (BertForTokenClassification, True)])
def test_gradient_accumulation_matches_hf_trainer(tmp_path, cls, token):
    data = _dataset(36, seed=102, token_labels=token)
    hf = _model(cls, seed=2)
    plain = copy.deepcopy(hf)
    before = _params(hf)
    rec = _Recorder(data)
    kw = dict(num_train_epochs=1, gradient_accumulation_steps=2, optim="sgd")
    trainer = RaggedTrainer(
        ragged.nn.convert(hf), _args(tmp_path / "r", **kw), train_dataset=data, max_tokens=80, data_collator=rec
    )
    trainer.train()
    assert len(rec.batches) >= 4
    ref = _FixedBatches(plain, _args(tmp_path / "p", **kw), train_dataset=data, batches=rec.batches)
    ref.train()
    assert trainer.state.global_step == ref.state.global_step == -(-len(rec.batches) // 2)
    _assert_same_params(_params(hf), _params(plain))
    assert any(not torch.allclose(before[k], v) for k, v in _params(hf).items())


class _NanAt:
    """Mixin: the loss of the given training calls reads NaN (its gradient stays the real one)."""

    nan_calls = (2, 5)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._calls = getattr(self, "_calls", 0) + 1
        self.host_filter = getattr(self, "host_filter", set()) | {self.args.logging_nan_inf_filter}
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self._calls in self.nan_calls and model.training:
            loss = loss + (torch.full_like(loss, float("nan")) - loss).detach()
        return loss


class _NanRagged(_NanAt, RaggedTrainer):
    pass


class _NanFixed(_NanAt, _FixedBatches):
    pass


def test_non_finite_losses_are_filtered_as_hf_trainer_does(tmp_path):
    """The filter of non-finite losses runs on the device here (no host read per step): the
    logged training loss must be Trainer's, and the argument is left as it was."""
    data = _dataset(40, seed=103)
    hf = _model(BertForSequenceClassification, seed=4)
    plain = copy.deepcopy(hf)
    rec = _Recorder(data)
    kw = dict(num_train_epochs=1, optim="sgd", logging_strategy="steps", logging_steps=3)
    args = _args(tmp_path / "r", **kw)
    assert args.logging_nan_inf_filter
    ours = _NanRagged(ragged.nn.convert(hf), args, train_dataset=data, max_tokens=96, data_collator=rec)
    out = ours.train()
    assert len(rec.batches) >= 7 and args.logging_nan_inf_filter
    assert ours.host_filter == {False}, "Trainer's host-side filter (a sync per step) ran"
    ref = _NanFixed(plain, _args(tmp_path / "p", **kw), train_dataset=data, batches=rec.batches)
    expected = ref.train()
    assert np.isfinite(out.training_loss)
    assert out.training_loss == pytest.approx(expected.training_loss, rel=1e-9)
    logged = [e["loss"] for e in ours.state.log_history if "loss" in e]
    assert logged == pytest.approx([e["loss"] for e in ref.state.log_history if "loss" in e], rel=1e-9)


@pytest.mark.parametrize("cls,token", [(BertForSequenceClassification, False), (BertForTokenClassification, True)])
def test_evaluate_and_predict_match_hf_trainer(tmp_path, cls, token):
    data = _dataset(23, seed=104, token_labels=token)
    hf = _model(cls, seed=3)
    plain = copy.deepcopy(hf)
    args = _args(tmp_path, per_device_eval_batch_size=5)
    ours = RaggedTrainer(ragged.nn.convert(hf), args, eval_dataset=data, max_tokens=64)
    theirs = Trainer(plain, args, eval_dataset=data, data_collator=_pad)
    m_ours, m_theirs = ours.evaluate(), theirs.evaluate()
    assert m_ours["eval_loss"] == pytest.approx(m_theirs["eval_loss"], rel=1e-9)
    p_ours, p_theirs = ours.predict(data), theirs.predict(data)
    assert p_ours.predictions.shape == p_theirs.predictions.shape
    np.testing.assert_array_equal(p_ours.label_ids, p_theirs.label_ids)
    real = p_theirs.label_ids != -100  # token logits at padding differ (HF computes values there)
    np.testing.assert_allclose(p_ours.predictions[real], p_theirs.predictions[real], rtol=1e-9, atol=1e-12)


def test_batches_respect_budget_and_cover_each_epoch(tmp_path):
    data = _dataset(50, seed=105)
    rec = _Recorder(data)
    budget = 70
    trainer = RaggedTrainer(
        ragged.nn.convert(_model(BertForSequenceClassification, seed=4)),
        _args(tmp_path, num_train_epochs=3, optim="sgd"),
        train_dataset=data,
        max_tokens=budget,
        data_collator=rec,
    )
    trainer.train()
    lengths = [len(x["input_ids"]) for x in data]
    epochs, batch = [], 0
    for epoch in range(3):
        trainer._train_sampler.set_epoch(epoch)
        count = len(trainer._train_sampler)
        epochs.append(rec.batches[batch : batch + count])
        batch += count
    assert batch == len(rec.batches) == trainer.state.global_step
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(len(data)))
        assert all(sum(lengths[i] for i in b) <= budget for b in batches)
    assert epochs[0] != epochs[1]  # a new order each epoch


def test_errors(tmp_path):
    model = ragged.nn.convert(_model(BertForSequenceClassification, seed=5))
    args = _args(tmp_path)
    data = _dataset(4, seed=0)
    with pytest.raises(ValueError, match=r"RaggedTrainer.*'input_ids'.*item 0"):
        RaggedTrainer(model, args, train_dataset=[{"text": "a", "labels": 0}], max_tokens=8)
    with pytest.raises(ValueError, match=r"RaggedTrainer.*max_tokens.*0"):
        RaggedTrainer(model, args, train_dataset=data, max_tokens=0)
    with pytest.raises(TypeError, match=r"RaggedTrainer.*max_tokens"):
        RaggedTrainer(model, args, train_dataset=data, max_tokens=8.5)
    with pytest.raises(ValueError, match=r"RaggedTrainer.*one length per training sequence \(4\), got 3"):
        RaggedTrainer(model, args, train_dataset=data, max_tokens=8, lengths=[1, 2, 3])
    with pytest.raises(TypeError, match=r"RaggedTrainer.*train_dataset"):
        RaggedTrainer(model, args, train_dataset=_Stream(), max_tokens=8)


@pytest.mark.parametrize("cls,token", [(BertForSequenceClassification, False), (BertForTokenClassification, True)])
def test_graphs_train_and_evaluate_as_without(tmp_path, cls, token):
    """graphs=: each step runs the bucketed batch the graphs replay (capture=False: eagerly, with
    autograd, on the CPU; the capture itself is tested on the GPU), with accumulation and eval."""
    data = _dataset(30, seed=106, token_labels=token)
    hf = _model(cls, seed=6)
    plain = ragged.nn.convert(copy.deepcopy(hf))
    model = ragged.nn.convert(hf)
    graphs = ragged.nn.Graphed(model, 256, 16, capture=False)
    kw = dict(num_train_epochs=1, gradient_accumulation_steps=2, optim="adamw_torch", per_device_eval_batch_size=7)
    recs = [_Recorder(data), _Recorder(data)]
    ours = RaggedTrainer(
        model,
        _args(tmp_path / "g", **kw),
        train_dataset=data,
        eval_dataset=data,
        max_tokens=80,
        data_collator=recs[0],
        graphs=graphs,
    )
    ref = RaggedTrainer(
        plain,
        _args(tmp_path / "p", **kw, seed=ours.args.seed),
        train_dataset=data,
        eval_dataset=data,
        max_tokens=80,
        data_collator=recs[1],
    )
    ours.train()
    ref.train()
    assert recs[0].batches == recs[1].batches and graphs.num_graphs >= 2
    _assert_same_params(_params(model), _params(plain), rtol=1e-8, atol=1e-10)
    assert ours.evaluate()["eval_loss"] == pytest.approx(ref.evaluate()["eval_loss"], rel=1e-9)
    assert any(not key[1] for key in graphs._graphs)  # evaluation went through the inference buckets


def test_graphs_errors(tmp_path):
    args = _args(tmp_path)
    data = _dataset(4, seed=0)
    with pytest.raises(ValueError, match=r"RaggedTrainer\(\): graphs= needs a model converted by ragged.nn.convert"):
        RaggedTrainer(
            _model(BertForSequenceClassification, seed=5), args, train_dataset=data, max_tokens=8, graphs=True
        )
    model = ragged.nn.convert(_model(BertForSequenceClassification, seed=5))
    other = ragged.nn.convert(_model(BertForSequenceClassification, seed=5))
    with pytest.raises(ValueError, match=r"expected graphs= to be a ragged.nn.Graphed of the trainer's model"):
        RaggedTrainer(model, args, train_dataset=data, max_tokens=8, graphs=ragged.nn.Graphed(other, 64, 4))
    with pytest.raises(TypeError, match=r"expected graphs= to be a bool or a ragged.nn.Graphed, got"):
        RaggedTrainer(model, args, train_dataset=data, max_tokens=8, graphs="yes")


def test_a_datasets_dataset_with_text_columns(tmp_path):
    """A ``datasets.Dataset`` as users pass it: a text column collate cannot take (removed as
    Trainer removes unused columns), lengths read from its input_ids column, then from a length
    column when one exists; the same batches and result as the list of dicts."""
    datasets = pytest.importorskip("datasets")
    items = _dataset(30, seed=107)
    rows = [{**x, "text": " ".join(map(str, x["input_ids"]))} for x in items]
    results = []
    for data in (
        items,
        datasets.Dataset.from_list(rows),
        datasets.Dataset.from_list([{**r, "length": len(r["input_ids"])} for r in rows]),
    ):
        rec = _Recorder(items)
        hf = _model(BertForSequenceClassification, seed=7)
        model = ragged.nn.convert(hf)
        trainer = RaggedTrainer(
            model,
            _args(tmp_path / str(len(results)), num_train_epochs=1, optim="sgd", seed=3),
            train_dataset=data,
            max_tokens=90,
            data_collator=rec,
        )
        trainer.train()
        results.append((rec.batches, _params(model)))
    for batches, params in results[1:]:
        assert batches == results[0][0]
        _assert_same_params(params, results[0][1])


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(_dataset(4, seed=0))


def test_import_ragged_does_not_import_trainer():
    import subprocess
    import sys

    code = (
        "import sys, ragged, ragged.data; "
        "assert 'ragged.integrations.trainer' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_several_gpus_in_one_process_train_on_one(tmp_path):
    """Trainer would wrap the model in torch.nn.DataParallel there, whose scatter splits the
    per-sequence labels but not the RaggedTensor ids (a batch-size mismatch in the loss)."""
    data = _dataset(12, seed=108)
    args = _args(tmp_path)
    args._n_gpu = 2  # what TrainingArguments finds on a two-GPU host without torchrun
    with pytest.warns(UserWarning, match="training on one of them"):
        trainer = RaggedTrainer(
            ragged.nn.convert(_model(BertForSequenceClassification, seed=5)), args, train_dataset=data, max_tokens=64
        )
    assert trainer.args.n_gpu == 1
    assert trainer._wrap_model(trainer.model) is trainer.model  # no DataParallel


def test_graphs_under_ddp_run_inside_ddps_forward(tmp_path):
    """Under DistributedDataParallel (a one-process gloo group here) compute_loss runs the graphs
    inside DDP's forward (where graphed training hands its gradients to DDP's reducer): the loss
    and the reduced gradients equal the eager model's."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    from torch.nn.parallel import DistributedDataParallel

    data = _dataset(6, seed=109)
    hf = _model(BertForSequenceClassification, seed=7)
    plain = ragged.nn.convert(copy.deepcopy(hf))
    model = ragged.nn.convert(hf)
    graphs = ragged.nn.Graphed(model, 256, 16, capture=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        inside = []
        model.register_forward_pre_hook(lambda *_: inside.append(DistributedDataParallel._active_ddp_module is ddp))
        trainer = RaggedTrainer(model, _args(tmp_path), train_dataset=data, max_tokens=64, graphs=graphs)
        batch = collate([data[i] for i in range(len(data))])
        loss = trainer.compute_loss(ddp, dict(batch))
        loss.backward()
        want = plain(**dict(batch)).loss
        want.backward()
        assert inside == [True]
        assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-9)
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-10, msg=name)
    finally:
        dist.destroy_process_group()
