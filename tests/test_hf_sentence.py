"""ragged.nn.convert on sentence-transformers models, against the unconverted model.

Tiny BERT, RoBERTa and DistilBERT models (2 layers, hidden 32, random weights) with a
wordpiece tokenizer written to a temporary folder, run in float64 on the CPU: ``encode`` (every
pooling mode and their concatenation, Dense / Dropout / LayerNorm / Normalize after it, its
options, texts of 0 to 64 tokens, left padding, prompts), ``st(features)`` on padded features
with garbage at padding, training losses and every parameter's gradient, save / load,
deepcopy / pickle, modules left on padded token embeddings, and refusals with the model
untouched. ``RAGGED_TEST_MINILM=/path/to/all-MiniLM-L6-v2`` adds a check on a real checkpoint.
"""

from __future__ import annotations

import copy
import os
import pickle
import string
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import ragged

tf = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402
from sentence_transformers.sentence_transformer import modules as M

from ragged.nn import hf
from ragged.nn.hf import sentence as hf_sentence  # noqa: E402

D, MAXLEN = 32, 64
WORDS = (
    "the a of and to in is it that was for on are with as he she they be at one have this from or had by hot "
    "word but what some we can out other were all there when up use your how said an each which do their time "
    "if will way about many then them write would like so these her long make thing see him two has look more "
    "day could go come did number sound no most people my over know water than call first who may down side "
    "been now find quick brown fox jumps lazy dog"
).split()
VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + list(string.ascii_lowercase)
    + list(string.digits)
    + list(".,!?'")
    + ["##" + c for c in string.ascii_lowercase + string.digits]
    + WORDS
)
LONG = " ".join(WORDS[i % len(WORDS)] + ("xq" if i % 7 == 0 else "") for i in range(80))  # truncated to 64 tokens
TEXTS = [
    "",
    "a",
    "hello world",
    LONG,
    "the quick brown fox jumps over the lazy dog",
    "zz",
    "one two. three!",
    "people know water",
]
MODES = ["mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", ("cls", "mean", "max")]
TOL = {"rtol": 1e-9, "atol": 1e-10}  # float64 on both sides


def _config(family: str):
    if family == "distilbert":
        return tf.DistilBertConfig(
            vocab_size=len(VOCAB),
            dim=D,
            n_layers=2,
            n_heads=4,
            hidden_dim=2 * D,
            max_position_embeddings=MAXLEN,
            dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=0,
        )
    cls = tf.RobertaConfig if family == "roberta" else tf.BertConfig
    extra = 2 if family == "roberta" else 0  # RoBERTa's positions start past padding_idx
    return cls(
        vocab_size=len(VOCAB),
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * D,
        max_position_embeddings=MAXLEN + extra,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a folder holding a tiny model with random weights and its tokenizer."""
    out = {}
    for seed, family in enumerate(("bert", "roberta", "distilbert")):
        path = tmp_path_factory.mktemp(family)
        (path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
        tf.BertTokenizerFast(str(path / "vocab.txt"), model_max_length=MAXLEN).save_pretrained(str(path))
        torch.manual_seed(seed)
        model = tf.AutoModel.from_config(_config(family))
        with torch.no_grad():
            for p in model.parameters():  # larger than the default init, so that layers matter
                p.add_(0.2 * torch.randn_like(p))
        model.save_pretrained(str(path))
        out[family] = str(path)
    return out


@pytest.fixture(scope="module")
def transformers_(folders):
    """family -> a loaded sentence-transformers Transformer module (copied by each test)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {family: M.Transformer(path) for family, path in folders.items()}


def _st(transformers_, family="bert", mode="mean", after=(), **kw):
    """(original, converted) SentenceTransformers in float64: Transformer, Pooling, ``after``."""
    dim = D * (len(mode) if isinstance(mode, tuple) else 1)
    mods = [copy.deepcopy(transformers_[family]), M.Pooling(D, mode, **kw), *after]
    original = SentenceTransformer(modules=mods, device="cpu").double().eval()
    assert dim == original[1].get_embedding_dimension()
    ours = copy.deepcopy(original)
    assert hf_sentence.convert_sentence_transformer(ours) is ours
    return original, ours


def _close(a, b, **tol):
    a = torch.as_tensor(np.asarray(a)) if not torch.is_tensor(a) else a
    b = torch.as_tensor(np.asarray(b)) if not torch.is_tensor(b) else b
    torch.testing.assert_close(a, b, **(tol or TOL))


def _untouched(st) -> bool:
    """No converted forward / preprocess / encode anywhere in ``st``."""
    return "encode" not in st.__dict__ and all(
        "forward" not in m.__dict__ and "preprocess" not in m.__dict__ for m in st.modules()
    )


# --------------------------------------------------------------------------------------
# encode


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_encode_matches_original(transformers_, family, mode):
    original, ours = _st(transformers_, family, mode)
    want = original.encode(TEXTS, batch_size=3)
    got = ours.encode(TEXTS, batch_size=3)
    assert got.shape == want.shape == (len(TEXTS), original.get_embedding_dimension())
    _close(got, want)


def test_encode_packs_on_the_host(transformers_):
    """Sentence embeddings: tokenized without padding, packed on the host, no padded keys; token
    embeddings: sentence-transformers' padded batch, packed from its host mask."""
    original, ours = _st(transformers_)
    seen = []
    ours[0].register_forward_pre_hook(lambda m, args: seen.append(dict(args[0])))
    ours.encode(TEXTS, batch_size=4)
    assert len(seen) == 2
    for features in seen:
        assert set(features) == {"modality", hf_sentence.INPUT_KEY}
        packed = features[hf_sentence.INPUT_KEY]
        assert packed.ids.device.type == "cpu" and packed.token_type_ids is not None
    seen.clear()
    ours.encode(TEXTS[:3], output_value="token_embeddings")
    assert {"input_ids", "attention_mask", hf_sentence.INPUT_KEY} <= set(seen[0])
    seen.clear()
    ours(original.preprocess(TEXTS[:3]))  # outside encode: sentence-transformers' features, packed here
    assert hf_sentence.INPUT_KEY not in seen[0]


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_left_padding(transformers_, family):
    """A left-padding tokenizer: BERT's positions are the padded columns (as in HuggingFace) and
    weightedmean's weights too (as in sentence-transformers)."""
    for mode in ("weightedmean", "cls", "lasttoken", "mean"):
        original, ours = _st(transformers_, family, mode)
        for st in (original, ours):
            st.tokenizer.padding_side = "left"
        _close(ours.encode(TEXTS, batch_size=3), original.encode(TEXTS, batch_size=3))
        f = original.preprocess(TEXTS[:4])
        _close(ours(dict(f))["sentence_embedding"], original(dict(f))["sentence_embedding"])


def test_sentence_level_modules(transformers_):
    after = [M.Dense(D, 16, activation_function=nn.Tanh()), M.Dropout(0.5), M.LayerNorm(16), M.Normalize()]
    original, ours = _st(transformers_, "bert", "mean", after)
    assert not ours[0].forward.pad_token_embeddings
    _close(ours.encode(TEXTS, batch_size=5), original.encode(TEXTS, batch_size=5))


def test_encode_options(transformers_):
    original, ours = _st(transformers_, "roberta", ("mean", "lasttoken"), [M.Dense(2 * D, 24)])
    for kw in (
        {"convert_to_tensor": True},
        {"convert_to_numpy": False},
        {"normalize_embeddings": True},
        {"truncate_dim": 8},
        {"precision": "binary"},
        {"precision": "int8"},
        {"show_progress_bar": True},
        {"batch_size": 1},
        {"batch_size": 100},
    ):
        want, got = original.encode(TEXTS, **kw), ours.encode(TEXTS, **kw)
        if isinstance(want, list):
            want, got = torch.stack(want), torch.stack(got)
        assert type(got) is type(want)
        _close(got, want, rtol=0, atol=0) if kw.get("precision") else _close(got, want)
    _close(ours.encode("a single text"), original.encode("a single text"))
    assert ours.encode([]).shape == original.encode([]).shape
    _close(ours.encode([("a pair of", "texts"), ("b", "")]), original.encode([("a pair of", "texts"), ("b", "")]))


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_prompt_left_out(transformers_, mode):
    """include_prompt=False pools the tokens after the prompt, as sentence-transformers does."""
    original, ours = _st(transformers_, "bert", mode, include_prompt=False)
    for st in (original, ours):
        st.prompts = {"query": "query: the "}
    _close(
        ours.encode(TEXTS, prompt_name="query", batch_size=3), original.encode(TEXTS, prompt_name="query", batch_size=3)
    )
    _close(ours.encode_query(TEXTS[:3]), original.encode_query(TEXTS[:3]))
    _close(
        ours.encode(TEXTS, prompt="a b c d e f g h i j k l m n o p q r s t u v w x y z "),
        original.encode(TEXTS, prompt="a b c d e f g h i j k l m n o p q r s t u v w x y z "),
    )


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_token_embeddings(transformers_, family):
    original, ours = _st(transformers_, family, "cls")
    want = original.encode(TEXTS, output_value="token_embeddings", batch_size=3)
    got = ours.encode(TEXTS, output_value="token_embeddings", batch_size=3)
    assert [t.shape for t in got] == [t.shape for t in want]
    for g, w in zip(got, want):
        _close(g, w)
    want = original.encode(TEXTS, output_value=None, batch_size=3)
    got = ours.encode(TEXTS, output_value=None, batch_size=3)
    for g, w in zip(got, want):
        _close(g["sentence_embedding"], w["sentence_embedding"])
        n = int(w["attention_mask"].sum())
        _close(g["token_embeddings"][:n], w["token_embeddings"][:n])
        assert torch.all(g["token_embeddings"][n:] == 0)  # padding holds zeros
        _close(g[hf_sentence.TOKENS_KEY], w["token_embeddings"][:n])
        assert torch.equal(g["attention_mask"], w["attention_mask"])


@pytest.mark.parametrize("prompt", [None, 3])
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_pool_tokens_matches_padded_pooling(mode, prompt):
    """pool_tokens on packed tokens (lengths 0 to 17, right and left layouts) against
    sentence-transformers' pooling of the zero-padded batch: values and gradients. An empty
    sequence is left out of cls and max, where sentence-transformers reads padding or gives -inf, and
    so is, for cls, a left-padded sequence no longer than the prompt (sentence-transformers reads
    column 0, padding; pool_tokens its first token, as for right padding)."""
    from ragged.padding import PaddedLayout

    lengths, width = [4, 0, 17, 1, 3, 9], 19
    g = torch.Generator().manual_seed(10 * MODES.index(mode) + (prompt or 0))
    for side in ("right", "left"):
        x = torch.randn(sum(lengths), D, generator=g, dtype=torch.float64, requires_grad=True)
        rt = ragged.RaggedTensor.from_lengths(x, lengths)
        layout = PaddedLayout(width, side)
        pooling = M.Pooling(D, mode, include_prompt=prompt is None)
        extra = {} if prompt is None else {"prompt_length": prompt}
        got = hf_sentence.pool_tokens(pooling, hf_sentence.TokenEmbeddings(rt, layout, None), extra)
        padded = ragged.unpack(rt, total_length=width, padding_side=side)
        mask = rt.attention_mask(total_length=width, padding_side=side)
        want = pooling({"token_embeddings": padded, "attention_mask": mask, **extra})["sentence_embedding"]
        cls = "cls" in np.atleast_1d(mode)
        rows = [
            i
            for i, n in enumerate(lengths)
            if not (n == 0 and (cls or "max" in np.atleast_1d(mode)))
            and not (cls and side == "left" and prompt is not None and n <= prompt)
        ]
        _close(got[rows], want[rows])
        weights = torch.randn(want.shape, generator=g, dtype=torch.float64)
        (dg,) = torch.autograd.grad((got[rows] * weights[rows]).sum(), x)
        (dw,) = torch.autograd.grad((want[rows] * weights[rows]).sum(), x)
        _close(dg, dw)


# --------------------------------------------------------------------------------------
# st(features): padded features, training


def _poisoned(features, seed=0):
    """The features with random ids and token types at padding (right padding)."""
    g = torch.Generator().manual_seed(seed)
    pad = features["attention_mask"] == 0
    out = dict(features)
    out["input_ids"] = features["input_ids"].masked_scatter(
        pad, torch.randint(5, len(VOCAB), (int(pad.sum()),), generator=g)
    )
    out["token_type_ids"] = features["token_type_ids"].masked_fill(pad, 1)
    return out


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_forward_on_padded_features(transformers_, family):
    original, ours = _st(transformers_, family, ("weightedmean", "max"))
    f = original.preprocess(TEXTS)
    want = original(dict(f))["sentence_embedding"]
    for mask in (f["attention_mask"], f["attention_mask"].bool()):
        got = ours({**_poisoned(f), "attention_mask": mask})
        _close(got["sentence_embedding"], want)
        assert "token_embeddings" not in got
        tokens = got[hf_sentence.TOKENS_KEY]
        assert tokens.rt.host_lengths() == f["attention_mask"].sum(1).tolist()


def test_training_gradients(transformers_):
    """MultipleNegativesRankingLoss (merged padded columns), its cached variant (mini-batches)
    and a plain loss on st(features): losses and every parameter's gradient equal the
    original's; after an optimizer step the embeddings still match."""
    original, ours = _st(transformers_, "bert", "mean", [M.Dense(D, 16)])
    for st in (original, ours):
        st.train()
    anchors, positives = TEXTS[1:5], TEXTS[4:8]
    for make in (
        lambda st: losses.MultipleNegativesRankingLoss(st),
        lambda st: losses.CachedMultipleNegativesRankingLoss(st, mini_batch_size=2),
        None,
    ):
        results = []
        for st in (original, ours):
            st.zero_grad(set_to_none=True)
            features = [st.preprocess(anchors), st.preprocess(positives)]
            if make is None:
                loss = st(features[0])["sentence_embedding"].pow(2).sum()
            else:
                loss = make(st)(features, torch.zeros(0))
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in st.named_parameters()}))
        (l0, g0), (l1, g1) = results
        _close(l1, l0)
        assert g0.keys() == g1.keys()
        for name in g0:
            if g0[name] is None:
                assert g1[name] is None, name
            else:
                _close(g1[name], g0[name])
    for st in (original, ours):
        torch.optim.SGD(st.parameters(), lr=0.5).step()
    _close(ours.encode(TEXTS), original.encode(TEXTS))


def test_all_layer_embeddings(transformers_):
    """A model whose config asks for hidden states: padded all_layer_embeddings, read here by
    WeightedLayerPooling (a module left on padded token embeddings, before the Pooling)."""
    base = copy.deepcopy(transformers_["bert"])
    base.auto_model.config.output_hidden_states = True
    mods = [base, M.WeightedLayerPooling(D, num_hidden_layers=2, layer_start=1), M.Pooling(D, "mean")]
    original = SentenceTransformer(modules=mods, device="cpu").double().eval()
    ours = copy.deepcopy(original)
    with pytest.warns(UserWarning, match="WeightedLayerPooling"):
        hf_sentence.convert_sentence_transformer(ours)
    assert "forward" not in ours[2].__dict__  # its Pooling reads the token embeddings module '1' wrote
    _close(ours.encode(TEXTS, batch_size=3), original.encode(TEXTS, batch_size=3))
    f = original.preprocess(TEXTS[:4])
    want, got = original(dict(f))["all_layer_embeddings"], ours(dict(f))["all_layer_embeddings"]
    keep = f["attention_mask"].bool()
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        _close(g[keep], w[keep])


# --------------------------------------------------------------------------------------
# What conversion keeps


def test_keeps_modules_parameters_and_files(transformers_, tmp_path):
    original, ours = _st(transformers_, "bert", "mean", [M.Dense(D, 16), M.Normalize()])
    fresh = copy.deepcopy(original)
    params = {n: p for n, p in fresh.named_parameters()}
    assert hf_sentence.convert_sentence_transformer(fresh) is fresh
    assert {n: p for n, p in fresh.named_parameters()} == params  # the same Parameter objects
    assert [type(m) for m in fresh.modules()] == [type(m) for m in original.modules()]
    assert fresh.state_dict().keys() == original.state_dict().keys()
    assert repr(fresh) == repr(original)
    ours.save(str(tmp_path / "ours"))
    original.save(str(tmp_path / "original"))
    names = sorted(str(p.relative_to(tmp_path / "ours")) for p in (tmp_path / "ours").rglob("*") if p.is_file())
    assert names == sorted(
        str(p.relative_to(tmp_path / "original")) for p in (tmp_path / "original").rglob("*") if p.is_file()
    )
    for name in names:
        if name.endswith(".json") or name.endswith(".txt"):
            assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "original" / name).read_bytes(), name
    loaded = SentenceTransformer(str(tmp_path / "ours"), device="cpu")
    assert _untouched(loaded)  # a plain SentenceTransformer until converted again
    _close(loaded.encode(TEXTS), original.encode(TEXTS))
    hf_sentence.convert_sentence_transformer(loaded)
    _close(loaded.encode(TEXTS), original.encode(TEXTS))


def test_converting_twice_copy_deepcopy_pickle(transformers_):
    original, ours = _st(transformers_, "roberta", "cls")
    state = (ours.__dict__["encode"], ours[0].__dict__["forward"], ours[1].__dict__["forward"])
    assert hf_sentence.convert_sentence_transformer(ours) is ours
    assert (ours.__dict__["encode"], ours[0].__dict__["forward"], ours[1].__dict__["forward"]) == state
    fresh = copy.deepcopy(original)
    made = hf_sentence.convert_sentence_transformer(fresh, copy=True)
    assert made is not fresh and _untouched(fresh) and hf_sentence.is_converted(made)
    assert hf_sentence.convert_sentence_transformer(made, copy=True) is not made
    want = original.encode(TEXTS)
    for other in (made, copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert hf_sentence.is_converted(other)
        assert other[0].forward.module is other[0] and other.encode.model is other
        _close(other.encode(TEXTS), want)
    # the auto_model converted on its own first, then the SentenceTransformer
    fresh = copy.deepcopy(original)
    ragged.nn.convert(fresh[0].auto_model)
    hf_sentence.convert_sentence_transformer(fresh)
    _close(fresh.encode(TEXTS), want)


def test_ragged_nn_convert_dispatches(transformers_):
    original, _ = _st(transformers_)
    fresh = copy.deepcopy(original)
    assert ragged.nn.convert(fresh) is fresh
    assert hf_sentence.is_converted(fresh)
    _close(fresh.encode(TEXTS), original.encode(TEXTS))


# --------------------------------------------------------------------------------------
# Modules on padded token embeddings, refusals


class _Scale(nn.Module):
    """A custom module on token embeddings (padded, with the attention mask)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, D, dtype=torch.float64))

    def forward(self, features):
        features["token_embeddings"] = features["token_embeddings"] * self.weight
        return features


class _Reader(nn.Module):
    """A custom module after the Pooling that reads the padded token embeddings."""

    def forward(self, features):
        features["sentence_embedding"] = features["sentence_embedding"] + features["token_embeddings"][:, 0]
        return features


def test_modules_left_on_padded_token_embeddings(transformers_):
    for mods, patched in (
        ([_Scale(), M.Pooling(D, "weightedmean")], False),
        ([M.Pooling(D, "max"), _Reader()], True),
        (
            [
                M.Pooling(D, "mean"),
                M.Dense(D, D, module_input_name="token_embeddings", module_output_name="token_embeddings"),
            ],
            True,
        ),
    ):
        original = SentenceTransformer(modules=[copy.deepcopy(transformers_["bert"]), *mods], device="cpu").double()
        ours = copy.deepcopy(original)
        with pytest.raises(NotImplementedError, match="padded token embeddings: '[12]'"):
            hf_sentence.convert_sentence_transformer(ours, strict=True)
        assert _untouched(ours) and not hf.is_converted(ours[0].auto_model)
        with pytest.warns(UserWarning, match="run on padded token embeddings"):
            hf_sentence.convert_sentence_transformer(ours)
        pooling = next(m for m in ours if isinstance(m, M.Pooling))
        assert ("forward" in pooling.__dict__) == patched
        assert ours[0].forward.pad_token_embeddings
        _close(ours.encode(TEXTS, batch_size=3), original.encode(TEXTS, batch_size=3))


def test_pooling_reads_replaced_token_embeddings_padded(transformers_):
    """A loss or module that puts other token embeddings in the features (AdaptiveLayerLoss
    does) gets sentence-transformers' own pooling of them."""
    original, ours = _st(transformers_, "bert", "mean")
    f = original.preprocess(TEXTS[:4])
    out = ours[0](dict(f))
    other = torch.randn(*f["input_ids"].shape, D, dtype=torch.float64)
    got = ours[1]({**out, "token_embeddings": other})["sentence_embedding"]
    want = original[1]({"token_embeddings": other, "attention_mask": f["attention_mask"]})["sentence_embedding"]
    _close(got, want)


def _patches(st) -> list:
    return [st.__dict__.get("encode")] + [
        (m.__dict__.get("forward"), m.__dict__.get("preprocess")) for m in st.modules()
    ]


def _refused(st, match, **kw):
    before = _patches(st)
    with pytest.raises(NotImplementedError, match=match):
        hf_sentence.convert_sentence_transformer(st, **kw)
    assert _patches(st) == before
    if len(st) and isinstance(st[0], M.Transformer):
        assert not hf.is_converted(st[0].auto_model)


def test_refusals(transformers_, folders):
    original, _ = _st(transformers_)
    _refused(SentenceTransformer(modules=[M.Dense(4, 4)], device="cpu"), "first module is a Dense")
    st = copy.deepcopy(original)
    st[0].can_flatten_inputs = True
    _refused(st, "unpad_inputs")
    st = copy.deepcopy(original)
    st[0].transformer_task = "fill-mask"
    _refused(st, "task is 'fill-mask'")
    st = copy.deepcopy(original)
    st[0].forward = lambda features: features
    _refused(st, "forward replaced")
    st = copy.deepcopy(original)
    st[0].auto_model.config.is_decoder = True
    _refused(st, "auto_model cannot be converted: config.is_decoder")
    st = copy.deepcopy(original)
    st[0].auto_model.encoder.layer[0].output.dense = nn.Sequential(st[0].auto_model.encoder.layer[0].output.dense)
    _refused(st, "auto_model cannot be converted: .*Sequential")
    with pytest.raises(TypeError, match="expected a SentenceTransformer"):
        hf_sentence.convert_sentence_transformer(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="expected copy to be a bool"):
        hf_sentence.convert_sentence_transformer(copy.deepcopy(original), copy=1)
    ours = copy.deepcopy(original)
    hf_sentence.convert_sentence_transformer(ours)
    with pytest.raises(NotImplementedError, match="modality 'image'"):
        ours({**original.preprocess(["a"]), "modality": "image"})
    with pytest.raises(NotImplementedError, match="unpad_inputs"):
        ours({**original.preprocess(["a"]), "cu_seq_lens_q": torch.tensor([0, 3])})


def test_is_sentence_transformer_imports_nothing():
    code = (
        "import sys, torch, ragged.nn.hf.sentence as s;"
        "assert not s.is_sentence_transformer(torch.nn.Linear(1, 1));"
        "import ragged.nn; ragged.nn.convert(torch.nn.Sequential(torch.nn.Linear(1, 1)));"
        "assert 'sentence_transformers' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------
# A real checkpoint (optional)


@pytest.mark.skipif(not os.environ.get("RAGGED_TEST_MINILM"), reason="set RAGGED_TEST_MINILM=/path/to/all-MiniLM-L6-v2")
def test_minilm_checkpoint():
    original = SentenceTransformer(os.environ["RAGGED_TEST_MINILM"], device="cpu").float().eval()
    ours = ragged.nn.convert(copy.deepcopy(original))
    g = np.random.default_rng(0)
    words = WORDS + ["embedding", "sentence", "transformer", "ragged", "padding", "token", "ünïcödé", "日本語"]
    texts = ["", "a", LONG * 8] + [" ".join(g.choice(words, g.integers(1, 90))) for _ in range(47)]
    want, got = original.encode(texts, batch_size=16), ours.encode(texts, batch_size=16)
    cosine = (want * got).sum(1) / np.linalg.norm(want, axis=1) / np.linalg.norm(got, axis=1)
    assert cosine.min() >= 0.9999, cosine.min()
