"""ragged.integrations.trainer.RaggedTrainer with an empty training dataset: a ValueError that says so, at
construction (where the token-budget batches are planned) and again at ``train()`` for a dataset
set afterwards, instead of an error about ``args.max_steps`` from deep inside ``Trainer``."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

import ragged.nn
from ragged.integrations.trainer import RaggedTrainer


class _Empty(torch.utils.data.Dataset):
    def __len__(self):
        return 0

    def __getitem__(self, i):
        raise IndexError(i)


def _model():
    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    return ragged.nn.convert(BertForSequenceClassification(config))


def _args(tmp_path):
    return TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no"
    )


@pytest.mark.parametrize("empty", [[], _Empty()], ids=["list", "dataset"])
def test_empty_train_dataset_is_refused_at_construction(tmp_path, empty):
    with pytest.raises(
        ValueError,
        match=r"RaggedTrainer\(\): expected a train_dataset with at least one "
        r"sequence, got an empty",
    ):
        RaggedTrainer(_model(), _args(tmp_path), train_dataset=empty, max_tokens=8)


def test_empty_train_dataset_set_later_is_refused_by_train(tmp_path):
    trainer = RaggedTrainer(_model(), _args(tmp_path), train_dataset=[{"input_ids": [3, 4], "labels": 0}], max_tokens=8)
    trainer.train_dataset = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"RaggedTrainer.*expected a train_dataset with at least one sequence"):
            trainer.train()


def test_empty_eval_dataset_is_refused_by_evaluate(tmp_path):
    """Trainer's answer to an empty evaluation set depends on the release (metrics without a loss,
    or an AttributeError on a None batch): RaggedTrainer names the empty dataset on every one."""
    trainer = RaggedTrainer(_model(), _args(tmp_path), eval_dataset=[], max_tokens=8)
    with pytest.raises(
        ValueError,
        match=r"RaggedTrainer\.evaluate\(\): expected an eval_dataset with at least one "
        r"sequence, got an empty list",
    ):
        trainer.evaluate()
    trainer = RaggedTrainer(_model(), _args(tmp_path / "d"), eval_dataset={"a": [], "b": []}, max_tokens=8)
    with pytest.raises(ValueError, match=r"expected an eval_dataset with at least one sequence"):
        trainer.evaluate()
