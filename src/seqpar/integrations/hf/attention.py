"""The attention function :func:`seqpar.parallelize` registers with transformers, in named pieces.

transformers calls ``fn(module, query, key, value, attention_mask, scaling=..., dropout=...,
**kwargs)`` once per decoder layer. What seqpar does with the call, one piece each::

    batch_of            the LocalBatch of this forward (a keyword, or the model's pre-hook)
    keys_not_sharded    cross-attention / a cache: the model's own function, locally (exact as is)
    refuse_model_mask   a mask the model built itself describes the local shard: Refused
    Placement.of        the mesh and groups the batch was sharded over (a dynamic schedule's block),
                        checked against the call's sequence length
    layer_call          the call's spec: causal flag, window, chunk, sinks, softcap, the SeqShard
    local_kernel        the kernel rule: the model's own function under Ulysses, else seqpar's
    run_strategy        one dtype, heads-second -> sequence-second, the strategy, the call counted

:class:`AttentionBinding` holds what ``parallelize`` binds once (looked up outside any traced
region: inside ``torch.compile`` a process-group lookup would break the graph).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...attention.dispatch import STRATEGIES, mesh_groups
from ...attention.kernels import KernelArg
from ...attention.shard import SeqShard, chunked_documents
from ...batch.local_batch import BATCH_KWARG, LocalBatch
from ...comm.degrees import degree_meshes_of
from ...comm.mesh import Axis, axis_group
from ...errors import Refused
from .kernel import ModelKernel, eager_function, original_function
from .layer_spec import layer_options


class LastBatch:
    """The LocalBatch of the model's latest call, caught by a forward pre-hook on the model: the
    way seqpar's batch reaches attention in models whose decoder layers drop ``**kwargs`` on the
    way (StableLM, Nemotron). Replaced at every call, None when a call carries no batch."""

    batch: LocalBatch | None = None


@dataclass
class AttentionBinding:
    """What the registered function is bound to, fixed at ``parallelize``: the job's mesh and
    strategy, the kernel asked for, the model's original implementation and decoder config, the
    pre-hook's :class:`LastBatch`, and ``causal_mask`` (the model's own mask is causal whatever its
    layers' ``is_causal`` says: :attr:`~seqpar.integrations.vlm.families.Family.causal_mask`)."""

    mesh: DeviceMesh
    strategy: str
    kernel: KernelArg | None
    original: str | None
    config: Any
    last: LastBatch
    causal_mask: bool = False
    p: int = field(init=False)  # the job's sp size
    me: int = field(init=False)  # this rank in the sp group
    groups: Any = field(init=False)  # the strategy's process groups on the job's mesh
    blocks: dict[int, Any] = field(init=False, default_factory=dict)  # a dynamic schedule's, by degree

    def __post_init__(self) -> None:
        group = axis_group(self.mesh, Axis.SP.value)
        self.p, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.groups = mesh_groups(self.mesh, self.strategy)


@dataclass(frozen=True)
class Placement:
    """The mesh, process groups and sp size one call's attention runs on."""

    mesh: DeviceMesh
    groups: Any
    p: int

    @staticmethod
    def of(bound: AttentionBinding, batch: LocalBatch, local_len: int) -> Placement:
        """Where the batch was sharded: the job's mesh, or a block of it (a dynamic schedule's bin,
        :mod:`seqpar.comm.degrees`). Raises ValueError if the batch's sp size or shard length is
        not the model's (the batch was sharded with another mesh)."""
        place = Placement(bound.mesh, bound.groups, bound.p)
        bmesh = batch.shard.state.mesh
        if bmesh is not None and bmesh is not bound.mesh:
            place = Placement(*block_groups(bound.mesh, bmesh, bound.strategy, bound.blocks, bound.p, bound.groups))
        if batch.sp_size != place.p or local_len != batch.local_len:
            raise ValueError(f"the batch was sharded for sp={batch.sp_size} with {batch.local_len} tokens on rank "
                             f"{bound.me}, but the model runs over sp={bound.p} with {local_len}: shard the batch "
                             "with the mesh the model was parallelized with")
        return place


def block_groups(mesh: DeviceMesh, bmesh: DeviceMesh, strategy: str, blocks: dict[int, Any], p: int,
                 groups: Any) -> tuple[DeviceMesh, Any, int]:
    """``(mesh, groups, sp size)`` the attention of a batch sharded over ``bmesh`` runs on: a block
    mesh of a dynamic schedule over the job ``mesh`` (cached in ``blocks`` by degree), else the job's
    own (the size check then names the mismatch)."""
    found = degree_meshes_of(mesh)
    degree = None if found is None else found.degree_of(bmesh)
    if degree is None:
        return mesh, groups, p
    if degree not in blocks:
        blocks[degree] = mesh_groups(bmesh, strategy)
    return bmesh, blocks[degree], degree


def batch_of(kwargs: dict[str, Any], last: LastBatch) -> LocalBatch:
    """The LocalBatch of this forward: the ``seqpar_batch`` keyword, else the one the model's
    pre-hook caught. Raises ValueError when the model was fed an unsharded batch."""
    batch = kwargs.get(BATCH_KWARG, last.batch)
    if not isinstance(batch, LocalBatch):
        raise ValueError("this model is sequence-parallel (seqpar.parallelize): feed it "
                         "model(**seqpar.shard_batch(batch, mesh)), or call seqpar.unparallelize(model)")
    return batch


def keys_not_sharded(original: str | None, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Tensor | None, scaling: float | None, dropout: float,
                     kwargs: dict[str, Any]) -> tuple[Tensor, Any]:
    """Attention whose keys are not the sharded sequence (cross-attention, a cache): per-query
    attention against keys every rank holds whole is already exact locally, so the model's own
    function runs it. Raises Refused when that function cannot be found (not sdpa / eager)."""
    fn = eager_function(module) if original == "eager" else _registered(original)
    if fn is None:
        raise Refused(f"seqpar cannot run a {original!r} attention whose keys are not the sharded "
                      "sequence; use attn_implementation='sdpa' or 'eager'")
    return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _registered(name: str | None) -> Callable[..., Any] | None:
    from transformers import AttentionInterface

    return None if name is None else AttentionInterface().get(name)


def refuse_model_mask(module: nn.Module, attention_mask: Tensor | None) -> None:
    """transformers builds no mask for seqpar's name, so a mask that arrives is the model's own (a
    prefix-LM or image mask...): it describes the local shard, seqpar cannot use it -- Refused."""
    if attention_mask is not None:
        raise Refused(f"{type(module).__name__} passes its own attention mask, which seqpar cannot shard; "
                      "seqpar masks padding and packed documents itself (from shard_batch)")


@dataclass(frozen=True)
class LayerCall:
    """One layer's attention spec: what the suppressed masks would have said, from the call."""

    causal: bool
    window: int | None
    chunk: int | None
    sinks: Tensor | None
    softcap: float | None
    shard: SeqShard


def layer_call(module: nn.Module, config: Any, kwargs: dict[str, Any], shard: SeqShard,
               causal_mask: bool) -> LayerCall:
    """The spec of this call: causal from the call or ``module.is_causal`` (or the model's causal
    mask), window / chunk / sinks from :func:`.layer_spec.layer_options`, softcap from the call. A
    packed document's chunks start at the document (as if it were alone), not at the row: each
    chunk of each document becomes a segment of its own, and the layer runs unchunked."""
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal) or causal_mask
    opts = layer_options(module, config, kwargs)
    chunk = opts.chunk
    if chunk is not None and shard.segments is not None:
        shard, chunk = chunked_documents(shard, chunk), None
    return LayerCall(causal, opts.window, chunk, opts.sinks, kwargs.get("softcap"), shard)


def local_kernel(kernel: KernelArg | None, strategy: str, original: str | None, module: nn.Module) -> KernelArg | None:
    """The kernel rule: the kernel passed to ``parallelize``; else, under Ulysses (whole heads on
    each rank), the model's own function where it can be wrapped, else ``"auto"``; else None (ring
    and hybrid pick an lse kernel themselves)."""
    if kernel is not None or strategy != "ulysses":
        return kernel
    fn, kind = original_function(original, module)
    return ModelKernel(fn, module, kind) if fn is not None else "auto"


def run_strategy(bound: AttentionBinding, place: Placement, call: LayerCall, kernel: KernelArg | None,
                 query: Tensor, key: Tensor, value: Tensor, scaling: float | None, dropout: float,
                 batch: LocalBatch) -> Tensor:
    """The strategy on ``q [B, H, S/P, D]``, ``k, v [B, H_kv, S/P, D]``; returns ``[B, S/P, H, D]``
    (what transformers expects back) and counts the call on the batch."""
    if not query.dtype == key.dtype == value.dtype:
        # under torch.autocast RoPE leaves q, k in float32 while v is bfloat16; the fused
        # all-to-all needs one dtype, and autocast would run attention in v's anyway
        query, key = query.to(value.dtype), key.to(value.dtype)
    out = STRATEGIES[bound.strategy](query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                     mesh=place.mesh, groups=place.groups, causal=call.causal, scale=scaling,
                                     window=call.window, chunk=call.chunk, softcap=call.softcap, sinks=call.sinks,
                                     dropout=dropout, kernel=kernel, shard=call.shard, validate=False)
    batch.attention_calls += 1
    return out


def make_attention(bound: AttentionBinding) -> Callable[..., tuple[Tensor, Any]]:
    """The function registered with transformers' ``AttentionInterface``, bound to ``bound``."""

    def seqpar_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[Tensor, Any]:
        # query [B, H, S/P, D] (a non-contiguous view), key / value [B, H_kv, S/P, D]
        batch = batch_of(kwargs, bound.last)
        if key.shape[2] != query.shape[2]:
            return keys_not_sharded(bound.original, module, query, key, value, attention_mask, scaling, dropout,
                                    kwargs)
        refuse_model_mask(module, attention_mask)
        place = Placement.of(bound, batch, query.shape[2])
        call = layer_call(module, bound.config, kwargs, batch.shard, bound.causal_mask)
        kernel = local_kernel(bound.kernel, bound.strategy, bound.original, module)
        out = run_strategy(bound, place, call, kernel, query, key, value, scaling, dropout, batch)
        return out, None  # [B, S/P, H, D]

    return seqpar_attention
