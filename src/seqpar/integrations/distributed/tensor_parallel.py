"""Tensor parallelism from the model's own plan: ``apply_tp(model, tp_mesh)``, torchtitan's ``apply_tp``
over transformers' ``model.tp_plan`` with torch's public DTensor styles.

transformers declares, per model, which module is split how (``config.base_model_tp_plan`` and the
head's ``_tp_plan``, merged by the public ``model.tp_plan``). Each style name maps to a
``torch.distributed.tensor.parallel`` style, applied with ``parallelize_module`` on the tp submesh::

    plan style                        torch style (parallelize_module)        weights
    colwise                           ColwiseParallel()                       Shard(0): whole heads / columns
    rowwise                           RowwiseParallel()                       Shard(1), output all-reduced
    embedding_rowwise                 RowwiseParallel(input Replicate)        vocabulary rows, output all-reduced
    colwise_gather_output (the head)  ColwiseParallel(output Shard(-1))       vocabulary-parallel logits, never
                                                                              gathered: the loss reduces over tp
    replicated_with_grad_allreduce    PrepareModuleInputOutput(Shard(heads))  Replicate, gradient summed over tp
    replicate                         (nothing)

A decoder layer then runs on each tp rank with its share of the heads and MLP columns::

    hidden    # [B, S/sp, E]          replicated over tp
    q, k, v   # [B, S/sp, H/tp, D]    colwise: this rank's heads -> seqpar's attention (Ulysses splits
                                      them again over sp, ring runs them whole)
    o_proj    # [B, S/sp, E]          rowwise: partial sums, all-reduced over tp
    logits    # [B, S/sp, V/tp]       the vocabulary-parallel head (seqpar.batch.vocab_parallel)

Gradients: the column styles' input is a Replicate DTensor, whose backward all-reduces the partial
input gradients over tp (Megatron's "f"), so every replicated parameter (embeddings kept whole,
norms, routers) gets its whole gradient on every tp rank; a sharded parameter gets its shard's.
The exceptions are norms that see only this rank's heads (Qwen3's ``q_norm`` / ``k_norm``): their
gradient is a partial sum, made whole (Replicate) by one all-reduce over tp as it is computed
(:class:`_WholeGrad`). So no gradient is ever averaged over tp: the dp x sp average of
:mod:`seqpar.batch.loss` is the only reduction left.

What cannot be made exact is refused by name: a model without a plan, a style seqpar does not map,
heads or widths tp does not divide, per-head parameters outside the plan (attention sinks).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...errors import Refused
from ..models import decoder_config

MAPPED_STYLES = ("colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", "colwise_rep",
                 "replicated_with_grad_allreduce", "replicate")
"""The plan styles seqpar applies (module doc); any other is refused by name."""


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan (transformers' public ``model.tp_plan``: its config's
    ``base_model_tp_plan`` under the base model's prefix, plus the head's ``_tp_plan``), or ``{}``."""
    plan = getattr(model, "tp_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def plan_for_modules(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``{module name: style}`` for every module of ``model`` a plan key matches (``*`` stands for a
    layer number, as in transformers). Raises Refused for a key that names a parameter (only
    ``replicate`` is fine there)."""
    patterns = [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in plan.items()]
    modules = dict(model.named_modules())
    found: dict[str, str] = {}
    for name in modules:
        for pattern, style in patterns:
            if name and pattern.fullmatch(name):
                found[name] = style
    params = {n for n, _ in model.named_parameters()}
    for key, style in plan.items():
        pattern = re.compile(re.escape(key).replace(r"\*", r"\d+"))
        if style != "replicate" and any(pattern.fullmatch(p) for p in params):
            raise Refused(f"{type(model).__name__}'s tensor-parallel plan splits the parameter {key!r} ({style!r}): "
                          "seqpar applies module styles only; use tp=1")
    return found


def check_tp(model: nn.Module, tp: int) -> dict[str, str]:
    """The module plan of ``model`` at ``tp`` ranks (:func:`plan_for_modules`), after every check
    that needs no communication (so the same on every rank). Raises Refused for a model without a
    plan, a style seqpar does not map, or per-head parameters outside the plan; ValueError for
    heads, KV heads or widths that ``tp`` does not divide (naming the values that work)."""
    name = type(model).__name__
    plan = model_tp_plan(model)
    if not plan:
        raise Refused(f"{name} has no tensor-parallel plan (transformers' base_model_tp_plan / _tp_plan), so "
                      f"seqpar cannot split it over tp={tp}: use tp=1 (sp and dp still apply)")
    modules = plan_for_modules(model, plan)
    unmapped = sorted({s for s in modules.values() if s not in MAPPED_STYLES})
    if unmapped:
        raise Refused(f"{name}'s tensor-parallel plan uses {unmapped}, which seqpar does not map to an exact "
                      f"DTensor style (mapped: {list(MAPPED_STYLES)}): use tp=1")
    config, _ = decoder_config(model.config)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % tp or kv % tp:
        ok = [d for d in range(1, kv + 1) if heads % d == 0 and kv % d == 0]
        raise ValueError(f"{name} has {heads} query and {kv} KV heads, which tp={tp} cannot split into whole heads: "
                         f"choose tp in {ok} (Ulysses then splits each tp rank's heads over sp, KV heads "
                         "replicated where sp exceeds them)")
    by_name = dict(model.named_modules())
    for mod_name, style in modules.items():
        mod = by_name[mod_name]
        width = _split_width(mod, style)
        if width is not None and width % tp:
            raise ValueError(f"{name}.{mod_name} ({style}) has width {width}, which tp={tp} does not divide: "
                             f"choose tp dividing {width}")
        if style == "colwise" and mod_name.endswith("q_proj"):
            attention = by_name[mod_name.rsplit(".", 1)[0]]
            own = sorted(n for n, _ in attention.named_parameters(recurse=False))
            if own:
                raise Refused(f"{type(attention).__name__} holds per-head parameters {own} outside its tensor-parallel "
                              "plan (e.g. attention sinks), which seqpar cannot split with the heads: use tp=1")
    return modules


def _split_width(module: nn.Module, style: str) -> int | None:
    """The dimension a style splits: a column layer's outputs, a row layer's inputs, an embedding's rows."""
    if isinstance(module, nn.Embedding):
        return module.num_embeddings if style == "embedding_rowwise" else None
    if not isinstance(module, nn.Linear):
        return None
    if style in ("colwise", "colwise_gather_output", "colwise_rep"):
        return module.out_features
    return module.in_features if style == "rowwise" else None


class _WholeGrad:
    """A norm that sees only this rank's heads (``replicated_with_grad_allreduce``): its weight is a
    Replicate DTensor and its input this rank's heads (``Shard`` of the heads dim), so autograd makes
    the weight's gradient a ``Partial`` sum over tp; the hook turns it into a whole (Replicate) one
    as it is computed -- one all-reduce over tp of a ``[D]`` vector. Hooked in a forward pre-hook on
    whatever weight the module holds then (FSDP2 swaps in its own unsharded parameter)."""

    def __init__(self) -> None:
        self.hooked: dict[str, Tensor] = {}

    def __call__(self, module: nn.Module, _args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and self.hooked.get(name) is not param:
                param.register_hook(_replicate)
                self.hooked[name] = param


def _replicate(grad: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
        return grad.redistribute(placements=[Replicate()] * len(grad.placements))
    return grad


def _style(style: str, module: nn.Module, is_head: bool) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    if style in ("colwise_gather_output", "colwise_rep"):
        # the head: vocabulary-parallel logits, never gathered (the loss reduces over tp); anywhere else
        # the plan's own meaning, the output gathered whole
        return ColwiseParallel(output_layouts=Shard(-1) if is_head else Replicate())
    assert style == "replicated_with_grad_allreduce", style
    heads = Shard(-2)  # [B, S, H/tp, D]: the norm runs over D, per head
    return PrepareModuleInputOutput(input_layouts=(heads,), desired_input_layouts=(heads,), use_local_input=False,
                                    output_layouts=(heads,), desired_output_layouts=(heads,), use_local_output=True)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> dict[str, str]:
    """Split ``model`` over the 1-D ``tp_mesh`` by its own plan (module doc), in place; returns the
    module plan applied. Tied input and output embeddings stay tied (both vocabulary rows). Raises
    what :func:`check_tp` raises, before anything is changed."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    modules = check_tp(model, tp)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = head is not None and embed is not None and head.weight is embed.weight
    if tied and modules.get(_name_of(model, embed)) != "embedding_rowwise":
        raise Refused(f"{type(model).__name__} ties its head to its input embedding, which its plan does not split "
                      "by vocabulary rows: use tp=1")
    by_name = dict(model.named_modules())
    for mod_name, style in modules.items():
        if style == "replicate":
            continue
        mod = by_name[mod_name]
        if style == "replicated_with_grad_allreduce":
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), tp_mesh, [Replicate()]),
                                                           requires_grad=p.requires_grad))
            mod.register_forward_pre_hook(_WholeGrad())
        parallelize_module(mod, tp_mesh, _style(style, mod, mod is head))
    if tied:
        head.weight = embed.weight  # both Shard(0) over the same mesh: one parameter again
    return modules


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next((n for n, m in model.named_modules() if m is module), "")
