"""RaggedTrainer with captured graphs (``graphs=True``) on a converted masked-LM head whose
HuggingFace loss divides by ``num_items_in_batch`` (ModernBERT's): the graphs take no such
argument, and the trainer rescales their mean loss; the run must match the eager one (which
passes it) under gradient accumulation. BERT's masked LM, whose loss ignores it, alongside.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

tf = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import ragged.nn
from ragged.integrations.trainer import RaggedTrainer


def _model(family: str, seed: int):
    torch.manual_seed(seed)
    if family == "modernbert":
        config = tf.ModernBertConfig(
            vocab_size=500,
            hidden_size=128,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=2,
            global_attn_every_n_layers=2,
            local_attention=16,
            max_position_embeddings=256,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=3,
            cls_token_id=2,
            sep_token_id=3,
            attention_dropout=0.0,
            mlp_dropout=0.0,
            embedding_dropout=0.0,
        )
        model = tf.ModernBertForMaskedLM(config)
    else:
        config = tf.BertConfig(
            vocab_size=500,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=256,
            max_position_embeddings=256,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = tf.BertForMaskedLM(config)
    return ragged.nn.convert(model.cuda().float())


@pytest.mark.parametrize("family", ["modernbert", "bert"])
def test_gpu_graphed_masked_lm_loss_matches_eager(tmp_path, family):
    gen = torch.Generator().manual_seed(3)
    data = []
    for n in torch.randint(4, 100, (48,), generator=gen).tolist():
        labels = torch.randint(5, 500, (n,), generator=gen)
        labels[torch.rand(n, generator=gen) < 0.7] = -100
        data.append({"input_ids": torch.randint(5, 500, (n,), generator=gen).tolist(), "labels": labels.tolist()})
    runs = []
    for graphs in (False, True):
        model = _model(family, seed=5)
        args = tf.TrainingArguments(
            str(tmp_path / str(graphs)),
            num_train_epochs=1,
            learning_rate=0.5,
            optim="sgd",
            gradient_accumulation_steps=2,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            logging_steps=1,
            max_grad_norm=1e9,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = RaggedTrainer(model, args, train_dataset=data, max_tokens=512, max_batch_size=16, graphs=graphs)
            trainer.train()
        if graphs:
            assert trainer._graphs.num_graphs >= 2
        runs.append(
            (
                [h["loss"] for h in trainer.state.log_history if "loss" in h],
                [h["grad_norm"] for h in trainer.state.log_history if "loss" in h],
                {n: p.detach().clone() for n, p in model.named_parameters()},
            )
        )
    (loss0, norm0, p0), (loss1, norm1, p1) = runs
    assert len(loss0) == len(loss1) >= 3
    torch.testing.assert_close(torch.tensor(loss1), torch.tensor(loss0), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(torch.tensor(norm1), torch.tensor(norm0), rtol=1e-3, atol=1e-4)
    for n, p in p0.items():
        torch.testing.assert_close(p1[n], p, rtol=1e-3, atol=1e-3, msg=lambda m, n=n: f"{n}: {m}")
