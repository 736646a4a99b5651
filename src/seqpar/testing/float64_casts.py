"""A float64 model that stays float64: diffusers' casts to float32 made no-ops, for exact parity checks.

diffusers' transformers compute some steps in float32 whatever the model's dtype -- RoPE
(``apply_rotary_emb``: ``x.float() * cos ...``), ``FP32LayerNorm``, Wan's modulation
(``hidden_states.float()``) -- for stability in bfloat16. In a float64 model those steps are exact
to float32 only, and a sharded run rounds them differently from the whole one as soon as its
gradients are scaled by an odd number of ranks (seqpar's rule scales each rank's share by P; at
P = 3, ``3 g`` rounds in float32 where ``g`` did not): differences of ~1e-7 relative that say
nothing about seqpar. :class:`Float64Casts` keeps a float64 tensor float64 through those casts, for
the reference and the sharded run alike, so both compute the same float64 math (cf.
:mod:`.eager64`, transformers' float32 softmax in float64)::

    x.float(), x.half(), x.bfloat16()            float64 x -> x itself
    x.to(torch.float32), x.to(other_float32)     float64 x -> float64 (device moves still apply)
    x.type_as(y)                                 float64 x, lower-precision y -> x itself
    f(x, ..., dtype=torch.float32)               float64 x -> dtype=torch.float64 (a norm's, a sum's)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_LOWER = (torch.float32, torch.float16, torch.bfloat16)
_TO_LOWER = {Tensor.float, Tensor.half, Tensor.bfloat16}


def _is64(x: Any) -> bool:
    return isinstance(x, Tensor) and x.dtype == torch.float64


class Float64Casts(TorchFunctionMode):
    """Inside the block, casts of float64 tensors to a lower float precision keep float64 (see the
    module doc). Every other call runs as it is."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if args and _is64(args[0]):
            if func in _TO_LOWER:
                return args[0]
            if func is Tensor.type_as and isinstance(args[1], Tensor) and args[1].dtype in _LOWER:
                return args[0]
            if func is Tensor.to:
                args = tuple(_keep64(a) for a in args)
            if kwargs.get("dtype") in _LOWER:  # .to(dtype=...), a reduction's dtype= (vector_norm, sum)
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def _keep64(a: Any) -> Any:
    """An argument of ``x.to(...)`` with a lower float precision made float64 (``x.to(other)``: an
    empty float64 tensor on other's device stands for it)."""
    if isinstance(a, Tensor) and a.dtype in _LOWER:
        return a.new_empty(0, dtype=torch.float64)
    return torch.float64 if a in _LOWER else a
