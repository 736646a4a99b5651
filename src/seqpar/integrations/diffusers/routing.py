"""A diffusers attention module's ``scaled_dot_product_attention`` calls, sent through seqpar.

diffusers computes attention inside *processors* (one per model family: Flux's, SD3's joint one,
Wan's...), which project, normalize, apply RoPE, concatenate text and image streams and then call
``F.scaled_dot_product_attention`` -- directly or through ``dispatch_attention_fn``'s native backend.
seqpar leaves all of that as it is and takes over only that call: the module's ``forward`` becomes a
:class:`RoutedAttention` (an instance attribute; the processor, its signature and
``set_attention_backend`` are untouched), which runs the module's own forward under a
``TorchFunctionMode`` that answers the SDPA call with :data:`seqpar.attention.dispatch.STRATEGIES`::

    attn(hidden_states, encoder_hidden_states, ...)       the module's own forward, unchanged
      processor: q, k, v projections, norms, RoPE, cat(text, image)
        F.scaled_dot_product_attention(q, k, v, mask)   # q [B, H, S_local, D]  (S_local = T_r + N_r)
          -> _SdpaRoute: the strategy over the mesh,    # the forward's SeqShard for {text, image}
             key mask from the model's mask (key-only), non-causal
      processor: split text / image, output projections

Only self-attention over the sharded sequences is routed (a family declares which modules attend
over which sequences, :mod:`.families`); cross-attention to text every rank holds whole stays
local -- exact as it is, and no text K/V is exchanged. A routed module whose forward makes no SDPA
call (an attention computed by hand) is refused: its attention would stay local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from ...attention import lean
from ...attention.dispatch import STRATEGIES, mesh_groups
from ...attention.kernels import KernelArg, lse_kernel_for
from ...attention.spec import AttnSpec
from ...comm.mesh import Axis, axis_group
from ...errors import Refused
from .sequences import ForwardCall

SDPA = F.scaled_dot_product_attention


class CallHolder:
    """Which forward's :class:`~.sequences.ForwardCall` is current: set by the model's pre-hook, and
    again by a forward's backward (its recomputed blocks), read by every routed attention call."""

    current: ForwardCall | None = None


@dataclass
class Binding:
    """What a parallelized model's attention runs on, fixed at ``parallelize`` (looked up outside any
    traced region): the mesh, strategy, kernel, the strategy's process groups and the call holder."""

    mesh: DeviceMesh
    strategy: str
    kernel: KernelArg | None
    holder: CallHolder = field(default_factory=CallHolder)
    groups: Any = field(init=False)
    group: dist.ProcessGroup = field(init=False)  # the sp group

    def __post_init__(self) -> None:
        self.groups = mesh_groups(self.mesh, self.strategy)
        self.group = axis_group(self.mesh, Axis.SP.value)


class _SdpaRoute(TorchFunctionMode):
    """Inside one routed module's forward: SDPA calls go to :meth:`RoutedAttention.attend`, every
    other torch function runs as it is (torch turns the mode off while it answers, so seqpar's own
    kernels inside are not routed again)."""

    def __init__(self, routed: RoutedAttention) -> None:
        super().__init__()
        self.routed, self.calls = routed, 0
        self.outputs: list[Tensor] = []  # this call's attention outputs (eager only)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is SDPA:
            self.calls += 1
            return self.routed.attend(*args, **kwargs)
        if func is Tensor.unflatten:  # its Python method calls super(), which dynamo cannot trace under a mode
            return torch.unflatten(*args, **kwargs)
        return func(*args, **kwargs)


class RoutedAttention:
    """``module.forward`` of a routed attention module (see the module doc): its own forward under
    :class:`_SdpaRoute`, attending over the sequences ``seqs``. A callable object, not a closure: a
    deep copy of the model copies it bound to the copy's module."""

    def __init__(self, module: nn.Module, name: str, seqs: frozenset[str], binding: Binding) -> None:
        self.module, self.name, self.seqs, self.binding = module, name, seqs, binding
        self.inner = module.__dict__.get("forward")  # an instance forward someone set before us, kept
        self.route = _SdpaRoute(self)  # one per module: a compiled block guards on the mode it saw

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        route = self.route
        route.calls = 0
        forward = self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)
        with route:
            out = forward(*args, **kwargs)
        if not torch.compiler.is_compiling():  # a traced call runs the traced attention, which keeps nothing
            release_unprojected(out, route.outputs)
            route.outputs = []
        if route.calls == 0 and not torch.compiler.is_compiling():  # a traced mode's count is not kept
            raise Refused(f"seqpar: {self.name} ({type(self.module).__name__}) computed its attention without "
                          "scaled_dot_product_attention, so seqpar could not make it sequence-parallel")
        return out

    def attend(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> Tensor:
        """SDPA's contract (``q [B, H, S_local, D]``, ``k, v [B, H_kv, S_local, D]`` -> ``[B, H, S_local,
        Dv]``) over the whole sharded sequence. Raises Refused for a call seqpar cannot make exact:
        another length than the shard's, a mask that is not a key mask, causal over several sequences."""
        call = self.binding.holder.current
        if call is None or not self.seqs <= call.sizes.keys():
            raise Refused(f"seqpar: {self.name} attends over {sorted(self.seqs)} before the model split them")
        me = call.me
        local = sum(call.sizes[s][me] for s in self.seqs)
        if query.dim() != 4 or query.shape[2] != local or key.shape[2] != local:
            raise Refused(f"seqpar: {self.name} attends {tuple(query.shape)} queries to {tuple(key.shape)} keys where "
                          f"its shard of {'+'.join(sorted(self.seqs))} holds {local} tokens: this attention is not "
                          "over the sharded sequence as seqpar's plan for this model says")
        if is_causal and len(self.seqs) > 1:
            raise Refused(f"seqpar: {self.name} is causal over {'+'.join(sorted(self.seqs))}, whose shards seqpar "
                          "concatenates rank by rank (not in token order)")
        shard = call.shard(self.seqs, attn_mask, lambda m: key_mask(m, query.shape[0], local, self.name))
        if not query.dtype == key.dtype == value.dtype:
            query, key = query.to(value.dtype), key.to(value.dtype)
        b = self.binding
        # the device's lse kernel by default: Ulysses then keeps no gathered output (seqpar.attention.lean)
        kernel = b.kernel if b.kernel is not None or dropout_p else lse_kernel_for(query.device, query.dtype,
                                                                                   AttnSpec(causal=is_causal))
        out = STRATEGIES[b.strategy](query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                     mesh=b.mesh, groups=b.groups, causal=is_causal, scale=scale, dropout=dropout_p,
                                     kernel=kernel, shard=shard, validate=False)  # [B, S_local, H, Dv]
        if not torch.compiler.is_compiling():
            self.route.outputs.append(out)  # [B, S_local, H, Dv]: the strategy's own output (lean's node)
        return out.transpose(1, 2)


def release_unprojected(module_out: Any, attention_outs: list[Tensor]) -> None:
    """An attention output the module returns as it is (no output projection inside, which would save
    it): whoever consumes it outside may not keep it (Flux's single-stream blocks concatenate it), so
    Ulysses' backward recomputes it rather than keep it alive (:func:`seqpar.attention.lean.release`)."""
    outs = module_out if isinstance(module_out, (tuple, list)) else (module_out,)
    returned = {t.untyped_storage().data_ptr() for t in outs if isinstance(t, Tensor)}
    for out in attention_outs:
        if out.untyped_storage().data_ptr() in returned:
            lean.release(out)


def key_mask(mask: Tensor | None, batch: int, local: int, name: str) -> Tensor | None:
    """The ``[B, S_local]`` key mask (True = attend) an SDPA ``attn_mask`` stands for, or None. A
    bool mask or an additive one of 0 and large negatives (``<= -1e4``, which float64 softmax turns
    to 0 exactly) is accepted when it is the same for every query and head (``[B, S]``, ``[B, 1, 1, S]``,
    ``[B, H, S, S]`` with equal rows...); anything else (a bias, a mask per query) is refused. One host
    read per mask object: the model builds its mask once per forward."""
    if mask is None:
        return None
    lead = mask.shape[0] if mask.dim() > 1 else 1
    if mask.shape[-1] != local or (lead != 1 and lead % batch):
        raise Refused(f"seqpar: {name} passes an attention mask of shape {tuple(mask.shape)}, not a key mask "
                      f"over its {local} tokens")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask <= -1e4)).all()):
        raise Refused(f"seqpar: {name} adds a bias to its attention scores (a float mask with values other than 0 "
                      "and large negatives), which seqpar does not shard")
    keep = mask if mask.dtype == torch.bool else mask == 0
    rows = keep.reshape(1 if lead == 1 else batch, -1, local)  # [B or 1, rows (heads x queries), S_local]
    if not bool((rows == rows[:, :1]).all()):
        raise Refused(f"seqpar: {name} masks keys per query or per head; seqpar shards key masks only")
    return rows[:, 0].expand(batch, local)


def route_attention(module: nn.Module, name: str, seqs: frozenset[str], binding: Binding) -> None:
    """Route ``module``'s SDPA calls through seqpar (:class:`RoutedAttention`); :func:`unroute` undoes it."""
    if isinstance(module.__dict__.get("forward"), RoutedAttention):
        raise ValueError(f"{name} is already routed through seqpar")
    module.forward = RoutedAttention(module, name, seqs, binding)


def unroute(module: nn.Module) -> None:
    """Undo :func:`route_attention`: the module's earlier forward (instance or class) comes back."""
    routed = module.__dict__.get("forward")
    if isinstance(routed, RoutedAttention):
        if routed.inner is not None:
            module.forward = routed.inner
        else:
            del module.__dict__["forward"]
