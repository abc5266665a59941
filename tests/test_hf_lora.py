"""ragged.nn.convert on models with peft's LoRA adapters, against the unconverted peft model
(CPU, float64, tiny configs, random weights and random non-zero ``lora_B``: peft starts it at
zero, which would hide an adapter the converted layer left out).

A ``PeftModel`` (and the ``LoraModel`` inside it) is converted in place, its transformers model
patched and its modules kept: the loss, the logits and every trainable gradient (adapters and
``modules_to_save``) equal peft's on padded batches and on RaggedTensors, for several
``target_modules`` in BERT and DistilBERT (and all Linears in RoBERTa, ELECTRA and MPNet);
merging, unmerging, disabling and switching adapters (one or two active) give peft's outputs in
each state; what no effective weight expresses (``lora_dropout > 0``, DoRA, other tuners,
``adapter_names``) is refused with the module and the reason; a SentenceTransformer with an
adapter injected by transformers' PEFT integration encodes as the unconverted one.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ragged

tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from hf_convert_cases import _batch, _config, _ragged, _randomise, _real  # noqa: E402
from peft import IA3Config, LoraConfig, TaskType, get_peft_model, inject_adapter_in_model  # noqa: E402

from ragged.nn import hf  # noqa: E402

LENGTHS = [4, 1, 17, 9]
TOL = {"rtol": 1e-9, "atol": 1e-10}  # float64 on both sides
ALL = {
    "bert": ["query", "key", "value", "dense"],
    "roberta": ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"],
    "electra": ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"],
    "distilbert": ["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"],
    "mpnet": ["q", "k", "v", "o", "intermediate.dense", "output.dense"],
}
TARGETS = {
    "bert": [
        ["query", "value"],
        ["key", "attention.output.dense", "output.dense"],
        ["word_embeddings", "intermediate.dense"],
        ALL["bert"],
    ],
    "distilbert": [["q_lin", "v_lin"], ["k_lin", "out_lin", "lin1", "lin2"], ALL["distilbert"]],
}


def _randomise_adapters(model: torch.nn.Module, seed: int) -> None:
    """Every adapter matrix (and LoRA bias) random, so that each one shows in the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))


def _hf_model(family: str, kind: str = "sequence", seed: int = 0):
    if family == "mpnet":
        config = tf.MPNetConfig(
            vocab_size=50,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            pad_token_id=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=3,
        )
        cls = tf.MPNetForSequenceClassification if kind == "sequence" else tf.MPNetModel
    else:
        config = _config(family, kind)
        prefix = {"bert": "Bert", "roberta": "Roberta", "electra": "Electra", "distilbert": "DistilBert"}[family]
        cls = getattr(tf, prefix + ("ForSequenceClassification" if kind == "sequence" else "Model"))
    model = cls(config).double()
    _randomise(model, seed)
    return model


def _peft(family: str, targets, seed: int = 0, **lora):
    """(peft model to convert, the same unconverted) over a sequence classifier in train mode."""
    model = _hf_model(family, seed=seed)
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=targets, **lora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
    _randomise_adapters(peft_model, seed + 1)
    with torch.no_grad():  # the classifier copy that modules_to_save trains: away from the original
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.1)
    return peft_model, copy.deepcopy(peft_model)


def _convert(model) -> None:
    """Convert a PeftModel in place: the transformers model inside runs the ragged forward."""
    assert ragged.nn.convert(model) is model
    assert hf.is_converted(model.base_model.model)


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _check_grads(ours, ref) -> None:
    got, want = _grads(ours), _grads(ref)
    assert got.keys() == want.keys()
    assert any("lora_A" in n for n in got) and any("lora_B" in n for n in got)
    assert any("modules_to_save" in n for n in got)
    for name in want:
        assert want[name] is not None, name
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


# --------------------------------------------------------------------------------------
# Loss and gradients


@pytest.mark.parametrize(
    "family,targets",
    [(f, t) for f, ts in TARGETS.items() for t in ts],
    ids=lambda v: v if isinstance(v, str) else "+".join(v),
)
@pytest.mark.parametrize("ragged_input", [False, True], ids=["padded", "ragged"])
def test_loss_and_gradients_match_peft(family, targets, ragged_input):
    ours, ref = _peft(family, targets)
    keys, params = list(ours.state_dict()), dict(ours.named_parameters())
    assert ragged.nn.convert(ours) is ours
    assert hf.is_converted(ours.base_model.model)
    assert list(ours.state_dict()) == keys  # peft's keys (save_pretrained of the adapters reads them)
    assert all(p is params[n] for n, p in ours.named_parameters())
    ours.train()
    ref.train()
    ids, mask = _batch(LENGTHS)
    labels = torch.tensor([0, 2, 1, 2])
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    if ragged_input:
        got = ours(input_ids=_ragged(ids, mask), labels=labels)
    else:
        got = ours(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, want.logits, **TOL)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    got.loss.backward()
    want.loss.backward()
    _check_grads(ours, ref)


@pytest.mark.parametrize("family", ["roberta", "electra", "mpnet"])
def test_every_linear_of_other_families(family):
    """LoRA on every layer Linear, with a LoRA bias and rank-stabilised scaling."""
    ours, ref = _peft(family, ALL[family], seed=3, lora_bias=True, use_rslora=True)
    _convert(ours)
    ours.train()
    ref.train()
    ids, mask = _batch(LENGTHS)
    labels = torch.tensor([1, 0, 2, 2])
    got = ours(input_ids=ids, attention_mask=mask, labels=labels)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    got.loss.backward()
    want.loss.backward()
    _check_grads(ours, ref)
    assert any("lora_B" in n and n.endswith("bias") for n in _grads(ours))


def test_token_embeddings_of_a_base_model_ragged_and_padded():
    """A LoraModel (peft's tuner without the PeftModel) over a base model: last hidden states at
    the real tokens, padded and ragged."""
    model = _hf_model("bert", "base")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuner = peft.LoraModel(model, LoraConfig(r=4, target_modules=ALL["bert"]), "default")
    _randomise_adapters(tuner, 5)
    ref = copy.deepcopy(tuner).eval()
    assert ragged.nn.convert(tuner) is tuner
    tuner.eval()
    ids, mask = _batch(LENGTHS)
    want = _real(ref(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
    torch.testing.assert_close(_real(tuner(input_ids=ids, attention_mask=mask).last_hidden_state, mask), want, **TOL)
    torch.testing.assert_close(tuner(input_ids=_ragged(ids, mask)).last_hidden_state.values, want, **TOL)


def test_copy_converts_a_copy():
    ours, ref = _peft("bert", ["query", "value"])
    out = ragged.nn.convert(ours, copy=True)
    assert out is not ours and hf.is_converted(out.base_model.model)
    assert not hf.is_converted(ours.base_model.model)
    ids, mask = _batch(LENGTHS)
    torch.testing.assert_close(
        out.eval()(input_ids=ids, attention_mask=mask).logits,
        ref.eval()(input_ids=ids, attention_mask=mask).logits,
        **TOL,
    )


# --------------------------------------------------------------------------------------
# Adapter states


def _add_second(model) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.add_adapter(
            "other", LoraConfig(task_type=TaskType.SEQ_CLS, r=2, lora_alpha=4, target_modules=ALL["bert"])
        )
    _randomise_adapters(model, 11)  # the first adapter's too: the same values in both models (same seed)


def _both_adapters(model) -> None:
    """Both adapters active in every LoRA Linear (the classifier's modules_to_save keeps one)."""
    for module in model.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.set_adapter(["default", "other"])


STATES = [
    ("default", lambda m: None),
    ("other", lambda m: m.set_adapter("other")),
    ("both", _both_adapters),
    ("merged", lambda m: m.merge_adapter()),
    ("unmerged", lambda m: m.unmerge_adapter()),
    ("other merged", lambda m: (m.set_adapter("other"), m.merge_adapter())),
    ("back to default", lambda m: m.set_adapter("default")),  # unmerged by the disabled forward
]


def test_merge_unmerge_disable_and_switch_adapters():
    ours, ref = _peft("bert", ["query", "value"])
    for model in (ours, ref):
        _add_second(model)
    _convert(ours)
    ours.eval()
    ref.eval()
    ids, mask = _batch(LENGTHS)

    def same(state):
        got = ours(input_ids=ids, attention_mask=mask).logits
        want = ref(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, **TOL, msg=state)
        return got

    outputs = {}
    for state, step in STATES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's "Already unmerged" after a disabled forward unmerged
            step(ours)
            step(ref)
        outputs[state] = same(state)
        with ours.disable_adapter(), ref.disable_adapter():  # the base model (unmerging a merged adapter first)
            outputs[state + ", disabled"] = same(state + ", disabled")
        outputs[state + ", enabled again"] = same(state + ", enabled again")
    # the states differ, so the comparisons above could fail
    assert not torch.allclose(outputs["default"], outputs["other"])
    assert not torch.allclose(outputs["default"], outputs["both"])
    assert not torch.allclose(outputs["default"], outputs["default, disabled"])
    torch.testing.assert_close(outputs["merged"], outputs["both"], rtol=1e-7, atol=1e-9)  # merges the active ones


def test_save_pretrained_of_the_adapters(tmp_path):
    ours, ref = _peft("bert", ["query", "value"])
    _convert(ours)
    ours.save_pretrained(str(tmp_path / "a"))
    ref.save_pretrained(str(tmp_path / "b"))
    loaded = peft.PeftModel.from_pretrained(_hf_model("bert"), str(tmp_path / "a"))
    for (n, p), (m, q) in zip(loaded.state_dict().items(), ref.state_dict().items()):
        assert n == m
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# --------------------------------------------------------------------------------------
# Refusals


def _refused(model, *patterns):
    inner = model.base_model.model if isinstance(model, peft.PeftModel) else model
    with pytest.raises(NotImplementedError) as info:
        ragged.nn.convert(model)
    for pattern in patterns:
        assert pattern in str(info.value), (pattern, str(info.value))
    assert not hf.is_converted(inner)


def test_lora_dropout_is_refused():
    model, _ = _peft("bert", ["query", "value"], lora_dropout=0.1)
    _refused(model, "bert.encoder.layer.0 q projection", "lora_dropout=0.1", "set lora_dropout=0")


def test_dora_is_refused():
    model, _ = _peft("distilbert", ["v_lin"], use_dora=True)
    _refused(model, "distilbert.transformer.layer.0 v projection", "DoRA (use_dora=True)")


def test_other_tuners_and_layers_are_refused():
    config = IA3Config(
        task_type=TaskType.SEQ_CLS,
        target_modules=["query", "value", "output.dense"],
        feedforward_modules=["output.dense"],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ia3 = get_peft_model(_hf_model("bert"), config)
    with pytest.raises(NotImplementedError, match="IA3"):
        ragged.nn.convert(ia3)
    # injected without a PeftModel (transformers' PEFT integration): the layer's Linear is refused
    base = inject_adapter_in_model(
        IA3Config(target_modules=["query"], feedforward_modules=[]), _hf_model("bert", "base")
    )
    _refused(base, "encoder.layer.0 q projection is a Linear (peft's ia3)")
    # fan_in_fan_out (peft sets it only over transposed Conv1D weights)
    model, _ = _peft("bert", ["key"])
    model.base_model.model.bert.encoder.layer[1].attention.self.key.fan_in_fan_out = True
    _refused(model, "encoder.layer.1 k projection", "fan_in_fan_out")


def test_changes_after_conversion_are_refused_at_call_time():
    ours, _ = _peft("bert", ["query", "value"])
    _convert(ours)
    ids, mask = _batch(LENGTHS)
    # a per-row adapter choice (peft's forward hooks on its LoRA Linears)
    with pytest.raises(NotImplementedError, match="adapter_names"):
        ours.eval()(input_ids=ids, attention_mask=mask, adapter_names=["default"] * len(LENGTHS))
    # an adapter added with dropout (to a fresh model: peft leaves its adapter_names hooks in place
    # when the forward inside raises)
    ours, _ = _peft("bert", ["query", "value"])
    _convert(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours.add_adapter(
            "drop", LoraConfig(task_type=TaskType.SEQ_CLS, r=2, lora_dropout=0.2, target_modules=["query"])
        )
    with pytest.raises(NotImplementedError, match=r"q projection has adapter 'drop' with lora_dropout=0\.2"):
        ours(input_ids=ids, attention_mask=mask)


def test_modernbert_layers_with_lora_are_refused():
    config = tf.ModernBertConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, pad_token_id=1
    )
    model = tf.ModernBertModel(config).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuner = get_peft_model(model, LoraConfig(r=2, target_modules=["Wqkv"]))
    _refused(tuner, "layers.0.attn.Wqkv is a Linear")


# --------------------------------------------------------------------------------------
# sentence-transformers


def _sentence_transformer(tmp_path):
    st_mod = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer import modules as M

    words = [
        "[PAD]",
        "[UNK]",
        "[CLS]",
        "[SEP]",
        "[MASK]",
        *"abcdefghijklmnopqrstuvwxyz",
        "hello",
        "world",
        "the",
        "fox",
    ]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n")
    tf.BertTokenizerFast(str(tmp_path / "vocab.txt"), model_max_length=64).save_pretrained(str(tmp_path))
    config = tf.BertConfig(
        vocab_size=len(words),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    model = tf.BertModel(config)
    _randomise(model, 7)
    model.save_pretrained(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = M.Transformer(str(tmp_path))
    return st_mod.SentenceTransformer(modules=[first, M.Pooling(32, "mean")], device="cpu")


TEXTS = ["", "a", "hello world", "the quick brown fox", "fox " * 20, "zz"]


def _same_embeddings(st):
    st.double().eval()
    _randomise_adapters(st, 13)
    ref = copy.deepcopy(st)
    assert ragged.nn.convert(st) is st
    assert hf.is_converted(st[0].auto_model)
    torch.testing.assert_close(
        torch.as_tensor(st.encode(TEXTS, batch_size=4)), torch.as_tensor(ref.encode(TEXTS, batch_size=4)), **TOL
    )
    features = ref.preprocess(TEXTS)
    torch.testing.assert_close(
        st(dict(features))["sentence_embedding"], ref(dict(features))["sentence_embedding"], **TOL
    )


def test_sentence_transformer_with_an_injected_adapter(tmp_path):
    """The injection transformers' ``add_adapter`` (and sentence-transformers') performs: LoRA
    Linears in the auto_model, no PeftModel around it."""
    st = _sentence_transformer(tmp_path)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=ALL["bert"]), st[0].auto_model)
    _same_embeddings(st)


def test_sentence_transformer_add_adapter(tmp_path):
    st = _sentence_transformer(tmp_path)
    try:
        st.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]))
    except ValueError as err:  # transformers' PEFT integration asks for a newer peft than the one installed
        if "version of PEFT" not in str(err):
            raise
        pytest.skip(str(err))
    _same_embeddings(st)
