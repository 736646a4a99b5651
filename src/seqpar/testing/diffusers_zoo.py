"""The diffusers zoo: every transformer class the installed diffusers ships, tiny and in float64,
sequence-parallel against itself unsharded. Each class must end *exact* or *refused*.

Classes are enumerated from ``diffusers.models.transformers`` (every ``ModelMixin`` subclass defined
in one of its modules: never hand-picked, so a new release's class shows up, and fails
``tests/integrations/test_diffusers_zoo.py`` until it is classified). Each one is built from its own
config class with the tiny sizes of :data:`seqpar.testing.diffusers_specs.SPECS` (token counts and
head counts that do not divide P), and for each strategy and call (``output="whole"``, the drop-in,
and ``"sharded"``, the loss per shard) :func:`compare_dit` runs it with and without seqpar::

    exact        loss within 1e-9 and every parameter's gradient within 1e-8 (float64), after
                 seqpar.sync_gradients; the model's own float32 casts kept float64 in both runs
                 (:mod:`.float64_casts`)
    refused      parallelize raised seqpar.Refused on every rank, naming the class and the reason
    mismatch     ran, but the loss or a gradient differs: silently wrong -- a bug
    crashed      any other exception -- a bug
    unbuildable  the tiny config does not build or run without seqpar (diffusers' own code)

The loss is the rectified-flow loss against a fixed random target (:func:`seqpar.integrations.
diffusers.flow.flow_matching_loss`): on the whole output, or on each rank's shard with the target cut
by :func:`seqpar.integrations.diffusers.shard_output`.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import pkgutil
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch.loss import sync_gradients
from ..integrations.diffusers.flow import flow_matching_loss
from ..integrations.diffusers.parallelize import parallelize_diffusers, shard_output
from ..integrations.hf.parallelize import unparallelize
from .diffusers_specs import META, SPECS, make_inputs
from .float64_casts import Float64Casts
from .model_parity import GRAD_TOL, LOSS_TOL
from .zoo import ZooVerdict, agreed_outcome, verdict

OUTPUTS = ("whole", "sharded")
FORWARD_SEED = 7


def dit_classes() -> list[str]:
    """Every ``ModelMixin`` subclass defined in a module of ``diffusers.models.transformers``, sorted."""
    import diffusers.models.transformers as pkg
    from diffusers import ModelMixin

    names = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.iter_modules(pkg.__path__):
            module = importlib.import_module(f"{pkg.__name__}.{info.name}")
            names |= {n for n, c in inspect.getmembers(module, inspect.isclass)
                      if issubclass(c, ModelMixin) and c.__module__ == module.__name__}
    return sorted(names)


def dit_class(name: str) -> type:
    """The diffusers class named ``name`` (from :func:`dit_classes`)."""
    import diffusers.models.transformers as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        if isinstance(getattr(module, name, None), type):
            return getattr(module, name)
    raise KeyError(name)


def build_dit(name: str, seed: int = 0) -> nn.Module:
    """Class ``name`` with its tiny config (:data:`SPECS`), float64, train mode, the same on every
    rank; without a spec, its default config (or :data:`META`'s) on the meta device: it can only be
    refused then."""
    cls = dit_class(name)
    spec = SPECS.get(name)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if spec is None:
            with torch.device("meta"):
                return cls(**META.get(name, {}))
        model = cls(**spec.config).to(torch.float64).train()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every parameter drawn: diffusers zero-inits gates and output projections, which
        for p in model.parameters():  # would leave the attention without effect on the output
            scale = 1.0 / p.shape[-1] ** 0.5 if p.dim() >= 2 else 0.5
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
    return model


@dataclass(frozen=True, kw_only=True)
class DitRow(ZooVerdict):
    """One class under one strategy and call at one SP size (see the module doc for ``outcome``)."""

    name: str
    strategy: str
    output: str
    p: int


def _target(out: Tensor) -> Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(out.shape, generator=g, dtype=out.dtype)


def _sample(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out.sample


def _casts(float64: bool) -> Any:
    return Float64Casts() if float64 else contextlib.nullcontext()


def reference(model: nn.Module, inputs: dict[str, Any], *, float64: bool = True
              ) -> tuple[float, dict[str, Tensor | None], Tensor]:
    """The unsharded model's ``(loss, {param: grad}, output)`` on ``inputs`` (float64 throughout;
    ``float64=False``: with the model's own float32 casts -- a checkpointed block's recompute runs
    outside the forward's torch-function modes, so it cannot keep them float64)."""
    torch.manual_seed(FORWARD_SEED)
    with _casts(float64):
        out = _sample(model(**inputs))
        loss = flow_matching_loss(out, _target(out))
        loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads, out.detach()


def compare_dit(model: nn.Module, inputs: dict[str, Any], mesh: DeviceMesh, *, strategy: str, output: str,
                ref: tuple[float, dict[str, Tensor | None], Tensor], float64: bool = True) -> tuple[float, float, str]:
    """``(loss difference, largest gradient difference, worst parameter)`` of ``model`` (a fresh
    copy: parallelized here) against ``ref`` (:func:`reference`, with the same ``float64``), after
    sync_gradients."""
    loss_ref, grads_ref, out_ref = ref
    parallelize_diffusers(model, mesh, strategy=strategy, output=output)
    torch.manual_seed(FORWARD_SEED)  # training-mode draws (DiT's class-label dropout) alike on every rank and run
    with _casts(float64):
        out = _sample(model(**inputs))
        target = _target(out_ref)
        if output == "whole":
            loss = flow_matching_loss(out, target)
        else:
            loss = flow_matching_loss(out, shard_output(model, target), mesh=mesh)
        loss.backward()
    sync_gradients(model, mesh)
    worst, name = 0.0, ""
    for n, p in model.named_parameters():
        mine, theirs = p.grad, grads_ref[n]
        if mine is None and theirs is None:
            continue
        d = float(((mine if mine is not None else 0) - (theirs if theirs is not None else 0)).abs().max())
        if d > worst:
            worst, name = d, n
    unparallelize(model)
    return abs(float(loss.detach()) - loss_ref), worst, name


def zoo_class(name: str, mesh: DeviceMesh, strategies: tuple[str, ...], outputs: tuple[str, ...] = OUTPUTS
              ) -> list[DitRow]:
    """Every strategy x call of class ``name`` on this rank, collective over ``mesh``'s sp group.
    A refusal is checked first (a refused class needs no run)."""
    from ..comm.mesh import axis_group

    group = axis_group(mesh, "sp")
    p = dist.get_world_size(group)
    try:
        model = build_dit(name)
    except Exception as e:
        return [DitRow("unbuildable", f"{type(e).__name__}: {str(e)[:200]}", name=name, strategy="-", output="-", p=p)]
    outcome, detail = "exact", ""
    try:
        parallelize_diffusers(model, mesh, strategy=strategies[0])
        unparallelize(model)
    except Exception as e:
        outcome, detail = verdict(e)
    outcome, detail = agreed_outcome(outcome, detail, group)
    if outcome != "exact":
        return [DitRow(outcome, detail[:2000], name=name, strategy="-", output="-", p=p)]
    try:
        inputs = make_inputs(name)
        ref = reference(model, inputs)
    except Exception as e:
        return [DitRow("unbuildable", f"its tiny config does not run without seqpar ({type(e).__name__}: "
                       f"{str(e)[:200]})", name=name, strategy="-", output="-", p=p)]
    rows = []
    for strategy in strategies:
        for output in outputs:
            outcome, detail, loss_diff, grad_max = "exact", "", 0.0, 0.0
            try:
                loss_diff, grad_max, worst = compare_dit(copy.deepcopy(model), inputs, mesh, strategy=strategy,
                                                         output=output, ref=ref)
                if loss_diff > LOSS_TOL or grad_max > GRAD_TOL:
                    outcome, detail = "mismatch", f"loss {loss_diff:.2e}, worst gradient {grad_max:.2e} ({worst})"
            except Exception as e:
                outcome, detail = verdict(e)
            outcome, detail = agreed_outcome(outcome, detail, group)
            rows.append(DitRow(outcome, detail[:2000], loss_diff, grad_max, name=name, strategy=strategy,
                               output=output, p=p))
    return rows


def run_dit_zoo(rank: int, world: int, names: list[str] | None = None,
                strategies: tuple[str, ...] = ("ulysses", "ring"), outputs: tuple[str, ...] = OUTPUTS,
                every: Collection[str] | None = None) -> list[DitRow]:
    """The zoo on ``world`` ranks (SP size = world); returns this rank's rows.

    ``every``: None runs every class under every strategy and call; a set of classes runs those so,
    and each other class under one (strategy, call) pair, taken in turn (a quicker sweep that still
    runs every class, every strategy and both calls)."""
    from ..comm.mesh import init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(sp=world, device_type="cpu")
    pairs = [(s, o) for s in strategies for o in outputs]
    rows = []
    for i, name in enumerate(names or dit_classes()):
        if every is None or name in every:
            rows.extend(zoo_class(name, mesh, strategies, outputs))
        else:
            strategy, output = pairs[i % len(pairs)]
            rows.extend(zoo_class(name, mesh, (strategy,), (output,)))
    return rows
