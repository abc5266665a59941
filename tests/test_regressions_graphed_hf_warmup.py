"""Regressions on the CPU: ragged.nn.graphed never hands a model a position it has no row for;
the sequence layout attn_implementation="ragged" reads from position ids or a padding mask is
never reused after the tensor is written; ragged.warmup leaves the module as it was."""

from __future__ import annotations

import pytest
import torch
from hf_convert_cases import FAMILIES, KINDS, _config, _randomise
from torch import nn

import ragged

tf = pytest.importorskip("transformers")

# --------------------------------------------------------------------------------------
# ragged.nn.graphed: the buckets stay within the model's position table


def _hf(family: str, kind: str = "base", maxpos: int = 100, seed: int = 3):
    """(converted, untouched HuggingFace copy) in float64 with ``maxpos`` position rows."""
    hf = getattr(tf, FAMILIES[family][1] + KINDS[kind])(_config(family, kind, max_position_embeddings=maxpos))
    hf = hf.to(torch.float64)
    _randomise(hf, seed)
    hf.eval()
    import copy

    ours = copy.deepcopy(hf)
    assert ragged.nn.convert(ours) is ours
    return ours, hf


def _longest(family: str, maxpos: int) -> int:
    return maxpos - 2 if family == "roberta" else maxpos  # RoBERTa counts from padding_idx + 1 = 2


def _ids(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return ragged.pack([torch.randint(5, 50, (n,), generator=gen) for n in lengths])


def _poison(g: ragged.nn.Graphed) -> None:
    for buf in g._static_buffers.values():
        if buf.is_floating_point():
            buf.fill_(float("nan"))


def _same_outputs(got, want):
    assert type(got) is type(want)
    for name in want.keys():
        a, b = got[name], want[name]
        if isinstance(b, ragged.RaggedTensor):
            a, b = a.values, b.values
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("maxpos", [100, 37])
def test_graphed_buckets_never_pass_the_position_table(family, maxpos):
    model, _ = _hf(family, "base", maxpos)
    top = _longest(family, maxpos)
    # one token bucket of 256 rows: a small batch leaves well over `maxpos` spare rows
    g = ragged.nn.Graphed(model, 512, 8, token_buckets=[256], capture=False)
    # legal batches whose longest sequence sits in a power-of-two length bucket past the table
    for i, lengths in enumerate(([top - 30 if top > 40 else top - 5, 3], [top, 0, 1], [top - 1] * 2, [1], [0, 2])):
        ids = _ids(lengths, seed=i)
        with torch.no_grad():
            want = model(input_ids=ids)
        g(input_ids=ids)
        _poison(g)
        _same_outputs(g(input_ids=ids), want)
        size = g.bucket(ids.num_tokens, ids.batch_size, ids.max_len)
        assert size is not None and size[2] <= top
    assert g.max_len == top and g.length_buckets[-1] == top and all(b <= top for b in g.length_buckets)


@pytest.mark.parametrize("kind", ["sequence", "token"])
def test_graphed_heads_take_the_base_models_table(kind):
    model, _ = _hf("roberta", kind, 100)
    g = ragged.nn.graphed(model, max_tokens=1024, max_batch_size=4, token_buckets=[512])
    g.capture = False  # the bucketed batch run eagerly: what a graph would replay
    ids = _ids([70, 5, 98], seed=7)
    with torch.no_grad():
        want = model(input_ids=ids)
    _same_outputs(g(input_ids=ids), want)


def test_graphed_refuses_length_buckets_and_batches_past_the_model():
    model, _ = _hf("bert", "base", 100)
    with pytest.raises(
        ValueError,
        match=r"ragged.nn.graphed\(\): expected length_buckets of ints in 1..100 \(the "
        r"longest sequence BertModel takes: .*100 rows\), got \[64, 128\]",
    ):
        ragged.nn.graphed(model, max_tokens=512, max_batch_size=4, length_buckets=[64, 128])
    with pytest.raises(ValueError, match=r"ragged.nn.graphed\(\): expected max_len <= 100, .* got 101"):
        ragged.nn.graphed(model, max_tokens=512, max_batch_size=4, max_len=101)
    g = ragged.nn.Graphed(model, 512, 4, length_buckets=[64, 100], capture=False)
    assert g.length_buckets == (64, 100)
    with pytest.raises(
        ValueError,
        match=r"ragged.nn.Graphed.forward\(\): expected sequences of at most 100 tokens.*"
        r"max_len is 101",
    ):
        g(input_ids=_ids([101, 2], seed=0))
    # a lower max_len of the caller's own, for a module whose table graphed cannot read
    enc = ragged.nn.TransformerEncoder(ragged.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1).eval()
    assert ragged.nn.Graphed(enc, 256, 4, capture=False).max_len is None
    g = ragged.nn.Graphed(enc, 256, 4, capture=False, max_len=50)
    assert g.length_buckets == (16, 32, 50)
    x = ragged.pack([torch.randn(n, 16) for n in (40, 3)])
    assert g.bucket(x.num_tokens, x.batch_size, x.max_len)[2] == 50
    with torch.no_grad():
        torch.testing.assert_close(g(x).values, enc(x).values)
    with pytest.raises(ValueError, match=r"expected sequences of at most 50 tokens"):
        g(ragged.pack([torch.randn(51, 16)]))
    with pytest.raises(ValueError, match=r"ragged.nn.graphed\(\): expected max_len >= 1, got 0"):
        ragged.nn.Graphed(enc, 256, 4, max_len=0)


# --------------------------------------------------------------------------------------
# attn_implementation="ragged": a layout is never reused after its tensor is written

import copy  # noqa: E402

import ragged.integrations.transformers  # noqa: E402,F401  (registers "ragged")
from ragged.nn.hf import attention as attn  # noqa: E402

LLAMA_VOCAB = 97


def _llama_pair(seed=0):
    """(ragged model, sdpa model) in float32 eval mode, the same random weights."""
    config = tf.LlamaConfig(
        vocab_size=LLAMA_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    reference = tf.LlamaForCausalLM(config).float()
    reference.set_attn_implementation("sdpa")
    model = copy.deepcopy(reference)
    model.set_attn_implementation("ragged")
    return model.eval(), reference.eval()


def _flat_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def _per_sequence(reference, ids, lengths):
    """The logits of a flattened row ``ids [1, T]`` of sequences ``lengths``, one sdpa run each."""
    out, start = [], 0
    with torch.no_grad():
        for n in lengths:
            out.append(reference(input_ids=ids[:, start : start + n]).logits[0])
            start += n
    return torch.cat(out)


@pytest.mark.parametrize("write", ["data", "numpy"])  # writes that leave pos._version as it was
def test_position_ids_written_between_forwards_are_read_again(write):
    model, reference = _llama_pair()
    first, second = [5, 1, 14, 9], [9, 11, 1, 8]  # the same 29 tokens, other boundaries
    ids = torch.randint(0, LLAMA_VOCAB, (1, sum(first)), generator=torch.Generator().manual_seed(1))
    pos = _flat_positions(first)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos).logits[0]
    torch.testing.assert_close(got, _per_sequence(reference, ids, first), rtol=1e-5, atol=1e-5)
    new = _flat_positions(second)
    if write == "data":
        pos.data.copy_(new)
    else:
        pos.numpy()[...] = new.numpy()
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos).logits[0]
    torch.testing.assert_close(got, _per_sequence(reference, ids, second), rtol=1e-5, atol=1e-5)
    # the public reader agrees with what the tensor now holds
    assert attn.positions_layout(pos).host == (0, 9, 20, 21, 29)


def test_position_ids_are_read_once_per_forward_and_not_kept_past_their_tensor(monkeypatch):
    """The first layer reads the layout and the later layers of that forward reuse it; attention
    modules without a layer index read it each; nothing outlives the caller's tensor."""
    import gc

    model, reference = _llama_pair()
    assert model.config.num_hidden_layers > 1
    reads, real = [], attn._read_starts
    monkeypatch.setattr(attn, "_read_starts", lambda row: reads.append(1) or real(row))
    lengths = [5, 1, 14, 9]
    ids = torch.randint(0, LLAMA_VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    pos = _flat_positions(lengths)
    with torch.no_grad():
        for _ in range(2):
            reads.clear()
            got = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            assert len(reads) == 1
        torch.testing.assert_close(got, _per_sequence(reference, ids, lengths), rtol=1e-5, atol=1e-5)
        for layer in model.model.layers:
            layer.self_attn.layer_idx = None
        reads.clear()
        again = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    assert len(reads) == model.config.num_hidden_layers
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    key = id(pos)
    assert key in attn._FORWARD_LAYOUTS
    del pos
    gc.collect()
    assert key not in attn._FORWARD_LAYOUTS


def test_a_mask_written_after_its_layout_was_read_is_read_again():
    gen = torch.Generator().manual_seed(2)
    module = torch.nn.Module()
    module.is_causal = True
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    assert attn.mask_layout(mask).host == (0, 3, 8, 9)
    mask.data.copy_(torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert attn.mask_layout(mask).host == (0, 2, 6, 11)
    # the attention function on a caller's 2-D mask, written between two calls
    q, k, v = (torch.randn(3, h, 5, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    for rows in ([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]], [[1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0] * 5]):
        attn.attention_forward(module, q, k, v, mask)
        mask.data.copy_(torch.tensor(rows, dtype=torch.bool))
        out, _ = attn.attention_forward(module, q, k, v, mask)
        for b in range(3):
            n = int(mask[b].sum())
            if n:
                want = torch.nn.functional.scaled_dot_product_attention(
                    q[b : b + 1, :, :n],
                    k[b : b + 1, :, :n].repeat_interleave(2, 1),
                    v[b : b + 1, :, :n].repeat_interleave(2, 1),
                    is_causal=True,
                )
                torch.testing.assert_close(out[b, :n], want[0].transpose(0, 1), rtol=1e-10, atol=1e-12)
            assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))
    # the mask the mask function hands the layers keeps the layout of what it holds
    user = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    handed = attn.padding_mask(2, 6, 6, attention_mask=user)
    user.data.copy_(torch.tensor([[1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool))
    layout = attn.mask_layout(handed)
    assert layout.host == tuple([0, *handed.sum(1).cumsum(0).tolist()])


# --------------------------------------------------------------------------------------
# ragged.warmup leaves the module as it was


class _Net(nn.Module):
    """A ragged encoder layer (dropout), a frozen BatchNorm head in eval mode, one in train mode,
    and a buffer the forward writes through ``.data`` (which bumps no version counter)."""

    def __init__(self):
        super().__init__()
        layer = ragged.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.3, batch_first=True, dtype=torch.float64)
        self.enc = ragged.nn.TransformerEncoder(layer, 1)
        self.frozen = nn.Sequential(nn.Linear(16, 16, dtype=torch.float64), nn.BatchNorm1d(16, dtype=torch.float64))
        self.frozen.eval().requires_grad_(False)
        self.norm = nn.BatchNorm1d(16, dtype=torch.float64)
        self.scale = nn.Parameter(torch.ones(16, dtype=torch.float64))
        self.register_buffer("calls", torch.zeros(16, dtype=torch.float64))
        self.fail_on = None  # "train" / "eval": raise in that mode after the state has changed

    def forward(self, x):
        h = self.enc(x).values
        h = self.norm(self.frozen(h)) * self.scale
        self.calls.data.add_(1.5)
        if self.fail_on == ("train" if self.training else "eval"):
            raise RuntimeError("the forward fails")
        return x.with_values(h)


def _state(net):
    tensors = {k: v.detach().clone() for k, v in net.state_dict(keep_vars=True).items()}
    flags = {name: m.training for name, m in net.named_modules()}
    grads = {
        name: (p.grad, None if p.grad is None else p.grad.clone(), p.requires_grad)
        for name, p in net.named_parameters()
    }
    return tensors, flags, grads


def _assert_state(net, before):
    tensors, flags, grads = before
    now = {k: v.detach() for k, v in net.state_dict(keep_vars=True).items()}
    assert now.keys() == tensors.keys()
    for k, v in tensors.items():
        assert now[k].dtype == v.dtype and torch.equal(now[k], v), k
    assert {name: m.training for name, m in net.named_modules()} == flags
    for name, p in net.named_parameters():
        ref, values, requires = grads[name]
        assert p.grad is ref and p.requires_grad == requires, name
        if values is not None:
            assert torch.equal(p.grad, values), name


def _net():
    torch.manual_seed(0)
    net = _Net().train()
    net.frozen.eval()
    # gradients from an earlier step: one kept, one None
    net.enc.layers[0].linear1.weight.grad = torch.randn_like(net.enc.layers[0].linear1.weight)
    net.scale.grad = None
    return net


@pytest.mark.parametrize("training", [True, False])
def test_warmup_leaves_flags_buffers_parameters_and_gradients(training):
    net = _net()
    x = ragged.pack([torch.randn(n, 16, dtype=torch.float64) for n in (3, 1, 7, 0, 5)])
    before = _state(net)
    rng = torch.random.get_rng_state()
    times = ragged.warmup(net, x, training=training)
    assert set(times) == ({"inference", "training"} if training else {"inference"})
    _assert_state(net, before)
    assert torch.equal(torch.random.get_rng_state(), rng)
    # the module still computes what it computed before the warm-up
    twin = _net()
    torch.manual_seed(5)
    want = twin(x).values
    torch.manual_seed(5)
    torch.testing.assert_close(net(x).values, want, rtol=0, atol=0)


@pytest.mark.parametrize("fail_on", ["eval", "train"])
def test_warmup_that_raises_leaves_the_module(fail_on):
    net = _net()
    net.fail_on = fail_on
    x = ragged.pack([torch.randn(n, 16, dtype=torch.float64) for n in (4, 2)])
    before = _state(net)
    rng = torch.random.get_rng_state()
    with pytest.raises(RuntimeError, match="the forward fails"):
        ragged.warmup(net, x, training=True)
    _assert_state(net, before)
    assert torch.equal(torch.random.get_rng_state(), rng)


class _Swapping(nn.Module):
    """A forward that replaces a Parameter, registers a buffer and flips requires_grad."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8, dtype=torch.float64)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        y = self.lin(x)
        self.lin.weight = nn.Parameter(self.lin.weight.detach() * 2)
        self.register_buffer("cache", y.detach())
        self.steps += 1
        self.lin.bias.requires_grad_(False)
        return y


def test_warmup_puts_back_replaced_parameters_and_added_buffers():
    torch.manual_seed(1)
    net = _Swapping()
    weight, bias = net.lin.weight, net.lin.bias
    before = _state(net)
    ragged.warmup(net, torch.randn(5, 8, dtype=torch.float64), training=True)
    assert net.lin.weight is weight and net.lin.bias is bias and bias.requires_grad
    assert "cache" not in net._buffers
    _assert_state(net, before)


# --------------------------------------------------------------------------------------
# ragged.nn.graphed over a converted SentenceTransformer: the same limit on its model

pytest.importorskip("sentence_transformers")
from test_hf_sentence import MAXLEN, _st, folders, transformers_  # noqa: E402,F401  (fixtures)


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_graphed_sentence_transformer_buckets_stay_in_the_table(transformers_, family):  # noqa: F811
    _, ours = _st(transformers_, family)
    model = ours[0]._modules["model"]
    top = MAXLEN  # the CPU tests' RoBERTa has MAXLEN + 2 rows and padding_idx 0: positions 1..MAXLEN + 1
    if family == "roberta":
        top = MAXLEN + 1
    with pytest.raises(ValueError, match=rf"expected length_buckets of ints in 1..{top} \(the longest sequence"):
        ragged.nn.graphed(ours, max_tokens=1024, max_batch_size=8, length_buckets=[16, 2 * MAXLEN])
    assert ragged.nn.graphed(ours, max_tokens=1024, max_batch_size=8, token_buckets=[512]) is ours
    g = ours[0].forward.graphed
    assert g.max_len == top and g.length_buckets[-1] == top
    g.capture = False  # what the graphs replay, run eagerly on the CPU
    gen = torch.Generator().manual_seed(11)
    ids = ragged.pack([torch.randint(5, 60, (n,), generator=gen) for n in (top, 40, 1, 0)])
    with torch.no_grad():
        want = model(input_ids=ids, return_dict=True)
    got = g(input_ids=ids, return_dict=True)
    torch.testing.assert_close(got["last_hidden_state"].values, want["last_hidden_state"].values, rtol=1e-9, atol=1e-9)
