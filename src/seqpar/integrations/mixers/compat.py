"""The one place the mixers package reaches past transformers' public API: the kernel functions a
token mixer's ``forward`` calls by their module-level name.

transformers 5.24 (the version checked) has every recurrent mixer's ``forward`` call its kernels
as globals of its modeling module -- ``causal_conv1d_fn`` (the short convolution) and one chunked
scan (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``,
``mamba_selective_scan``), each a dispatcher to flash-linear-attention / mamba-ssm / causal-conv1d
when installed, else to transformers' torch code -- and offers no other way in: no kernel
attribute on the module, and the generation cache's recurrent state must be known before the
scan runs. The state-passing run mode needs the scan's inputs and its initial state, so
:func:`kernels_replaced` swaps those globals for the duration of one call of the mixer and puts
the originals back in ``finally``; :class:`KernelCall` re-issues a call with some arguments
changed, keeping the caller's positional / keyword convention (the installed kernels name their
parameters differently from the torch code: ``q`` vs ``query``).

The names each family relies on are declared in its module (:class:`.registry.StateKernels`);
``tests/integrations/test_state_passing.py`` checks, for each, that the class's ``forward`` still
calls it (a renamed kernel makes state passing unavailable, not wrong: :func:`calls_kernels`).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

TRANSFORMERS_CHECKED = ("5.24.0",)


def modeling_module(cls: type) -> ModuleType:
    """The module that defines ``cls`` (a mixer's modeling file)."""
    return sys.modules[cls.__module__]


def calls_kernels(cls: type, names: tuple[str, ...]) -> bool:
    """Whether ``cls.forward`` (under its decorators) reads every one of ``names`` as a global of
    its modeling module, and that module defines them: what :func:`kernels_replaced` needs."""
    module = sys.modules.get(cls.__module__)
    code = inspect.unwrap(cls.forward).__code__
    return module is not None and all(callable(getattr(module, n, None)) and n in code.co_names for n in names)


@contextlib.contextmanager
def kernels_replaced(module: ModuleType, replacements: Mapping[str, Callable[..., Any]]
                     ) -> Iterator[dict[str, Callable]]:
    """Inside the block, ``module`` (a modeling file: :func:`modeling_module`) resolves each name
    of ``replacements`` to the given function; yields the originals (by name), which the
    replacements call. Restored on exit, exceptions included. One mixer runs at a time in a
    process (its collectives order the ranks), so no other caller sees the swap."""
    originals = {name: getattr(module, name) for name in replacements}
    try:
        for name, fn in replacements.items():
            setattr(module, name, fn)
        yield originals
    finally:
        for name, fn in originals.items():
            setattr(module, name, fn)


class KernelCall:
    """One call of a kernel function: its arguments by the names of the function's signature
    (transformers' torch reference, which the dispatcher wraps), re-issued as given -- positional
    arguments stay positional -- with some replaced."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self._params = inspect.signature(fn).parameters
        self._positional = tuple(list(self._params)[:len(args)])
        self.values = {**dict(zip(self._positional, args, strict=True)), **kwargs}

    def __getitem__(self, name: str) -> Any:
        """The argument ``name`` as passed, else the signature's default (None without one)."""
        if name in self.values:
            return self.values[name]
        default = self._params[name].default if name in self._params else None
        return None if default is inspect.Parameter.empty else default

    def replace(self, **changes: Any) -> KernelCall:
        out = object.__new__(KernelCall)
        out.fn, out._params, out._positional = self.fn, self._params, self._positional
        out.values = {**self.values, **changes}
        return out

    def __call__(self) -> Any:
        args = [self.values[n] for n in self._positional]
        return self.fn(*args, **{k: v for k, v in self.values.items() if k not in self._positional})
