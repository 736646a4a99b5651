"""torch's and torch.distributed's private names seqpar touches (see :mod:`seqpar.compat`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

# ---------------------------------------------------------------------------------------------
# torch: meshes, autograd, kernels, dynamo
# ---------------------------------------------------------------------------------------------


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh._flatten(name)``: a 1-D view named ``name`` over the dims of the (sliced) DeviceMesh
    ``mesh``, registered on its root so that ``root[name]`` and ``root.get_group(name)`` find it.
    torch has no public way to name a flattened set of dims (2.13)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """``mesh._unflatten(0, sizes, names)``: the 1-D (flattened) DeviceMesh ``mesh`` seen as
    ``len(sizes)`` dimensions of those sizes (row-major, the last innermost), on the same root mesh
    (so its dims compose with the root's in a DTensor or ``fully_shard``). torch has no public
    unflatten (2.13)."""
    return mesh._unflatten(0, sizes, names)


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
