"""The loss keyword arguments of converted HuggingFace heads, against the installed transformers.

A head whose HuggingFace forward computes its loss as ``self.loss_function(..., **kwargs)``
(ModernBERT's masked LM and question answering in transformers 5) takes the forward's other
keyword arguments into its loss: ``num_items_in_batch`` (the loss becomes the sum over the
labelled tokens divided by it: what ``Trainer`` passes under gradient accumulation, when it
leaves the loss undivided) and ``ignore_index``. Every other head computes a fixed
cross-entropy (or MSE / BCE) and ignores them. The converted heads must do the same:

* the families declare which heads go through ``loss_function``, checked here against the
  installed transformers' source of every converted head class;
* a direct call with each keyword gives HuggingFace's loss (or its error);
* ``transformers.Trainer`` with gradient accumulation (SGD) trains the converted model as it
  trains the original (losses, gradient norms and weights), for every head of every family;
  ``ragged.integrations.trainer.RaggedTrainer`` too for the masked-LM heads, eagerly and through graphs
  (``ragged.nn.Graphed(capture=False)``, run eagerly on the CPU).

Tiny float64 models (ModernBERT's HuggingFace rotary angles and masked-LM loss are float32,
hence its wider tolerance); no padding in the question-answering batches, whose HuggingFace
softmax spans padding (a documented difference).
"""

from __future__ import annotations

import copy
import inspect
import sys
import warnings

import numpy as np
import pytest
import torch

import ragged
import ragged.nn

tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_convert_cases import _batch, _labels, _randomise
from hf_convert_cases import _config as _bert_like_config

from ragged.data import collate
from ragged.integrations.trainer import RaggedTrainer
from ragged.nn.hf import FAMILIES

VOCAB, PAD = 50, 1
HEADS = {
    "sequence": "ForSequenceClassification",
    "token": "ForTokenClassification",
    "masked_lm": "ForMaskedLM",
    "qa": "ForQuestionAnswering",
}
PREFIX = {
    "bert": "Bert",
    "roberta": "Roberta",
    "xlm-roberta": "XLMRoberta",
    "camembert": "Camembert",
    "electra": "Electra",
    "distilbert": "DistilBert",
    "mpnet": "MPNet",
    "modernbert": "ModernBert",
}
TIGHT = {"rtol": 1e-9, "atol": 1e-11}
LOOSE = {"rtol": 2e-5, "atol": 1e-6}  # ModernBERT: HuggingFace's float32 rotary angles and masked-LM loss


def _config(family: str, kind: str, **over):
    labels = 2 if kind == "qa" else 3
    if family == "mpnet":
        return tf.MPNetConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
            pad_token_id=PAD,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=labels,
            **over,
        )
    if family == "modernbert":
        return tf.ModernBertConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            global_attn_every_n_layers=2,
            local_attention=8,
            max_position_embeddings=64,
            pad_token_id=PAD,
            bos_token_id=2,
            eos_token_id=3,
            cls_token_id=2,
            sep_token_id=3,
            attention_dropout=0.0,
            mlp_dropout=0.0,
            embedding_dropout=0.0,
            classifier_dropout=0.0,
            num_labels=labels,
            attn_implementation="sdpa",
            **over,
        )
    return _bert_like_config(family, kind, **over)


def _pair(family: str, kind: str, seed: int = 0, **over):
    """(converted, HuggingFace original), float64, eval mode, equal weights."""
    hf = getattr(tf, PREFIX[family] + HEADS[kind])(_config(family, kind, **over)).double()
    _randomise(hf, seed)
    hf.eval()
    ours = copy.deepcopy(hf)
    assert ragged.nn.convert(ours) is ours
    return ours, hf


def _tol(family: str) -> dict:
    return LOOSE if family == "modernbert" else TIGHT


def _calls_loss_function(cls: type) -> bool:
    return "self.loss_function(" in inspect.getsource(cls.forward)


# --------------------------------------------------------------------------------------
# The audit: which heads take loss keyword arguments


def test_families_declare_the_heads_huggingface_computes_with_loss_function():
    """Every converted head class of every family: its HuggingFace forward passes its keyword
    arguments to ``self.loss_function`` exactly when the family says so."""
    checked = 0
    for family in FAMILIES.values():
        pytest.importorskip(family.module)
        mod = sys.modules[family.module]
        for suffix, kind in family.kinds.items():
            if kind == "base":
                continue
            cls = getattr(mod, family.prefix + suffix)
            assert _calls_loss_function(cls) == (kind in family.loss_function_heads), (
                f"{cls.__name__}: HuggingFace's loss_function use and {family!r}.loss_function_heads differ"
            )
            checked += 1
    assert checked >= 4 * len(PREFIX)


# --------------------------------------------------------------------------------------
# Direct calls


def _run(model, **kw):
    try:
        return model(**kw).loss
    except (TypeError, ValueError, IndexError, RuntimeError) as err:  # HuggingFace's refusal (ignore_index twice)
        return err


def _same(got, want, tol):
    if isinstance(want, Exception):
        assert type(got) is type(want), f"HuggingFace raised {want!r}, converted gave {got!r}"
        return
    assert not isinstance(got, Exception), f"HuggingFace gave {want}, converted raised {got!r}"
    torch.testing.assert_close(got.double(), want.double(), **tol)


LOSS_KWARGS = [
    {},
    {"num_items_in_batch": 7},
    {"num_items_in_batch": torch.tensor(11)},
    {"ignore_index": 5},
    {"num_items_in_batch": 9, "ignore_index": 5},
    {"reduction": "sum"},
]


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("family", list(PREFIX))
def test_direct_call_with_loss_kwargs_matches_hf(family, kind):
    ours, hf = _pair(family, kind)
    full = [6, 6, 6]  # no padding: the question-answering softmax spans the same tokens on both sides
    for lengths in [full] if kind in ("qa", "sequence") else [full, [4, 1, 9, 6]]:
        ids, mask = _batch(lengths)
        labels = _labels(kind, lengths, mask, seed=3)
        for kw in LOSS_KWARGS:
            if "ignore_index" in kw and lengths != full:
                continue  # labels 5 at padding: HuggingFace counts them, the converted heads skip padding
            given = dict(labels)
            if "ignore_index" in kw and "labels" in given and kind != "sequence":
                # label 5 where the labels say -100: the ignored class under ignore_index=5
                given["labels"] = given["labels"].masked_fill(given["labels"] == -100, 5)
            want = _run(hf, input_ids=ids, attention_mask=mask, **given, **kw)
            got = _run(ours, input_ids=ids, attention_mask=mask, **given, **kw)
            _same(got, want, _tol(family))


@pytest.mark.parametrize("sparse", [False, True])
def test_modernbert_masked_lm_num_items_on_ragged_input(sparse):
    """A RaggedTensor batch (no padding anywhere) and sparse prediction: HuggingFace's loss of
    the padded batch whose labels at padding are -100, divided by ``num_items_in_batch``."""
    ours, hf = _pair("modernbert", "masked_lm", seed=2, sparse_prediction=sparse)
    lengths = [4, 1, 9, 6]
    ids, mask = _batch(lengths)
    labels = _labels("masked_lm", lengths, mask, seed=4)["labels"]
    rt = ragged.pack([row[m.bool()] for row, m in zip(ids, mask)])
    rl = ragged.pack([row[m.bool()] for row, m in zip(labels, mask)])
    for n in (None, 3, torch.tensor(40.0)):
        kw = {} if n is None else {"num_items_in_batch": n}
        want = hf(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss
        torch.testing.assert_close(ours(input_ids=rt, labels=rl, **kw).loss.double(), want.double(), **LOOSE)
        torch.testing.assert_close(
            ours(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss.double(), want.double(), **LOOSE
        )


# --------------------------------------------------------------------------------------
# Trainer with gradient accumulation


def _dataset(kind: str, n: int, seed: int, equal: bool = False) -> list[dict]:
    """Distinct sequences of lengths 2..12 (all 8 with ``equal``) and their labels (token labels
    with some -100, so that micro-batches count different numbers of items)."""
    gen = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = 8 if equal else int(gen.integers(2, 13))
        item = {"input_ids": gen.integers(3, VOCAB, length).tolist()}
        if kind == "sequence":
            item["labels"] = int(gen.integers(0, 3))
        elif kind == "qa":
            item["start_positions"], item["end_positions"] = sorted(int(v) for v in gen.integers(0, length, 2))
        else:
            labels = gen.integers(0, 3 if kind == "token" else VOCAB, length)
            labels[gen.random(length) < 0.4] = -100
            item["labels"] = labels.tolist()
        out.append(item)
    return out


def _pad(features: list[dict]) -> dict:
    """HuggingFace's padded batch: ids padded with the pad id, token labels with -100."""
    width = max(len(f["input_ids"]) for f in features)
    out = {
        "input_ids": torch.tensor([f["input_ids"] + [PAD] * (width - len(f["input_ids"])) for f in features]),
        "attention_mask": torch.tensor(
            [[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features]
        ),
    }
    for key in features[0]:
        if key == "input_ids":
            continue
        values = [f[key] for f in features]
        out[key] = (
            torch.tensor([v + [-100] * (width - len(v)) for v in values])
            if isinstance(values[0], list)
            else torch.tensor(values)
        )
    return out


def _args(path, **kw):
    return tf.TrainingArguments(
        **{
            "output_dir": str(path),
            "report_to": [],
            "optim": "sgd",
            "learning_rate": 0.5,
            "weight_decay": 0.0,
            "lr_scheduler_type": "constant",
            "max_grad_norm": 1e9,
            "gradient_accumulation_steps": 2,
            "per_device_train_batch_size": 3,
            "num_train_epochs": 1,
            "logging_steps": 1,
            "save_strategy": "no",
            "seed": 7,
            "data_seed": 7,
            "use_cpu": True,
            "disable_tqdm": True,
            **kw,
        }
    )


def _history(trainer) -> list[tuple[float, float]]:
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _assert_same_run(ours_model, ours, theirs_model, theirs, tol):
    got, want = _history(ours), _history(theirs)
    assert len(got) == len(want) >= 2
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), **tol)
    a, b = dict(ours_model.named_parameters()), dict(theirs_model.named_parameters())
    assert a.keys() == b.keys()
    for k, value in a.items():
        torch.testing.assert_close(value, b[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("kind", list(HEADS))
@pytest.mark.parametrize("family", list(PREFIX))
def test_trainer_gradient_accumulation_matches_hf(tmp_path, family, kind):
    """Both models through ``transformers.Trainer`` (padded batches, the same order), four
    micro-batches in two SGD steps: the logged losses and gradient norms and the final weights."""
    ours_model, hf_model = _pair(family, kind, seed=1)
    data = _dataset(kind, 12, seed=5, equal=kind == "qa")
    runs = []
    for name, model in (("theirs", hf_model), ("ours", ours_model)):
        model.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = tf.Trainer(model, _args(tmp_path / name), train_dataset=data, data_collator=_pad)
            trainer.train()
        runs.append(trainer)
    assert runs[0].model_accepts_loss_kwargs == runs[1].model_accepts_loss_kwargs
    _assert_same_run(ours_model, runs[1], hf_model, runs[0], _tol(family))


class _Recorder:
    """A collator recording each batch's dataset indices, collating by ragged.data.collate."""

    def __init__(self, data):
        self.index = {tuple(x["input_ids"]): i for i, x in enumerate(data)}
        self.batches = []

    def __call__(self, features):
        self.batches.append([self.index[tuple(f["input_ids"])] for f in features])
        return collate(features)


class _FixedBatches(tf.Trainer):
    """Trainer on the original model, fed the given index batches (padded), in that order."""

    def __init__(self, *a, batches, **kw):
        super().__init__(*a, **kw)
        self.batches = batches

    def get_train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_dataset, batch_sampler=self.batches, collate_fn=_pad)


def _ragged_trainer_run(tmp_path, family, graphs, **over):
    ours_model, hf_model = _pair(family, "masked_lm", seed=3, **over)
    data = _dataset("masked_lm", 16, seed=6)
    rec = _Recorder(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {}
        if graphs:
            kw["graphs"] = ragged.nn.Graphed(ours_model, 128, 16, capture=False)
        ours = RaggedTrainer(
            ours_model, _args(tmp_path / "ours"), train_dataset=data, max_tokens=24, data_collator=rec, **kw
        )
        ours_model.train()
        ours.train()
        assert len(rec.batches) >= 4 and len({len(b) for b in rec.batches}) > 1
        assert not graphs or kw["graphs"].num_graphs >= 1  # the steps ran the bucketed batches
        theirs = _FixedBatches(hf_model, _args(tmp_path / "theirs"), train_dataset=data, batches=rec.batches)
        hf_model.train()
        theirs.train()
    return ours_model, ours, hf_model, theirs


@pytest.mark.parametrize("family", list(PREFIX))
def test_ragged_trainer_masked_lm_matches_hf_trainer(tmp_path, family):
    """The issue's case: a converted masked-LM head under RaggedTrainer (token-budget batches of
    RaggedTensors, gradient accumulation 2, SGD) against Trainer on the original, fed the same
    batches padded."""
    _assert_same_run(*_ragged_trainer_run(tmp_path, family, graphs=False), _tol(family))


@pytest.mark.parametrize("sparse", [False, True])
def test_ragged_trainer_graphs_divide_by_num_items(tmp_path, sparse):
    """Through graphs (which take no ``num_items_in_batch``): the loss of a head that divides by
    it is rescaled to HuggingFace's."""
    _assert_same_run(*_ragged_trainer_run(tmp_path, "modernbert", graphs=True, sparse_prediction=sparse), LOOSE)


def test_graphed_call_runs_a_question_answering_head_eagerly_with_num_items():
    """A head that divides by ``num_items_in_batch`` in a way the graphs' loss cannot be rescaled
    to (question answering: two means) runs eagerly when given it, as HuggingFace computes it."""
    from ragged.integrations.trainer import _GraphedCall

    ours, hf = _pair("modernbert", "qa", seed=4)
    graphs = ragged.nn.Graphed(ours, 128, 16, capture=False)
    ids, mask = _batch([6, 6, 6])
    positions = _labels("qa", [6, 6, 6], mask, seed=5)
    rt = ragged.pack(list(ids))  # the graphs take RaggedTensor batches (no padding here)
    call = _GraphedCall(graphs, ours)
    want = hf(input_ids=ids, attention_mask=mask, **positions, num_items_in_batch=4).loss
    torch.testing.assert_close(call(input_ids=rt, **positions, num_items_in_batch=4).loss, want, **LOOSE)
    assert graphs.num_graphs == 0  # eagerly
    torch.testing.assert_close(
        call(input_ids=rt, **positions).loss, hf(input_ids=ids, attention_mask=mask, **positions).loss, **LOOSE
    )
    assert graphs.num_graphs == 1
