"""Layer 0: every private torch / transformers / accelerate name seqpar touches, in one room.

Each shim below is the *only* place its outside internal is read or written, says what it relies on,
and has a test of exactly that on the installed versions (``tests/test_compat.py``). When a version
moves, this file and that test are what to check. Layer 0 (imports nothing of seqpar) so that every
layer can use it: comm and attention touch torch internals too. transformers and accelerate are
imported inside the shims that need them, never at import time.

Checked on the tested set (``seqpar/tested.txt``: torch 2.13.0's CPU build -- the CUDA attention ops on a
CUDA build where a GPU ran them --, transformers 5.25.0, accelerate 1.16.0) and on the releases before it
that :data:`CHECKED_ON` lists (transformers 5.24.0, accelerate 1.15.0).

    shim                             outside internal                                  used by
    -------------------------------  ------------------------------------------------  -----------------------
    flatten_mesh                     DeviceMesh._flatten                               comm/mesh.py
    queue_backward_callback          Variable._execution_engine.queue_callback         comm/guard.py, comm/faults.py
    default_store                    distributed_c10d._get_default_store               comm/faults.py
    abort_all_groups                 distributed_c10d._abort_process_group             comm/waits.py
    DCP_METADATA_GLOBALS             DCP .metadata: filesystem._StorageInfo,           train/safe_load.py
                                     serialization._get_layout, _MEM_FORMAT_ENCODING
    cpu_flash_attention(_backward)   aten._scaled_dot_product_flash_attention_for_cpu  attention/flash_cpu.py
                                     (and its _backward)
    cuda_flash_attention(_backward)  aten._scaled_dot_product_flash_attention(_bw)     attention/cuda.py
    cuda_efficient_attention(...)    aten._scaled_dot_product_efficient_attention(_bw) attention/cuda.py
    cudnn_attention(_backward)       aten._scaled_dot_product_cudnn_attention(_bw)     attention/cuda.py
    fail_on_recompile_limit          torch._dynamo.config (fail_on_recompile_limit_hit) attention/flex.py
    fake_process_group               torch.testing._internal.distributed.fake_pg       benchmarks/bench_rank.py,
                                     (FakeStore; importing it registers "fake")        bench_ring_step.py
    TorchDispatchMode,               torch.utils._python_dispatch                      testing/memory.py
      is_traceable_wrapper_subclass
    active_ddp_module                DistributedDataParallel._get_active_ddp_module    integrations/fsdp.py
    fsdp_meshes                      FSDPModule._get_fsdp_state()._fsdp_param_groups   integrations/fsdp.py
    attn_implementation              PretrainedConfig._attn_implementation             integrations/hf.py, zoo
    decoder_block_classes            PreTrainedModel._no_split_modules                 integrations/fsdp, memory
    mark_uninitialized               module._is_hf_initialized                         integrations/materialize.py
    init_weights_override            PreTrainedModel._init_weights (shadowed)          integrations/materialize.py
    split_prepared_loader            accelerate's BatchSamplerShard and                integrations/trainer.py
                                     IterableDatasetShard: num_processes, process_index
    float64_loss_log                 Trainer._tr_loss (the loss summed between logs,   integrations/
                                     then averaged over every process)                trl_trainers.py
    trl_grpo_gathers                 trl.trainer.grpo_trainer's module globals gather, integrations/trl_grpo.py
                                     gather_object (swapped for a block; trl 1.16.0)
    kernels_replaced, KernelCall,    a recurrent mixer's modeling-module globals       integrations/mixers/
      calls_kernels, kernel_route,   (causal_conv1d_fn, torch_chunk_gated_delta_rule,  state_*, testing/scans64,
      modeling_module,               chunk_kimi_delta_attention, mamba2_chunk_scan,    integrations/features
      kernel_signature               mamba_selective_scan, mamba_split_conv1d_scan_
                                     combined): swapped for one call of the mixer; read
                                     from forward or a same-module helper (5.25)
    kernelized_funcs                 kernels.get_kernelized_layers (public; the        integrations/mixers/
                                     ``kernels`` package, a dependency of 5.25)        state_passing
    load_balancing_loss_func         a MoE modeling module's load_balancing_loss_func  testing/router64.py,
                                     (called, never replaced: the oracle of the aux    tests/batch/
                                     loss seqpar recomputes over the whole batch)      test_router_loss.py
    deepspeed_skip_cpu_shm_build     deepspeed.ops.__compatible_ops__ (its op probe's  bench/alst.py
                                     cache; deepspeed 0.19.8)
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


def tested_set() -> dict[str, str]:
    """The tested set: every package's version as CI installed and ran it together (``seqpar/tested.txt``,
    pip constraints that ``make install`` applies), by lower-case distribution name."""
    text = (Path(__file__).parent / "tested.txt").read_text()
    pins = (line.split("==", 1) for line in text.splitlines() if "==" in line and not line.startswith("#"))
    return {name.strip().lower().replace("_", "-"): version.strip() for name, version in pins}


_TESTED = tested_set()
CHECKED_ON: dict[str, tuple[str, ...]] = {
    name: tuple(sorted({_TESTED[name], *earlier}))
    for name, earlier in {"torch": (), "transformers": ("5.24.0",), "accelerate": ("1.15.0",), "deepspeed": ()}.items()
    if name in _TESTED}
"""The versions every shim here was tested on (``tests/test_compat.py``), per package: the tested set's
and the earlier releases whose internals the shims still serve (checked with those installed)."""


@dataclass(frozen=True)
class FeatureStatus:
    """One line of a feature report (:func:`seqpar.integrations.hf.features.feature_report`): whether
    ``feature`` (e.g. ``"state passing: Qwen3NextGatedDeltaNet"``) is available with the installed
    versions, and ``detail``: how it is reached, or why it is not and what runs instead."""

    feature: str
    available: bool
    detail: str

__all__ = [
    "CHECKED_ON", "FeatureStatus", "KernelCall", "TorchDispatchMode", "abort_all_groups", "active_ddp_module",
    "attn_implementation", "calls_kernels", "cpu_flash_attention", "cpu_flash_attention_backward",
    "cuda_efficient_attention", "cuda_efficient_attention_backward", "cuda_flash_attention",
    "cuda_flash_attention_backward", "cudnn_attention", "cudnn_attention_backward", "decoder_block_classes",
    "default_store", "fail_on_recompile_limit", "fake_process_group", "flatten_mesh", "float64_loss_log", "fsdp_meshes",
    "init_weights_override", "is_traceable_wrapper_subclass", "kernel_route", "kernel_signature", "kernelized_funcs",
    "kernels_replaced", "load_balancing_loss_func", "mark_uninitialized", "modeling_module",
    "queue_backward_callback", "split_prepared_loader", "tested_set", "trl_grpo_gathers",
    "deepspeed_skip_cpu_shm_build",
]

# ---------------------------------------------------------------------------------------------
# torch: meshes, autograd, kernels, dynamo
# ---------------------------------------------------------------------------------------------


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh._flatten(name)``: a 1-D view named ``name`` over the dims of the (sliced) DeviceMesh
    ``mesh``, registered on its root so that ``root[name]`` and ``root.get_group(name)`` find it.
    torch has no public way to name a flattened set of dims (2.13)."""
    return mesh._flatten(name)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once when the running backward pass ends (``Variable._execution_engine.
    queue_callback``, what FSDP2 uses for its own end of backward). Call it from a backward."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def cpu_flash_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, is_causal: bool, *,
                        attn_mask: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: ``(out [B, H, S, D], lse [B, H, S])``,
    the fused CPU kernel SDPA dispatches to, with the log-sum-exp SDPA does not return."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                      attn_mask=attn_mask, scale=scale)


def cpu_flash_attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 dropout_p: float, is_causal: bool, *, attn_mask: Tensor | None = None,
                                 scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention_for_cpu_backward``: ``(dq, dk, dv)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)


def cuda_flash_attention(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``aten._scaled_dot_product_flash_attention`` (FlashAttention-2, CUDA): ``(out, lse, ...)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention(*args, **kwargs)


def cuda_flash_attention_backward(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._scaled_dot_product_flash_attention_backward`` (CUDA): ``(dq, dk, dv)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(*args, **kwargs)


def cuda_efficient_attention(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``aten._scaled_dot_product_efficient_attention`` (memory-efficient, CUDA): ``(out, lse, ...)``."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(*args, **kwargs)


def cuda_efficient_attention_backward(*args: Any, **kwargs: Any) -> tuple[Tensor, ...]:
    """``aten._scaled_dot_product_efficient_attention_backward`` (CUDA): ``(dq, dk, dv, dbias)``."""
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(*args, **kwargs)


def cudnn_attention(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``aten._scaled_dot_product_cudnn_attention`` (cuDNN, CUDA): ``(out, lse [B, H, S, 1], ...)``."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(*args, **kwargs)


def cudnn_attention_backward(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
    """``aten._scaled_dot_product_cudnn_attention_backward`` (CUDA): ``(dq, dk, dv)``."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(*args, **kwargs)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group as rank ``rank`` of ``world_size`` in this one process, on torch's
    ``"fake"`` backend: every collective returns at once and moves no bytes (an all-gather's or
    all-reduce's output is this rank's own input, a receive buffer keeps what it held). Relies on
    ``torch.testing._internal.distributed.fake_pg`` registering the backend on import and on its
    ``FakeStore``. Destroyed on exit; refuses to run when a process group exists already."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: torch.distributed is initialized already in this process")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def fail_on_recompile_limit() -> contextlib.AbstractContextManager[Any]:
    """A context in which a compiled function that hits dynamo's recompile limit raises, instead
    of silently running uncompiled (``torch._dynamo.config.fail_on_recompile_limit_hit``)."""
    return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)



# ---------------------------------------------------------------------------------------------
# torch.distributed: the default group's store, aborting every group
# ---------------------------------------------------------------------------------------------


def default_store() -> Any:
    """The store ``init_process_group`` created for (or was given for) the default process group
    (``distributed_c10d._get_default_store()``): the one every rank of the job reaches, whatever the
    launcher (torchrun's agent store, a ``file://`` or ``env://`` rendezvous). torch has no public
    getter (2.13); the alternative is asking every user to pass their store in."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def abort_all_groups() -> None:
    """Abort every process group of this process, the default one included
    (``distributed_c10d._abort_process_group()``): on NCCL this frees a collective that waits for a
    peer that will never come; gloo ignores it (measured: a pending gloo collective stays blocked)."""
    import torch.distributed as dist

    dist.distributed_c10d._abort_process_group()


DCP_METADATA_GLOBALS = frozenset({
    "torch.Size", "torch.serialization._get_layout", "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", "pathlib.PosixPath", "pathlib.WindowsPath",
    "pathlib.PurePosixPath", "pathlib.PureWindowsPath", "collections.OrderedDict"})
"""What torch.distributed.checkpoint's ``.metadata`` pickle names besides the dataclasses of
``torch.distributed.checkpoint.metadata`` and torch dtypes: its private ``_StorageInfo`` (where each
item sits in which file), ``_get_layout`` (a layout from its name) and the memory-format enum. A
restricted unpickler reads the file with only these (``train/safe_load.py``): DCP itself uses a plain
``pickle.load``, which runs whatever a handed-over checkpoint names."""


# ---------------------------------------------------------------------------------------------
# torch.distributed: which ranks a data-parallel wrapper reduces over
# ---------------------------------------------------------------------------------------------


def active_ddp_module() -> nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel whose forward is running now (around the wrapped module's
    call, hooks included), or None (``DistributedDataParallel._get_active_ddp_module()``; not set
    under ``TORCH_DISTRIBUTED_USE_PYTHON_REDUCER`` or DDP's delayed all-reduce of all parameters)."""
    return nn.parallel.DistributedDataParallel._get_active_ddp_module()


def fsdp_meshes(module: nn.Module) -> list[Any]:
    """The DeviceMeshes over which ``fully_shard`` (FSDP2) reduces the gradients of ``module``'s
    own parameters (one per parameter group; none for a module that is not an FSDPModule or
    holds no parameter of its own) -- whether the parameters are sharded or unsharded right now."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return []
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # before per-parameter meshes: at most one group
        groups = [g for g in (state._fsdp_param_group,) if g is not None]
    return [g.mesh_info.mesh for g in groups]


# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a (sub-)config runs now (``config._attn_implementation``;
    ``set_attn_implementation`` is the public setter, there is no public getter)."""
    return config._attn_implementation


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


# ---------------------------------------------------------------------------------------------
# accelerate
# ---------------------------------------------------------------------------------------------


def split_prepared_loader(loader: Any, num: int, index: int) -> bool:
    """Make an accelerate-prepared DataLoader hand out share ``index`` of ``num`` instead of this
    process's share of all processes, by setting its ``BatchSamplerShard`` (map-style data) or
    ``IterableDatasetShard`` (iterable data) ``num_processes`` / ``process_index`` -- the knob
    transformers' Trainer itself turns for its BatchRebalanceSampler. ``num == 1``: one reader of
    the whole set, no batches repeated to even out the processes. Returns False (and changes
    nothing) for a loader without either."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, BatchSamplerShard):
        sampler.num_processes, sampler.process_index = num, index
        sampler.even_batches = sampler.even_batches and num > 1
        return True
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDatasetShard):
        dataset.num_processes, dataset.process_index = num, index
        return True
    return False


def float64_loss_log(trainer: Any, step_loss: Tensor) -> Tensor:
    """The value to return from ``training_step`` so that the Trainer's running loss sum
    (``_tr_loss``: reset by ``train()``, ``+=`` each step, averaged over every process at logging)
    holds what a float32 sum holds in the script without seqpar, and its mean over SP copies is exact.

    The sum is made float64 (a float32 mean of equal copies, ``(3 y) / 3``, can move by an ulp); the
    step adds ``fl32(acc + loss) - acc``, so the float64 sum stays the float32 sum the plain script
    keeps (float32 += a float64 loss rounds too)."""
    acc = getattr(trainer, "_tr_loss", None)
    if not isinstance(acc, Tensor):
        return step_loss
    if acc.dtype != torch.float64:
        acc = trainer._tr_loss = acc.to(torch.float64)
    total = (acc + step_loss.detach().to(torch.float64)).to(torch.float32).to(torch.float64)
    return total - acc


@contextlib.contextmanager
def trl_grpo_gathers(gather: Callable[[Any], Any], gather_object: Callable[[Any], Any]) -> Iterator[None]:
    """For the block, TRL's GRPO module calls ``gather`` / ``gather_object`` in place of accelerate's
    (it imports them as module globals: its reward gather, its completion logs); restored after."""
    from trl.trainer import grpo_trainer

    old = grpo_trainer.gather, grpo_trainer.gather_object
    grpo_trainer.gather, grpo_trainer.gather_object = gather, gather_object
    try:
        yield
    finally:
        grpo_trainer.gather, grpo_trainer.gather_object = old


# ---------------------------------------------------------------------------------------------
# deepspeed (the peer the bench measures against; an optional package)
# ---------------------------------------------------------------------------------------------

DEEPSPEED_SHM_OP = "deepspeed_shm_comm"


def deepspeed_skip_cpu_shm_build() -> None:
    """Before ``deepspeed.init_distributed`` on a CPU: mark DeepSpeed's shared-memory comm op as not
    buildable, so that its CPU backend does not JIT-compile it (one to four minutes of C++ on a fresh
    2-core machine). That op serves only ``inference_all_reduce``; every collective of training goes
    through torch.distributed (gloo) either way. Relies on ``deepspeed.ops.__compatible_ops__``, the
    cache of DeepSpeed's op probe (a dict its comm backend reads and, as its comment says, keeps edits
    to: checked on deepspeed 0.19.8)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[DEEPSPEED_SHM_OP] = False
