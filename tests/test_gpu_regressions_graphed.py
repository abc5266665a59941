"""Regressions on the GPU: ragged.nn.graphed over converted HuggingFace models (and a converted
SentenceTransformer) whose position table is not a power of two: every bucket stays within it,
replays equal the eager model for batches up to the longest sequence the model takes, and no
device-side assert fires; length buckets and batches past the table are refused on the host.
Also ragged.warmup on CUDA modules: their random state, parameters, buffers and gradients are
left as they were.

Run with ``pytest -m gpu`` on a machine with CUDA (skipped otherwise)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ragged

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

tf = pytest.importorskip("transformers")

from hf_convert_cases import FAMILIES, KINDS, _config, _randomise  # noqa: E402

MAXPOS = 100  # not a power of two: the default length buckets run 16, 32, 64, 128, ...
TOL = {torch.bfloat16: 3e-2, torch.float32: 2e-4}


def _longest(family: str, maxpos: int = MAXPOS) -> int:
    return maxpos - 2 if family == "roberta" else maxpos  # RoBERTa counts from padding_idx + 1 = 2


def _hf(family: str, kind: str, dtype, maxpos: int = MAXPOS):
    """A converted HuggingFace model (head dim 64) with ``maxpos`` position rows, on the GPU."""
    over = (
        dict(dim=128, n_heads=2, hidden_dim=256)
        if family == "distilbert"
        else dict(hidden_size=128, num_attention_heads=2, intermediate_size=256)
    )
    hf = getattr(tf, FAMILIES[family][1] + KINDS[kind])(_config(family, kind, max_position_embeddings=maxpos, **over))
    _randomise(hf, 3)
    hf = hf.to("cuda", dtype).eval()
    return ragged.nn.convert(hf)


def _close(got: torch.Tensor, want: torch.Tensor, dtype, what: str) -> None:
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), what
    scale = want.float().abs().max().item() + 1e-6
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * scale, f"{what}: max abs error {err:.3g} over {TOL[dtype] * scale:.3g}"


def _ids(lengths, gen):
    return ragged.pack([torch.randint(5, 50, (n,), generator=gen, device="cuda") for n in lengths])


def _batches(top: int):
    # longest sequences in a power-of-two bucket past the table (70 -> 128), at the table's end,
    # one under it, with empty and one-token sequences; odd sizes throughout
    return ([70, 3], [top], [top, 0, 1], [top - 1] * 3, [65, 33, 17, 9, 5, 1, 0], [1], [0, 2], [top, top, top, 7])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("token_buckets", [None, [1024]], ids=["default", "one-bucket"])
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("kind", ["base", "sequence", "token"])
def test_graphed_replays_equal_eager_up_to_the_longest_sequence(kind, family, token_buckets, dtype):
    model = _hf(family, kind, dtype)
    top = _longest(family)
    # one bucket of 1024 rows: hundreds of spare rows, whose positions run to the bucket's length
    g = ragged.nn.graphed(model, max_tokens=1024, max_batch_size=8, token_buckets=token_buckets)
    assert g.max_len == top and g.length_buckets[-1] == top and all(b <= top for b in g.length_buckets)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for i, lengths in enumerate(_batches(top)):
        ids = _ids(lengths, gen)
        with torch.no_grad():
            want = model(input_ids=ids)
        for _ in range(2):  # the capture, then a replay
            got = g(input_ids=ids)
            torch.cuda.synchronize()  # a device-side assert in the graph would surface here
            assert type(got) is type(want)
            for name in want.keys():
                a, b = got[name], want[name]
                if isinstance(b, ragged.RaggedTensor):
                    assert a.offsets is ids.offsets
                    a, b = a.values, b.values
                _close(a, b, dtype, f"{lengths} {name}")
    assert g.num_graphs >= 2
    torch.cuda.synchronize()


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_buckets_and_batches_past_the_table_are_refused_on_the_host(family):
    model = _hf(family, "base", torch.float32)
    top = _longest(family)
    with pytest.raises(ValueError, match=rf"expected length_buckets of ints in 1..{top} \(the longest sequence"):
        ragged.nn.graphed(model, max_tokens=1024, max_batch_size=8, length_buckets=[32, 64, 128, 256])
    with pytest.raises(ValueError, match=rf"expected max_len <= {top}"):
        ragged.nn.graphed(model, max_tokens=1024, max_batch_size=8, max_len=top + 1)
    # custom buckets inside the table, one of them its end
    g = ragged.nn.graphed(
        model, max_tokens=1024, max_batch_size=8, length_buckets=[24, 80, top], token_buckets=[512, 1024]
    )
    assert g.length_buckets == (24, 80, top)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for lengths in ([81, 2], [top, 1], [23], [24, 25]):
        ids = _ids(lengths, gen)
        with torch.no_grad():
            want = model(input_ids=ids).last_hidden_state.values
        _close(g(input_ids=ids).last_hidden_state.values, want, torch.float32, str(lengths))
    with pytest.raises(ValueError, match=rf"expected sequences of at most {top} tokens"):
        g(input_ids=_ids([top + 1, 3], gen))
    torch.cuda.synchronize()  # nothing was launched out of bounds: the context is intact
    assert torch.ones(3, device="cuda").sum().item() == 3


def test_graphed_sentence_transformer_with_a_short_position_table(tmp_path):
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as M
    from test_hf_sentence import LONG, TEXTS, VOCAB, WORDS

    texts = TEXTS + [LONG * 2, " ".join(WORDS[:70]), " ".join(WORDS[:90]), "x"]
    for family in ("bert", "roberta", "distilbert"):
        path = tmp_path / family
        path.mkdir()
        # RoBERTa's positions count from padding_idx + 1 = 1 here: it takes MAXPOS - 1 tokens
        longest = MAXPOS - 1 if family == "roberta" else MAXPOS
        (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
        tf.BertTokenizerFast(str(path / "vocab.txt"), model_max_length=longest).save_pretrained(str(path))
        if family == "distilbert":
            config = tf.DistilBertConfig(
                vocab_size=len(VOCAB),
                dim=128,
                n_layers=2,
                n_heads=2,
                hidden_dim=256,
                max_position_embeddings=MAXPOS,
                dropout=0.0,
                attention_dropout=0.0,
                pad_token_id=0,
            )
        else:
            cls = tf.RobertaConfig if family == "roberta" else tf.BertConfig
            config = cls(
                vocab_size=len(VOCAB),
                hidden_size=128,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=256,
                max_position_embeddings=MAXPOS,
                type_vocab_size=2,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                pad_token_id=0,
            )
        torch.manual_seed(11)
        tf.AutoModel.from_config(config).save_pretrained(str(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = M.Transformer(str(path))
        st = SentenceTransformer(modules=[tr, M.Pooling(tr.get_embedding_dimension(), "mean")], device="cuda").eval()
        ragged.nn.convert(st)
        eager = st.encode(texts, batch_size=4, convert_to_tensor=True)
        with pytest.raises(ValueError, match="expected length_buckets of ints in"):
            ragged.nn.graphed(st, max_tokens=1024, max_batch_size=8, length_buckets=[64, 128])
        assert ragged.nn.graphed(st, max_tokens=1024, max_batch_size=8, token_buckets=[512, 1024]) is st
        assert st[0].forward.graphed.max_len == longest
        got = st.encode(texts, batch_size=4, convert_to_tensor=True)
        torch.cuda.synchronize()
        assert st[0].forward.graphed.num_graphs >= 1
        _close(got, eager, torch.float32, f"{family} sentence embeddings")


# --------------------------------------------------------------------------------------
# ragged.warmup on CUDA modules


class _ListNet(nn.Module):
    """Takes a list (no top-level tensor argument): its device is known from its parameters."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)

    def forward(self, xs):
        return self.drop(self.norm(self.lin(xs[0])))


def test_warmup_restores_the_cuda_state_of_the_modules_device():
    torch.manual_seed(0)
    net = _ListNet().cuda().train()
    net.lin.weight.grad = torch.randn_like(net.lin.weight)
    grad, grad_values = net.lin.weight.grad, net.lin.weight.grad.clone()
    before = {k: v.detach().clone() for k, v in net.state_dict().items()}
    example = [torch.randn(8, 16, device="cuda")]  # drawn before the states are read
    cuda_rng, cpu_rng = torch.cuda.get_rng_state(), torch.random.get_rng_state()
    ragged.warmup(net, example, training=True)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)  # dropout's draws on the GPU
    assert torch.equal(torch.random.get_rng_state(), cpu_rng)
    for k, v in net.state_dict().items():  # BatchNorm's running statistics and count
        assert torch.equal(v, before[k]), k
    assert net.training and net.lin.weight.grad is grad and torch.equal(grad, grad_values)
    assert net.lin.bias.grad is None


def test_graphs_captured_from_two_threads_at_once():
    """Two graphed models on one GPU asked to capture from two threads at the same time (python
    -m ragged.embed --devices runs a thread per GPU; two models may share one): each capture has
    its own stream (torch.cuda.graph's default capture stream is one per process, and a capture
    begun on a stream that is capturing fails) and captures on one GPU take turns (two at once
    share the GPU's random generator and allocator capture state, and fail) and the calls' work
    on that GPU takes turns with captures, with Python's garbage collector paused meanwhile (a
    collection that frees a graph inside a capture invalidates it); the replays equal
    the eager models, and a later capture on torch's default stream still works."""
    import threading

    models = [_hf("bert", "base", torch.bfloat16) for _ in range(2)]
    graphs = [ragged.nn.graphed(m, max_tokens=1024, max_batch_size=16) for m in models]
    gen = torch.Generator(device="cuda").manual_seed(5)
    rounds = [_ids(lengths, gen) for lengths in ([5, 9, 3], [40, 1, 17, 60], [90, 2], [30] * 12)]
    barrier = threading.Barrier(2)
    results: list = [[], []]
    errors: list = []

    def work(i):
        try:
            with torch.no_grad():
                for ids in rounds:
                    barrier.wait(timeout=60)
                    # copy_outputs (the default): the rows come out as a copy made under the
                    # module's turn, so no work of this thread overlaps the other's capture
                    results[i].append(graphs[i](input_ids=ids).last_hidden_state.values)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    assert graphs[0].num_graphs == graphs[1].num_graphs >= 2
    with torch.no_grad():
        for i, model in enumerate(models):
            for ids, got in zip(rounds, results[i]):
                _close(got, model(input_ids=ids).last_hidden_state.values, torch.bfloat16, f"model {i}")
    graph, x = torch.cuda.CUDAGraph(), torch.ones(4, device="cuda")
    with torch.cuda.graph(graph):
        y = x * 2
    graph.replay()
    assert y.sum().item() == 8
