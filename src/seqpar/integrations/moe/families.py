"""Which modules of a transformers MoE model are experts seqpar can shard: as the model declares them.

transformers' MoE families declare an expert-parallel plan in their config, ``base_model_ep_plan``
(78 families in 5.25): the experts module (style ``"ep_dispatch_experts"``), which the MoE block
calls as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, and
its parameters stacked by expert on dim 0 (style ``"grouped_gemm"``: ``gate_up_proj [E, ...]``,
``down_proj [E, ...]``, GPT-OSS's biases). seqpar reads that declaration -- no second plan per
family -- and checks every experts module it names against it::

    config.base_model_ep_plan  {"layers.*.mlp.experts": "ep_dispatch_experts",
                                "layers.*.mlp.experts.gate_up_proj": "grouped_gemm", ...}
    model.model.layers.3.mlp.experts   matches "layers.*.mlp.experts" (numbers -> *, by suffix)

Refused, by name, with the reason: a model without a plan (its experts, if any, are not stacked
tensors seqpar knows how to cut); a plan that names no module of the model; an experts module
holding a parameter the plan does not stack (it could not be cut by expert) or a stacked one whose
dim 0 is not its ``num_experts``; an experts implementation other than the ones that index the
stacked tensors with ``num_experts`` (a kernel that moves tokens itself cannot run on a shard).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ... import compat
from ...errors import Refused
from ..models import decoder_config

DISPATCH, STACKED = "ep_dispatch_experts", "grouped_gemm"
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
"""Experts implementations that run on a shard: they index the stacked tensors by local expert id
below ``num_experts`` (transformers' own expert parallelism runs them the same way)."""


@dataclass(frozen=True)
class Experts:
    """One experts module: its path in the model, the module, its stacked parameters' names (dim 0
    is the expert) and its expert count."""

    name: str
    module: nn.Module
    params: tuple[str, ...]
    num_experts: int


def ep_plan(model: nn.Module) -> dict[str, str]:
    """The model's declared expert-parallel plan (its decoder config's, for a multimodal model), or {}."""
    for config in (model.config, decoder_config(model.config)[0]):
        plan = getattr(config, "base_model_ep_plan", None)
        if plan:
            return dict(plan)
    return {}


def _pattern(name: str) -> str:
    """A module path with its layer numbers as ``*`` (the plan's spelling)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _matches(name: str, key: str) -> bool:
    pattern = _pattern(name)
    return pattern == key or pattern.endswith("." + key)


def experts_of(model: nn.Module) -> list[Experts]:
    """Every experts module of ``model`` its plan names, checked (see the module doc). Raises
    :class:`seqpar.Refused` naming the model and the reason when seqpar cannot shard them."""
    what = type(model).__name__
    plan = ep_plan(model)
    dispatch = [k for k, style in plan.items() if style == DISPATCH]
    if not dispatch:
        raise Refused(f"{what} declares no expert-parallel plan (config.base_model_ep_plan with an "
                      f"{DISPATCH!r} module): seqpar shards only experts a model declares as stacked tensors; run it "
                      "without ep (its experts replicated on every rank)")
    impl = compat.experts_implementation(decoder_config(model.config)[0]) or compat.experts_implementation(model.config)
    if impl not in IMPLEMENTATIONS:
        raise Refused(f"{what} runs its experts with experts_implementation={impl!r}, which seqpar cannot run on a "
                      f"shard of the experts: load it with experts_implementation in {IMPLEMENTATIONS}")
    found = []
    for name, module in model.named_modules():
        if not any(_matches(name, key) for key in dispatch):
            continue
        stacked = tuple(p for p, _ in module.named_parameters() if any(_matches(f"{name}.{p}", k)
                                                                       for k, s in plan.items() if s == STACKED))
        found.append(_checked(what, name, module, stacked))
    if not found:
        raise Refused(f"{what}'s expert-parallel plan names {dispatch}, but no module of the model matches it: "
                      "seqpar cannot tell which modules are its experts")
    return found


def _checked(what: str, name: str, module: nn.Module, stacked: tuple[str, ...]) -> Experts:
    """One experts module, or Refused: every parameter stacked by expert, ``num_experts`` on dim 0."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or n < 1:
        raise Refused(f"{what}'s experts module {name} ({type(module).__name__}) has no num_experts: seqpar cannot "
                      "run it on a shard of its experts")
    loose = [p for p, _ in module.named_parameters() if p not in stacked]
    if loose or not stacked:
        raise Refused(f"{what}'s experts module {name} ({type(module).__name__}) holds parameters its plan does not "
                      f"stack by expert ({loose or 'none stacked'}): seqpar cannot cut them by expert")
    wrong = [p for p in stacked if module.get_parameter(p).shape[0] != n]
    if wrong:
        raise Refused(f"{what}'s experts module {name}: {wrong} do not have its {n} experts on dim 0, as the plan's "
                      f"{STACKED!r} says: seqpar cannot cut them by expert")
    return Experts(name, module, stacked, n)
