"""A diffusers transformer, sequence-parallel: what :func:`seqpar.parallelize` does with a ``ModelMixin``.

Every sp rank calls the model with the same whole inputs (diffusers' own convention); seqpar splits
the sequences where the family's plan says, routes the attention modules' SDPA calls through the
strategy, and at the plan's exit either gathers the output (``output="whole"``: a drop-in, the
unsharded model's output on every rank) or keeps it sharded (``output="sharded"``: ``sample`` is this
rank's ``[B, N_local, C']`` tokens, for a loss computed per shard --
:func:`seqpar.integrations.diffusers.flow.flow_matching_loss` -- so the whole output is never
gathered)::

    model(**inputs)                               inputs whole, the same on every rank (checked)
      pre-hook   new ForwardCall; "" splits       # hidden [B, N_r, C], text [B, T_r, C], ids sliced
      plan       split hooks (rope outputs, blocks.0 inputs, patch embedding output)
      blocks     routed attention: STRATEGIES[strategy] over the forward's SeqShard
                 cross-attention to whole text: local
      exit       proj_out's output: gathered (whole) or kept (sharded; a zero stand-in flows on)
      hook       sharded: sample <- this rank's tokens; an exception is told to every rank

Gradients follow seqpar's rule: average them over the sp ranks (:func:`seqpar.sync_gradients`,
DDP, FSDP2) and every gradient is the unsharded model's. ``seqpar.unparallelize`` undoes it all.
"""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...attention.dispatch import check_strategy, resolve_strategy
from ...attention.kernels import KernelArg
from ...comm import faults
from ...comm.collectives import split_sizes
from ...comm.guard import check_failures
from ...comm.mesh import Axis, as_mesh, axis_group
from ...errors import Refused
from ..state import ParallelState, ensure_state, state_of, undo
from .families import Family, family_of
from .inputs import check_same_inputs
from .layouts import LAYOUTS
from .plan import ShardPlan, Split, modules_at
from .routing import Binding, route_attention, unroute
from .sequences import ForwardCall, leave, split_local

OUTPUTS = ("whole", "sharded")


@dataclass
class DitState(ParallelState):
    """:class:`~seqpar.integrations.state.ParallelState` of a diffusers model: also its family, plan,
    output mode and the attention binding (what :func:`seqpar.integrations.diffusers.shard_output` reads)."""

    family: Family | None = None
    plan: ShardPlan | None = None
    output: str = "whole"
    binding: Binding | None = None


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every diffusers attention module of ``model`` (one with a ``processor`` it calls), by name."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "set_processor") and hasattr(m, "processor")]


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(a in ("*", b) for a, b in zip(p, n, strict=True))


def attention_plan(model: nn.Module, family: Family) -> list[tuple[str, nn.Module, frozenset[str] | None]]:
    """Each attention module with the sequences it attends over (None: cross-attention, local).
    Raises Refused for a module no pattern of the family covers."""
    out = []
    for name, module in attention_modules(model):
        seqs = [s for pattern, s in family.attention.items() if _matches(pattern, name)]
        if not seqs:
            raise Refused(f"seqpar: {type(model).__name__}.{name} ({type(module).__name__}) is an attention module "
                          "seqpar's plan for this class does not cover: it cannot say whether it is exact")
        out.append((name, module, None if seqs[0] is None else frozenset(seqs[0])))
    if not any(seqs is not None for _, _, seqs in out):
        raise Refused(f"seqpar: {type(model).__name__} has no self-attention seqpar routes")
    return out


def _heads(model: nn.Module) -> int:
    return int(next((m.heads for _, m in attention_modules(model) if hasattr(m, "heads")), 1))


def parallelize_diffusers(model: nn.Module, mesh: DeviceMesh, *, strategy: str = "ulysses",
                          kernel: KernelArg | None = None, output: str = "whole", validate: bool = True) -> nn.Module:
    """Make a diffusers transformer sequence-parallel over the ``"sp"`` axis of ``mesh`` (in place;
    see the module doc). ``output``: ``"whole"`` (drop-in) or ``"sharded"``. ``validate``: check every
    forward's inputs agree across the sp ranks (one small all-gather). Raises Refused for a class seqpar
    does not run exactly, ValueError for a bad option or a model parallelized already -- the same
    on every rank, before any collective."""
    check_strategy(strategy)
    axis_group(as_mesh(mesh, "parallelize"), Axis.SP.value)
    if strategy == "hybrid":
        axis_group(mesh, Axis.ULYSSES.value)
        axis_group(mesh, Axis.RING.value)
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r}: choose 'whole' (drop-in: the whole output on every rank) or 'sharded' "
                         "(each rank's tokens, for a loss per shard)")
    record = state_of(model)
    if record is not None and record.parallel is not None:
        raise ValueError("this model is already parallelized: call seqpar.unparallelize(model) first")
    family = family_of(model)
    plan = family.shard_plan(model)
    routes = attention_plan(model, family)
    comps = tuple(sorted({s for _, _, s in routes if s is not None}, key=sorted))
    missing = sorted({s for c in comps for s in c} - set(plan.sequences))
    if missing:
        raise Refused(f"seqpar: {type(model).__name__}'s attention attends over {missing}, which its plan never splits")
    strategy = resolve_strategy(strategy, mesh, _heads(model))
    binding = Binding(mesh, strategy, kernel)
    heads = _heads(model)
    state = DitState(name="seqpar_diffusers", original=None, sub_config=None, strategy=strategy, kernel=kernel,
                     num_heads=heads, num_kv_heads=heads, family=family, plan=plan, output=output, binding=binding)
    record = ensure_state(model)
    record.parallel = state
    how = f"{strategy}/{output}/{type(model).__name__}/{sum(p.numel() for p in model.parameters())}"
    try:
        for name, module, seqs in routes:
            if seqs is not None:
                route_attention(module, name, seqs, binding)
                record.push("parallel", f"the attention route of {name}", functools.partial(unroute, module))
        for path, entry in plan.splits.items():
            if path == "":
                continue
            for m in modules_at(model, path):
                _hook(record, m, path, entry, binding)
        exit_path, gather = plan.exit
        for m in modules_at(model, exit_path):
            handle = m.register_forward_hook(_Exit(binding, gather.dim, gather.seq, gather.ndim, output == "whole"))
            record.push("parallel", f"the exit hook on {exit_path}", handle.remove)
        entry = _Entry(binding, plan.splits.get("", {}), family.refuse_inputs, comps, how, validate, model)
        handle = model.register_forward_pre_hook(entry, with_kwargs=True)
        record.push("parallel", "the forward pre-hook", handle.remove)
        handle = model.register_forward_hook(_Leave(binding, output == "sharded"), always_call=True)
        record.push("parallel", "the forward hook", handle.remove)
    except BaseException:
        undo(model, "parallel")
        raise
    return model


def _hook(record: Any, module: nn.Module, path: str, entry: Any, binding: Binding) -> None:
    names = {k: s for k, s in entry.items() if isinstance(k, str)}
    items = {k: s for k, s in entry.items() if isinstance(k, int)}
    if names:
        handle = module.register_forward_pre_hook(_SplitInputs(binding, path, names, module), with_kwargs=True)
        record.push("parallel", f"the split of {sorted(names)} into {path}", handle.remove)
    if items:
        handle = module.register_forward_hook(_SplitOutputs(binding, path, items))
        record.push("parallel", f"the split of {path}'s outputs {sorted(items)}", handle.remove)


def _split(binding: Binding, x: Any, split: Split, what: str, copy: bool = True) -> Any:
    """``x``'s shard when it is a tensor of the split's dims (recording its sequence), each item's
    for a tuple or list of them (a RoPE table's cos and sin), else ``x``. ``copy``: see
    :func:`~.sequences.split_local`."""
    if isinstance(x, (tuple, list)):
        return type(x)(_split(binding, item, split, what, copy) for item in x)
    if not isinstance(x, Tensor) or (split.ndim is not None and x.dim() != split.ndim):
        return x
    call = binding.holder.current
    assert call is not None, "a split outside a forward of the parallelized model"
    sizes = call.record(split.seq, x.shape[split.dim], what)
    return split_local(x, split.dim, sizes, call.me, copy=copy)


def _split_named(binding: Binding, module: nn.Module, args: tuple, kwargs: dict[str, Any],
                 splits: dict[str, Split], names: list[str], where: str, copy: bool = True
                 ) -> tuple[tuple, dict[str, Any]]:
    args, kwargs = list(args), dict(kwargs)
    for key, split in splits.items():
        what = f"{key} of {where}"
        if key in kwargs:
            kwargs[key] = _split(binding, kwargs[key], split, what, copy)
        elif key in names and names.index(key) < len(args):
            i = names.index(key)
            args[i] = _split(binding, args[i], split, what, copy)
    return tuple(args), kwargs


def _forward_names(cls: type) -> list[str]:
    return list(inspect.signature(cls.forward).parameters)[1:]  # without self


class _SplitInputs:
    """Forward pre-hook: split the named inputs of a plan module (``rope``, ``blocks.0``...)."""

    def __init__(self, binding: Binding, path: str, splits: dict[str, Split], module: nn.Module) -> None:
        self.binding, self.path, self.splits = binding, path, splits
        self.names = _forward_names(type(module))

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return _split_named(self.binding, module, args, kwargs, self.splits, self.names, self.path)


class _SplitOutputs:
    """Forward hook: split items of a plan module's output (RoPE tables, a patch embedding)."""

    def __init__(self, binding: Binding, path: str, splits: dict[int, Split]) -> None:
        self.binding, self.path, self.splits = binding, path, splits

    def __call__(self, module: nn.Module, _args: Any, output: Any) -> Any:
        single = isinstance(output, Tensor)
        items = [output] if single else list(output)
        for i, split in self.splits.items():
            items[i] = _split(self.binding, items[i], split, f"output {i} of {self.path}")
        return items[0] if single else type(output)(items)


class _Exit:
    """Forward hook on the plan's exit module: its output gathered (whole), or kept on the forward's
    call with a zero stand-in of the whole shape flowing on (sharded)."""

    def __init__(self, binding: Binding, dim: int, seq: str, ndim: int | None, gather: bool) -> None:
        self.binding, self.dim, self.seq, self.ndim, self.gather = binding, dim, seq, ndim, gather

    def __call__(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        call = self.binding.holder.current
        if not isinstance(output, Tensor) or (self.ndim is not None and output.dim() != self.ndim):
            raise Refused(f"seqpar: the exit of the sharded region gave {type(output).__name__} "
                          f"{getattr(output, 'shape', '')}, not the [B, N, C] tokens the plan expects")
        sizes = call.sizes[self.seq]
        out = leave(output, self.dim, sizes, call, self.binding.holder, gather=self.gather)
        if self.gather:
            check_failures(self.binding.group)  # no output from a failed forward (free when nothing was deferred)
            return out
        call.local_out = out
        shape = list(output.shape)
        shape[self.dim] = sum(sizes)
        return output.new_zeros(shape)


class _Entry:
    """The model's forward pre-hook: check the inputs agree across ranks, refuse inputs seqpar does
    not shard, start the forward's call, split the model's own inputs of the plan."""

    def __init__(self, binding: Binding, splits: dict[str, Split], refused: tuple[str, ...],
                 comps: tuple[frozenset[str], ...], how: str, validate: bool, model: nn.Module) -> None:
        self.binding, self.splits, self.refused = binding, splits, refused
        self.comps, self.how, self.validate = comps, how, validate
        self.names = _forward_names(type(model))

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        b = self.binding
        if self.validate and not torch.compiler.is_compiling():
            check_same_inputs(args, kwargs, b.group, self.how)
        names = self.names
        given = [n for n in self.refused if _given(kwargs[n] if n in kwargs else args[names.index(n)]
                                                   if n in names and names.index(n) < len(args) else None)]
        if given:
            raise Refused(f"seqpar: {type(model).__name__} got {', '.join(given)}, which would enter the sharded "
                          "region whole; seqpar does not shard it")
        b.holder.current = ForwardCall(b.mesh, b.group, self.comps)
        # the model's own inputs: views (the caller holds them whole anyway)
        return _split_named(b, model, args, kwargs, self.splits, names, "the model's inputs", copy=False)


def _given(value: Any) -> bool:
    return value is not None and value is not False


class _Leave:
    """The model's forward hook (also on the way out of a forward that raised): an exception is told
    to every rank (:mod:`seqpar.comm.faults`); with ``sharded``, ``sample`` becomes this rank's tokens."""

    def __init__(self, binding: Binding, sharded: bool) -> None:
        self.binding, self.sharded = binding, sharded

    def __call__(self, _model: nn.Module, _args: Any, output: Any) -> Any:
        if output is None:
            error = sys.exc_info()[1]
            if isinstance(error, Exception):
                faults.note(error, "the forward")
            return None
        if not self.sharded:
            return None
        local = self.binding.holder.current.local_out
        self.binding.holder.current.local_out = None
        if isinstance(output, tuple):
            return (local, *output[1:])
        output["sample"] = local
        return output


def dit_state(model: nn.Module) -> DitState:
    """The :class:`DitState` of a diffusers model parallelized by seqpar. Raises ValueError otherwise."""
    state = state_of(model)
    if state is None or not isinstance(state.parallel, DitState):
        raise ValueError("this model is not a diffusers model parallelized by seqpar (seqpar.parallelize)")
    return state.parallel


def shard_output(model: nn.Module, whole: Tensor) -> Tensor:
    """This rank's tokens of a tensor shaped like the model's whole output (a target ``noise - x0``,
    or the drop-in output), in the layout ``output="sharded"`` returns them: ``[B, N_local, C']``,
    the family's unpatchify inverted (:mod:`.layouts`) and cut as the model cuts its sequence.
    Pure: no communication."""
    state = dit_state(model)
    tokens = LAYOUTS[state.family.output](model.config, whole)
    binding, gather = state.binding, state.plan.exit[1]
    p, me = binding.group.size(), binding.group.rank()
    return split_local(tokens, gather.dim, tuple(split_sizes(tokens.shape[gather.dim], p)), me)
