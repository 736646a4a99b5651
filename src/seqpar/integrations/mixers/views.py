"""Copies of a module whose weights are views of the real ones: how a family hands the ``"heads"``
run mode the part of a mixer that computes some of its heads, with the class's own ``forward``.

:func:`view_module` builds a *new* instance of the module's class through public APIs only
(``cls.__new__`` and ``nn.Module.__init__``, then ``setattr``): the real module's attributes and
submodules are copied by reference, the given tensors (slices of the real parameters, so gradients
reach them) and attributes replace theirs. The real module is never written to, and its hooks do
not run on the copy. A tensor that is not an ``nn.Parameter`` is a plain attribute of the copy,
which is what the class's ``forward`` reads (``self.weight``); the copy lives for one call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

_MODULE_STATE = frozenset(vars(nn.Module()))
"""What ``nn.Module.__init__`` sets on every module (parameter, buffer, submodule and hook tables,
``training``): built fresh for the copy, never shared with the real module."""


def view_module(module: nn.Module, tensors: dict[str, Tensor | None], **attrs: Any) -> nn.Module:
    """A new ``type(module)`` whose named tensors are ``tensors`` (views of the real parameters, or
    None) and attributes / submodules ``attrs``; every other attribute, parameter, buffer and
    submodule is the real module's. No instance ``forward`` (seqpar's wrapper) is copied."""
    cls = type(module)
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.training = module.training
    # dir() lists the instance's attributes, parameters (None ones too), buffers and submodules;
    # minus the class's own names it is the module's state
    state = (set(dir(module)) - set(dir(cls))) | set(vars(module))
    state |= {name for name, _ in module.named_children()}  # names dir() leaves out (digits)
    for name in sorted(state - _MODULE_STATE - {"forward"} - tensors.keys() - attrs.keys()):
        setattr(new, name, getattr(module, name))
    for name, value in {**tensors, **attrs}.items():
        setattr(new, name, value)
    return new


def rows(w: Tensor, *ranges: tuple[int, int]) -> Tensor:
    """``w``'s rows ``a .. e`` of each range, in order (a view for one range, else a copy;
    gradients reach ``w`` either way)."""
    return w[ranges[0][0]:ranges[0][1]] if len(ranges) == 1 else torch.cat([w[a:e] for a, e in ranges])


def plain(*modules: nn.Module | None) -> bool:
    """Plain bias-free ``nn.Linear`` / ``nn.Conv1d`` (exactly those classes): what the families'
    slices cut. A bias is not a per-head partial sum; a wrapped layer (LoRA) is not sliced."""
    return all(type(m) in (nn.Linear, nn.Conv1d) and m.bias is None for m in modules)


def conv_view(conv: nn.Module, *ranges: tuple[int, int]) -> nn.Module:
    """A depthwise ``nn.Conv1d`` restricted to the channels of ``ranges`` (weight and bias rows)."""
    n = sum(e - a for a, e in ranges)
    return view_module(conv, {"weight": rows(conv.weight, *ranges),
                              "bias": None if conv.bias is None else rows(conv.bias, *ranges)},
                       in_channels=n, out_channels=n, groups=n)


def linear_view(lin: nn.Module, *ranges: tuple[int, int], columns: bool = False) -> nn.Module:
    """A bias-free ``nn.Linear`` restricted to the output rows of ``ranges`` (or, with ``columns``,
    its input columns: a partial sum of the full layer's output)."""
    w = lin.weight
    weight = rows(w.t(), *ranges).t() if columns else rows(w, *ranges)
    return view_module(lin, {"weight": weight, "bias": None})
