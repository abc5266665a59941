"""A converted decoder on TRL's padding-free batches (SFTTrainer(padding_free=True)'s collator):
the same logits and loss as the unconverted model under attn_implementation="ragged"."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from test_decoder_convert import TOL, _pair  # noqa: E402

import ragged.integrations.transformers  # noqa: E402,F401  (registers "ragged")
import ragged.nn  # noqa: E402


def test_trl_padding_free_batches():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    ref, _ = _pair("llama")
    ref.set_attn_implementation("ragged")
    mine = ragged.nn.convert(copy.deepcopy(ref))
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, return_position_ids=True)
    g = torch.Generator().manual_seed(2)
    batch = collate([{"input_ids": torch.randint(1, 90, (n,), generator=g).tolist()} for n in (6, 1, 11, 3)])
    assert batch["input_ids"].shape[0] == 1 and "cu_seq_lens_q" in batch
    for train in (False, True):
        ref.train(train), mine.train(train)
        want = ref(**batch)
        got = mine(**batch)
        torch.testing.assert_close(got.loss.float(), want.loss.float(), **TOL)
        if not train:
            torch.testing.assert_close(got.logits, want.logits, **TOL)
        else:
            assert got.logits is None


def test_sft_trainer_example_trains_a_converted_model(capsys):
    """examples/sft_with_trl.py --convert: SFTTrainer(padding_free=True) on ragged.nn.convert of
    the model (TRL's defaults, autocast included): the padding-free loss of a batch equals the
    per-sequence one before training, and a few steps run."""
    import pathlib
    import runpy

    # TRL's trainer needs accelerate >= 1.10.1 (its requirement); the oldest-releases stage of the
    # tests installs an older one for transformers' sake
    pytest.importorskip("accelerate", minversion="1.10.1")

    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "sft_with_trl.py"
    main = runpy.run_path(str(script), run_name="sft_with_trl")["main"]
    assert main(["--cpu", "--steps", "4", "--examples", "64", "--batch", "8", "--convert"]) == 0
    assert "padding-free loss vs per-sequence losses" in capsys.readouterr().out
