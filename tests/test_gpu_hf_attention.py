"""attn_implementation="ragged" on the GPU: half-precision models against float32 transformers.

Run with ``pytest -m gpu`` (skipped without CUDA). Error rule as in ``test_gpu_attention.py``
(flash-attn's): the ragged model's max abs error against the float32 sdpa model may be at most
twice that of the sdpa model run in the same half precision, plus ``atol`` (1e-3 of the largest
reference magnitude). It holds for the loss, the logits and every parameter's gradient. The
flattened path runs under ``torch.cuda.set_sync_debug_mode("error")``: no host sync.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from transformers import DataCollatorWithFlattening  # noqa: E402

import ragged  # noqa: E402
import ragged.integrations.transformers  # noqa: E402,F401  (registers "ragged")
from ragged.nn.hf import attention as attn  # noqa: E402

pytestmark = pytest.mark.gpu

VOCAB = 512
ATOL = 1e-3
HALF = [torch.bfloat16, torch.float16]
# ~1k tokens up to 300 long (Triton kernels), and short sequences (the CUDA short-sequence kernel
# forward where "auto" takes it).
LENGTHS = {"long": [1, 7, 64, 130, 257, 300, 33, 200], "short": [1, 17, 64, 100, 33, 7, 128, 2]}
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 64}),
}


def _models(family: str, dtype: torch.dtype, seed: int = 0):
    """(ragged model in dtype, sdpa model in dtype, sdpa model in float32): the same weights."""
    config_cls, model_cls, extra = FAMILIES[family]
    if extra.get("sliding_window") and not attn._window_param(ragged.varlen_attention):
        pytest.skip("ragged.varlen_attention takes no window_size yet")
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.05,
        attention_dropout=0.0,
        **extra,
    )
    torch.manual_seed(seed)
    reference = model_cls(config).cuda().train()
    reference.set_attn_implementation("sdpa")
    baseline = copy.deepcopy(reference).to(dtype)
    model = copy.deepcopy(baseline)
    model.set_attn_implementation("ragged")
    return model, baseline, reference


def _ids(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _cuda(batch):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _check(name, got, baseline, reference):
    reference = reference.detach().float()
    err = (got.detach().float() - reference).abs().max().item()
    base = (baseline.detach().float() - reference).abs().max().item()
    atol = ATOL * max(1.0, reference.abs().max().item()) if reference.numel() else ATOL
    assert err <= 2 * base + atol, f"{name}: ragged error {err:.3g} > 2 x sdpa error {base:.3g} + {atol:.3g}"


def _check_grads(model, baseline, reference):
    grads = {n: p.grad for n, p in reference.named_parameters()}
    scale = max(g.abs().max().item() for g in grads.values())
    for (name, p), (_, b) in zip(model.named_parameters(), baseline.named_parameters()):
        assert p.grad is not None, name
        got, base, ref = p.grad.float(), b.grad.float(), grads[name].float()
        err = (got - ref).abs().max().item()
        base_err = (base - ref).abs().max().item()
        assert err <= 2 * base_err + ATOL * scale, (
            f"{name}: ragged error {err:.3g} > 2 x sdpa error {base_err:.3g} + {ATOL * scale:.3g}"
        )


@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flattened_training_step(family, dtype, lengths):
    """A flattened batch: the ragged model on cu_seq_lens against sdpa on the same tokens with
    packed position ids (transformers builds its block-diagonal mask from them)."""
    model, baseline, reference = _models(family, dtype)
    ids = _ids(LENGTHS[lengths], seed=1)
    batch = _cuda(DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": x} for x in ids]))
    plain = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    got = model(**batch, use_cache=False)
    base = baseline(**plain, use_cache=False)
    ref = reference(**plain, use_cache=False)
    for out in (got, base, ref):
        out.loss.backward()
    _check("loss", got.loss, base.loss, ref.loss)
    _check("logits", got.logits, base.logits, ref.logits)
    _check_grads(model, baseline, reference)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_padded_batch(family, dtype, side):
    model, baseline, reference = _models(family, dtype)
    lengths = [1, 100, 257, 0, 33, 130]
    width = max(lengths)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (len(lengths), width), generator=gen).cuda()
    columns = torch.arange(width)
    mask = torch.stack([columns < n if side == "right" else columns >= width - n for n in lengths]).long().cuda()
    real = mask.bool()
    up = torch.randn(len(lengths), width, VOCAB, generator=gen).cuda()
    outs = []
    for m in (model, baseline, reference):
        logits = m(input_ids=ids, attention_mask=mask, use_cache=False).logits
        (logits.float()[real] * up[real]).sum().backward()
        outs.append(logits[real])
    _check("logits", *outs)
    _check_grads(model, baseline, reference)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_flattened_attention_layer_runs_without_host_sync(backend):
    """One attention layer (projections, rotary embedding, the "ragged" interface), forward and
    backward over ~1k flattened tokens, under sync-debug mode "error"."""
    model, _, _ = _models("llama", torch.bfloat16)
    layer = model.model.layers[0].self_attn
    lengths = LENGTHS["long"]
    batch = _cuda(
        DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": x} for x in _ids(lengths, seed=3)])
    )
    total = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(4)
    hidden = torch.randn(1, total, 256, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(1, total, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
    position_embeddings = model.model.rotary_emb(hidden, batch["position_ids"])
    flat = {k: batch[k] for k in attn._FLAT_KEYS}

    def step():
        with ragged.use_backend(None if backend == "auto" else backend):
            out, _ = layer(
                hidden,
                position_embeddings=position_embeddings,
                attention_mask=None,
                position_ids=batch["position_ids"],
                **flat,
            )
            out.backward(up)
        return out

    step()  # warm up: compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(hidden.grad).all()


def test_flattened_model_forward_runs_without_host_sync():
    """The whole model's forward on a flattened batch, with the model's own defaults (a cache
    is built, so transformers does not look for packed sequences in the position ids)."""
    model, _, _ = _models("qwen2", torch.bfloat16)
    batch = _cuda(
        DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
            [{"input_ids": x} for x in _ids(LENGTHS["long"], seed=5)]
        )
    )
    model.eval()
    with torch.no_grad():
        expected = model(**batch).logits
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = model(**batch).logits
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got, expected)
