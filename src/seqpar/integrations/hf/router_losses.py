"""MoE router losses under sequence parallelism: the model's aux loss recomputed over the whole batch.

With ``output_router_logits`` a transformers MoE model adds ``coef * aux_loss`` to its loss, the
aux loss computed by its ``load_balancing_loss_func`` from the router logits of the forward's tokens
(masked by ``attention_mask``). Under seqpar each rank's forward sees its own shard only (and no
``attention_mask``: shard_batch masks padding itself), so the model's own aux loss is its shard's --
different on every rank and wrong (issue 36). A forward hook that :func:`seqpar.parallelize`
installs replaces it::

    outputs.aux_loss = exact                    seqpar.batch.router_loss: sums all-reduced over sp
    outputs.loss     = outputs.loss - coef * outputs.aux_loss + coef * exact

The model's own term cancels exactly (``c * aux`` is the same float32 product in both places; its
gradient ``c * g - c * g`` is exactly 0), so the loss's value and gradient are the token loss plus
the exact aux term. Which rule a family's aux loss follows is declared in :data:`RULES` (the
default: transformers' shared Switch-Transformer function, whose sums any router's logits feed).
At a model's first forward with an aux loss the rule, run on the rank's own logits without a mask
as the model ran it, must give the model's own ``aux_loss`` (to float32 rounding: transformers
sums in float32): a family whose aux loss is something else raises :class:`~seqpar.errors.Refused`
on every rank (the verdict rides the all-reduce). Refused at ``parallelize``: a logit z-loss
computed per shard (Bamba's ``z_loss_coefficient``), and router z-losses (Switch Transformers).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...batch.local_batch import BATCH_KWARG, LocalBatch
from ...batch.router_loss import ROUTER_RULES, aux_from_sums, close, reduce_sums
from ...comm.mesh import Axis, axis_group
from ...errors import Refused
from ..models import decoder_config

RULES: dict[str, str] = {"doge": "product_key"}
"""model_type -> rule of :data:`seqpar.batch.router_loss.ROUTER_RULES` where it is not ``"switch"``
(transformers' shared ``load_balancing_loss_func``; checked at the first forward either way)."""

_SHARD_LOSSES = ("z_loss_coefficient", "router_z_loss_coef")  # config fields of losses seqpar does not shard


def check_router_losses(model: nn.Module) -> None:
    """Raise Refused if the model computes a loss term over its positions that seqpar cannot make exact."""
    config = decoder_config(model.config)[0]
    for name in _SHARD_LOSSES:
        if float(getattr(config, name, 0.0) or 0.0) > 0:
            raise Refused(f"{type(model).__name__} adds a z-loss over the positions of the forward ({name}="
                          f"{getattr(config, name)}), which seqpar would compute per shard: set {name}=0 to "
                          "train it sequence-parallel")


def model_setting(model: nn.Module, names: tuple[str, ...], default: Any = None) -> Any:
    """The first of ``names`` set on the model (what its forward reads), else on its decoder config."""
    config = decoder_config(model.config)[0]
    for holder in (model, config):
        for name in names:
            value = getattr(holder, name, None)
            if value is not None:
                return value
    return default


def _local_keep(batch: LocalBatch) -> Tensor | None:
    """``[B, S_local]`` bool, False at padding, of this rank's tokens (None: no padding)."""
    keep = batch.shard.key_keep  # [B, S] in layout order: rank r holds columns off_r .. off_r + len_r
    if keep is None:
        return None
    start = sum(batch.shard.seq_lens[:batch.sp_rank])
    return keep[:, start:start + batch.local_len]


class _State:
    checked = False  # the family's rule agreed with the model's own aux loss (first forward)


def make_router_hook(model: nn.Module, mesh: DeviceMesh) -> Any:
    """The forward hook (``register_forward_hook(..., with_kwargs=True)``) that makes ``model``'s
    router aux loss the whole batch's (see the module doc)."""
    group = axis_group(mesh, Axis.SP.value)
    rule_name = RULES.get(getattr(model.config, "model_type", ""), "switch")
    rule = ROUTER_RULES[rule_name]
    state = _State()

    def exact_router_loss(module: nn.Module, _args: Any, kwargs: dict[str, Any], outputs: Any) -> Any:
        batch = kwargs.get(BATCH_KWARG)
        if isinstance(outputs, tuple):
            if getattr(decoder_config(module.config)[0], "output_router_logits", False):
                raise Refused("with output_router_logits seqpar recomputes the router aux loss from the model's "
                              "outputs: call the model with return_dict=True")
            return outputs
        local = getattr(outputs, "aux_loss", None)
        logits = getattr(outputs, "router_logits", None)
        if not isinstance(batch, LocalBatch) or not isinstance(local, Tensor) or not logits:
            return outputs  # no aux loss this call (or no seqpar batch: the attention has raised already)
        if batch.in_bin:  # a dynamic schedule's bin at any degree (seqpar.planner.bins), before any collective
            raise Refused(router_loss_in_bin(batch.sp_size))
        top_k, dtype = int(model_setting(module, ("num_experts_per_tok",))), getattr(module, "dtype", None)
        flags = 0.0
        if not state.checked:  # the model's own aux loss is the rule's on the same (unmasked, local) tokens
            flags = 0.0 if close(aux_from_sums(rule(logits, top_k, None, dtype)), local) else 1.0
        sums = rule(logits, top_k, _local_keep(batch), dtype)
        shared = batch.num_items_in_batch is not None or kwargs.get("num_items_in_batch") is not None
        whole, flagged = reduce_sums(sums, group, float(batch.dp_size) if shared else 1.0, flags)
        if not state.checked:
            if float(flagged):
                raise Refused(f"{type(module).__name__}'s router aux loss is not the {rule_name!r} load-balancing "
                              "loss seqpar recomputes over the whole sequence: turn output_router_logits off (or "
                              "router_aux_loss_coef=0) to train it sequence-parallel")
            state.checked = True
        exact = aux_from_sums(whole)
        loss = getattr(outputs, "loss", None)
        if isinstance(loss, Tensor):
            coef = float(model_setting(module, ("router_aux_loss_coef", "aux_loss_coef"), 0.0))
            outputs.loss = (loss - coef * local.to(loss.device)) + coef * exact.to(loss)
        outputs.aux_loss = exact
        return outputs

    return exact_router_loss


def router_loss_in_bin(degree: int) -> str:
    """Why a dynamic SP schedule's bin below sp cannot run a router aux loss, and what to change."""
    return (f"the MoE router aux loss in a dynamic SP schedule's bin of degree {degree}: it is a statistic of the "
            "whole batch (every row of the step), which a bin holds only part of -- at the job's sp too, where the "
            "step's other bins run in other forwards; turn output_router_logits off (or router_aux_loss_coef=0), "
            "or use the static schedule (no DynamicSP; seqpar train --sp-schedule static)")


def install_router_losses(model: nn.Module, mesh: DeviceMesh) -> Any:
    """Refuse what cannot be exact (:func:`check_router_losses`), then hook ``model``'s forward;
    returns the hook handle (``.remove()`` undoes it)."""
    check_router_losses(model)
    return model.register_forward_hook(make_router_hook(model, mesh), with_kwargs=True)
