"""transformers' private names seqpar touches, the recurrent mixers' kernel globals included
(the table: :mod:`seqpar.compat`)."""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any

from torch import nn

# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------


def set_tp_size(model: nn.Module, tp: int) -> None:
    """``model._tp_size = tp``: what transformers' ``model.tp_size`` returns, accelerate's
    ``get_model_tp_size`` reads to accept a tensor-parallel model in its TP path, and the Trainer's
    ``get_tp_size`` divides the batch count by. transformers sets it when it shards a model itself
    (``from_pretrained(distributed_config=...)``); there is no public setter (5.25)."""
    model._tp_size = int(tp)


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a (sub-)config runs now (``config._attn_implementation``;
    ``set_attn_implementation`` is the public setter, there is no public getter)."""
    return config._attn_implementation


def experts_implementation(config: Any) -> str | None:
    """The MoE experts implementation a (sub-)config runs now (``config._experts_implementation``:
    ``"eager"``, ``"grouped_mm"``, ...; set through ``from_pretrained(experts_implementation=...)``,
    there is no public getter). None for a config that has none."""
    return getattr(config, "_experts_implementation", None)


def decoder_block_classes(model: nn.Module) -> set[str]:
    """Class names of the repeated blocks (decoder layers) transformers declares for ``model``
    (``_no_split_modules``, the list ``device_map`` and accelerate's FSDP wrapping read)."""
    names = getattr(model, "_no_split_modules", None) or []
    return {n for n in names if isinstance(n, str)}


def mark_uninitialized(model: nn.Module) -> None:
    """Clear transformers' per-module "already initialized" flag (``_is_hf_initialized``), so that
    ``initialize_weights()`` initializes every module again."""
    for m in model.modules():
        m._is_hf_initialized = False


@contextlib.contextmanager
def init_weights_override(models: Iterable[nn.Module],
                          wrap: Callable[[Callable[[nn.Module], None]], Callable[[nn.Module], None]]
                          ) -> Iterator[None]:
    """Within the block, ``initialize_weights()`` calls ``wrap(original)(module)`` wherever a
    PreTrainedModel of ``models`` would call its own ``_init_weights(module)`` (an instance
    attribute shadows the method; removed on exit, also on error)."""
    models = list(models)
    originals = [m._init_weights for m in models]
    try:
        for m, original in zip(models, originals, strict=True):
            m._init_weights = wrap(original)
        yield
    finally:
        for m in models:
            m.__dict__.pop("_init_weights", None)


# ---------------------------------------------------------------------------------------------
# transformers: the kernel functions a recurrent token mixer's forward calls by name
# ---------------------------------------------------------------------------------------------
# Every recurrent mixer's ``forward`` calls its kernels as globals of its modeling module --
# ``causal_conv1d_fn`` (the short convolution) and one chunked scan (``torch_chunk_gated_delta_rule``,
# ``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``, ``mamba_selective_scan``), each a dispatcher
# to flash-linear-attention / mamba-ssm / causal-conv1d when installed, else to transformers' torch
# code. transformers 5.24 calls them from ``forward`` itself; 5.25 through a module-level helper of
# the same file (``causal_conv1d_forward``, ``mamba2_scan_forward``, ``mamba_scan_forward``), which
# also reads the generation cache. Neither offers another way in: 5.25's public hook,
# ``use_kernelized_func`` + ``kernelize`` (the ``kernels`` package), replaces a function for a
# whole model, persistently, with a kernel loaded from a Hub or local *repository* -- not one call
# with a function that needs the call's inputs. State passing (integrations/mixers/state_passing.py)
# needs the scan's inputs and its initial state, so it swaps those globals for one call of the
# mixer; a helper reads them from the same module globals, so the swap reaches them there too.
# Two things can still bypass the swap and make it wrong, and both are checked: a forward that no
# longer reaches a name (:func:`kernel_route` / :func:`calls_kernels`: state passing is then
# unavailable, the feature report says why), and a helper that ``kernelize`` replaced on an instance
# (:func:`kernelized_funcs`). With ``kernels`` installed (a dependency of transformers 5.25) each
# kernel function is an ``nn.Module`` instance whose ``forward`` carries the function's signature
# (:func:`kernel_signature`). The names each family relies on are declared in its module
# (StateKernels); tests/integrations/test_state_passing.py checks them for each class.


def modeling_module(cls: type) -> ModuleType:
    """The module that defines ``cls`` (a mixer's modeling file)."""
    return sys.modules[cls.__module__]


@functools.cache
def _module_functions(module_name: str) -> dict[str, frozenset[str]]:
    """Each top-level function of the module's source -> the global names its body reads (from the
    source, so that a function a decorator turned into a module instance is read the same way)."""
    module = sys.modules[module_name]
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return {}
    return {node.name: frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
            for node in tree.body if isinstance(node, ast.FunctionDef)}


def kernel_route(cls: type, names: tuple[str, ...]) -> dict[str, str | None] | None:
    """How ``cls.forward`` (under its decorators) reaches each of ``names``, globals of its modeling
    module that the module defines: ``None`` where ``forward`` reads the name itself (5.24), else the
    module-level helper of the same file that ``forward`` calls and that reads it (5.25:
    ``causal_conv1d_forward`` reads ``causal_conv1d_fn``). ``None`` overall when a name is not
    reached, one level down at most, or not defined: what :func:`kernels_replaced` needs."""
    module = sys.modules.get(cls.__module__)
    if module is None or not all(callable(getattr(module, n, None)) for n in names):
        return None
    direct = set(inspect.unwrap(cls.forward).__code__.co_names)
    helpers = {h: reads for h, reads in _module_functions(cls.__module__).items() if h in direct}
    route: dict[str, str | None] = {}
    for name in names:
        if name in direct:
            route[name] = None
            continue
        via = sorted(h for h, reads in helpers.items() if name in reads)
        if not via:
            return None
        route[name] = via[0]
    return route


def calls_kernels(cls: type, names: tuple[str, ...]) -> bool:
    """Whether ``cls.forward`` reaches every one of ``names`` (:func:`kernel_route`)."""
    return kernel_route(cls, names) is not None


def kernelized_funcs(module: nn.Module) -> set[str]:
    """Names of the kernel functions attached to ``module`` (``use_kernelized_func``) whose forward
    ``kernelize`` replaced with a kernel from a repository (``kernels.get_kernelized_layers``, the
    package's public inspection); empty without the ``kernels`` package."""
    try:
        from kernels import get_kernelized_layers
    except ImportError:
        return set()
    return {func for (layer, func) in get_kernelized_layers(module).funcs if layer == ""}


def kernel_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """The signature of a kernel function: a plain function's own, or, for a function that the
    ``kernels`` package made an ``nn.Module`` instance (``use_kernel_forward_from_hub``), its
    ``forward``'s -- which carries the function's parameters."""
    return inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn)


def load_balancing_loss_func(cls: type) -> Callable[..., Any]:
    """The ``load_balancing_loss_func`` of the modeling module that defines ``cls`` (a MoE causal
    LM): ``fn(gate_logits: tuple, num_experts, top_k, attention_mask)`` (Doge's: ``num_experts,
    num_keys, top_k, attention_mask``). Raises ValueError where the module has none."""
    fn = getattr(modeling_module(cls), "load_balancing_loss_func", None)
    if not callable(fn):
        raise ValueError(f"{cls.__name__}'s modeling module has no load_balancing_loss_func")
    return fn


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
    arguments stay positional -- with some replaced (the installed kernels name their parameters
    differently from the torch code: ``q`` vs ``query``)."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self._params = kernel_signature(fn).parameters
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
