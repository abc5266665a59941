"""Transformers decoder base models run on packed batches, under ``attn_implementation="ragged"``
(:mod:`ragged.nn.hf.attention`): what a sentence-transformers ``Transformer`` over a decoder (Qwen3-Embedding,
EmbeddingGemma and the like) runs once converted (:mod:`ragged.nn.hf.sentence`).

Unlike the encoder families of this package, a decoder keeps its own forward: nothing of the model
is patched. Its attention layers call transformers' attention interface, and ``"ragged"`` there
runs :func:`ragged.varlen_attention` on a flattened batch: the packed tokens as one row
``input_ids [1, T]``, ``position_ids [1, T]`` and the offsets as ``cu_seq_lens_q`` /
``cu_seq_lens_k`` with the longest sequence as ``max_length_q`` / ``max_length_k`` (host ints). Each
sequence attends within itself (causally, or both ways where the model's attention modules or its
config's ``is_causal`` say so: EmbeddingGemma's ``use_bidirectional_attention``), sliding windows
included; every other step of a decoder layer acts on each token alone, which is what makes the
one row safe: a model whose layers mix tokens some other way (convolutions, linear attention,
state-space layers) would mix the sequences, so only the classes listed in :data:`DECODERS`,
checked against transformers' padded forward, are taken.

**The decoder core.** Where :func:`ragged.nn.hf.decoder_core.why_not_core` takes the model (the
families of :data:`ragged.nn.hf.decoder_core.CORE_FAMILIES`, plain Linears, no hooks on the modules
it does not call), :func:`run_packed` computes the layers from ragged's fused ops
(:mod:`ragged.nn.decoder_layer`) instead of calling the model's forward; otherwise the model's
forward runs as below, with a one-time warning saying why.

**Positions** are the caller's (:func:`run_packed`'s ``position_ids``, the padded batch's columns
for a left-padded one, as transformers numbers them) or each sequence's from 0. **Masks**: models
that take prepared masks by layer type (``mask_mapping``) get ``None`` for every type, so no mask
is built and nothing is read from the device; the others build theirs from the position ids,
which costs transformers' one device-to-host read per forward (none while a CUDA graph is
captured, where transformers skips it). The padding mask function of ``"ragged"`` returns None
for a flattened batch either way: the offsets carry the sequences.

**Refused** (:func:`why_not`), with the model untouched: other classes (a subclass too),
attention logit soft-capping (Gemma 2's default), ``output_attentions`` in the config. Setting
``config._attn_implementation = "ragged"`` is :func:`use_ragged_attention`'s (conversion calls it);
:func:`run_packed` raises when it was changed since.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

import torch
from torch import nn

from ragged import RaggedTensor
from ragged.utils import describe

__all__ = [
    "DECODERS",
    "Decoder",
    "PackedDecoder",
    "identify_decoder",
    "restore_attention",
    "run_packed",
    "supported",
    "use_ragged_attention",
    "uses_ragged_attention",
    "why_not",
]

NAME = "ragged"  # the attention implementation's name (attention.NAME; read here without importing transformers)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A decoder base class taken: ``name`` (for messages), the transformers ``module`` (under
    ``transformers.models.``) and ``cls`` name, and ``mask_mapping``: whether its forward takes
    prepared masks as a dict by layer type (then none is built)."""

    name: str
    module: str
    cls: str
    mask_mapping: bool

    def resolve(self) -> type | None:
        """The class, where its module is loaded (never imports it)."""
        mod = sys.modules.get(f"transformers.models.{self.module}")
        return getattr(mod, self.cls, None) if mod is not None else None


DECODERS = (
    Decoder("Llama", "llama.modeling_llama", "LlamaModel", False),
    Decoder("Mistral", "mistral.modeling_mistral", "MistralModel", False),
    Decoder("Qwen2", "qwen2.modeling_qwen2", "Qwen2Model", True),
    Decoder("Qwen3", "qwen3.modeling_qwen3", "Qwen3Model", True),
    Decoder("Gemma", "gemma.modeling_gemma", "GemmaModel", False),
    Decoder("Gemma2", "gemma2.modeling_gemma2", "Gemma2Model", True),
    Decoder("Gemma3", "gemma3.modeling_gemma3", "Gemma3TextModel", True),
)
_MASK_TYPES = ("full_attention", "sliding_attention")


def supported() -> str:
    """The decoder classes taken, for messages."""
    return ", ".join(d.cls for d in DECODERS)


def identify_decoder(model: object) -> Decoder | None:
    """The :class:`Decoder` whose class ``model`` is exactly; None otherwise."""
    cls = type(model)
    for d in DECODERS:
        if cls.__name__ == d.cls and d.resolve() is cls:
            return d
    return None


def why_not(model: nn.Module) -> str | None:
    """Why ``model`` cannot run on packed batches; None when it can. Reads only."""
    d = identify_decoder(model)
    if d is None:
        return f"{type(model).__name__} is not a decoder ragged runs on packed batches (supported: {supported()})"
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return (
            f"its config sets attn_logit_softcapping={config.attn_logit_softcapping!r} (attention logit "
            "soft-capping), which ragged's attention does not compute"
        )
    if getattr(config, "output_attentions", False):
        return "its config sets output_attentions=True; ragged's attention forms no attention weights"
    return None


def uses_ragged_attention(model: nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NAME


def use_ragged_attention(model: nn.Module) -> str | None:
    """Set ``attn_implementation="ragged"`` on ``model`` (registering it with transformers first);
    returns the implementation it had, for :func:`restore_attention`."""
    from . import attention  # imports transformers

    attention.register()
    before = getattr(model.config, "_attn_implementation", None)
    if before != NAME:
        model.set_attn_implementation(NAME)
    return before


def restore_attention(model: nn.Module, before: str | None) -> None:
    """Undo :func:`use_ragged_attention`."""
    if before is not None and before != NAME:
        model.set_attn_implementation(before)


def run_packed(model: nn.Module, input_ids: RaggedTensor, position_ids: torch.Tensor | None = None) -> dict:
    """``model`` (a decoder of :data:`DECODERS` under ``attn_implementation="ragged"``) on the
    packed ``input_ids`` (values ``[T]``): ``{"last_hidden_state": RaggedTensor [T, d],
    "hidden_states": tuple of RaggedTensors or None}`` (the hidden states where the config asks
    for them), with the input's offsets. ``position_ids``: ``[T]`` (default: each sequence's
    positions from 0). No host read for models that take prepared masks (see the module
    docstring)."""
    fn = f"{type(model).__name__}.forward"
    if not uses_ragged_attention(model):
        raise NotImplementedError(
            f"{fn}(): the packed batch needs attn_implementation={NAME!r}, but the model's is "
            f"{getattr(model.config, '_attn_implementation', None)!r} (changed after conversion?): every sequence "
            "would attend to the others; convert the model again"
        )
    if not isinstance(input_ids, RaggedTensor):
        raise TypeError(f"{fn}(): expected input_ids to be a RaggedTensor of token ids, got {describe(input_ids)}")
    if position_ids is None:
        position_ids = input_ids.position_ids()
    if input_ids.num_tokens == 0:
        return _empty(model, input_ids)
    why = _why_not_core(model)
    if why is None:  # the decoder core: the layers from ragged's fused ops, no HF module per op
        from .decoder_core import run_packed_core

        hidden_list: list | None = [] if getattr(model.config, "output_hidden_states", False) else None
        last = run_packed_core(model, input_ids, position_ids, hidden_list)
        states = None if hidden_list is None else tuple(input_ids.with_values(h) for h in hidden_list)
        return {"last_hidden_state": last, "hidden_states": states}
    _warn_once(model, why)
    d = identify_decoder(model)
    offsets, longest = input_ids.offsets, input_ids.max_len
    kwargs = {}
    if d is not None and d.mask_mapping:
        types = dict.fromkeys((*_MASK_TYPES, *(getattr(model.config, "layer_types", None) or ())))
        kwargs["attention_mask"] = types  # prepared masks, all None: the offsets carry the sequences
    out = model(
        input_ids=input_ids.values.reshape(1, -1),
        position_ids=position_ids.reshape(1, -1),
        use_cache=False,
        return_dict=True,
        cu_seq_lens_q=offsets,
        cu_seq_lens_k=offsets,
        max_length_q=longest,
        max_length_k=longest,
        **kwargs,
    )
    hidden = out.get("hidden_states")
    if hidden is not None:
        hidden = tuple(None if h is None else input_ids.with_values(h[0]) for h in hidden)
    return {"last_hidden_state": input_ids.with_values(out["last_hidden_state"][0]), "hidden_states": hidden}


_WARNED: set[tuple[str, str]] = set()


def _why_not_core(model: nn.Module) -> str | None:
    from .decoder_core import why_not_core

    return why_not_core(model)


def _warn_once(model: nn.Module, why: str) -> None:
    """The slower path (HF's layers under ``"ragged"`` attention) said once per class and reason."""
    key = (type(model).__name__, why)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"ragged.nn: {type(model).__name__} runs HuggingFace's own layers on the packed batch (with "
            f"ragged's attention), not the decoder core: {why}",
            stacklevel=3,
        )


def _empty(model: nn.Module, input_ids: RaggedTensor) -> dict:
    """The output for a batch of no tokens (the model is not called: a row of none)."""
    weight = model.get_input_embeddings().weight
    values = weight.new_zeros((0, model.config.hidden_size))
    hidden = None
    if getattr(model.config, "output_hidden_states", False):
        hidden = tuple(input_ids.with_values(values) for _ in range(model.config.num_hidden_layers + 1))
    return {"last_hidden_state": input_ids.with_values(values), "hidden_states": hidden}


class PackedDecoder(nn.Module):
    """``model`` as a module of RaggedTensors (what :func:`ragged.nn.graphed` captures for a
    converted SentenceTransformer over a decoder): ``forward(input_ids, position_ids=None)``
    with ``input_ids`` a RaggedTensor of ids and ``position_ids`` one of positions (or None), the
    :func:`run_packed` output out (``return_dict`` is taken and ignored: always a dict;
    ``token_type_ids`` too, as the decoders' own forward ignores the token types a BERT-style
    tokenizer gives). Its mode is the model's.

    A graph's bucket holds rows past ``offsets[-1]`` (see :mod:`ragged.nn.graphed`), which
    :func:`ragged.varlen_attention` takes only inside a sequence: the call gives them sequences of
    their own, ``ceil(rows / max_len)`` of at most ``max_len`` rows each, cut from the offsets on the
    device (no read; empty where there are no such rows), so each real sequence attends as before."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def training(self) -> bool:
        """The model's mode (the graphs replay inference for a model in eval mode)."""
        model = self._modules.get("model") if "_modules" in self.__dict__ else None
        return bool(model is not None and model.training)

    @training.setter
    def training(self, mode: bool) -> None:
        pass  # train() / eval() set the model's own, which this reads

    def forward(
        self,
        input_ids: RaggedTensor,
        position_ids: RaggedTensor | None = None,
        return_dict: bool = True,
        token_type_ids: RaggedTensor | None = None,
    ) -> dict:
        if not isinstance(input_ids, RaggedTensor):
            raise TypeError(
                f"PackedDecoder.forward(): expected input_ids to be a RaggedTensor of token ids, got "
                f"{describe(input_ids)}"
            )
        rows, longest, offsets = input_ids.values.shape[0], max(input_ids.max_len, 1), input_ids.offsets
        if position_ids is None:
            positions = input_ids.position_ids()
        else:
            positions = position_ids.values if isinstance(position_ids, RaggedTensor) else position_ids
        ends = torch.arange(1, -(-rows // longest) + 1, device=offsets.device, dtype=offsets.dtype) * longest
        spare = (offsets[-1:] + ends).clamp_(max=rows)
        out = run_packed(self.model, RaggedTensor(input_ids.values, torch.cat([offsets, spare]), longest), positions)
        hidden = out["hidden_states"]  # with the caller's offsets again
        return {
            "last_hidden_state": input_ids.with_values(out["last_hidden_state"].values),
            "hidden_states": None
            if hidden is None
            else tuple(None if h is None else input_ids.with_values(h.values) for h in hidden),
        }
