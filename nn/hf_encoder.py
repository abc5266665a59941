"""The encoder of a converted HuggingFace BERT-family model (see :mod:`ragged.nn.hf_bert`):
the batch read once, the embeddings on packed tokens, every layer described as a
:class:`ragged.nn.layer.LayerSpec` and run by the layer core.

Coordinates: a *packed token* is row ``t`` of ``values [T, ...]``; its *position* is its
index ``j`` within its sequence; its *column* is where it sat in the caller's padded
``[B, M]`` batch (the position for right padding and for RaggedTensor inputs).

Nothing here imports transformers: the model's own modules are called (embeddings, heads)
or read (the layers' Linear and LayerNorm parameters).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ragged
from ragged import RaggedTensor
from ragged.padding import PaddedLayout, mask_keep, pack_by_layout, read_mask_layout
from ragged.utils import describe, eager

from .layer import LayerSpec, LayerWeights, call_with_hooks, fused_backend, plain_call, run_layer, run_stack

__all__ = ["Batch", "Family", "encode", "layer_spec", "packed_in_projection", "read_batch"]


@dataclasses.dataclass(frozen=True)
class Family:
    """What differs between the BERT-family models: ``style`` is ``"bert"`` (BERT),
    ``"roberta"`` (RoBERTa, XLM-RoBERTa, CamemBERT: positions from ``padding_idx + 1``),
    ``"electra"`` (BERT's layers, ``embeddings_project`` when ``embedding_size !=
    hidden_size``) or ``"distil"`` (DistilBERT: its own names, no token types)."""

    name: str        # as the documentation names it
    module: str      # the modeling module in transformers
    prefix: str      # class-name prefix: f"{prefix}Model", f"{prefix}ForMaskedLM", ...
    style: str

    @property
    def encoder_name(self) -> str:
        return "transformer" if self.style == "distil" else "encoder"

    @property
    def layer_class(self) -> str:
        return "TransformerBlock" if self.style == "distil" else f"{self.prefix}Layer"

    @property
    def attention_class(self) -> str:
        return f"{self.prefix}SelfAttention"


# --------------------------------------------------------------------------------------
# The batch: read once, packed with the caller's layout


def _sub(module: nn.Module, name: str):
    # the module's own dict first (Module.__getattr__ costs about 0.3 us a read)
    value = module._modules.get(name)
    return getattr(module, name) if value is None else value


@dataclasses.dataclass
class Batch:
    """The sequences of one call: ``rt`` (the packed input ids or embeddings, with the
    offsets and host ``max_len`` every step uses), ``layout`` (where the tokens sat in the
    caller's padded batch; None for a RaggedTensor input) and ``keep`` (``[B, M]`` bool,
    True at tokens; None without an attention mask or for a RaggedTensor input)."""

    rt: RaggedTensor
    layout: PaddedLayout | None
    keep: torch.Tensor | None = None

    @property
    def ragged(self) -> bool:
        return self.layout is None

    def pack(self, fn: str, name: str, t, features: int, broadcast: bool = False) -> torch.Tensor | None:
        """``t`` as packed ``[T, *F]`` values (``features`` = ``len(F)``): a RaggedTensor (its
        values), packed values ``[T, *F]`` with a RaggedTensor input, or a padded
        ``[B, M, *F]`` tensor (``[1, M, *F]`` too with ``broadcast``) with a padded input."""
        if t is None:
            return None
        total = self.rt.num_tokens
        if isinstance(t, RaggedTensor) or self.ragged:
            v = t.values if isinstance(t, RaggedTensor) else t
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"{fn}(): expected {name} to be a RaggedTensor or a tensor, got {describe(t)}")
            if v.dim() != 1 + features or v.shape[0] != total:
                raise ValueError(f"{fn}(): expected {name} with values of {1 + features} dims and {total} tokens "
                                 f"(those of the input), got shape {tuple(v.shape)}")
            return v
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}(): expected {name} to be a tensor or a RaggedTensor, got {describe(t)}")
        batch, width = self.rt.batch_size, self.layout.width
        if broadcast and t.dim() == 2 + features and t.shape[0] == 1 and batch != 1:
            t = t.expand(batch, *t.shape[1:])
        if t.dim() != 2 + features or tuple(t.shape[:2]) != (batch, width):
            raise ValueError(f"{fn}(): expected {name} of shape ({batch}, {width}{', ...' if features else ''}) "
                             f"like the input, got {tuple(t.shape)}")
        if self.layout.side == "scattered":
            return t[self.layout.index]
        return ragged.pack_values(t, self.rt.offsets, total, padding_side=self.layout.side)

    def out(self, values: torch.Tensor, fill: float = 0.0):
        """Packed ``values [T, ...]`` in the caller's form: a RaggedTensor, or padded like the
        input with ``fill`` at padding."""
        rt = self.rt.with_values(values)
        if self.layout is None:
            return rt
        if fill == 0.0:
            return self.layout.unpack(rt)
        if self.layout.side == "scattered":
            full = values.new_full((rt.batch_size, self.layout.width, *values.shape[1:]), fill)
            return full.index_put(self.layout.index, values)
        return ragged.unpack(rt, padding_value=fill, total_length=self.layout.width, padding_side=self.layout.side)

    def columns(self) -> torch.Tensor:
        """``[T]`` int64: each token's column in the padded input (its position when ragged)."""
        return self.rt.position_ids() if self.layout is None else self.layout.positions(self.rt)


def read_batch(fn: str, name: str, src, attention_mask, features: int) -> Batch:
    """The batch of ``src`` (``input_ids``: ``features=0``; ``inputs_embeds``: 1): a
    RaggedTensor is taken as it is (no device read); a padded ``[B, M, *F]`` tensor is
    packed with its 2-D HuggingFace ``attention_mask`` (1 at tokens, 0 at padding; right,
    left or scattered), which costs one device-to-host read (:func:`ragged.padding.read_mask_layout`;
    a scattered mask one more, for its token coordinates), or as full rows without one."""
    if isinstance(src, RaggedTensor):
        if attention_mask is not None:
            raise ValueError(f"{fn}(): attention_mask applies to padded inputs; the RaggedTensor {name} carries "
                             "its own lengths")
        if src.values.dim() != 1 + features:
            shape = "[T, E]" if features else "[T]"
            raise ValueError(f"{fn}(): expected {name} with values of shape {shape}, got {tuple(src.values.shape)}")
        return Batch(src, None)
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{fn}(): expected {name} to be a tensor or a RaggedTensor, got {describe(src)}")
    if src.dim() != 2 + features:
        shape = "[B, M, E]" if features else "[B, M]"
        raise ValueError(f"{fn}(): expected {name} of shape {shape} (or a RaggedTensor), got {tuple(src.shape)}")
    batch, width = src.shape[0], src.shape[1]
    if attention_mask is None:
        return Batch(ragged.pack(src), PaddedLayout(width))
    mask = attention_mask
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{fn}(): expected attention_mask to be a tensor, got {describe(mask)}")
    if mask.dim() != 2:
        raise NotImplementedError(f"{fn}(): attention_mask of shape {tuple(mask.shape)} is not supported: ragged takes "
                                  "the 2-D [B, M] padding mask (1 at tokens, 0 at padding), not 4-D attention masks")
    if tuple(mask.shape) != (batch, width):
        raise ValueError(f"{fn}(): expected attention_mask of shape ({batch}, {width}) like {name}, "
                         f"got {tuple(mask.shape)}")
    if mask.device != src.device:
        raise ValueError(f"{fn}(): expected attention_mask on {src.device} (the device of {name}), got {mask.device}")
    keep, bad = mask_keep(fn, "attention_mask", mask, "hf")
    # The one read of a padded call: lengths and layout flags together.
    host, is_right, is_left, is_bad = read_mask_layout(keep, bad)
    if is_bad:
        raise ValueError(f"{fn}(): expected attention_mask to hold 1 (token) and 0 (padding) only, got other values")
    rt, layout = pack_by_layout(src, keep, host, is_right, is_left)
    return Batch(rt, layout, keep)


# --------------------------------------------------------------------------------------
# Positions and embeddings


def _roberta_positions(ids: torch.Tensor, batch: Batch, pad: int) -> torch.Tensor:
    """RoBERTa's rule on packed ids: tokens that are not ``pad`` count ``pad + 1, pad + 2,
    ...`` within their sequence, ``pad`` tokens stay at ``pad``: a segment cumulative sum
    on the device, the same as HuggingFace's row cumsum whenever padding holds ``pad``."""
    rt = batch.rt
    real = (ids != pad).to(torch.int64)
    run = torch.cumsum(real, 0)
    # each token's sequence start, as row - position (safe for the spare rows of a graphed bucket)
    starts = torch.arange(rt.num_tokens, device=ids.device) - rt.position_ids()
    before = (run - real).index_select(0, starts)  # the count before each token's sequence
    return (run - before) * real + pad


def embed(fn: str, family: Family, base: nn.Module, batch: Batch, ids, embeds, token_type_ids,
          position_ids) -> torch.Tensor:
    """``[T, hidden]``: the model's own embeddings module on the packed tokens (called on a
    batch of one row ``[1, T]``), positions computed as the family computes them."""
    pos = batch.pack(fn, "position_ids", position_ids, 0, broadcast=True)
    emb = _sub(base, "embeddings")
    if pos is None:
        if family.style == "roberta":
            pad = emb.padding_idx
            pos = _roberta_positions(ids, batch, pad) if ids is not None else batch.columns() + (pad + 1)
        else:
            pos = batch.columns()
    one = (lambda t: None if t is None else t.unsqueeze(0))
    if family.style == "distil":  # DistilBERT has no token types (its forward ignores them too)
        h = emb(one(ids), one(embeds), one(pos))
    else:
        types = batch.pack(fn, "token_type_ids", token_type_ids, 0, broadcast=True)
        h = emb(input_ids=one(ids), token_type_ids=one(types), position_ids=one(pos), inputs_embeds=one(embeds))
    h = h[0]
    project = base._modules.get("embeddings_project") if family.style == "electra" else None
    return h if project is None else project(h)


# --------------------------------------------------------------------------------------
# The layers, described as LayerSpecs

_MISSING = object()


def _param(module: nn.Module, name: str):
    # the module's own dict first; a name that is not a plain parameter there (a
    # parametrization, say) goes through getattr
    value = module._parameters.get(name, _MISSING)
    return getattr(module, name) if value is _MISSING else value


def packed_in_projection(q: nn.Module, k: nn.Module, v: nn.Module):
    """``(in_w [3d, d], in_b [3d] or None)``: the three projections concatenated, on every call.

    Nothing is cached: a cache would need a key that every write to the weights changes, and
    writes through ``.data`` (an EMA or target-network update, a re-initialisation) change
    neither a tensor's version counter nor its address. The concatenation copies the three
    weights once per layer and forward (reads and writes ``3 d^2`` elements, a small share of
    the layer's GEMMs at any batch of more than a few tokens); when a gradient is recorded,
    autograd reaches the original Parameters through it."""
    w = torch.cat((_param(q, "weight"), _param(k, "weight"), _param(v, "weight")))
    qb = _param(q, "bias")
    b = None if qb is None else torch.cat((qb, _param(k, "bias"), _param(v, "bias")))
    return w, b


def fused_activation(act):
    """The :func:`ragged.bias_act` name of a HuggingFace activation module, or ``act`` itself
    (the layer core then calls it on ``[T, ff]``): erf GELU (``"gelu"``, ``"gelu_python"``),
    the tanh approximation (``"gelu_new"``, ``"gelu_pytorch_tanh"``, ``"gelu_python_tanh"``:
    the fused kernel computes the same formula) and ReLU, by exact class and without hooks."""
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


def _rate(dropout: nn.Module) -> float:
    return dropout.p if dropout.training else 0.0


def layer_modules(style: str, layer: nn.Module) -> dict:
    """The modules of one layer under the family's names: the self-attention (``attn``), its
    projections (``q``, ``k``, ``v``, ``out``), ``norm1``, ``ff1``, ``act``, ``ff2``, ``norm2``
    and the dropouts after the attention block (``drop1``, None in DistilBERT) and after the
    feed-forward block (``drop2``)."""
    if style == "distil":
        attn, ffn = _sub(layer, "attention"), _sub(layer, "ffn")
        return {"attn": attn, "q": _sub(attn, "q_lin"), "k": _sub(attn, "k_lin"), "v": _sub(attn, "v_lin"),
                "out": _sub(attn, "out_lin"), "norm1": _sub(layer, "sa_layer_norm"), "drop1": None,
                "ff1": _sub(ffn, "lin1"), "act": getattr(ffn, "activation"), "ff2": _sub(ffn, "lin2"),
                "drop2": _sub(ffn, "dropout"), "norm2": _sub(layer, "output_layer_norm")}
    attention = _sub(layer, "attention")
    attn, self_out = _sub(attention, "self"), _sub(attention, "output")
    inter, out = _sub(layer, "intermediate"), _sub(layer, "output")
    return {"attn": attn, "q": _sub(attn, "query"), "k": _sub(attn, "key"), "v": _sub(attn, "value"),
            "out": _sub(self_out, "dense"), "norm1": _sub(self_out, "LayerNorm"), "drop1": _sub(self_out, "dropout"),
            "ff1": _sub(inter, "dense"), "act": getattr(inter, "intermediate_act_fn"), "ff2": _sub(out, "dense"),
            "drop2": _sub(out, "dropout"), "norm2": _sub(out, "LayerNorm")}


def attention_shape(style: str, attn: nn.Module) -> tuple[int, int]:
    """``(heads, head_dim)`` of a layer's self-attention."""
    if style == "distil":
        return attn.n_heads, attn.attention_head_size
    return attn.num_attention_heads, attn.attention_head_size


def layer_spec(style: str, layer: nn.Module) -> LayerSpec:
    """The :class:`LayerSpec` of one HuggingFace layer (post-norm): its weights (Q, K and V
    concatenated by :func:`packed_in_projection`), LayerNorm eps, activation and, in
    training mode, the dropout rates of the attention probabilities, after the attention
    block, none in the feed-forward hidden layer, and after the feed-forward block."""
    m = layer_modules(style, layer)
    attn = m["attn"]
    linear = nn.Linear
    if not (type(m["q"]) is linear and type(m["k"]) is linear and type(m["v"]) is linear and type(m["out"]) is linear
            and type(m["ff1"]) is linear and type(m["ff2"]) is linear):
        # a module swapped in after conversion (an adapter's Linear, say) would be read as a plain Linear
        names = [n for n in ("q", "k", "v", "out", "ff1", "ff2") if type(m[n]) is not linear]
        raise NotImplementedError(f"ragged.nn.hf_encoder.layer_spec(): the layer's {', '.join(names)} projection is "
                                  f"a {type(m[names[0]]).__name__}, not a torch.nn.Linear: convert the model after "
                                  "such changes (which it refuses) or undo them")
    heads, head_dim = attention_shape(style, attn)
    in_w, in_b = packed_in_projection(m["q"], m["k"], m["v"])
    out, ff1, ff2, norm1, norm2 = m["out"], m["ff1"], m["ff2"], m["norm1"], m["norm2"]
    p_attn = _sub(attn, "dropout").p if attn.training else 0.0
    drop1 = m["drop1"]
    dropout = (p_attn, 0.0 if drop1 is None else _rate(drop1), 0.0, _rate(m["drop2"]))
    weights = LayerWeights(in_w, in_b, _param(out, "weight"), _param(out, "bias"), _param(norm1, "weight"),
                           _param(norm1, "bias"), _param(ff1, "weight"), _param(ff1, "bias"), _param(ff2, "weight"),
                           _param(ff2, "bias"), _param(norm2, "weight"), _param(norm2, "bias"))
    return LayerSpec(heads, head_dim, False, fused_activation(m["act"]), (norm1.eps, norm2.eps), dropout, weights)


def hook_kinds(module: nn.Module) -> list[str]:
    """The hooks on ``module`` itself, except HuggingFace's output-capturing hooks (installed
    on the layers by ``output_hidden_states``; inactive outside HuggingFace's own forward, and
    the converted forward collects hidden states itself)."""
    kinds = []
    for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"):
        for hook in (getattr(module, name, None) or {}).values():
            if not (getattr(hook, "__name__", "") == "output_capturing_hook"
                    and getattr(hook, "__module__", "").startswith("transformers.")):
                kinds.append(name.strip("_").replace("_", " "))
                break
    return kinds


def _plain(layer: nn.Module) -> bool:
    """The layer can be run without calling it as a module: no hooks but HuggingFace's
    output-capturing ones, no global module hooks."""
    return not hook_kinds(layer) and plain_call(_NO_HOOKS)


_NO_HOOKS = nn.Module()  # plain_call() of a module without hooks: whether global hooks exist


def _checkpointing(layers) -> bool:
    """HuggingFace's gradient checkpointing switched on (``gradient_checkpointing_enable``)."""
    if not torch.is_grad_enabled():
        return False
    return any(getattr(layer, "gradient_checkpointing", False) and layer.training for layer in layers)


def run_encoder(family: Family, base: nn.Module, x: torch.Tensor, rt: RaggedTensor,
                collect: bool) -> tuple[torch.Tensor, list | None]:
    """The layers on ``x [T, d]``: ``(y, hidden)`` with ``hidden`` the input of every layer
    and the last output when ``collect``. Inference without collection runs the stack with
    the choices made once (:func:`ragged.nn.layer.run_stack`); otherwise layer by layer, each
    under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant) when the model has
    gradient checkpointing on."""
    layers = _sub(_sub(base, family.encoder_name), "layer")
    cu, max_len = rt.offsets, rt.max_len
    fused = fused_backend(x)
    saving = _checkpointing(layers)
    plain = all(_plain(layer) for layer in layers)
    if plain and not collect and not saving and fused is not None and eager(x, cu):
        y = run_stack([layer_spec(family.style, layer) for layer in layers], x, cu, max_len, False, fused)
        if y is not None:
            return y, None

    def body(layer, x):
        spec = layer_spec(family.style, layer)  # read here: an FSDP2 unit's parameters are gathered now
        is_eager = eager(x, cu, *[w for w in spec.weights if w is not None])
        if saving:
            return checkpoint(run_layer, spec, x, cu, max_len, False, fused, is_eager, use_reentrant=False)
        return run_layer(spec, x, cu, max_len, False, fused, is_eager)

    hidden = [x] if collect else None
    for layer in layers:
        # a layer with hooks (an FSDP2 unit, say) is called as a module, with body as its forward
        x = body(layer, x) if _plain(layer) else call_with_hooks(layer, functools.partial(body, layer), x)
        if collect:
            hidden.append(x)
    return x, hidden


@dataclasses.dataclass
class Encoded:
    """The encoder's result: ``values [T, d]`` of the last layer, the batch, and with
    hidden states asked for, the packed hidden states (None entries where a selection of
    layers left them out)."""

    values: torch.Tensor
    batch: Batch
    hidden: tuple | None = None

    @property
    def rt(self) -> RaggedTensor:
        return self.batch.rt.with_values(self.values)

    def hidden_states(self):
        if self.hidden is None:
            return None
        return tuple(None if h is None else self.batch.out(h) for h in self.hidden)


def encode(fn: str, family: Family, base: nn.Module, input_ids, attention_mask, token_type_ids, position_ids,
           inputs_embeds, picks: tuple | None) -> Encoded:
    """Read the batch, embed the packed tokens and run the layers (see the module docstring).
    ``picks``: None (no hidden states) or, per entry of the hidden states returned, the index
    of the hidden state it holds (0 the embeddings' output, ``i`` layer ``i``'s) or None."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"{fn}(): expected exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        batch = read_batch(fn, "input_ids", input_ids, attention_mask, 0)
        ids, embeds = batch.rt.values, None
    else:
        batch = read_batch(fn, "inputs_embeds", inputs_embeds, attention_mask, 1)
        ids, embeds = None, batch.rt.values
    x = embed(fn, family, base, batch, ids, embeds, token_type_ids, position_ids)
    collect = picks is not None and any(p is not None for p in picks)
    y, hidden = run_encoder(family, base, x, batch.rt, collect)
    if picks is not None:
        hidden = tuple(None if p is None else hidden[p] for p in picks)
    return Encoded(y, batch, hidden)
