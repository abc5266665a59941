"""TransformerEncoderLayer / TransformerEncoder with torch.nn's signatures and state_dict keys,
computed padding-free (:func:`ragged.nn.convert` swaps them, and MultiheadAttention, into a model).

The torch.nn adapter of the one layer core: :func:`layer_spec` reads a layer's weights and
configuration under torch.nn's attribute names into a :class:`ragged.nn.layer.LayerSpec`,
and :mod:`ragged.nn.layer` computes it.

A padded input is packed once at the top (from its key padding mask, or with every row
full), every per-token op (Linear, LayerNorm, activation, dropout, residual) runs on
``rt.values [T, d]``, attention runs through :func:`ragged.attention`, and the result is
unpacked once at the end with zeros at padding. A RaggedTensor input is never padded: it
returns a RaggedTensor.
"""

from __future__ import annotations

import copy as _copy
import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ragged import RaggedTensor
from ragged.utils import describe, eager

from . import layer_graphs
from .accept import adopt, module_attention_features
from .graph_switch import tap
from .layer import LayerSpec, LayerWeights, fused_backend, plain_call, run_layer, run_stack
from .multihead_attention import (
    MultiheadAttention,
    causal_flag,
    check_padding_mask,
    from_batch_first,
    pack_padded,
    to_batch_first,
)

__all__ = ["TransformerEncoder", "TransformerEncoderLayer"]


def _activation_fn(fn: str, activation) -> Callable[[torch.Tensor], torch.Tensor]:
    if isinstance(activation, str):
        if activation == "relu":
            return F.relu
        if activation == "gelu":
            return F.gelu
        raise ValueError(f"{fn}(): expected activation 'relu', 'gelu' or a callable, got {activation!r}")
    if not callable(activation):
        raise TypeError(f"{fn}(): expected activation 'relu', 'gelu' or a callable, got {describe(activation)}")
    return activation


def _fused_activation(activation) -> str | None:
    """The :func:`ragged.bias_act` name of a layer's activation, None for other callables.

    Modules by exact class: a subclass may override ``forward`` (the fused op would not run
    it), and a module with hooks must be called as a module for them to run."""
    if activation is F.relu:
        return "relu"
    if activation is F.gelu:
        return "gelu"
    kind = type(activation)
    if kind is not nn.ReLU and kind is not nn.GELU:
        return None
    if activation._forward_hooks or activation._forward_pre_hooks:
        return None
    if kind is nn.ReLU:
        return "relu"
    return "gelu" if activation.approximate == "none" else "gelu_tanh"


_UNSET = object()
_MISSING = object()


def _param(module: nn.Module, name: str):
    # The module's own dict first (Module.__getattr__ is slower per read, and this runs per call); a name that
    # is not a plain parameter there (a parametrization, say) goes through getattr.
    value = module._parameters.get(name, _MISSING)
    return getattr(module, name) if value is _MISSING else value


def _child(module: nn.Module, name: str):
    value = module._modules.get(name, _MISSING)
    return getattr(module, name) if value is _MISSING else value


def layer_spec(layer: TransformerEncoderLayer) -> LayerSpec:
    """The :class:`ragged.nn.layer.LayerSpec` of a layer with torch.nn's attribute names (its
    weights, configuration and, in training mode, dropout rates). Called once per layer and
    step: the module reads go through the modules' dicts."""
    attn = _child(layer, "self_attn")
    out_proj = _child(attn, "out_proj")
    norm1, norm2 = _child(layer, "norm1"), _child(layer, "norm2")
    linear1, linear2 = _child(layer, "linear1"), _child(layer, "linear2")
    activation = layer.__dict__["activation"] if "activation" in layer.__dict__ else layer.activation
    if layer.training:
        dropout = (attn.dropout, _child(layer, "dropout1").p, _child(layer, "dropout").p, _child(layer, "dropout2").p)
    else:
        dropout = (0.0, 0.0, 0.0, 0.0)
    weights = LayerWeights(
        _param(attn, "in_proj_weight"),
        _param(attn, "in_proj_bias"),
        _param(out_proj, "weight"),
        _param(out_proj, "bias"),
        _param(norm1, "weight"),
        _param(norm1, "bias"),
        _param(linear1, "weight"),
        _param(linear1, "bias"),
        _param(linear2, "weight"),
        _param(linear2, "bias"),
        _param(norm2, "weight"),
        _param(norm2, "bias"),
    )
    return LayerSpec(
        attn.num_heads,
        attn.head_dim,
        layer.norm_first,
        _fused_activation(activation) or activation,
        (norm1.eps, norm2.eps),
        dropout,
        weights,
    )


def _run(
    fn: str,
    src,
    d_model: int,
    batch_first: bool,
    mask,
    mask_name: str,
    key_padding_mask,
    is_causal,
    body: Callable[[RaggedTensor, bool], RaggedTensor],
):
    """Call ``body(rt, causal)`` on a RaggedTensor input, or pack / body / unpack a padded one."""
    if isinstance(src, RaggedTensor):
        if key_padding_mask is not None:
            raise ValueError(
                f"{fn}(): src_key_padding_mask applies to padded inputs; a RaggedTensor carries its own lengths"
            )
        if src.values.dim() != 2 or src.values.shape[1] != d_model:
            raise ValueError(f"{fn}(): expected src with values of shape [T, {d_model}], got {tuple(src.values.shape)}")
        causal = causal_flag(fn, mask_name, mask, is_causal, src.max_len, src.max_len, at_least=True)
        return body(src, causal)
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{fn}(): expected src to be a torch.Tensor or a RaggedTensor, got {describe(src)}")
    if src.dim() not in (2, 3) or src.shape[-1] != d_model:
        shape = "[B, M, " if batch_first else "[M, B, "
        raise ValueError(
            f"{fn}(): expected src of shape {shape}{d_model}] (or unbatched [M, {d_model}]), got {tuple(src.shape)}"
        )
    batched = src.dim() == 3
    x = to_batch_first(src, batch_first) if batched else src.unsqueeze(0)
    if key_padding_mask is not None:
        if not batched and isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.dim() == 1:
            key_padding_mask = key_padding_mask.unsqueeze(0)
        check_padding_mask(fn, "src_key_padding_mask", key_padding_mask, x.shape[0], x.shape[1])
    causal = causal_flag(fn, mask_name, mask, is_causal, x.shape[1], x.shape[1])
    rt, layout = pack_padded(fn, "src_key_padding_mask", x, key_padding_mask)
    out = layout.unpack(body(rt, causal))
    return from_batch_first(out, batch_first) if batched else out.squeeze(0)


class TransformerEncoderLayer(nn.Module):
    """``torch.nn.TransformerEncoderLayer`` computed padding-free.

    Same constructor, submodules and ``state_dict`` keys (``self_attn`` is a
    :class:`ragged.nn.MultiheadAttention`). ``forward(src, src_mask=None,
    src_key_padding_mask=None, is_causal=False)`` takes a RaggedTensor (``values [T, d_model]``,
    returned as a RaggedTensor) or a padded tensor as torch.nn does (zeros come out at
    padding). ``src_mask`` may only be a causal mask (see :class:`ragged.nn.TransformerEncoder`).
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[torch.Tensor], torch.Tensor] = F.relu,
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, **factory
        )
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        activation = _activation_fn("ragged.nn.TransformerEncoderLayer", activation)
        if activation is F.relu or isinstance(activation, nn.ReLU):
            self.activation_relu_or_gelu = 1
        elif activation is F.gelu or isinstance(activation, nn.GELU):
            self.activation_relu_or_gelu = 2
        else:
            self.activation_relu_or_gelu = 0
        self.activation = activation

    @classmethod
    def from_torch(
        cls, layer: nn.TransformerEncoderLayer, *, copy: bool = False, memo: dict | None = None
    ) -> TransformerEncoderLayer:
        """The ragged layer for ``layer``: same configuration (dropout rates, eps, activation,
        training mode) and weights. ``copy=False`` shares its Parameter objects (training
        either trains both); ``copy=True`` copies them (same device and dtype)."""
        fn = "ragged.nn.TransformerEncoderLayer.from_torch"
        if not isinstance(layer, nn.TransformerEncoderLayer):
            raise TypeError(f"{fn}(): expected a torch.nn.TransformerEncoderLayer, got {type(layer).__name__}")
        attn = layer.self_attn
        if type(attn) is not nn.MultiheadAttention:
            raise NotImplementedError(
                f"{fn}(): the layer's self_attn is not a plain torch.nn.MultiheadAttention, got {type(attn).__name__}"
            )
        unsupported = module_attention_features(attn)
        if unsupported:
            raise NotImplementedError(f"{fn}(): the layer's self_attn uses {unsupported}, which is not supported")
        if copy:
            memo = {} if memo is None else memo
            layer = _copy.deepcopy(layer, memo)
        shell = cls(
            attn.embed_dim,
            attn.num_heads,
            dim_feedforward=layer.linear1.out_features,
            dropout=layer.dropout.p,
            activation=layer.activation,
            layer_norm_eps=layer.norm1.eps,
            batch_first=attn.batch_first,
            norm_first=layer.norm_first,
            bias=layer.linear1.bias is not None,
            device="meta",
        )
        shell.self_attn.dropout = attn.dropout
        shell.dropout1.p, shell.dropout2.p = layer.dropout1.p, layer.dropout2.p
        shell.norm2.eps = layer.norm2.eps
        return adopt(fn, shell, layer, False, None)

    def _block(self, rt: RaggedTensor, causal: bool, fused=_UNSET) -> RaggedTensor:
        x = rt.values
        if fused is _UNSET:
            fused = fused_backend(x)
        spec = layer_spec(self)
        return rt.with_values(
            run_layer(
                spec,
                x,
                rt.offsets,
                rt.max_len,
                causal,
                fused,
                eager(x, rt.offsets, *[w for w in spec.weights if w is not None]),
            )
        )

    def forward(
        self,
        src,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ):
        return _run(
            "ragged.nn.TransformerEncoderLayer.forward",
            src,
            self.self_attn.embed_dim,
            self.self_attn.batch_first,
            src_mask,
            "src_mask",
            src_key_padding_mask,
            is_causal,
            self._block,
        )


def _bucket_body(layer, fused, x: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """Layer ``layer`` (not causal) on a bucket's values, offsets and longest length: what its graphs capture."""
    return layer._block(RaggedTensor(x, cu, max_len), False, fused).values


class TransformerEncoder(nn.Module):
    """``torch.nn.TransformerEncoder`` computed padding-free.

    ``TransformerEncoder(encoder_layer, num_layers, norm=None, enable_nested_tensor=True,
    mask_check=True)``: ``num_layers`` deep copies of ``encoder_layer`` (a
    :class:`TransformerEncoderLayer`; a ``torch.nn.TransformerEncoderLayer`` is converted
    first); ``enable_nested_tensor`` and ``mask_check`` are accepted and ignored. Keys are
    torch.nn's (``layers.N.*``, ``norm.*``).

    ``forward(src, mask=None, src_key_padding_mask=None, is_causal=None)``:

    * ``src`` a RaggedTensor (``values [T, d_model]``): returns a RaggedTensor; nothing is
      padded and nothing is read from the device.
    * ``src`` padded (``[B, M, d]`` with ``batch_first``, else ``[M, B, d]``; unbatched
      ``[M, d]``), with an optional ``src_key_padding_mask [B, M]`` (bool, True = padding,
      or float, -inf = padding; right, left or scattered): packed once (reading the mask's
      lengths costs one device-to-host read), returned padded like the input with zeros at
      padding (torch.nn's nested fast path has zeros there too; its training path leaves
      unused values).
    * causal attention through ``is_causal=True`` or a causal ``mask`` (``[M, M]`` bool with
      True exactly above the diagonal, or float with -inf above the diagonal and 0
      elsewhere). Unless ``is_causal=True``, a given ``mask`` is checked on the device (one
      read, and a graph break under torch.compile); any other ``mask`` raises
      NotImplementedError.
    """

    def __init__(
        self,
        encoder_layer: TransformerEncoderLayer,
        num_layers: int,
        norm: nn.Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ) -> None:
        super().__init__()
        fn = "ragged.nn.TransformerEncoder"
        if type(encoder_layer) is nn.TransformerEncoderLayer:
            encoder_layer = TransformerEncoderLayer.from_torch(encoder_layer, copy=True)
        elif not isinstance(encoder_layer, TransformerEncoderLayer):
            raise TypeError(
                f"{fn}(): expected encoder_layer to be a ragged.nn.TransformerEncoderLayer (or a "
                f"torch.nn.TransformerEncoderLayer, converted), got {type(encoder_layer).__name__}"
            )
        self.layers = nn.ModuleList([_copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.mask_check = mask_check

    @classmethod
    def from_torch(
        cls, encoder: nn.TransformerEncoder, *, copy: bool = False, memo: dict | None = None
    ) -> TransformerEncoder:
        """The ragged encoder for ``encoder``: every layer converted with its own weights, the
        final ``norm`` carried over. ``copy=False`` shares the Parameter objects (and the
        ``norm`` module); ``copy=True`` copies them (same device and dtype)."""
        fn = "ragged.nn.TransformerEncoder.from_torch"
        if not isinstance(encoder, nn.TransformerEncoder):
            raise TypeError(f"{fn}(): expected a torch.nn.TransformerEncoder, got {type(encoder).__name__}")
        memo = {} if memo is None else memo
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.layers = nn.ModuleList(
            [TransformerEncoderLayer.from_torch(layer, copy=copy, memo=memo) for layer in encoder.layers]
        )
        new.num_layers = len(new.layers)
        new.norm = _copy.deepcopy(encoder.norm, memo) if copy and encoder.norm is not None else encoder.norm
        new.enable_nested_tensor = getattr(encoder, "enable_nested_tensor", True)
        new.mask_check = getattr(encoder, "mask_check", True)
        new.training, new.layers.training = encoder.training, encoder.layers.training
        return new

    def _stack(self, rt: RaggedTensor, causal: bool) -> RaggedTensor:
        fused = fused_backend(rt.values)  # one choice for the stack: same device, dtype and width
        values = None
        layers = cast(list[TransformerEncoderLayer], list(self.layers))
        if fused is not None and eager(rt.values, rt.offsets) and all(plain_call(layer) for layer in layers):
            values = run_stack(
                [layer_spec(layer) for layer in layers], rt.values, rt.offsets, rt.max_len, causal, fused
            )
        if values is not None:
            rt = rt.with_values(values)
        else:
            # eager training on a GPU: each layer from its CUDA graphs for the batch's bucket
            # (ragged.nn.layer_graphs); not causal, which the graphs' key does not hold
            plan = None
            if not causal and layer_graphs.active(rt.values):
                plan = layer_graphs.plan(rt.values, rt.offsets, rt.max_len)
            last = len(layers) - 1
            for i, layer in enumerate(layers):
                y = None
                if plan is not None:
                    if plain_call(layer):
                        body = functools.partial(_bucket_body, layer, fused)
                        y = layer_graphs.run(layer, body, rt.values, plan, hand_on=i < last, first=i == 0)
                    if y is None:
                        rt = rt.with_values(layer_graphs.own(rt.values, plan))
                if y is not None:
                    rt = rt.with_values(y)
                else:
                    # the input was checked once above; a layer without hooks runs its body directly
                    rt = layer._block(rt, causal, fused) if plain_call(layer) else layer(rt, is_causal=causal)
                rt = rt.with_values(tap(rt.values))  # (a cut of a whole-model graph's backward)
        if self.norm is not None:
            rt = rt.with_values(self.norm(rt.values))
        return rt

    def forward(
        self,
        src,
        mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
    ):
        fn = "ragged.nn.TransformerEncoder.forward"
        if len(self.layers) == 0:
            raise ValueError(f"{fn}(): the encoder has no layers")
        attn = cast(TransformerEncoderLayer, self.layers[0]).self_attn
        return _run(
            fn, src, attn.embed_dim, attn.batch_first, mask, "mask", src_key_padding_mask, is_causal, self._stack
        )
