"""The encoder of a converted HuggingFace model, the same for every family: the batch read
once (:mod:`ragged.nn.hf.batch`), the family's embeddings on the packed tokens, its layers
one by one or as one stack, and what follows them (:class:`ragged.nn.hf.family.Family`).

HuggingFace's gradient checkpointing is honoured (each layer under
:func:`torch.utils.checkpoint.checkpoint`, non-reentrant); a layer with hooks (an FSDP2 unit,
say) is called as a module with the packed values ``[T, d]`` in and out, the layer body as
its forward, so that the hooks run around it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ragged import RaggedTensor

from .. import layer_graphs
from ..graph_switch import tap
from ..layer import call_with_hooks, plain_call
from .batch import Batch, read_batch
from .family import Family, SpecFamily, hook_kinds

__all__ = ["Encoded", "encode", "run_encoder"]


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


def run_encoder(
    family: Family, base: nn.Module, x: torch.Tensor, ctx, collect: bool
) -> tuple[torch.Tensor, list | None]:
    """The layers on ``x [T, d]``: ``(y, hidden)`` with ``hidden`` the input of every layer
    and the last output when ``collect`` (before :meth:`Family.finish`). Inference without
    collection runs the family's stack where it has one; otherwise layer by layer."""
    layers = family.layers(base)
    saving = _checkpointing(layers)
    training = torch.is_grad_enabled() and (x.requires_grad or (len(layers) > 0 and layers[0].training))
    if not collect and not saving and not training and all(_plain(layer) for layer in layers):
        y = family.run_stack(layers, x, ctx)
        if y is not None:
            return y, None

    def body(layer, x):
        if saving:
            return checkpoint(family.run_layer, layer, x, ctx, use_reentrant=False)
        return family.run_layer(layer, x, ctx)

    # eager training on a GPU: each layer from its CUDA graphs for the batch's bucket (the families
    # whose layers read only the offsets and the longest length of the batch)
    plan = None
    if not saving and layer_graphs.active(x) and _graphable(family, ctx):
        plan = layer_graphs.plan(x, ctx.offsets, ctx.max_len)

    hidden = [x] if collect else None
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        y = None
        if plan is not None:
            if _plain(layer):
                body_i = functools.partial(_bucket_body, family, layer)
                # an output read by the next layer only stays in the bucket's buffer
                y = layer_graphs.run(layer, body_i, x, plan, hand_on=not collect and i < last, first=i == 0)
            if y is None:
                x = layer_graphs.own(x, plan)
        if y is None:
            # a layer with hooks (an FSDP2 unit, say) is called as a module, with body as its forward
            y = body(layer, x) if _plain(layer) else call_with_hooks(layer, functools.partial(body, layer), x)
        x = tap(y)  # (a cut of the backward of a whole-model graph, when one is captured)
        if collect:
            hidden.append(x)
    return x, hidden


def _graphable(family: Family, ctx) -> bool:
    """The family's layers read nothing of a batch but its offsets and longest length."""
    return (
        isinstance(ctx, RaggedTensor)
        and type(family).run_layer is SpecFamily.run_layer
        and (type(family).spec_of is SpecFamily.spec_of)
    )


def _bucket_body(family: Family, layer: nn.Module, x: torch.Tensor, cu: torch.Tensor, max_len: int):
    """Layer ``layer`` on a bucket's values, offsets and longest length (what its graphs capture)."""
    return family.run_layer(layer, x, RaggedTensor(x, cu, max_len))


@dataclasses.dataclass
class Encoded:
    """The encoder's result: ``values [T, d]`` of the last layer (after the family's final
    step), the batch, and with hidden states asked for, the packed hidden states (None entries
    where a selection of layers left them out)."""

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


def encode(
    fn: str,
    family: Family,
    base: nn.Module,
    input_ids,
    attention_mask,
    token_type_ids,
    position_ids,
    inputs_embeds,
    hidden_indices: tuple | None,
) -> Encoded:
    """Read the batch, embed the packed tokens, run the layers and the family's final step.
    ``hidden_indices``: None (no hidden states) or, per entry of the hidden states returned,
    the index of the hidden state it holds (0 the embeddings' output, ``i`` layer ``i``'s) or None."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"{fn}(): expected exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        batch = read_batch(fn, "input_ids", input_ids, attention_mask, 0)
        ids, embeds = batch.rt.values, None
    else:
        batch = read_batch(fn, "inputs_embeds", inputs_embeds, attention_mask, 1)
        ids, embeds = None, batch.rt.values
    x = family.embed(fn, base, batch, ids, embeds, token_type_ids, position_ids)
    ctx = family.context(fn, base, batch, x, position_ids)
    collect = hidden_indices is not None and any(i is not None for i in hidden_indices)
    y, hidden = run_encoder(family, base, x, ctx, collect)
    y = family.finish(base, y)
    if collect:
        hidden[-1] = y  # the last hidden state is the output (after a final norm), as in HuggingFace
    if hidden_indices is not None:
        hidden = tuple(None if i is None else hidden[i] for i in hidden_indices)
    return Encoded(y, batch, hidden)
