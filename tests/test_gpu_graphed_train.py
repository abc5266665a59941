"""Training through ragged.nn.graphed on the GPU: forward and backward captured per bucket and
replayed, against the eager module over several optimizer steps (bf16 / fp16 / fp32; AdamW
foreach and fused, gradient clipping, accumulation, autocast with GradScaler, evaluation in
between), dropout drawing new masks every replay (reproducible under torch.manual_seed; the
attention kernels' seed read on the device), no host sync on a replayed step, the errors.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ragged
from ragged.nn import layer_graphs

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

D, HEADS = 256, 4
TOL = {torch.bfloat16: 4e-2, torch.float16: 1e-2, torch.float32: 1e-3}
BATCHES = [[5, 0, 1, 9], [31, 2, 17], [100, 3, 250, 1, 64, 7, 7], [12] * 20, [5, 1, 9, 3], [40, 2, 17]]


def _encoder(dtype, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    layer = ragged.nn.TransformerEncoderLayer(
        D, HEADS, 4 * D, dropout=dropout, activation="gelu", batch_first=True, device="cuda", dtype=dtype
    )
    return ragged.nn.TransformerEncoder(layer, 2).train()


def _batch(lengths, dtype, seed=1, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = ragged.pack([torch.randn(n, D, generator=g, device="cuda", dtype=dtype) for n in lengths])
    return x.with_values(x.values.requires_grad_(grad))


def _close(got, want, tol, what="", floor=1e-6):
    scale = want.float().abs().max().item() + floor
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} over {tol * scale:.3g}"


def _bert(dtype, dropout=0.0, labels=3):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        num_labels=labels,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return ragged.nn.convert(BertForSequenceClassification(cfg).to("cuda", dtype)).train()


def _ids(lengths, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = ragged.pack([torch.randint(5, 1000, (n,), generator=g, device="cuda") for n in lengths])
    labels = torch.randint(0, 3, (len(lengths),), generator=g, device="cuda")
    return ids, labels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_graphed_encoder_training_matches_eager(dtype):
    enc = _encoder(dtype)
    mine = copy.deepcopy(enc)
    g = ragged.nn.graphed(mine, max_tokens=1024, max_batch_size=32)
    for epoch in range(2):
        for seed, lengths in enumerate(BATCHES):
            x, y = _batch(lengths, dtype, seed, grad=True), _batch(lengths, dtype, seed, grad=True)
            with layer_graphs.off():  # eager: each layer run as it is, not from its own graphs
                want = enc(x)
                (want.values.float() ** 2).mean().backward()
            got = g(y)
            (got.values.float() ** 2).mean().backward()
            _close(got.values, want.values, TOL[dtype], "output")
            _close(y.values.grad, x.values.grad, TOL[dtype], "input gradient")
            for (n, p), q in zip(enc.named_parameters(), mine.parameters()):
                _close(q.grad, p.grad, TOL[dtype], n, floor=1e-5)  # LayerNorm weights' gradients are near 0
            enc.zero_grad(set_to_none=True)
            mine.zero_grad(set_to_none=epoch == 0)  # None, then zeroed in place: both reach the graphs
        if epoch == 0:
            captured = g.num_graphs
    assert g.num_graphs == captured >= 3  # the second epoch replays
    mem = g.memory()
    assert mem["graphs"] > 0 and mem["gradients"] == sum(p.numel() * p.element_size() for p in mine.parameters())


@pytest.mark.parametrize(
    "dtype,fused",
    [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
    ids=["fp32-foreach", "fp32-fused", "bf16-fused"],
)
def test_converted_bert_training_trajectory_matches_eager(dtype, fused):
    model = _bert(dtype)
    mine = copy.deepcopy(model)
    g = ragged.nn.graphed(mine, max_tokens=2048, max_batch_size=8)
    opts = [
        torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True) for m in (model, mine)
    ]
    for step in range(8):
        ids, labels = _ids([[7, 1, 19, 3, 11], [64, 2], [5] * 8, [128, 1, 30]][step % 4], step)
        losses = []
        for m, opt in zip((model, g), opts):
            out = m(input_ids=ids, labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in opt.param_groups[0]["params"]], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.detach().float())
            assert out.logits.shape == (ids.batch_size, 3)
        _close(losses[1], losses[0], TOL[dtype] * 2, f"step {step} loss")
    for (n, p), q in zip(model.named_parameters(), mine.parameters()):
        # floor: Adam moves every parameter by about lr a step, also the key biases, whose true
        # gradient is zero (the softmax ignores them) and whose updates follow rounding noise
        _close(q, p, TOL[dtype], n, floor=8e-3)


def test_accumulation_and_the_order_of_backwards():
    model = _bert(torch.float32)
    mine = copy.deepcopy(model)
    g = ragged.nn.graphed(mine, max_tokens=2048, max_batch_size=8)
    micro = [_ids([7, 1, 19], 1), _ids([64, 2, 5, 5], 2), _ids([3, 3], 3)]
    for ids, labels in micro:  # eager accumulates over three micro-batches; so do the graphs
        model(input_ids=ids, labels=labels).loss.backward()
        g(input_ids=ids, labels=labels).loss.backward()
    for (n, p), q in zip(model.named_parameters(), mine.parameters()):
        _close(q.grad, p.grad, 1e-3, n)
    a = g(input_ids=micro[0][0], labels=micro[0][1]).loss
    b = g(input_ids=micro[1][0], labels=micro[1][1]).loss
    with pytest.raises(RuntimeError, match="backward of a training forward whose saved activations a later forward"):
        a.backward()
    b.backward()
    with pytest.raises(RuntimeError):
        b.backward()  # once


def test_parameter_hooks_get_the_gradients_through_autograd():
    """Parameters with gradient hooks: the graphs hand the gradients to autograd, whose
    accumulation runs the hooks; ``torch.autograd.grad`` gets them too, and accumulation over
    micro-batches equals eager."""
    model = _bert(torch.float32)
    mine = copy.deepcopy(model)
    seen: dict[str, int] = {}
    for n, q in mine.named_parameters():
        q.register_post_accumulate_grad_hook(lambda t, n=n: seen.__setitem__(n, seen.get(n, 0) + 1))
    g = ragged.nn.graphed(mine, max_tokens=2048, max_batch_size=8)
    micro = [_ids([7, 1, 19], 1), _ids([64, 2, 5, 5], 2), _ids([9, 30], 3), _ids([5, 1, 20], 4)]
    for ids, labels in micro:
        model(input_ids=ids, labels=labels).loss.backward()
        g(input_ids=ids, labels=labels).loss.backward()
    for (n, p), q in zip(model.named_parameters(), mine.parameters()):
        _close(q.grad, p.grad, 1e-3, n)
        assert seen[n] == len(micro), n
    assert g.num_graphs >= 1
    ids, labels = micro[1]
    want = torch.autograd.grad(model(input_ids=ids, labels=labels).loss, list(model.parameters()))
    got = torch.autograd.grad(g(input_ids=ids, labels=labels).loss, list(mine.parameters()))
    for (n, _), a, b in zip(model.named_parameters(), got, want):
        _close(a, b, 1e-3, n)


def test_dropout_draws_new_masks_reproducibly():
    g = ragged.nn.graphed(_bert(torch.float32, dropout=0.1), max_tokens=2048, max_batch_size=8)
    ids, labels = _ids([50, 7, 19, 3, 11], 5)
    g(input_ids=ids, labels=labels).loss.backward()  # captures
    losses = []
    for seed in (1, 2, 1):
        torch.manual_seed(seed)
        out = g(input_ids=ids, labels=labels)
        out.loss.backward()
        losses.append(out.loss.item())
    assert losses[0] != losses[1] and losses[0] == losses[2]


def test_attention_seed_is_drawn_on_the_device_in_a_graph():
    from ragged.kernels.triton import attention as ka
    from ragged.ops.attention import AttentionArgs, dropout_seed

    torch.manual_seed(0)
    lengths = [50, 7, 128, 1]
    cu = torch.tensor([0, 50, 57, 185, 186], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    args = AttentionArgs(
        q=q, k=k, v=v, cu_q=cu, cu_k=cu, max_q=128, max_k=128, causal=False, scale=0.125, dropout_p=0.25, seed=7
    )
    for _ in range(2):
        ka.forward(args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seed = dropout_seed(0.25, q.device)
        out = ka.forward(args._replace(seed=seed)).out
    assert isinstance(seed, torch.Tensor)
    seen = set()
    for _ in range(3):
        graph.replay()
        s = int(seed.item())
        want = ka.forward(args._replace(seed=s)).out
        assert torch.equal(out, want)
        seen.add(s)
    assert len(seen) == 3
    # the keep fraction of the kernels' mask for those seeds
    keep = ka.dropout_keep_mask(s, 0.25, cu, 4, sum(lengths), 128, q.device)
    assert abs(keep.float().mean().item() - 0.75) < 0.01


def test_autocast_gradscaler_and_evaluation_in_between():
    model = _bert(torch.float32)
    mine = copy.deepcopy(model)
    g = ragged.nn.graphed(mine, max_tokens=2048, max_batch_size=8)
    scalers = [torch.amp.GradScaler("cuda"), torch.amp.GradScaler("cuda")]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, mine)]
    for step in range(4):
        ids, labels = _ids([[7, 1, 19], [64, 2, 5]][step % 2], step)
        losses = []
        for m, opt, scaler, net in zip((model, g), opts, scalers, (model, mine)):
            net.train()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = m(input_ids=ids, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach().float())
            net.eval()
            with torch.no_grad():
                losses.append(m(input_ids=ids, labels=labels).loss.float())
        _close(losses[2], losses[0], 2e-2, f"step {step} train loss")
        _close(losses[3], losses[1], 2e-2, f"step {step} eval loss")
    assert any(k[1] for k in g._graphs) and any(not k[1] for k in g._graphs)


def test_replayed_step_does_not_sync_and_large_batches_run_eagerly():
    g = ragged.nn.graphed(_encoder(torch.bfloat16), max_tokens=256, max_batch_size=8)
    x = _batch([5, 30, 9], torch.bfloat16, 3)
    g(x).values.float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g(x).values.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = g(_batch([200, 100], torch.bfloat16, 4))
    assert any("over the largest bucket" in str(w.message) for w in caught)
    out.values.float().sum().backward()


def test_checkpoint_load_and_in_place_updates_reach_the_graphs(tmp_path):
    model = _bert(torch.float32)
    g = ragged.nn.graphed(model, max_tokens=2048, max_batch_size=8)
    ids, labels = _ids([7, 1, 19, 3], 8)
    path = tmp_path / "start.pt"
    torch.save(model.state_dict(), path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):  # the graphs are captured, and the weights move
        g(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict(torch.load(path))  # copies into the same parameters
    fresh = _bert(torch.float32)  # the saved weights, run eagerly
    fresh.load_state_dict(torch.load(path))
    got = g(input_ids=ids, labels=labels).loss
    want = fresh(input_ids=ids, labels=labels).loss
    _close(got.detach(), want.detach(), 1e-4, "loss after load_state_dict")
    got.backward()
    want.backward()
    for (n, p), q in zip(fresh.named_parameters(), model.parameters()):
        _close(q.grad, p.grad, 1e-3, n)


def test_ragged_trainer_with_graphs_matches_without(tmp_path):
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from ragged.integrations.trainer import RaggedTrainer

    gen = torch.Generator().manual_seed(9)
    data = [
        {"input_ids": torch.randint(5, 1000, (int(n),), generator=gen).tolist(), "labels": int(n) % 3}
        for n in torch.randint(1, 120, (64,), generator=gen)
    ]
    params = []
    for graphs in (False, True):
        model = _bert(torch.float32)
        args = TrainingArguments(
            str(tmp_path / str(graphs)),
            num_train_epochs=1,
            learning_rate=1e-3,
            gradient_accumulation_steps=2,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            logging_strategy="no",
        )
        trainer = RaggedTrainer(model, args, train_dataset=data, max_tokens=512, max_batch_size=16, graphs=graphs)
        trainer.train()
        if graphs:
            assert trainer._graphs.num_graphs >= 2
        params.append(dict(model.named_parameters()))
    for n, p in params[0].items():
        _close(params[1][n].detach(), p.detach(), 1e-3, n, floor=1e-2)
