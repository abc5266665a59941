"""What a HuggingFace model family declares to be converted, and the machinery families share.

A family is one object (a :class:`Family`) declared in its own file of this package (``bert.py``,
``roberta.py``, ...); :mod:`ragged.nn.hf.families` lists them. It says:

* which classes it is: ``module`` (the modeling module in transformers), ``prefix`` (class
  names are ``f"{prefix}Model"``, ``f"{prefix}ForMaskedLM"``, ...) and ``kinds`` (the class-name
  suffixes it converts and their head kinds);
* its layer modules: :meth:`Family.layers` and, for the checks, :meth:`Family.layer_reason`;
* its attention shape and how a layer runs: :meth:`Family.run_layer` (and
  :meth:`Family.run_stack` where a stack of layers runs faster as one call);
* its embeddings (:meth:`Family.embed`, positions included) and what follows the last layer
  (:meth:`Family.finish`);
* its heads: the submodules each head kind calls (``head_modules``) and their logits, and the
  heads whose HuggingFace loss is the model's ``loss_function`` (``loss_function_heads``);
* its outputs: the base model's output class and fields (:meth:`Family.base_fields`);
* what it refuses: :meth:`Family.config_reason`, :meth:`Family.model_reason` and the modules
  the converted forward does not call, which must carry no hooks (:meth:`Family.bypassed`).

:class:`SpecFamily` is the shared base of families whose layers are the layer core's
post-norm layer (BERT, RoBERTa, ELECTRA, DistilBERT): each layer is read into a
:class:`ragged.nn.layer.LayerSpec` on every forward and run by :func:`ragged.nn.layer.run_layer`
(or :func:`ragged.nn.layer.run_stack`). Such a family only names its modules.

Nothing here imports transformers: the model's own modules are called (embeddings, heads) or
read (the layers' Linear and LayerNorm parameters); classes are looked up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from typing import ClassVar

import torch
from torch import nn

import ragged
from ragged.utils import eager

from ..layer import LayerSpec, LayerWeights, fused_backend, run_layer, run_stack
from ..layer_spec import concatenated
from .batch import Batch
from .lora import effective_linear, linear_reason

__all__ = [
    "KINDS",
    "Family",
    "SpecFamily",
    "exact",
    "fused_activation",
    "hook_kinds",
    "packed_in_projection",
    "param",
    "sub",
]

# class-name suffix -> head kind, for the families that have all of them
KINDS = {
    "Model": "base",
    "ForSequenceClassification": "sequence",
    "ForTokenClassification": "token",
    "ForMaskedLM": "masked_lm",
    "ForQuestionAnswering": "qa",
}

_MISSING = object()


def sub(module: nn.Module, name: str):
    """``module.<name>``, the module's own dict first (``Module.__getattr__`` costs about 0.3 us a read)."""
    value = module._modules.get(name)
    return getattr(module, name) if value is None else value


def param(module: nn.Module, name: str):
    """``module.<name>`` for a parameter: the module's own dict first; a name that is not a plain
    parameter there (a parametrization, say) goes through getattr."""
    value = module._parameters.get(name, _MISSING)
    return getattr(module, name) if value is _MISSING else value


def exact(module, kind: type, path: str, what: str) -> str | None:
    """Why ``module`` is not exactly of class ``kind`` (a subclass may run other code), or None."""
    if type(module) is not kind:
        return f"its {path} is a {type(module).__name__}, not a {what} (ragged would not run its code)"
    return None


def packed_in_projection(q: nn.Module, k: nn.Module, v: nn.Module):
    """``(in_w [3d, d], in_b [3d] or None)``: the three projections concatenated, on every call
    (each a torch.nn.Linear or peft's LoRA Linear: :func:`ragged.nn.hf.lora.effective_linear`).

    Outside :func:`ragged.nn.layer_spec.frozen_weights` nothing is cached: a cache would need a
    key that every write to the weights changes, and writes through ``.data`` (an EMA or
    target-network update, a re-initialisation) change neither a tensor's version counter nor
    its address. The concatenation copies the three weights once per layer and forward (reads
    and writes ``3 d^2`` elements: a small share of the layer's GEMMs at a batch of more than a
    few tokens, but not at one short text on a CPU); when a gradient is recorded, autograd
    reaches the original Parameters through it. Under ``frozen_weights`` (the encode pipeline,
    ``ragged.serve``) it is made once per set of CPU Parameters."""
    qw, qb = effective_linear(q, "the layer's q projection")
    kw, kb = effective_linear(k, "the layer's k projection")
    vw, vb = effective_linear(v, "the layer's v projection")
    w = concatenated((qw, kw, vw))
    b = None if qb is None else concatenated((qb, kb, vb))
    return w, b


def fused_activation(act):
    """The :func:`ragged.bias_act` / :func:`ragged.gated_act` name of a HuggingFace activation
    module, or ``act`` itself (then called on the tokens): erf GELU (``"gelu"``,
    ``"gelu_python"``), the tanh approximation (``"gelu_new"``, ``"gelu_pytorch_tanh"``,
    ``"gelu_python_tanh"``: the fused kernel computes the same formula) and ReLU, by exact class
    and without hooks."""
    kind = type(act)
    if act is torch.nn.functional.gelu:
        return "gelu"
    if act is torch.nn.functional.relu:
        return "relu"
    if not isinstance(act, nn.Module) or act._forward_hooks or act._forward_pre_hooks:
        return act
    if kind is nn.ReLU:
        return "relu"
    if kind is nn.GELU:
        return "gelu" if act.approximate == "none" else "gelu_tanh"
    if kind.__module__ == "transformers.activations":
        if kind.__name__ == "GELUActivation":
            return "gelu"
        if kind.__name__ in ("NewGELUActivation", "GELUTanh"):
            return "gelu_tanh"
    return act


def hook_kinds(module: nn.Module) -> list[str]:
    """The hooks on ``module`` itself, except HuggingFace's output-capturing hooks (installed
    on the layers by ``output_hidden_states``; inactive outside HuggingFace's own forward, and
    the converted forward collects hidden states itself)."""
    kinds = []
    for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
        for hook in (getattr(module, name, None) or {}).values():
            if not (
                getattr(hook, "__name__", "") == "output_capturing_hook"
                and getattr(hook, "__module__", "").startswith("transformers.")
            ):
                kinds.append(name.strip("_").replace("_", " "))
                break
    return kinds


def rate(dropout: nn.Module) -> float:
    """The rate a Dropout module applies now (0 in eval mode)."""
    return dropout.p if dropout.training else 0.0


class Family:
    """One HuggingFace model family (see the module docstring). Subclasses override what
    differs; one instance per transformers modeling module."""

    kinds = KINDS
    layer_path = "encoder.layer"  # from the base model to the ModuleList of layers
    base_output = "BaseModelOutputWithPoolingAndCrossAttentions"
    head_modules: ClassVar[dict[str, tuple[str, ...]]] = {}  # head kind -> the head's submodules called
    positions_from_ids = False  # positions counted from the ids (RoBERTa) rather than columns
    # head kinds ("masked_lm", "qa") whose HuggingFace loss is ``self.loss_function(..., **kwargs)``: the
    # forward's other keyword arguments reach it (num_items_in_batch, ignore_index), as in the converted head
    loss_function_heads: tuple[str, ...] = ()
    refused_families = ()  # (module fragment, why) for classes near this family it refuses

    def __init__(self, name: str, module: str, prefix: str) -> None:
        self.name = name  # as the documentation names it
        self.module = module  # the modeling module in transformers
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def cls(self, name: str) -> type:
        """Class ``name`` of the family's modeling module (loaded: a model of it exists)."""
        return getattr(sys.modules[self.module], name)

    # ---- structure

    def layers(self, base: nn.Module) -> nn.ModuleList:
        module = base
        for name in self.layer_path.split("."):
            module = module._modules[name]
        return module

    def bypassed(self, base: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(path, module)`` for the modules of the base model the converted forward runs
        without calling them, whose hooks or replaced forwards would not run: by default the
        subtree of the module holding the layers (the encoder)."""
        path = self.layer_path.rsplit(".", 1)[0]
        return [(f"{path}.{p}" if p else path, s) for p, s in base._modules[path].named_modules(remove_duplicate=False)]

    def hidden_size(self, config) -> int:
        return config.hidden_size

    def max_len(self, model: nn.Module) -> tuple[int, str] | None:
        """``(L, why)``: the longest sequence the converted ``model`` takes, and where that comes
        from: the rows of its position-embedding table, else ``config.max_position_embeddings``;
        None where neither is known. :func:`ragged.nn.graphed` sizes its buckets by it (a spare
        row's position runs up to the bucket's length)."""
        table = getattr(getattr(model.base_model, "embeddings", None), "position_embeddings", None)
        if isinstance(table, nn.Embedding):
            return table.num_embeddings, f"its position embeddings have {table.num_embeddings} rows"
        rows = getattr(model.config, "max_position_embeddings", None)
        if isinstance(rows, bool) or not isinstance(rows, int):
            return None
        return rows, f"max_position_embeddings={rows}"

    # ---- what it refuses

    def config_reason(self, config) -> str | None:
        """Why the model's configuration cannot be converted, or None."""
        return None

    def layer_reason(self, layer: nn.Module, path: str, hidden: int) -> str | None:
        """Why layer ``layer`` (at ``path``) cannot be run by :meth:`run_layer`, or None."""
        raise NotImplementedError

    def model_reason(self, model: nn.Module, base: nn.Module, kind: str, prefix: str) -> str | None:
        """Why the model's head cannot be run, beyond a missing head module, or None."""
        return None

    # ---- compute

    def embed(self, fn: str, base: nn.Module, batch: Batch, ids, embeds, token_type_ids, position_ids):
        """``[T, hidden]``: the model's embeddings on the packed tokens."""
        raise NotImplementedError

    def context(self, fn: str, base: nn.Module, batch: Batch, x: torch.Tensor, position_ids):
        """What every layer of one forward reads (computed once per forward): by default the
        offsets and the longest length."""
        return batch.rt

    def run_layer(self, layer: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
        """Layer ``layer`` on ``x [T, hidden]``; its parameters are read here (an FSDP2 unit's
        are gathered now)."""
        raise NotImplementedError

    def run_stack(self, layers, x: torch.Tensor, ctx) -> torch.Tensor | None:
        """All layers at once where that is faster (inference, no hooks); None to run them one by one."""
        return None

    def finish(self, base: nn.Module, y: torch.Tensor) -> torch.Tensor:
        """What follows the last layer (a final norm), on ``[T, hidden]``."""
        return y

    # ---- heads and outputs

    def base_fields(self, base: nn.Module, enc) -> dict:
        """The base model's output fields beside ``last_hidden_state`` (a pooler's output)."""
        return {}

    def sequence_logits(self, model: nn.Module, base: nn.Module, enc) -> torch.Tensor:
        raise NotImplementedError

    def token_logits(self, model: nn.Module, h: torch.Tensor) -> torch.Tensor:
        m = model._modules
        return m["classifier"](m["dropout"](h))

    def masked_lm_logits(self, model: nn.Module, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def masked_lm_tokens(self, model: nn.Module, target: torch.Tensor | None) -> torch.Tensor | None:
        """The packed tokens whose masked-LM logits are computed: None for all of them."""
        return None

    def qa_logits(self, model: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return model._modules["qa_outputs"](h)


def pooled_output(base: nn.Module, enc) -> torch.Tensor | None:
    """``[B, d]``: the base model's pooler on each sequence's first token (None without one).
    The pooler is called as HuggingFace calls it, on a ``[B, 1, d]`` batch."""
    pooler = base._modules.get("pooler")
    if pooler is None:
        return None
    return pooler(ragged.pool(enc.rt, "first").unsqueeze(1))


class SpecFamily(Family):
    """A family whose layers are the layer core's post-norm layer, read into a LayerSpec. A
    subclass names its layer's modules (:meth:`layer_modules`), the classes that must be
    HuggingFace's own (``layer_class``, ``layer_parts``, ``attention_class``) and its
    attention shape."""

    base_output = "BaseModelOutputWithPoolingAndCrossAttentions"

    @property
    def layer_class(self) -> str:
        return f"{self.prefix}Layer"

    @property
    def attention_class(self) -> str:
        return f"{self.prefix}SelfAttention"

    @property
    def layer_parts(self) -> dict[str, str]:
        """Submodule path -> the transformers class it must be."""
        return {
            "attention": f"{self.prefix}Attention",
            "attention.output": f"{self.prefix}SelfOutput",
            "intermediate": f"{self.prefix}Intermediate",
            "output": f"{self.prefix}Output",
        }

    def layer_modules(self, layer: nn.Module) -> dict:
        """The modules of one layer under common names: the self-attention (``attn``), its
        projections (``q``, ``k``, ``v``, ``out``), ``norm1``, ``ff1``, ``act``, ``ff2``,
        ``norm2`` and the dropouts after the attention block (``drop1``, None where there is
        none) and after the feed-forward block (``drop2``)."""
        attention = sub(layer, "attention")
        attn, self_out = sub(attention, "self"), sub(attention, "output")
        inter, out = sub(layer, "intermediate"), sub(layer, "output")
        return {
            "attn": attn,
            "q": sub(attn, "query"),
            "k": sub(attn, "key"),
            "v": sub(attn, "value"),
            "out": sub(self_out, "dense"),
            "norm1": sub(self_out, "LayerNorm"),
            "drop1": sub(self_out, "dropout"),
            "ff1": sub(inter, "dense"),
            "act": inter.intermediate_act_fn,
            "ff2": sub(out, "dense"),
            "drop2": sub(out, "dropout"),
            "norm2": sub(out, "LayerNorm"),
        }

    def attention_shape(self, attn: nn.Module) -> tuple[int, int]:
        """``(heads, head_dim)`` of a layer's self-attention."""
        return attn.num_attention_heads, attn.attention_head_size

    def layer_spec(self, layer: nn.Module) -> LayerSpec:
        """The :class:`LayerSpec` of one HuggingFace layer (post-norm): its weights (Q, K and V
        concatenated by :func:`packed_in_projection`), LayerNorm eps, activation and, in
        training mode, the dropout rates of the attention probabilities, after the attention
        block, none in the feed-forward hidden layer, and after the feed-forward block."""
        m = self.layer_modules(layer)
        attn = m["attn"]
        # a torch.nn.Linear, or peft's LoRA Linear read as the Linear it computes; any other module (one
        # swapped in after conversion, say) raises rather than being read as a plain Linear
        in_w, in_b = packed_in_projection(m["q"], m["k"], m["v"])
        out = effective_linear(m["out"], "the layer's out projection")
        ff1 = effective_linear(m["ff1"], "the layer's ff1 projection")
        ff2 = effective_linear(m["ff2"], "the layer's ff2 projection")
        heads, head_dim = self.attention_shape(attn)
        norm1, norm2 = m["norm1"], m["norm2"]
        p_attn = sub(attn, "dropout").p if attn.training else 0.0
        drop1 = m["drop1"]
        dropout = (p_attn, 0.0 if drop1 is None else rate(drop1), 0.0, rate(m["drop2"]))
        weights = LayerWeights(
            in_w,
            in_b,
            out[0],
            out[1],
            param(norm1, "weight"),
            param(norm1, "bias"),
            ff1[0],
            ff1[1],
            ff2[0],
            ff2[1],
            param(norm2, "weight"),
            param(norm2, "bias"),
        )
        return LayerSpec(heads, head_dim, False, fused_activation(m["act"]), (norm1.eps, norm2.eps), dropout, weights)

    def context(self, fn, base, batch, x, position_ids):
        return batch.rt

    def spec_of(self, layer: nn.Module, ctx) -> LayerSpec:
        """The layer's spec in this forward (:meth:`layer_spec`, plus what ``ctx`` adds)."""
        return self.layer_spec(layer)

    def run_layer(self, layer, x, ctx):
        spec = self.spec_of(layer, ctx)
        is_eager = eager(x, ctx.offsets, *[w for w in spec.weights if w is not None])
        return run_layer(spec, x, ctx.offsets, ctx.max_len, False, fused_backend(x), is_eager)

    def run_stack(self, layers, x, ctx):
        fused = fused_backend(x)
        if fused is None or not eager(x, ctx.offsets):
            return None
        return run_stack([self.spec_of(layer, ctx) for layer in layers], x, ctx.offsets, ctx.max_len, False, fused)

    def layer_reason(self, layer, path, hidden):
        why = exact(layer, self.cls(self.layer_class), path, f"transformers {self.layer_class}")
        if why:
            return why
        if "crossattention" in layer._modules:
            return f"its {path} has cross-attention, which is not supported"
        try:
            for name, cls_name in self.layer_parts.items():
                why = exact(layer.get_submodule(name), self.cls(cls_name), f"{path}.{name}", f"transformers {cls_name}")
                if why:
                    return why
            m = self.layer_modules(layer)
        except AttributeError as err:
            return f"its {path} lacks a module HuggingFace's layer has ({err})"
        attn = m["attn"]
        why = exact(attn, self.cls(self.attention_class), f"{path} attention", f"transformers {self.attention_class}")
        if why:
            return why
        heads, head_dim = self.attention_shape(attn)
        if heads * head_dim != hidden:
            return f"its {path} attention has {heads} heads of {head_dim} features, not the hidden size {hidden}"
        for name in ("q", "k", "v", "out", "ff1", "ff2"):
            why = linear_reason(m[name], f"its {path} {name} projection")
            if why:
                return why
        for name in ("q", "k", "v", "out"):
            if (m[name].in_features, m[name].out_features) != (hidden, hidden):
                return f"its {path} {name} projection is not a {hidden} x {hidden} Linear"
        if (m["q"].bias is None) != (m["k"].bias is None) or (m["q"].bias is None) != (m["v"].bias is None):
            return f"its {path} query, key and value projections do not all have biases, or all lack them"
        if (
            m["ff1"].in_features != hidden
            or m["ff2"].out_features != hidden
            or m["ff2"].in_features != m["ff1"].out_features
        ):
            return f"its {path} feed-forward Linears do not map {hidden} -> ff -> {hidden}"
        for name in ("norm1", "norm2"):
            norm = m[name]
            why = exact(norm, nn.LayerNorm, f"{path} {name}", "torch.nn.LayerNorm")
            if why:
                return why
            if tuple(norm.normalized_shape) != (hidden,) or not norm.elementwise_affine:
                return f"its {path} {name} is not a LayerNorm over the {hidden} features with a learned weight"
        drops = {"attention dropout": getattr(attn, "dropout", None), "output dropout": m["drop2"]}
        if m["drop1"] is not None:
            drops["attention output dropout"] = m["drop1"]
        for name, drop in drops.items():
            why = exact(drop, nn.Dropout, f"{path} {name}", "torch.nn.Dropout")
            if why:
                return why
        return None

    def config_reason(self, config):
        if getattr(config, "is_decoder", False):
            return "config.is_decoder=True (causal self-attention with a key/value cache) is not supported"
        if getattr(config, "add_cross_attention", False):
            return "config.add_cross_attention=True (cross-attention layers) is not supported"
        position = getattr(config, "position_embedding_type", "absolute")
        if position not in (None, "absolute"):
            return f"config.position_embedding_type={position!r} is not supported (absolute positions only)"
        return None

    def embed_positions(self, base: nn.Module, batch: Batch, ids) -> torch.Tensor:
        """Positions when the caller passes none: the columns of the padded input."""
        return batch.columns()

    def embed(self, fn, base, batch, ids, embeds, token_type_ids, position_ids):
        pos = batch.pack(fn, "position_ids", position_ids, 0, broadcast=True)
        if pos is None:
            pos = self.embed_positions(base, batch, ids)
        types = batch.pack(fn, "token_type_ids", token_type_ids, 0, broadcast=True)
        h = sub(base, "embeddings")(
            input_ids=_row(ids), token_type_ids=_row(types), position_ids=_row(pos), inputs_embeds=_row(embeds)
        )
        return h[0]

    def base_fields(self, base, enc):
        return {"pooler_output": pooled_output(base, enc)}

    def sequence_logits(self, model, base, enc):
        # RobertaClassificationHead / ElectraClassificationHead read [:, 0]
        return model._modules["classifier"](ragged.pool(enc.rt, "first").unsqueeze(1))


def _row(t):
    """A packed ``[T, ...]`` tensor as HuggingFace's modules take it: a batch of one row."""
    return None if t is None else t.unsqueeze(0)
