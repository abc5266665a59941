"""A layer's Linear as the converted layer reads it: a ``torch.nn.Linear``, or peft's LoRA
``Linear`` read as the one Linear it computes.

The converted layers never call their Linears: they read each one's weight and bias into a
:class:`ragged.nn.layer.LayerSpec` (:mod:`ragged.nn.hf.family`). A LoRA Linear (peft's
``peft.tuners.lora.layer.Linear``, put in place by ``get_peft_model``, by transformers'
``add_adapter`` or by sentence-transformers' ``add_adapter``) computes, in peft's forward,
``base(x) + sum over its active adapters of scaling * B(A(dropout(x)))``; with the dropout an
identity that is one Linear, of weight ``W + sum scaling * B_w @ A_w`` and bias
``b + sum scaling * B_b`` (``B_b`` only with ``lora_bias=True``). :func:`effective_linear`
returns that pair, read from the leaf Parameters on every call with plain torch ops (no cache,
no write to a Parameter): the gradient reaches ``A`` and ``B`` (and ``W``, ``b`` where they
train), and merging, unmerging, disabling and switching adapters change what the next forward
reads, exactly as they change peft's forward:

* adapters disabled (``disable_adapter()``, ``disable_adapters()``): the base Linear; a merged
  adapter is first unmerged, as peft's forward does (peft's own ``unmerge``);
* any adapter merged (``merge_adapter()``): the base Linear, which holds the merged weight;
* otherwise the base Linear plus every active adapter the module holds (``set_adapter``, a
  list of active adapters: all of them).

In float32 and float64 the sum is peft's to rounding; in bf16 or fp16 the low-rank product is
rounded to the weight's dtype once, as merging rounds it, where peft adds it to the output in
the adapter's dtype.

Refused (:func:`linear_reason`, at conversion and again on every forward, so that an adapter
added later is checked too): ``lora_dropout > 0`` (the adapter reads ``dropout(x)``, which no
weight expresses), LoRA variants (DoRA's ``use_dora``, aLoRA and the others peft resolves into
a ``lora_variant``), ``fan_in_fan_out`` (weights stored transposed), a base layer or adapter
matrix other than a ``torch.nn.Linear``, forward hooks on the LoRA Linear (peft adds them for a
per-row ``adapter_names``, which the converted layer would not run), and any other module class
(other peft tuners' layers, a subclass of Linear).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

__all__ = ["effective_linear", "linear_reason"]

_LORA_LAYER = "peft.tuners.lora.layer"  # where peft defines its LoRA Linear


def _lora_class() -> type | None:
    """peft's LoRA ``Linear`` when peft is loaded (a module of it can exist), else None."""
    mod = sys.modules.get(_LORA_LAYER)
    cls = getattr(mod, "Linear", None)
    return cls if isinstance(cls, type) else None


def _param(module: nn.Module, name: str) -> Any:
    """``module.<name>`` for a parameter, the module's own dict first (as the families read them)."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_pre_hooks or module._forward_hooks)


def linear_reason(module: nn.Module, subject: str) -> str | None:
    """Why :func:`effective_linear` cannot read ``module`` as one Linear, or None. ``subject``
    names it and starts the sentence (``"its bert.encoder.layer.0 q projection"``). Reads only."""
    cls = type(module)
    if cls is nn.Linear:
        return None
    lora = _lora_class()
    if lora is None or cls is not lora:
        parts = cls.__module__.split(".")
        where = f" (peft's {parts[2]})" if parts[:2] == ["peft", "tuners"] and len(parts) > 2 else ""
        return (
            f"{subject} is a {cls.__name__}{where}, not a torch.nn.Linear or peft's LoRA Linear (ragged would not "
            "run its code)"
        )
    m: Any = module
    base = module._modules.get("base_layer")
    if type(base) is not nn.Linear:
        return f"{subject} is a LoRA Linear over a {type(base).__name__}, not over a torch.nn.Linear"
    if getattr(m, "fan_in_fan_out", False):
        return (
            f"{subject} is a LoRA Linear with fan_in_fan_out=True (weights stored transposed), which ragged does not "
            "read; a torch.nn.Linear base takes fan_in_fan_out=False"
        )
    if _hooked(module):
        return (
            f"{subject} (a LoRA Linear) has forward hooks, which the converted layer would not run (peft adds them "
            "for adapter_names=, a per-row choice of adapter: call the model without it, or keep it unconverted)"
        )
    variants = getattr(m, "lora_variant", None) or {}
    dora = getattr(m, "use_dora", None) or {}
    for name in m.lora_A:
        if dora.get(name) or name in variants:
            what = "DoRA (use_dora=True)" if dora.get(name) else f"the LoRA variant {type(variants[name]).__name__}"
            return (
                f"{subject} has adapter {name!r} using {what}, whose output is no sum of Linears; ragged reads plain "
                "LoRA adapters: keep this model unconverted"
            )
        a, b = m.lora_A[name], m.lora_B._modules.get(name)
        if type(a) is not nn.Linear or type(b) is not nn.Linear:
            return f"{subject} has adapter {name!r} whose lora_A / lora_B are not torch.nn.Linear modules"
        if (a.in_features, a.out_features, b.out_features) != (base.in_features, b.in_features, base.out_features):
            return f"{subject} has adapter {name!r} whose lora_A / lora_B shapes do not match its base Linear"
        if a.bias is not None or (b.bias is not None and base.bias is None):
            return f"{subject} has adapter {name!r} with a bias peft's LoRA Linear does not make"
        if any(_hooked(s) for s in (a, b, base)):
            return f"{subject} has adapter {name!r} with forward hooks on its Linears, which ragged would not run"
        drop = m.lora_dropout._modules.get(name)
        p = drop.p if isinstance(drop, nn.Dropout) else None
        if type(drop) is not nn.Identity and not (type(drop) is nn.Dropout and p == 0):
            rate = f"lora_dropout={p}" if p is not None else f"a {type(drop).__name__} as its lora_dropout"
            return (
                f"{subject} has adapter {name!r} with {rate}: the adapter reads dropout(x), which no effective "
                "weight expresses; set lora_dropout=0 in its LoraConfig, or keep the model unconverted"
            )
        if not isinstance(m.scaling.get(name), (int, float)):
            return f"{subject} has adapter {name!r} whose scaling is {m.scaling.get(name)!r}, not a number"
    return None


def effective_linear(module: nn.Module, subject: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [out, in], bias [out] or None)`` that ``module`` (a ``torch.nn.Linear`` or
    peft's LoRA Linear) applies now (see the module docstring); raises NotImplementedError with
    :func:`linear_reason`'s sentence for what it cannot read."""
    if type(module) is nn.Linear:
        return _param(module, "weight"), _param(module, "bias")
    why = linear_reason(module, subject)
    if why is not None:
        swapped = type(module) is not _lora_class()  # another class put in after conversion
        hint = "; it is never read as a plain Linear: undo the change, or convert the model again" if swapped else ""
        raise NotImplementedError(f"ragged.nn.hf: {why}{hint}")
    m: Any = module
    base = module._modules["base_layer"]
    assert base is not None  # checked by linear_reason
    if m.disable_adapters:
        if m.merged:
            m.unmerge()  # what peft's forward does with adapters disabled
        return _param(base, "weight"), _param(base, "bias")
    weight, bias = _param(base, "weight"), _param(base, "bias")
    if m.merged:
        return weight, bias
    held = m.lora_A
    for name in m.active_adapters:
        if name not in held:
            continue
        scaling = m.scaling[name]
        a, b = _param(held[name], "weight"), m.lora_B[name]
        weight = weight + ((_param(b, "weight") * scaling) @ a).to(weight.dtype)
        b_bias = _param(b, "bias")
        if b_bias is not None:
            bias = bias + (b_bias * scaling).to(bias.dtype)
    return weight, bias
