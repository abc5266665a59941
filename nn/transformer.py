"""TransformerEncoderLayer / TransformerEncoder with torch.nn's signatures and state_dict keys,
computed padding-free; :func:`convert` swaps them (and MultiheadAttention) into a model.

A padded input is packed once at the top (from its key padding mask, or with every row
full), every per-token op (Linear, LayerNorm, activation, dropout, residual) runs on
``rt.values [T, d]``, attention runs through :func:`ragged.attention`, and the result is
unpacked once at the end with zeros at padding. A RaggedTensor input is never padded: it
returns a RaggedTensor.
"""

from __future__ import annotations

import copy as _copy
import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize, prune

from .. import backends
from .._utils import describe, eager
from ..ops.fused import _call_add_layer_norm, _call_bias_act
from ..tensor import RaggedTensor
from .activation import (
    MultiheadAttention,
    adopt,
    causal_flag,
    check_padding_mask,
    from_batch_first,
    pack_padded,
    to_batch_first,
)
from .fused_layer import (
    InferenceKernels,
    _child,
    _param,
    direct_layer_norm_takes,
    infer_layer,
    layer_forward,
    layer_params,
)

__all__ = ["TransformerEncoder", "TransformerEncoderLayer", "convert"]


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
_BIAS_ACT_BACKENDS: dict[tuple, str] = {}


def _bias_act_backend(h: torch.Tensor, bias: torch.Tensor | None, act: str) -> str:
    """Backend of bias + activation for a Linear's output ``h`` (contiguous and aligned, as
    every F.linear output is): chosen once per (device, dtypes, width, activation, global
    backend choice), since its reasons depend on nothing else for such inputs."""
    key = (h.device, h.dtype, None if bias is None else bias.dtype, h.shape[-1], act, backends.get_backend(),
           h.is_contiguous())
    name = _BIAS_ACT_BACKENDS.get(key)
    if name is None:
        name = backends.select("bias_act", None, h.device, h, bias, act).name
        if not torch.compiler.is_compiling() and h.data_ptr() % 16 == 0:
            _BIAS_ACT_BACKENDS[key] = name
    return name


def _linear_output_act_backend(x: torch.Tensor, width: int, bias: torch.Tensor | None, act: str) -> str:
    """:func:`_bias_act_backend` for the ``[T, width]`` output of a Linear applied to ``x``,
    before it exists (a one-row probe of it on a cache miss)."""
    key = (x.device, x.dtype, None if bias is None else bias.dtype, width, act, backends.get_backend(), True)
    name = _BIAS_ACT_BACKENDS.get(key)
    return name if name is not None else _bias_act_backend(x.new_empty((1, width)), bias, act)


def _one_node_backends(layer: "TransformerEncoderLayer", rt: RaggedTensor, causal: bool, fused: str):
    """``(activation, attention backend, add_layer_norm backend, bias_act backend, needs
    grad)`` when the layer can run through :func:`ragged.nn.fused_layer.layer_forward` (one
    autograd node in training, the kernels called straight in inference), else None: an
    activation bias_act fuses, the packed input projection, every parameter a plain tensor
    of the input's dtype, tokens present. Called once per layer and step: the module reads
    go through the modules' dicts (``Module.__getattr__`` costs about a microsecond each)."""
    act = _fused_activation(layer.__dict__["activation"] if "activation" in layer.__dict__ else layer.activation)
    attn = _child(layer, "self_attn")
    if act is None or not attn._qkv_same_embed_dim or _param(attn, "bias_k") is not None:
        return None
    x = rt.values
    if x.shape[0] == 0 or not x.is_contiguous():
        return None
    params = layer_params(layer)
    if not eager(x, rt.offsets, *[p for p in params if p is not None]):
        return None
    dtype, index = x.dtype, x.get_device()
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    for p in params:
        if p is not None:
            if p.dtype != dtype or p.get_device() != index:
                return None
            needs_grad = needs_grad or (p.requires_grad and torch.is_grad_enabled())
    heads = x.view(x.shape[0], attn.num_heads, attn.head_dim)
    attn_backend = backends.select("attention", None, x.device, heads, heads, heads, rt.offsets, rt.offsets,
                                   rt.max_len, rt.max_len, causal, attn.dropout if layer.training else 0.0,
                                   needs_grad).name
    act_backend = _linear_output_act_backend(x, params[6].shape[0], params[7], act)
    return act, attn_backend, fused, act_backend, needs_grad


def _direct_inference(layers, rt: RaggedTensor, causal: bool, fused: str) -> torch.Tensor | None:
    """The values after ``layers`` through :func:`ragged.nn.fused_layer.infer_layer` (the
    kernels called straight, choices made once for the stack), or None when that path does not
    apply and the layers run one by one: a gradient is needed, a layer has hooks, dropout is
    active, an activation bias_act does not fuse, the input projection is not packed, a
    parameter is not a plain tensor of the input's dtype and device, or no tokens."""
    x = rt.values
    n_tok = x.shape[0]
    grad = torch.is_grad_enabled()
    if n_tok == 0 or not x.is_contiguous() or (grad and x.requires_grad) or not eager(x, rt.offsets):
        return None
    dtype, index = x.dtype, x.get_device()
    parameter = nn.Parameter
    max_len, cu = rt.max_len, rt.offsets
    kernels: dict[tuple, InferenceKernels] = {}
    steps = []
    # later layers' inputs are fresh tensors. dynamo cannot trace data_ptr(): skipped when
    # compiling (eager() above already turns this path off there; the check keeps it so)
    direct_ln = fused == "cuda" and not torch.compiler.is_compiling() and x.data_ptr() % 16 == 0
    for layer in layers:
        if not _plain_call(layer):
            return None
        attn = layer.self_attn
        act = _fused_activation(layer.activation)
        if act is None or not attn._qkv_same_embed_dim or attn.bias_k is not None:
            return None
        if layer.training and (attn.dropout or layer.dropout1.p or layer.dropout.p or layer.dropout2.p):
            return None
        params = layer_params(layer)
        for p in params:
            if p is not None and ((type(p) is not torch.Tensor and type(p) is not parameter) or p.dtype != dtype
                                  or p.get_device() != index or (grad and p.requires_grad)):
                return None
        heads, head_dim = attn.num_heads, attn.head_dim
        act_backend = _linear_output_act_backend(x, params[6].shape[0], params[7], act)
        key = (heads, head_dim, act_backend)
        kern = kernels.get(key)
        if kern is None:
            view = x.view(n_tok, heads, head_dim)
            attn_backend = backends.select("attention", None, x.device, view, view, view, cu, cu, max_len, max_len,
                                           causal, 0.0, False).name
            kern = kernels[key] = InferenceKernels(attn_backend, fused, act_backend)
        n1, n2 = layer.norm1, layer.norm2
        config = (layer.norm_first, heads, 1.0 / math.sqrt(head_dim), n1.eps, n2.eps, act,
                  direct_ln and direct_layer_norm_takes(dtype, params[4], params[5], params[10], params[11]))
        steps.append((config, params, kern))
        direct_ln = fused == "cuda"
    for config, params, kern in steps:
        x = infer_layer(x, cu, max_len, causal, config, params, kern)
    return x


def _plain_call(module: nn.Module) -> bool:
    """True when calling ``module`` would only run its forward: no hooks on it, no global
    module hooks (then the encoder may call the layer's body directly)."""
    from torch.nn.modules import module as m

    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or m._global_forward_hooks or m._global_forward_pre_hooks
                or m._global_backward_hooks or m._global_backward_pre_hooks)


def _fused_backend(x: torch.Tensor) -> str | None:
    """Backend of the fused per-token ops (bias + activation, residual + LayerNorm) for the
    layer's values ``x``, or None to run torch's own ops: off the GPU (there the fused ops
    would run their float32 reference, slower than torch's kernels) and under autocast
    (torch runs LayerNorm in float32 there, which the plain ops reproduce exactly)."""
    if x.device.type != "cuda" or torch.is_autocast_enabled("cuda"):
        return None
    impl = backends.select("add_layer_norm", None, x.device, x, None, None, None)
    return impl.name if impl.name != "torch" else None


def _run(fn: str, src, d_model: int, batch_first: bool, mask, mask_name: str, key_padding_mask, is_causal,
         body: Callable[[RaggedTensor, bool], RaggedTensor]):
    """Call ``body(rt, causal)`` on a RaggedTensor input, or pack / body / unpack a padded one."""
    if isinstance(src, RaggedTensor):
        if key_padding_mask is not None:
            raise ValueError(f"{fn}(): src_key_padding_mask applies to padded inputs; a RaggedTensor carries "
                             "its own lengths")
        if src.values.dim() != 2 or src.values.shape[1] != d_model:
            raise ValueError(f"{fn}(): expected src with values of shape [T, {d_model}], got "
                             f"{tuple(src.values.shape)}")
        causal = causal_flag(fn, mask_name, mask, is_causal, src.max_len, src.max_len, at_least=True)
        return body(src, causal)
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"{fn}(): expected src to be a torch.Tensor or a RaggedTensor, got {describe(src)}")
    if src.dim() not in (2, 3) or src.shape[-1] != d_model:
        shape = "[B, M, " if batch_first else "[M, B, "
        raise ValueError(f"{fn}(): expected src of shape {shape}{d_model}] (or unbatched [M, {d_model}]), "
                         f"got {tuple(src.shape)}")
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


    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str | Callable[[torch.Tensor], torch.Tensor] = F.relu, layer_norm_eps: float = 1e-5,
                 batch_first: bool = False, norm_first: bool = False, bias: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first,
                                            **factory)
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
    def from_torch(cls, layer: nn.TransformerEncoderLayer, *, copy: bool = False,
                   memo: dict | None = None) -> TransformerEncoderLayer:
        """The ragged layer for ``layer``: same configuration (dropout rates, eps, activation,
        training mode) and weights. ``copy=False`` shares its Parameter objects (training
        either trains both); ``copy=True`` copies them (same device and dtype)."""
        fn = "ragged.nn.TransformerEncoderLayer.from_torch"
        if not isinstance(layer, nn.TransformerEncoderLayer):
            raise TypeError(f"{fn}(): expected a torch.nn.TransformerEncoderLayer, got {type(layer).__name__}")
        attn = layer.self_attn
        if type(attn) is not nn.MultiheadAttention or attn.bias_k is not None or attn.add_zero_attn:
            raise NotImplementedError(f"{fn}(): the layer's self_attn is not a plain torch.nn.MultiheadAttention "
                                      "(or uses add_bias_kv / add_zero_attn)")
        if copy:
            memo = {} if memo is None else memo
            layer = _copy.deepcopy(layer, memo)
        shell = cls(attn.embed_dim, attn.num_heads, dim_feedforward=layer.linear1.out_features,
                    dropout=layer.dropout.p, activation=layer.activation, layer_norm_eps=layer.norm1.eps,
                    batch_first=attn.batch_first, norm_first=layer.norm_first,
                    bias=layer.linear1.bias is not None, device="meta")
        shell.self_attn.dropout = attn.dropout
        shell.dropout1.p, shell.dropout2.p = layer.dropout1.p, layer.dropout2.p
        shell.norm2.eps = layer.norm2.eps
        return adopt(fn, shell, layer, False, None)

    def _block(self, rt: RaggedTensor, causal: bool, fused=_UNSET, direct: bool = True) -> RaggedTensor:
        x = rt.values
        if fused is _UNSET:
            fused = _fused_backend(x)
        if fused is None:
            if self.norm_first:
                x = x + self._sa_block(rt.with_values(self.norm1(x)), causal)
                x = x + self._ff_block(self.norm2(x), None)
            else:
                x = self.norm1(x + self._sa_block(rt, causal))
                x = self.norm2(x + self._ff_block(x, None))
            return rt.with_values(x)
        if direct:
            values = _direct_inference((self,), rt, causal, fused)
            if values is not None:
                return rt.with_values(values)
        one_node = _one_node_backends(self, rt, causal, fused)
        if one_node is not None:
            return rt.with_values(layer_forward(self, x, rt.offsets, rt.max_len, causal, *one_node))
        n1, n2 = self.norm1, self.norm2
        if self.norm_first:
            h = _call_add_layer_norm(x, None, n1.weight, n1.bias, n1.eps, False, fused)[0]
            sa = self._sa_block(rt.with_values(h), causal)
            # x + sa and norm2 of it in one pass: the sum is the residual stream
            h, x = _call_add_layer_norm(sa, x, n2.weight, n2.bias, n2.eps, True, fused)[:2]
            x = x + self._ff_block(h, fused)
        else:
            x = _call_add_layer_norm(self._sa_block(rt, causal), x, n1.weight, n1.bias, n1.eps, False, fused)[0]
            x = _call_add_layer_norm(self._ff_block(x, fused), x, n2.weight, n2.bias, n2.eps, False, fused)[0]
        return rt.with_values(x)

    def _sa_block(self, h: RaggedTensor, causal: bool) -> torch.Tensor:
        # the layer has checked its input: straight to the attention's packed computation
        out = self.self_attn._attend(h, h, h, causal)[0].values
        return self.dropout1(out) if self.training and self.dropout1.p > 0 else out

    def _ff_block(self, x: torch.Tensor, fused: str | None) -> torch.Tensor:
        act = _fused_activation(self.activation) if fused is not None else None
        if act is not None:  # bias + activation in one pass (and in one pass backward, with dbias)
            h = F.linear(x, self.linear1.weight)
            h = _call_bias_act(h, self.linear1.bias, act, _bias_act_backend(h, self.linear1.bias, act))
        else:
            h = self.activation(self.linear1(x))
        if self.training and self.dropout.p > 0:
            h = self.dropout(h)
        out = F.linear(h, self.linear2.weight, self.linear2.bias)
        return self.dropout2(out) if self.training and self.dropout2.p > 0 else out

    def forward(self, src, src_mask: torch.Tensor | None = None, src_key_padding_mask: torch.Tensor | None = None,
                is_causal: bool = False):
        return _run("ragged.nn.TransformerEncoderLayer.forward", src, self.self_attn.embed_dim,
                    self.self_attn.batch_first, src_mask, "src_mask", src_key_padding_mask, is_causal, self._block)


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


    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: nn.Module | None = None,
                 enable_nested_tensor: bool = True, mask_check: bool = True) -> None:
        super().__init__()
        fn = "ragged.nn.TransformerEncoder"
        if type(encoder_layer) is nn.TransformerEncoderLayer:
            encoder_layer = TransformerEncoderLayer.from_torch(encoder_layer, copy=True)
        elif not isinstance(encoder_layer, TransformerEncoderLayer):
            raise TypeError(f"{fn}(): expected encoder_layer to be a ragged.nn.TransformerEncoderLayer (or a "
                            f"torch.nn.TransformerEncoderLayer, converted), got {type(encoder_layer).__name__}")
        self.layers = nn.ModuleList([_copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.mask_check = mask_check

    @classmethod
    def from_torch(cls, encoder: nn.TransformerEncoder, *, copy: bool = False,
                   memo: dict | None = None) -> TransformerEncoder:
        """The ragged encoder for ``encoder``: every layer converted with its own weights, the
        final ``norm`` carried over. ``copy=False`` shares the Parameter objects (and the
        ``norm`` module); ``copy=True`` copies them (same device and dtype)."""
        fn = "ragged.nn.TransformerEncoder.from_torch"
        if not isinstance(encoder, nn.TransformerEncoder):
            raise TypeError(f"{fn}(): expected a torch.nn.TransformerEncoder, got {type(encoder).__name__}")
        memo = {} if memo is None else memo
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.layers = nn.ModuleList([TransformerEncoderLayer.from_torch(layer, copy=copy, memo=memo)
                                    for layer in encoder.layers])
        new.num_layers = len(new.layers)
        new.norm = _copy.deepcopy(encoder.norm, memo) if copy and encoder.norm is not None else encoder.norm
        new.enable_nested_tensor = getattr(encoder, "enable_nested_tensor", True)
        new.mask_check = getattr(encoder, "mask_check", True)
        new.training, new.layers.training = encoder.training, encoder.layers.training
        return new

    def _stack(self, rt: RaggedTensor, causal: bool) -> RaggedTensor:
        fused = _fused_backend(rt.values)  # one choice for the stack: same device, dtype and width
        values = _direct_inference(self.layers, rt, causal, fused) if fused is not None else None
        if values is not None:
            rt = rt.with_values(values)
        else:
            for layer in self.layers:
                # the input was checked once above; a layer without hooks runs its body directly
                rt = layer._block(rt, causal, fused, False) if _plain_call(layer) else layer(rt, is_causal=causal)
        if self.norm is not None:
            rt = rt.with_values(self.norm(rt.values))
        return rt

    def forward(self, src, mask: torch.Tensor | None = None, src_key_padding_mask: torch.Tensor | None = None,
                is_causal: bool | None = None):
        fn = "ragged.nn.TransformerEncoder.forward"
        if len(self.layers) == 0:
            raise ValueError(f"{fn}(): the encoder has no layers")
        attn = self.layers[0].self_attn
        return _run(fn, src, attn.embed_dim, attn.batch_first, mask, "mask", src_key_padding_mask, is_causal,
                    self._stack)


# --------------------------------------------------------------------------------------
# convert

_SWAPS: dict[type, type] = {
    nn.TransformerEncoder: TransformerEncoder,
    nn.TransformerEncoderLayer: TransformerEncoderLayer,
    nn.MultiheadAttention: MultiheadAttention,
}
_RAGGED = (TransformerEncoder, TransformerEncoderLayer, MultiheadAttention)
# Every per-module hook registry: the ragged modules call their submodules differently (or
# not at all: the fused paths read the Linear and LayerNorm parameters directly), so a hook
# anywhere inside a swapped module would silently stop running or see other arguments.
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks", "_state_dict_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_LAYER_CHILDREN: dict[str, type] = {
    "self_attn": nn.MultiheadAttention, "linear1": nn.Linear, "dropout": nn.Dropout, "linear2": nn.Linear,
    "norm1": nn.LayerNorm, "norm2": nn.LayerNorm, "dropout1": nn.Dropout, "dropout2": nn.Dropout,
}


def _its(path: str) -> str:
    return "it" if not path else f"its {path}"


def _extras_reason(module: nn.Module) -> str | None:
    """Why something inside ``module`` (itself included) would be lost by a ragged module
    built from its Parameters: a parametrization, pruning, or any hook."""
    for path, sub in module.named_modules(remove_duplicate=False):
        if parametrize.is_parametrized(sub):
            return f"{_its(path)} has a parametrization (torch.nn.utils.parametrize)"
        if any(isinstance(h, prune.BasePruningMethod) for h in sub._forward_pre_hooks.values()):
            return f"{_its(path)} is pruned (torch.nn.utils.prune)"
        kinds = [name.strip("_").replace("_", " ") for name in _HOOKS if getattr(sub, name, None)]
        if kinds:
            return f"{_its(path)} has {', '.join(kinds)} (a ragged module would not run them)"
    return None


def _attention_reason(attn: nn.MultiheadAttention, path: str) -> str | None:
    if attn.bias_k is not None or attn.bias_v is not None or attn.add_zero_attn:
        return f"{_its(path)} uses add_bias_kv / add_zero_attn, which are not supported"
    if set(attn._modules) != {"out_proj"} or not isinstance(attn._modules["out_proj"], nn.Linear):
        return f"{_its(path)} has submodules {sorted(attn._modules)}, expected only the out_proj Linear"
    return None


def _layer_reason(layer: nn.TransformerEncoderLayer, path: str) -> str | None:
    prefix = f"{path}." if path else ""
    for name, kind in _LAYER_CHILDREN.items():
        child = layer._modules.get(name)
        if type(child) is not kind:
            return (f"its {prefix}{name} is a {type(child).__name__}, not a torch.nn.{kind.__name__} (the ragged "
                    "layer would not run its code)")
    extra = sorted(set(layer._modules) - set(_LAYER_CHILDREN) - {"activation"})
    if extra:
        return f"{_its(path)} has submodules {extra} that the ragged layer would not run"
    attn = layer.self_attn
    why = _attention_reason(attn, prefix + "self_attn")
    if why:
        return why
    if not attn._qkv_same_embed_dim:
        return f"its {prefix}self_attn has kdim / vdim different from embed_dim"
    for name in ("norm1", "norm2"):
        norm = layer._modules[name]
        if tuple(norm.normalized_shape) != (attn.embed_dim,) or not norm.elementwise_affine:
            return (f"its {prefix}{name} is not a LayerNorm over the {attn.embed_dim} features with a learned "
                    "weight")
    return None


def _why_not(module: nn.Module) -> str | None:
    """Why ``module`` (of a type in ``_SWAPS``) stays as it is; None when it can be swapped."""
    why = _extras_reason(module)
    if why:
        return why
    if isinstance(module, nn.MultiheadAttention):
        return _attention_reason(module, "")
    if isinstance(module, nn.TransformerEncoderLayer):
        return _layer_reason(module, "")
    layers = module._modules.get("layers")
    if type(layers) is not nn.ModuleList or len(layers) == 0:
        return "its layers are not a non-empty torch.nn.ModuleList"
    first = layers[0]
    for i, layer in enumerate(layers):
        if type(layer) is not nn.TransformerEncoderLayer:
            return f"its layers.{i} is a {type(layer).__name__}, not a torch.nn.TransformerEncoderLayer"
        why = _layer_reason(layer, f"layers.{i}")
        if why:
            return why
        if (layer.self_attn.embed_dim, layer.self_attn.batch_first) != (first.self_attn.embed_dim,
                                                                         first.self_attn.batch_first):
            return f"its layers.{i} differs from layers.0 in d_model or batch_first"
    return None


def _left_whole(module: nn.Module) -> bool:
    """Whether convert leaves everything inside ``module`` alone when it does not swap it: a
    torch.nn.TransformerEncoder (of any class) may hand its layers torch's nested tensors."""
    return isinstance(module, nn.TransformerEncoder)


def convert(model: nn.Module, *, copy: bool = False, strict: bool = False) -> nn.Module:
    """Swap every ``torch.nn.TransformerEncoder``, ``TransformerEncoderLayer`` and
    ``MultiheadAttention`` in ``model`` (in place) for its ragged.nn counterpart; returns
    ``model`` (or the replacement when ``model`` itself is one of them).

    The whole model is checked and every replacement built before anything is swapped; the
    swaps then happen together. An exception (``strict=True``, a bad argument, an error while
    building) leaves ``model`` exactly as it was.

    * Only those exact classes are swapped. A subclass (it may override ``forward``) is left
      alone, without a warning, and its children are visited, except those of a
      ``torch.nn.TransformerEncoder`` subclass (its forward may hand its layers torch's nested
      tensors, which the ragged layers do not take). Ragged modules already there stay.
    * A swapped module brings its children: the ragged module holds the same Parameter and
      buffer objects (``copy=False``, the default: an optimizer built before the swap keeps
      training the model) or copies of them (``copy=True``: same device and dtype, ties between
      tensors kept); the original module objects are not modified either way. A swapped
      module used at several places is one ragged module at all of them.
    * Modules the ragged versions cannot take are left as they are, with everything inside
      them: ``add_bias_kv`` / ``add_zero_attn`` attention, a parametrization
      (``torch.nn.utils.parametrize``), pruning (``torch.nn.utils.prune``) or any hook on the
      module or inside it, submodules of other classes than torch.nn builds (a custom layer
      class inside an encoder, a replaced Linear or LayerNorm), and a module that is also part
      of a module left as it is. Everything else is swapped, and one warning lists every
      module left with the reason. ``strict=True`` raises NotImplementedError with that list
      instead, before anything is swapped.

    A custom ``activation`` (a function or a module, called as torch.nn calls it) is kept.
    A final ``norm`` of an encoder is applied to the packed tokens ``[T, d_model]``: it must
    work token by token, as LayerNorm and RMSNorm do.
    """
    fn = "ragged.nn.convert"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}(): expected an nn.Module, got {describe(model)}")
    for name, flag in (("copy", copy), ("strict", strict)):
        if not isinstance(flag, bool):
            raise TypeError(f"{fn}(): expected {name} to be a bool, got {describe(flag)}")
    memo: dict = {}
    built: dict[int, tuple[nn.Module, nn.Module]] = {}  # id(original) -> (original, replacement)
    refused: dict[int, tuple[nn.Module, str, str]] = {}  # id(original) -> (original, where, why)
    places: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, child name, original child)
    first_place: dict[int, str] = {}  # id(original) -> its qualified name where first met

    def plan(module: nn.Module, where: str) -> None:
        """Build the replacement of a swappable ``module`` (once), or record why not.
        Building touches nothing of ``module``: a failure is one more reason."""
        key = id(module)
        if key in built or key in refused:
            return
        first_place[key] = where
        why = _why_not(module)
        if why is None:
            try:
                built[key] = (module, _SWAPS[type(module)].from_torch(module, copy=copy, memo=memo))
                return
            except (TypeError, ValueError, NotImplementedError) as err:
                why = str(err)
        refused[key] = (module, where, why)

    visited: set[int] = {id(model)}
    whole: list[tuple[nn.Module, str]] = []  # (module left whole, where): subclasses of nn.TransformerEncoder

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module._modules.items():
            if child is None or isinstance(child, _RAGGED):
                continue
            if type(child) in _SWAPS:
                plan(child, prefix + name)
                places.append((module, name, child))
            elif id(child) not in visited:
                visited.add(id(child))
                if _left_whole(child):
                    whole.append((child, prefix + name))
                else:
                    visit(child, f"{prefix}{name}.")

    if type(model) in _SWAPS:
        plan(model, "")
    elif not isinstance(model, _RAGGED) and not _left_whole(model):
        visit(model, "")

    # A module inside one that stays must stay too, or it would become two modules (the
    # original there, the ragged one elsewhere): refuse until nothing changes.
    changed = True
    while changed:
        changed = False
        kept: dict[int, str] = {}  # id(module inside a module that stays) -> where that one is
        for original, where in [*whole, *((o, w) for o, w, _ in refused.values())]:
            for sub in original.modules():
                kept.setdefault(id(sub), where)
        for key, (original, _) in list(built.items()):
            hit = next(((path, kept[id(sub)]) for path, sub in original.named_modules(remove_duplicate=False)
                        if type(sub) in _SWAPS and id(sub) in kept), None)
            if hit is not None:
                del built[key]
                owner = repr(hit[1]) if hit[1] else "the model"
                refused[key] = (original, first_place[key], f"{_its(hit[0])} is also part of {owner}, which stays")
                changed = True

    # A swapped module that also sits inside another swapped module: one ragged module at both.
    for original, new in built.values():
        for path, sub in original.named_modules(remove_duplicate=False):
            if path and type(sub) in _SWAPS and id(sub) in built:
                owner, _, leaf = path.rpartition(".")
                setattr(new.get_submodule(owner) if owner else new, leaf, built[id(sub)][1])

    if refused:
        listing = "; ".join(f"{repr(where) if where else 'the model'} ({type(m).__name__}): {why}"
                            for m, where, why in sorted(refused.values(), key=lambda r: r[1]))
        if strict:
            raise NotImplementedError(f"{fn}(): nothing converted: {len(refused)} module(s) cannot be converted: "
                                      f"{listing}")
        warnings.warn(f"{fn}(): left {len(refused)} module(s) as torch.nn modules: {listing}", stacklevel=2)

    if type(model) in _SWAPS:
        return built[id(model)][1] if id(model) in built else model
    done: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        for parent, name, original in places:
            if id(original) in built:
                setattr(parent, name, built[id(original)][1])
                done.append((parent, name, original))
    except BaseException:
        for parent, name, original in reversed(done):
            setattr(parent, name, original)
        raise
    return model
