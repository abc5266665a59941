"""What the GPU tests of converted HuggingFace families share (test_gpu_hf_modernbert.py,
test_gpu_hf_mpnet.py): a padded batch, and the three checks — outputs and training gradients
against HuggingFace in float64 by flash-attn's rule (``_close`` of test_gpu_hf_convert.py), and
inference without device reads, graphed equal to eager. A family's test file supplies
``models(kind, dtype) -> (oracle float64, HuggingFace in dtype, converted in dtype)``."""

from __future__ import annotations

import torch
from hf_convert_cases import _labels
from test_gpu_hf_convert import _close, _values

import ragged

LENGTHS = [37, 3, 130, 1, 64]
VOCAB = 50


def batch(lengths=LENGTHS, seed=22):
    """``(ids [B, M], mask [B, M])`` on the GPU, right-padded with id 1."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), width), generator=g)
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    return ids.masked_fill(mask == 0, 1).cuda(), mask.cuda()


def _packed(t, mask):
    return ragged.pack([row[m.bool()] for row, m in zip(t, mask)])


def check_outputs(models, kind, dtype):
    """Every output field, padded and RaggedTensor input, as close to the oracle as HuggingFace's."""
    oracle, theirs, ours = models(kind, dtype)
    ids, mask = batch()
    with torch.no_grad():
        want = oracle(input_ids=ids, attention_mask=mask)
        hf = theirs(input_ids=ids, attention_mask=mask)
        for got in (ours(input_ids=ids, attention_mask=mask), ours(input_ids=_packed(ids, mask))):
            for key in want.keys():
                _close(_values(got[key], mask), _values(hf[key], mask), _values(want[key], mask), dtype, key)


def check_training(models, kind, dtype):
    """Train mode (dropout 0), a RaggedTensor input: the loss and every parameter's gradient."""
    oracle, theirs, ours = models(kind, dtype)
    ids, mask = batch()
    labels = {k: v.cuda() for k, v in _labels(kind, LENGTHS, mask.cpu(), 23).items()}
    if kind == "masked_lm":
        labels["labels"] = labels["labels"].clamp(max=VOCAB - 1)
    rlabels = {k: (_packed(v, mask) if v.dim() == 2 else v) for k, v in labels.items()}
    losses = {}
    for name, model in (("oracle", oracle), ("theirs", theirs), ("ours", ours)):
        model.train()
        loss = (
            model(input_ids=_packed(ids, mask), **rlabels).loss
            if name == "ours"
            else model(input_ids=ids, attention_mask=mask, **labels).loss
        )
        loss.backward()
        losses[name] = loss.detach()
    _close(losses["ours"], losses["theirs"], losses["oracle"], dtype, "loss")
    grads = {n: p.grad for n, p in oracle.named_parameters()}
    hf_grads = {n: p.grad for n, p in theirs.named_parameters()}
    for n, p in ours.named_parameters():
        if grads[n] is None:
            assert p.grad is None or torch.all(p.grad == 0), n
            continue
        _close(p.grad, hf_grads[n], grads[n], dtype, f"d {n}")


def check_no_sync_and_graphs(models):
    """A RaggedTensor input reads nothing from the GPU; a graphed model gives the eager outputs."""
    _, _, ours = models("base", torch.bfloat16)
    rt = ragged.pack([torch.randint(3, VOCAB, (n,), device="cuda") for n in [37, 0, 130, 1, 64]])
    with torch.no_grad():
        want = ours(input_ids=rt).last_hidden_state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ours(input_ids=rt)
            ours(input_ids=rt, output_hidden_states=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graphed = ragged.nn.graphed(ours, max_tokens=512, max_batch_size=8)
        for _ in range(2):  # capture, then replay
            got = graphed(input_ids=rt).last_hidden_state
            assert got.host_lengths() == want.host_lengths()
            torch.testing.assert_close(got.values, want.values, rtol=2e-2, atol=2e-2)
