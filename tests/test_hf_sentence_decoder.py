"""ragged.nn.convert on sentence-transformers models over decoders (Qwen3-Embedding and
EmbeddingGemma style), against the unconverted model, on the CPU in float64.

Tiny Qwen2, Qwen3, Llama, Mistral, Gemma, Gemma 2 and Gemma 3 (bidirectional, EmbeddingGemma's
setting) base models (2 layers, hidden 32, 4 query heads over 2 key/value heads, sliding windows of
6 where the family has them) with random weights, and word-level tokenizers built here: one that
ends every text with an EOS token (Qwen3-Embedding's) and one that starts it with a BOS token
(Llama's), padding left or right. Checked: ``encode`` with every pooling mode, prompts
(``prompt=``, ``prompt_name=``, the model's default prompt, ``include_prompt=False``),
truncation, chat-message rendering, ``st(features)`` on padded features with garbage at padding,
token embeddings and hidden states, training gradients, the attention implementation conversion
sets (and a copy, a save and a refusal leave alone), replicas, the packed call itself against
transformers' padded forward, ``ragged.nn.graphed`` (its bucketed batch run eagerly), and the
refusals with the model untouched. Converted, the decoders run ragged's decoder core
(float64 norms where transformers computes them in float32): compared at ``HF_TOL``.
"""

from __future__ import annotations

import copy
import json
import pickle
import string
import warnings

import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402
from sentence_transformers.sentence_transformer import modules as M
from test_hf_sentence import LONG, MODES, WORDS  # noqa: E402
from test_hf_sentence import _close as _close_exact  # noqa: E402
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors  # noqa: E402

from ragged.nn.hf import decoder as hf_decoder  # noqa: E402
from ragged.nn.hf import sentence as hf_sentence  # noqa: E402

D, MAXLEN, WINDOW = 32, 64, 6
VOCAB = (
    ["<pad>", "<unk>", "<s>", "</s>", "<sys>"]
    + list(string.ascii_lowercase)
    + list(string.digits)
    + list(".,!?':|")
    + WORDS
)
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
FAMILIES = ["qwen3", "qwen2", "llama", "mistral", "gemma", "gemma2", "gemma3"]
INSTRUCT = "Instruct: find the text that answers the question\nQuery: "


# transformers' decoders compute their RMSNorms and rotary tables in float32 inside a float64
# model; the decoder core (what a converted model runs) computes the norms in float64: the two agree
# to float32's rounding of those steps, not to float64's
HF_TOL = {"rtol": 2e-5, "atol": 2e-6}


def _close(a, b, **tol):
    _close_exact(a, b, **(tol or HF_TOL))


# Families whose transformers code computes in float32 inside a float64 model (Gemma 2's RMSNorm
# and eager softmax in transformers 5.24, not in 5.17), checked at float32's precision.
FLOAT32_INSIDE = ("gemma2",)
FLOAT32_TOL = {"rtol": 1e-4, "atol": 1e-5}


def _config(family: str, **overrides):
    common = dict(
        vocab_size=len(VOCAB),
        hidden_size=D,
        intermediate_size=2 * D,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAXLEN,
        pad_token_id=0,
        attention_dropout=0.0,
    )
    head = dict(head_dim=8)
    window = dict(sliding_window=WINDOW)
    make = {
        "qwen3": lambda: tf.Qwen3Config(**common, **head),
        "qwen2": lambda: tf.Qwen2Config(**common, use_sliding_window=True, max_window_layers=1, **window),
        "llama": lambda: tf.LlamaConfig(**common),
        "mistral": lambda: tf.MistralConfig(**common, **window),
        "gemma": lambda: tf.GemmaConfig(**common, **head),
        "gemma2": lambda: tf.Gemma2Config(
            **common, **head, **window, attn_logit_softcapping=None, final_logit_softcapping=None
        ),
        "gemma3": lambda: tf.Gemma3TextConfig(**common, **head, **window, use_bidirectional_attention=True),
    }
    config = make[family]()
    for k, v in overrides.items():
        setattr(config, k, v)
    return config


def _tokenizer(style: str, chat: bool = False, max_length: int = 24):
    """A word-level tokenizer: ``"eos"`` ends every text with ``</s>`` (Qwen3-Embedding's), ``"bos"``
    starts it with ``<s>`` (Llama's); ``chat``: with a chat template (texts become messages)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    single, pair, special = (
        ("$A </s>", "$A $B </s>", ("</s>", 3)) if style == "eos" else ("<s> $A", "<s> $A $B", ("<s>", 2))
    )
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=[special])
    out = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="</s>",
        bos_token="<s>",
        model_max_length=max_length,
    )
    if chat:
        out.chat_template = "{% for m in messages %}<sys> {{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    return out


def _save(path, family, style="eos", chat=False, seed=0):
    tok = _tokenizer(style, chat)
    if style == "none":
        tok._tokenizer.post_processor = None  # no special token: an empty text has no token
    tok.save_pretrained(str(path))
    torch.manual_seed(seed)
    model = tf.AutoModel.from_config(_config(family))
    with torch.no_grad():
        for p in model.parameters():  # larger than the default init, so that layers matter
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> a folder with a tiny decoder and its tokenizer (EOS style, unless named)."""
    out = {f: _save(tmp_path_factory.mktemp(f), f, seed=i) for i, f in enumerate(FAMILIES)}
    out["llama-bos"] = _save(tmp_path_factory.mktemp("llama-bos"), "llama", "bos", seed=20)
    out["qwen3-chat"] = _save(tmp_path_factory.mktemp("qwen3-chat"), "qwen3", chat=True, seed=21)
    out["qwen2-plain"] = _save(tmp_path_factory.mktemp("qwen2-plain"), "qwen2", "none", seed=22)
    return out


@pytest.fixture(scope="module")
def transformers_(folders):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: M.Transformer(path) for name, path in folders.items()}


def _st(transformers_, name="qwen3", mode="lasttoken", side="left", after=(), prompts=None, **kw):
    """(original, converted) SentenceTransformers in float64, the tokenizer padding on ``side``."""
    tr = copy.deepcopy(transformers_[name])
    tr.tokenizer.padding_side = side
    original = (
        SentenceTransformer(modules=[tr, M.Pooling(D, mode, **kw), *after], device="cpu", prompts=prompts)
        .double()
        .eval()
    )
    ours = copy.deepcopy(original)
    assert hf_sentence.convert_sentence_transformer(ours) is ours
    return original, ours


def _attention(st) -> str:
    return st[0].auto_model.config._attn_implementation


# --------------------------------------------------------------------------------------
# encode


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("name", ["qwen3", "llama-bos"])
def test_encode_matches_original(transformers_, name, mode, side):
    original, ours = _st(transformers_, name, mode, side)
    assert _attention(ours) == "ragged" and _attention(original) == "sdpa"
    want = original.encode(TEXTS, batch_size=3)
    got = ours.encode(TEXTS, batch_size=3)
    assert got.shape == want.shape == (len(TEXTS), original.get_embedding_dimension())
    _close(got, want)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family(transformers_, family, side):
    """Each decoder class taken, lasttoken and mean pooling (sliding windows cut the long texts).
    Gemma 2 (transformers 5.24; not 5.17) runs its norms and its eager softmax in float32 whatever the
    model's dtype: a padded batch's fully masked rows become NaN there, so its oracle is each
    text alone (no padding), at float32's precision."""
    for mode in ("lasttoken", "mean"):
        original, ours = _st(transformers_, family, mode, side)
        if family in FLOAT32_INSIDE:
            _close(ours.encode(TEXTS, batch_size=4), original.encode(TEXTS, batch_size=1), **FLOAT32_TOL)
        else:
            _close(ours.encode(TEXTS, batch_size=4), original.encode(TEXTS, batch_size=4))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", ["lasttoken", "mean", "cls", "max", "weightedmean"])
def test_prompts(transformers_, mode, side):
    """An instruction prompt by ``prompt=``, by ``prompt_name=`` and as the model's default, its
    tokens pooled or left out (``include_prompt=False``), as sentence-transformers does."""
    for include in (True, False):
        original, ours = _st(
            transformers_, "qwen3", mode, side, prompts={"query": INSTRUCT, "doc": ""}, include_prompt=include
        )
        for kw in (
            {"prompt": INSTRUCT},
            {"prompt_name": "query"},
            {"prompt": "a b c d e f g h i j k l m n o p q r s t u v w x y z 1 2 3 "},
        ):
            _close(ours.encode(TEXTS, batch_size=3, **kw), original.encode(TEXTS, batch_size=3, **kw))
        _close(ours.encode_query(TEXTS[:4]), original.encode_query(TEXTS[:4]))
        for st in (original, ours):
            st.default_prompt_name = "query"
        _close(ours.encode(TEXTS, batch_size=5), original.encode(TEXTS, batch_size=5))


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation(transformers_, side):
    original, ours = _st(transformers_, "gemma3", "mean", side)
    for length in (5, 12):
        for st in (original, ours):
            st.max_seq_length = length
        _close(ours.encode(TEXTS, batch_size=3, prompt=INSTRUCT), original.encode(TEXTS, batch_size=3, prompt=INSTRUCT))


@pytest.mark.parametrize("side", ["left", "right"])
def test_empty_text(transformers_, side):
    """A tokenizer that adds no special token gives an empty text no token: it pools to zeros, as
    sentence-transformers pools it by lasttoken and mean (max gives -inf there, cls a padding
    position's embedding)."""
    assert transformers_["qwen2-plain"].tokenizer("")["input_ids"] == []
    for mode in ("lasttoken", "mean", "cls", "max"):
        original, ours = _st(transformers_, "qwen2-plain", mode, side)
        want, got = original.encode(TEXTS, batch_size=3), ours.encode(TEXTS, batch_size=3)
        assert TEXTS[0] == "" and (got[0] == 0).all()
        _close(got[1:], want[1:])
        if mode in ("lasttoken", "mean"):
            _close(got[0], want[0])


def test_encode_packs_on_the_host(transformers_):
    """Both padding sides tokenize without padding; left padding numbers positions by the padded
    batch's columns, as transformers does for the original."""
    for side in ("left", "right"):
        original, ours = _st(transformers_, "qwen3", "lasttoken", side)
        seen = []
        ours[0].register_forward_pre_hook(lambda m, args: seen.append(dict(args[0])))
        ours.encode(TEXTS[:3], batch_size=3)
        (features,) = seen
        assert set(features) == {"modality", hf_sentence.INPUT_KEY}
        packed = features[hf_sentence.INPUT_KEY]
        assert packed.layout.side == side and packed.ids.device.type == "cpu"
        padded = original.preprocess(sorted(TEXTS[:3], key=len, reverse=True))  # encode's order
        mask = padded["attention_mask"].bool()
        assert torch.equal(packed.ids.values, padded["input_ids"][mask])
        if side == "left":
            columns = torch.arange(mask.shape[1]).expand_as(mask)[mask]
            assert torch.equal(packed.position_ids, columns)
        else:
            assert packed.position_ids is None


def test_chat_messages(transformers_):
    """A tokenizer with a chat template: sentence-transformers renders texts (and a prompt, as a
    system message) through it; the padded batch is packed on the host."""
    for side in ("left", "right"):
        original, ours = _st(transformers_, "qwen3-chat", "lasttoken", side)
        assert "message" in ours[0].modality_config
        _close(ours.encode(TEXTS, batch_size=3), original.encode(TEXTS, batch_size=3))
        _close(ours.encode(TEXTS, batch_size=3, prompt=INSTRUCT), original.encode(TEXTS, batch_size=3, prompt=INSTRUCT))
        f = original.preprocess(TEXTS[:3])
        assert f["modality"] == "message"
        with pytest.raises(NotImplementedError, match="text-only messages.*pixel_values"):
            ours({**f, "pixel_values": torch.zeros(3, 3, 2, 2)})


# --------------------------------------------------------------------------------------
# st(features), token embeddings, training


def _poisoned(features, seed=0):
    g = torch.Generator().manual_seed(seed)
    pad = features["attention_mask"] == 0
    ids = features["input_ids"].masked_scatter(pad, torch.randint(5, len(VOCAB), (int(pad.sum()),), generator=g))
    return {**features, "input_ids": ids}


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_features(transformers_, side):
    """st(features) outside encode: the padded batch packed from its mask; what sits at padding is
    never read; hidden states padded like the input."""
    original, ours = _st(transformers_, "qwen2", ("lasttoken", "mean"), side)
    for st in (original, ours):
        st[0].auto_model.config.output_hidden_states = True
    f = original.preprocess(TEXTS)
    want = original(dict(f))
    got = ours(_poisoned(f))
    _close(got["sentence_embedding"], want["sentence_embedding"])
    mask = f["attention_mask"].bool()
    assert len(got["all_layer_embeddings"]) == len(want["all_layer_embeddings"]) == 3
    for g, w in zip(got["all_layer_embeddings"], want["all_layer_embeddings"]):
        _close(g[mask], w[mask])
        assert torch.all(g[~mask] == 0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_token_embeddings(transformers_, side):
    original, ours = _st(transformers_, "llama", "lasttoken", side)
    want = original.encode(TEXTS, output_value=None, batch_size=3)
    got = ours.encode(TEXTS, output_value=None, batch_size=3)
    for g, w in zip(got, want):
        _close(g["sentence_embedding"], w["sentence_embedding"])
        mask = w["attention_mask"].bool()
        _close(g["token_embeddings"][mask], w["token_embeddings"][mask])
        assert torch.all(g["token_embeddings"][~mask] == 0)
        _close(g[hf_sentence.TOKENS_KEY], w["token_embeddings"][mask])


@pytest.mark.parametrize("side", ["left", "right"])
def test_training_gradients(transformers_, side):
    """MultipleNegativesRankingLoss on padded features: the loss and every parameter's gradient."""
    original, ours = _st(transformers_, "qwen3", "lasttoken", side, after=[M.Dense(D, 16)])
    results = []
    for st in (original, ours):
        st.train()
        features = [_poisoned(st.preprocess(TEXTS[:4]), 1), _poisoned(st.preprocess(TEXTS[4:]), 2)]
        loss = losses.MultipleNegativesRankingLoss(st)(features, torch.zeros(0))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in st.named_parameters()}))
    _close(results[1][0], results[0][0])
    for n, w in results[0][1].items():
        g = results[1][1][n]
        if w is None or torch.all(w == 0):
            assert g is None or torch.all(g == 0), n
        else:
            _close(g, w)


# --------------------------------------------------------------------------------------
# The attention implementation, copies, replicas


def test_attention_set_by_convert(transformers_, tmp_path):
    original, _ = _st(transformers_)
    ours = hf_sentence.convert_sentence_transformer(original, copy=True)
    assert _attention(original) == "sdpa" and not hf_sentence.is_converted(original)
    assert _attention(ours) == "ragged" and hf_sentence.is_converted(ours)
    ours.save(str(tmp_path / "saved"))
    assert "ragged" not in (tmp_path / "saved" / "config.json").read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = SentenceTransformer(str(tmp_path / "saved"), device="cpu").double()
    assert _attention(loaded) == "sdpa" and not hf_sentence.is_converted(loaded)
    # another implementation set after conversion: the packed call refuses, conversion sets it again
    ours[0].auto_model.set_attn_implementation("sdpa")
    assert not hf_sentence.is_converted(ours)
    with pytest.raises(NotImplementedError, match="attn_implementation='ragged'.*'sdpa'.*convert the model again"):
        ours.encode(TEXTS[:2])
    assert hf_sentence.convert_sentence_transformer(ours) is ours and _attention(ours) == "ragged"
    _close(ours.encode(TEXTS), original.encode(TEXTS))


def test_loaded_with_ragged_attention(folders):
    """A model loaded with attn_implementation="ragged" already: kept as it is."""
    import ragged.integrations.transformers  # noqa: F401  (registers the implementation with transformers)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = M.Transformer(folders["qwen3"], model_kwargs={"attn_implementation": "ragged"})
        reference = M.Transformer(folders["qwen3"])
    ours = SentenceTransformer(modules=[tr, M.Pooling(D, "lasttoken")], device="cpu").double()
    original = SentenceTransformer(modules=[reference, M.Pooling(D, "lasttoken")], device="cpu").double()
    assert _attention(ours) == "ragged"
    ragged.nn.convert(ours)
    _close(ours.encode(TEXTS, batch_size=3), original.encode(TEXTS, batch_size=3))


def test_copies_and_replicas(transformers_, monkeypatch):
    from test_hf_sentence_replicas import _replicate

    original, ours = _st(transformers_, "gemma3", "mean")
    want = original.encode(TEXTS)
    for other in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert hf_sentence.is_converted(other) and other[0].forward.decoder and _attention(other) == "ragged"
        _close(other.encode(TEXTS), want)
    f = original.preprocess(TEXTS)
    theirs = _replicate(original, 2, True, monkeypatch)  # the unconverted model's replicas: the oracle
    replicas = _replicate(ours, 2, True, monkeypatch)
    for r in replicas:
        assert hf_sentence.is_converted(r) and r[0].forward.decoder and r[0].forward.module is r[0]
    for r in (theirs[1], replicas[1]):  # the second replicas' own tensors change; nothing else does
        r[0]._modules["model"].layers[0].self_attn.q_proj.weight.mul_(-2.0)
    with torch.no_grad():
        want = [r(dict(f))["sentence_embedding"] for r in theirs]
        got = [r(dict(f))["sentence_embedding"] for r in replicas]
    assert (want[1] - want[0]).abs().max() > 1e-3  # the change moves the output
    for g, w in zip(got, want):
        _close(g, w)


# --------------------------------------------------------------------------------------
# The packed call, graphs


def _ids(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ragged.RaggedTensor.from_lengths(torch.randint(5, len(VOCAB), (sum(lengths),), generator=g), lengths)


@pytest.mark.parametrize("family", FAMILIES)
def test_run_packed_equals_each_sequence_alone(family):
    """run_packed on a batch (sequences of 0 to 17 tokens) against transformers' forward of each
    sequence alone, last hidden state and hidden states."""
    torch.manual_seed(3)
    reference = tf.AutoModel.from_config(_config(family, output_hidden_states=True)).double().eval()
    model = copy.deepcopy(reference)
    hf_decoder.use_ragged_attention(model)
    rt = _ids([5, 0, 17, 1, 9])
    with torch.no_grad():
        out = hf_decoder.run_packed(model, rt)
        for b, x in enumerate(rt.unbind()):
            if not len(x):
                continue
            want = reference(input_ids=x[None])
            tol = FLOAT32_TOL if family in FLOAT32_INSIDE else {}
            _close(out["last_hidden_state"][b], want.last_hidden_state[0], **tol)
            for g, w in zip(out["hidden_states"], want.hidden_states, strict=True):
                _close(g[b], w[0], **tol)
        empty = hf_decoder.run_packed(model, _ids([0, 0]))
    assert empty["last_hidden_state"].values.shape == (0, D) and len(empty["hidden_states"]) == 3


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
def test_graphed_bucket_equals_eager(family):
    """What ragged.nn.graphed captures (a PackedDecoder), run on its padded bucket eagerly: spare
    sequences of no tokens, spare rows past the batch, positions given or not."""
    torch.manual_seed(4)
    model = tf.AutoModel.from_config(_config(family)).double().eval()
    hf_decoder.use_ragged_attention(model)
    g = ragged.nn.Graphed(hf_decoder.PackedDecoder(model), 128, 8, capture=False)
    for lengths in ([5, 1, 9], [13], [2, 0, 7, 3]):
        rt = _ids(lengths, seed=len(lengths))
        with torch.no_grad():
            want = hf_decoder.run_packed(model, rt)["last_hidden_state"]
            got = g(input_ids=rt)["last_hidden_state"]
            _close(got.values, want.values)
            alone = g.module(input_ids=rt)["last_hidden_state"]  # as a batch over the largest bucket runs
            assert alone.offsets is rt.offsets
            _close(alone.values, want.values)
            columns = rt.with_values(rt.position_ids() + 3)
            want = hf_decoder.run_packed(model, rt, columns.values)["last_hidden_state"]
            _close(g(input_ids=rt, position_ids=columns)["last_hidden_state"].values, want.values)
    assert g.num_graphs >= 2


def test_graphed_sentence_transformer_on_the_cpu(transformers_):
    """ragged.nn.graphed(st) graphs a PackedDecoder of the auto_model; off the GPU encode runs eagerly."""
    original, ours = _st(transformers_, "qwen3", "lasttoken")
    assert ragged.nn.graphed(ours, max_tokens=256, max_batch_size=8) is ours
    graphs = ours[0].forward.graphed
    assert isinstance(graphs.module, hf_decoder.PackedDecoder) and graphs.module.model is ours[0].auto_model
    _close(ours.encode(TEXTS, batch_size=3), original.encode(TEXTS, batch_size=3))
    assert graphs.num_graphs == 0


# --------------------------------------------------------------------------------------
# Refusals


def _state(st):
    return [st.__dict__.get("encode")] + [
        (m.__dict__.get("forward"), m.__dict__.get("preprocess")) for m in st.modules()
    ], _attention(st)


def _refused(st, match):
    before = _state(st)
    with pytest.raises(NotImplementedError, match=match):
        hf_sentence.convert_sentence_transformer(st)
    assert _state(st) == before


class _OwnQwen3(tf.Qwen3Model):
    pass


def test_refusals(transformers_):
    original, _ = _st(transformers_)
    st = copy.deepcopy(original)
    st[0].model = tf.GPT2Model(tf.GPT2Config(vocab_size=len(VOCAB), n_embd=D, n_layer=1, n_head=4)).double()
    _refused(st, "GPT2Model is not a supported model class.*decoders run on packed batches: LlamaModel, ")
    st = copy.deepcopy(original)
    st[0].model = tf.Gemma2Model(_config("gemma2", attn_logit_softcapping=50.0)).double()
    _refused(st, "cannot run on packed batches: .*attn_logit_softcapping=50.0")
    st = copy.deepcopy(original)
    st[0].auto_model.set_attn_implementation("eager")
    st[0].auto_model.config.output_attentions = True
    _refused(st, "output_attentions=True")
    assert _attention(st) == "eager"
    st = copy.deepcopy(original)
    own = _OwnQwen3(st[0].auto_model.config).double()
    st[0].model = own
    _refused(st, "_OwnQwen3, not a transformers model")
    assert hf_decoder.why_not(own).startswith("_OwnQwen3 is not a decoder ragged runs on packed batches")
    st = copy.deepcopy(original)
    st[0].modality_config = {**st[0].modality_config, "message": {"method": "generate", "method_output_name": None}}
    _refused(st, "maps chat messages")
    with pytest.raises(TypeError, match="expected input_ids to be a RaggedTensor"):
        hf_decoder.run_packed(_ragged_model(), torch.zeros(3, dtype=torch.long))


def _ragged_model():
    model = tf.AutoModel.from_config(_config("qwen3"))
    hf_decoder.use_ragged_attention(model)
    return model


def test_config_json_of_a_converted_model_is_the_original(transformers_, tmp_path):
    original, ours = _st(transformers_, "llama")
    original.save(str(tmp_path / "a"))
    ours.save(str(tmp_path / "b"))
    for name in ("config.json", "sentence_bert_config.json", "modules.json"):
        a, b = (json.loads((tmp_path / d / name).read_text()) for d in ("a", "b"))
        assert a == b, name
