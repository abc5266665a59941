"""ragged.nn.convert on HuggingFace BERT-family models on the GPU: the Triton / CUDA kernels
behind the converted forward, in float16, bfloat16 and float32.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise). The oracle is the
HuggingFace model in float64 (same weights); the converted model in ``dtype`` must be as
close to it as HuggingFace itself in ``dtype``, by flash-attn's rule (tests/test_gpu_attention.py):
its max abs error at real positions is at most twice HuggingFace's plus ``atol`` (relative to
the size of the oracle's values), for outputs, losses and every parameter's gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_convert_cases import FAMILIES, KINDS, _config, _labels, _randomise  # the CPU tests' models

import ragged

tf = pytest.importorskip("transformers")

pytestmark = pytest.mark.gpu

GPU_D, GPU_HEADS = 128, 2  # head dim 64
LENGTHS = [37, 3, 130, 1, 64]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ATOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-3}
GPU_FAMILIES = ["bert", "roberta", "electra", "distilbert"]


def _models(family: str, kind: str, dtype: torch.dtype):
    """(oracle float64, HuggingFace in dtype, converted in dtype), all on the GPU, eval mode."""
    if family == "distilbert":
        over = dict(dim=GPU_D, n_heads=GPU_HEADS, hidden_dim=2 * GPU_D, max_position_embeddings=160)
    else:
        over = dict(
            hidden_size=GPU_D, num_attention_heads=GPU_HEADS, intermediate_size=2 * GPU_D, max_position_embeddings=160
        )
        if family == "electra":
            over["embedding_size"] = 64
    cls = getattr(tf, FAMILIES[family][1] + KINDS[kind])
    oracle = cls(_config(family, kind, **over)).double()
    _randomise(oracle, 11)
    oracle = oracle.cuda().eval()
    if family == "distilbert" and kind == "sequence":
        _keep_relu_off_zero(oracle)
    theirs = copy.deepcopy(oracle).to(dtype)
    ours = ragged.nn.convert(copy.deepcopy(theirs))
    return oracle, theirs, ours


def _keep_relu_off_zero(model) -> None:
    """Shift the biases of DistilBERT's ``pre_classifier`` so that, on the batch of the tests, no
    input of the ReLU after it lies within 5% of its largest value of zero. Near zero a 16-bit
    rounding (HuggingFace's as well as ours) can flip the ReLU's gate, and a flipped gate changes
    every gradient by a large amount: a gradient comparison there measures luck. Both gates stay
    used (the shift keeps roughly half the units off)."""
    ids, mask = _batch()
    z = {}
    hook = model.pre_classifier.register_forward_hook(lambda mod, args, out: z.__setitem__("z", out.detach()))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    hook.remove()
    z = z["z"].reshape(-1, z["z"].shape[-1])  # [B, d]: the first token's pre-activations
    margin = 0.05 * z.abs().max()
    shift = torch.zeros_like(z[0])
    for step in (0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 4.0, -4.0):
        bad = (z + shift).abs().min(0).values < margin
        if not bad.any():
            break
        shift = torch.where(bad, torch.full_like(shift, step) * 2 * margin, shift)
    assert ((z + shift).abs().min(0).values >= margin).all(), "no bias shift keeps the ReLU's inputs off zero"
    with torch.no_grad():
        model.pre_classifier.bias += shift


def _batch(lengths=LENGTHS, seed=12):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(3, 50, (len(lengths), width), generator=g)
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    return ids.masked_fill(mask == 0, 1).cuda(), mask.cuda()


def _close(got, theirs, want, dtype, what):
    """Flash-attn's rule, with a floor of one unit in the last place of ``dtype`` at the
    largest value (a single rounding: HuggingFace's own error in one scalar, a loss, may
    happen to be near 0)."""
    if want.numel() == 0:
        return
    want = want.double()
    ours_err = (got.double() - want).abs().max().item()
    hf_err = (theirs.double() - want).abs().max().item()
    floor = max(ATOL[dtype], torch.finfo(dtype).eps) * max(1.0, want.abs().max().item())
    assert ours_err <= 2 * hf_err + floor, (what, ours_err, hf_err)


def _values(x, mask):
    """The real positions of an output: a RaggedTensor's values, a padded [B, M, ...] output's
    real rows, a [B, ...] output as it is."""
    if isinstance(x, ragged.RaggedTensor):
        return x.values
    if x.dim() >= 2 and x.shape[:2] == mask.shape:
        return x[mask.bool()]
    return x


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_gpu_outputs_match_hf(family, kind, dtype):
    oracle, theirs, ours = _models(family, kind, dtype)
    ids, mask = _batch()
    rt = ragged.pack([row[m.bool()] for row, m in zip(ids, mask)])
    with torch.no_grad():
        want = oracle(input_ids=ids, attention_mask=mask)
        hf = theirs(input_ids=ids, attention_mask=mask)
        for got in (ours(input_ids=ids, attention_mask=mask), ours(input_ids=rt)):
            for key in want.keys():
                _close(_values(got[key], mask), _values(hf[key], mask), _values(want[key], mask), dtype, key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["token", "sequence", "masked_lm"])
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_gpu_training_gradients_match_hf(family, kind, dtype):
    """Train mode (dropout 0), a RaggedTensor input: loss and every parameter's gradient."""
    oracle, theirs, ours = _models(family, kind, dtype)
    ids, mask = _batch()
    labels = {k: v.cuda() for k, v in _labels(kind, LENGTHS, mask.cpu(), 13).items()}
    rt = ragged.pack([row[m.bool()] for row, m in zip(ids, mask)])
    rlabels = {
        k: (ragged.pack([row[m.bool()] for row, m in zip(v, mask)]) if v.dim() == 2 else v) for k, v in labels.items()
    }
    losses = {}
    for name, model in (("oracle", oracle), ("theirs", theirs), ("ours", ours)):
        model.train()
        if name == "ours":
            loss = model(input_ids=rt, **rlabels).loss
        else:
            loss = model(input_ids=ids, attention_mask=mask, **labels).loss
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", GPU_FAMILIES)
def test_gpu_ragged_inference_does_not_sync(family, dtype):
    """A RaggedTensor input in inference reads nothing from the GPU: base model, a token-level
    and a sequence-level head (the packed Q/K/V weights built at the first call and reused)."""
    models = [_models(family, kind, dtype)[2] for kind in ("base", "token", "sequence")]
    rt = ragged.pack([torch.randint(3, 50, (n,), device="cuda") for n in [37, 0, 130, 1, 64]])
    types = rt.with_values(torch.zeros_like(rt.values))
    extra = {} if family == "distilbert" else {"token_type_ids": types}
    with torch.no_grad():
        for model in models:  # first calls: kernel compilation and tuning may read the GPU
            model(input_ids=rt, **extra)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for model in models:
                model(input_ids=rt, **extra)
                model(input_ids=rt, output_hidden_states=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
