"""Expert parallelism (EP) with sequence parallelism: each rank holds a shard of every MoE layer's
experts, and every token goes to its experts' owners and comes back. Dropless: every row reaches
its expert, however uneven the load.

``apply_ep(model, ep, mesh=mesh)`` takes the ep process group (or 1-D DeviceMesh) explicitly; its
ranks are folded over the dp x sp ranks of ``mesh`` (the contract: :mod:`.layout`). It cuts each
experts module the model's plan declares (:mod:`.families`) to this rank's experts, and gives it an
instance ``forward`` that runs the module's own forward on them::

    experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])   T: this rank's tokens
      route              rows (token, slot) sorted by expert                       [T*k, H]
      exchange_counts    rows per (source, expert) to each owner
      all_to_all_rows    rows to the owners of their experts                       [R, H]
      module's forward   on its local experts: top-1, unit weights                 [R, H]
      all_to_all_rows    back to the rows' sources (split sizes swapped)           [T*k, H]
      sum over slots     weighted by top_k_weights, here: the router stays local   [T, H]

Dense layers are not touched: attention, norms, shared experts and dense MLPs stay replicated and
keep SP (their tokens never leave the rank; NeMo Automodel#3507 lost SP on them once EP was on).
The router runs on every rank for its own tokens over every expert's logits, so the router aux
loss seqpar recomputes over the SP group (:mod:`seqpar.integrations.hf.router_losses`) is unchanged.

Gradients. The seqpar loss scales each rank's share of the gradient so that the *average* over the
dp x sp ranks is exact (:mod:`seqpar.batch.loss`). An expert's owner receives the rows of every rank
of its ep group, so its gradient is already the sum over those ranks' shares; the true gradient is
the sum over every rank's shares divided by dp x sp, i.e. the sum over the expert's replicas (one
per ep group) divided by dp x sp = ep x replicas. So the experts run between ``scale_grad(x, ep)``
and ``scale_grad(y, 1 / ep)``: values unchanged, every gradient inside the experts (their
parameters') divided by ep, the tokens' gradient leaving them multiplied back. Then *averaging*
each shard over its replicas -- what :func:`seqpar.sync_gradients` does with the groups this module
declares (:mod:`seqpar.batch.grad_groups`) -- is exact, as for every other parameter.

Build the optimizer after ``apply_ep`` (it replaces the stacked parameters with their shards).
:func:`remove_ep` (and ``unparallelize``) gathers the whole experts back, gradients included.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...batch import grad_groups
from ...batch.local_batch import LocalBatch
from ...batch.loss import scale_grad
from ...comm import collectives
from ...comm.dispatch import all_to_all_rows, exchange_counts
from ...comm.gather import gather_padded
from ...comm.mesh import as_mesh
from ...errors import Refused
from . import plan
from .families import experts_of
from .layout import EPLayout, fold


class ExpertParallelForward:
    """The ``forward`` seqpar binds to one experts module (see the module doc): its layout, how
    many experts each ep rank owns, the stacked parameters it cut, and the module's expert count
    before the cut (restored by :func:`remove_ep`). ``loads``: the latest calls' ``recv[s][j]``, rows
    from ep rank s for this rank's j-th expert (what its experts ran on). Bound to its module as a
    method: a deep copy of the model (a reference model) binds its own copy of the module to the
    same object (``deepcopy`` keeps a bound method's function), which holds nothing per module
    but ``loads``."""

    def __init__(self, layout: EPLayout, owned: list[int], params: tuple[str, ...], num_experts: int,
                 last_batch: Callable[[], LocalBatch | None] | None) -> None:
        self.layout, self.owned, self.params, self.num_experts = layout, owned, params, num_experts
        self.last_batch = last_batch
        self.loads: collections.deque[list[list[int]]] = collections.deque(maxlen=64)  # recv per call, latest

    def __call__(self, module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        # hidden_states [T, H]: this rank's tokens; top_k_index, top_k_weights [T, k] (global expert ids)
        batch = self.last_batch() if self.last_batch is not None else None
        if isinstance(batch, LocalBatch) and batch.in_bin:
            raise Refused(f"expert parallelism in a dynamic SP schedule's bin (degree {batch.sp_size}): the ranks "
                          "of an ep group run different numbers of forwards there, so their token exchanges cannot "
                          "pair up; use the static schedule (no DynamicSP; seqpar train --sp-schedule static)")
        group, k = self.layout.group, top_k_index.shape[-1]
        routing = plan.route(top_k_index, self.num_experts)
        recv = exchange_counts(routing.counts, self.owned, group=group, check=hidden_states.shape[-1])
        send_sizes = plan.per_rank(routing.counts.tolist(), self.owned)
        recv_sizes = [sum(row) for row in recv]
        x = all_to_all_rows(hidden_states.index_select(0, routing.tokens), send_sizes, recv_sizes, group=group)
        self.loads.append(recv)
        y = self._local_experts(module, x, plan.local_ids(recv, x.device))  # [R, H]
        back = all_to_all_rows(y, recv_sizes, send_sizes, group=group)  # [T*k, H] in send order
        out = plan.unsort(back, routing.order, k)  # [T, k, H]
        return (out * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(1).to(hidden_states.dtype)

    def _local_experts(self, module: nn.Module, x: Tensor, ids: Tensor) -> Tensor:
        """The module's own forward (its class's: eager, grouped_mm or batched_mm) on its local
        experts, each row top-1 with weight 1, its gradient scaled (module doc: ``1 / ep`` inside)."""
        if x.shape[0] == 0:  # no row here: keep the exchanges' backward connected (it is collective)
            return x * 0.0
        ep = float(self.layout.size)
        x = scale_grad(x, ep)  # the rows' gradient, leaving the experts, back at full scale
        y = type(module).forward(module, x, ids.unsqueeze(-1), x.new_ones(x.shape[0], 1))
        return scale_grad(y, 1.0 / ep)  # every gradient inside the experts divided by ep


def _bound(module: nn.Module) -> ExpertParallelForward | None:
    fn = getattr(vars(module).get("forward"), "__func__", None)
    return fn if isinstance(fn, ExpertParallelForward) else None


def expert_parallel_modules(model: nn.Module) -> list[tuple[str, nn.Module, ExpertParallelForward]]:
    """``(path, module, its ExpertParallelForward)`` of every experts module of ``model`` under EP."""
    return [(n, m, f) for n, m in model.named_modules() if (f := _bound(m)) is not None]


def apply_ep(model: nn.Module, ep: dist.ProcessGroup | DeviceMesh, *, mesh: DeviceMesh,
             last_batch: Callable[[], LocalBatch | None] | None = None) -> nn.Module:
    """Shard ``model``'s experts over ``ep`` (in place) and route every token to its experts' owners.

    ``ep``: a ProcessGroup or 1-D DeviceMesh whose ranks are a subset of the dp x sp ranks of ``mesh``
    (the contract: :mod:`.layout`); every rank of the world calls this together. ``last_batch``:
    the running call's sharded batch, when ``seqpar.parallelize`` applies it. An ep of one rank
    changes nothing. Returns the model.

    Raises :class:`seqpar.Refused` for a model whose experts seqpar cannot shard (:mod:`.families`:
    never a silent run without EP), ValueError for ranks that break the contract, an ep larger than
    a layer's expert count, or a model already under EP -- on every rank, before any token moves."""
    mesh = as_mesh(mesh, "apply_ep")
    found = experts_of(model)  # the model alone decides: the same on every rank
    if expert_parallel_modules(model):
        raise ValueError("this model's experts are already sharded (apply_ep): call seqpar.remove_ep(model) first")
    layout = fold(ep, mesh)
    owned = {e.name: plan.owned_experts(e.num_experts, layout.size) for e in found}  # ValueError: ep > E
    if layout.size == 1:
        return model
    for e in found:
        start, n = plan.expert_range(e.num_experts, layout.size, layout.rank)
        for name in e.params:
            full = e.module.get_parameter(name)
            shard = nn.Parameter(full.detach()[start:start + n].clone(), requires_grad=full.requires_grad)
            _set_param(e.module, name, shard)
        forward = ExpertParallelForward(layout, owned[e.name], e.params, e.num_experts, last_batch)
        e.module.num_experts = n
        e.module.forward = types.MethodType(forward, e.module)
    return model


def _set_param(module: nn.Module, name: str, value: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, value)


def remove_ep(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_ep`: every experts module gets its whole stacked parameters back, gathered
    over its ep group, with their gradients where any rank of the group has one (then a rank
    without counts as zeros). Collective over each ep group. Returns the model."""
    modules = expert_parallel_modules(model)
    if not modules:
        return model
    layout = modules[0][2].layout
    has_grad = torch.tensor([float(m.get_parameter(p).grad is not None) for _, m, f in modules for p in f.params],
                            device=collectives.comm_device(layout.group))
    collectives.all_reduce(has_grad, group=layout.group, op=dist.ReduceOp.MAX)
    flags = iter(has_grad.tolist())
    for _, module, forward in modules:
        for name in forward.params:
            shard = module.get_parameter(name)
            full = nn.Parameter(_gathered(shard.detach(), forward), requires_grad=shard.requires_grad)
            if next(flags):
                grad = shard.grad if shard.grad is not None else torch.zeros_like(shard)
                full.grad = _gathered(grad, forward)
            _set_param(module, name, full)
        module.num_experts = forward.num_experts
        del module.forward
    return model


def _gathered(shard: Tensor, forward: ExpertParallelForward) -> Tensor:
    """The whole stacked tensor from every ep rank's shard (experts on dim 0, uneven counts)."""
    return gather_padded(shard.contiguous(), 0, forward.owned, forward.layout.group)


def gather_experts(model: nn.Module) -> dict[str, Tensor]:
    """The whole stacked expert tensors of a model under EP, by parameter name (as in
    ``model.state_dict()``), on every rank; {} for a model not under EP. Collective over each ep group."""
    out = {}
    for path, module, forward in expert_parallel_modules(model):
        for name in forward.params:
            out[f"{path}.{name}" if path else name] = _gathered(module.get_parameter(name).detach(), forward)
    return out


def _sharded(model: nn.Module) -> list[grad_groups.ShardedParams]:
    """The finder of :mod:`seqpar.batch.grad_groups`: each experts module's shards and their replicas."""
    return [grad_groups.ShardedParams(tuple(m.get_parameter(p) for p in f.params), f.layout.replicas, f.layout.group,
                                      f"the experts of {path}")
            for path, m, f in expert_parallel_modules(model)]


grad_groups.register_finder(_sharded)
