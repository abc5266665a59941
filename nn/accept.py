"""What a torch.nn transformer module must be for ragged.nn to take it, in one place: the rules
of ``MultiheadAttention``'s constructor, of the ``from_torch`` class methods and of
:func:`ragged.nn.convert` (which reports a reason and leaves the module as it is, where the
others raise), and :func:`adopt`, which hands a source module's Parameters to the ragged one."""

from __future__ import annotations

import copy as _copy
from typing import TypeVar

from torch import nn

__all__ = ["adopt", "attention_features", "module_attention_features", "reason_subject"]

_M = TypeVar("_M", bound=nn.Module)


def reason_subject(path: str) -> str:
    """The words a reason starts with to name the module it is about: ``"it"`` for the module
    itself, ``"its <path>"`` for a submodule."""
    return "it" if not path else f"its {path}"


def attention_features(add_bias_kv: bool, add_zero_attn: bool) -> str | None:
    """The attention features ragged does not take, as one phrase, or None: a learned key/value
    (``add_bias_kv``) or a zero key/value (``add_zero_attn``) appended to every sequence."""
    if add_bias_kv:
        return "add_bias_kv=True (a learned key/value appended to every sequence)"
    if add_zero_attn:
        return "add_zero_attn=True (a zero key/value appended to every sequence)"
    return None


def module_attention_features(attn: nn.MultiheadAttention) -> str | None:
    """:func:`attention_features` of a built ``torch.nn.MultiheadAttention``."""
    return attention_features(attn.bias_k is not None or attn.bias_v is not None, attn.add_zero_attn)


def adopt(fn: str, shell: _M, source: nn.Module, copy: bool, memo: dict | None) -> _M:
    """Give ``shell`` (built on the meta device with ``source``'s configuration) the
    Parameters and buffers of ``source`` at the same names: the same objects, or with
    ``copy`` deep copies (``memo`` keeps tied tensors tied across a conversion). Every
    submodule takes the training mode of its counterpart in ``source``.

    ``source`` is never modified, also when this raises (a submodule ``shell`` shares with
    ``source``, such as a custom activation module, already holds the right tensors and
    modes and is left as it is)."""
    if copy:
        source = _copy.deepcopy(source, memo if memo is not None else {})
    for kind, named in (("parameter", "named_parameters"), ("buffer", "named_buffers")):
        ours = dict(getattr(shell, named)(remove_duplicate=False))
        theirs = dict(getattr(source, named)(remove_duplicate=False))
        if set(ours) != set(theirs):
            raise TypeError(f"{fn}(): {type(source).__name__} has {kind}s {sorted(theirs)}, expected {sorted(ours)}")
    for kind, named in (("parameter", "named_parameters"), ("buffer", "named_buffers")):
        ours = dict(getattr(shell, named)(remove_duplicate=False))
        for name, tensor in getattr(source, named)(remove_duplicate=False):
            if ours[name] is tensor:
                continue
            owner, _, leaf = name.rpartition(".")
            target = shell.get_submodule(owner) if owner else shell
            if kind == "parameter":
                setattr(target, leaf, tensor)
            else:
                target.register_buffer(leaf, tensor, persistent=leaf not in target._non_persistent_buffers_set)
    theirs = dict(source.named_modules(remove_duplicate=False))
    for name, module in shell.named_modules(remove_duplicate=False):
        if name in theirs:
            module.training = theirs[name].training
    return shell
