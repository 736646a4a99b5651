"""The exact causal-LM loss under sequence parallelism, and the gradient contract that goes with it.

Each SP rank holds the logits of its own tokens only. The loss of the whole sequence is

    loss = sum over all targets of w_i * CE_i / N

(N: the target count of this dp rank's batch, or ``num_items_in_batch``). Every rank computes its
local sum; one all-reduce makes the *value* global on every rank, while the *gradient* stays local:
rank r back-propagates only its own share, scaled by the number of ranks the gradients are
averaged over afterwards::

    d(loss_r) / d(local_sum_r) = dp * sp / N     with num_items_in_batch (N over all dp ranks)
                               =      sp / N     without (N: this dp rank's targets; the dp
                                                 average is then the mean of the dp ranks' means)

Cross-rank paths (attention) send their gradients back through the attention's own collectives,
so the *average* of the parameter gradients over the dp x sp ranks -- what stock DDP and FSDP2
over those ranks compute (as torchtitan, Megatron, DeepSpeed and accelerate do), and what
:func:`sync_gradients` computes without a wrapper -- is exactly the non-parallel model's gradient.
A wrapper that averages over the dp ranks only would leave the sp ranks' shares uncombined:
parallelized models refuse it at their first training forward (:mod:`seqpar.integrations.distributed.fsdp`).

Rounding: scaling by the number of ranks and averaging cancel to float64 rounding. A model that
computes in float32 inside (Llama's RMSNorm casts to float32 whatever the model's dtype) rounds
each token's gradient relative to its scale, so when the number of ranks has an odd factor (3, 6)
its gradients match the unparallelized model's to that model's own float32 precision -- and the
unparallelized model back-propagating the same scaled loss to float64 rounding (the oracle of
:func:`seqpar.testing.model_parity.reference_grads`). At a power of two the scaling is exact.

Convention change: the gradients used to be *summed* over the ranks (seqpar's FSDP2 with a divide
factor of 1, a summing DDP hook), so a model under stock DDP / FSDP2 trained with 1 / (dp * sp) of
its gradient, silently. Code that summed the gradients itself (an ``all_reduce`` of SUM with no
division) must now divide by the number of ranks, or call :func:`sync_gradients`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..attention.layout import inverse_permutation
from ..attention.shard import SeqShard
from ..comm import backward_faults, collectives, faults
from ..comm.degrees import is_block_of
from ..comm.gather import gather_seq
from ..comm.guard import check_failures, pending_failure
from ..comm.mesh import Axis, as_mesh, axis_group, axis_size, has_axis, is_nd, tp_size
from ..errors import Refused
from . import grad_groups
from .local_batch import BATCH_KWARG, LocalBatch
from .targets import IGNORE_INDEX
from .vocab_parallel import vocab_parallel_log_probs


@torch.compiler.disable  # host reads, fault-aware waits: one eager call (one graph break) under torch.compile
def _global_sum(total: Tensor, group: dist.ProcessGroup | None, awaits_backward: bool) -> Tensor:
    """The sum over ``group`` of every rank's ``total``; the batch's attention failures ride the
    same all-reduce, so no loss comes from a failed forward. ``awaits_backward``: the loss will be
    differentiated (its batch then awaits a backward, :mod:`seqpar.comm.backward_faults`)."""
    total = _summed(total, group)
    if awaits_backward:
        backward_faults.loss_awaits_backward()
    return total


def _summed(total: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    failed = pending_failure()  # None: no attention call to check
    if group is None or dist.get_world_size(group) == 1:
        check_failures()  # no all-reduce to ride: over the attention calls' own groups
        return total
    if failed is None:
        collectives.all_reduce(total, group=group)
        return total
    total = torch.stack([total, total.new_tensor(failed)])  # [loss sum, ranks that failed]
    collectives.all_reduce(total, group=group)
    any_failed = bool(total[1].item())  # the batch's one host read
    faults.raise_if_flagged()  # NCCL: a peer's fault made the watchdog abort this all-reduce
    check_failures(group, any_failed=any_failed)
    return total[0]


class _GlobalTokenMean(torch.autograd.Function):
    """Forward: all-reduce (sum) the ranks' local loss sums, divide by N: the same global loss on
    every rank. Backward: no collective -- ``grad * grad_scale`` into the local sum only. Each rank
    is responsible for its own targets; averaging the parameter gradients over the ranks afterwards
    (not here: DDP, FSDP2 or sync_gradients) is what makes the total exact, so ``grad_scale``
    carries the number of ranks that average divides by; all-reducing here too would count each
    target once per rank."""

    @staticmethod
    def forward(ctx, local_sum: Tensor, group: dist.ProcessGroup | None, denominator: float,
                grad_scale: float) -> Tensor:
        total = _global_sum(local_sum.detach().clone(), group, ctx.needs_input_grad[0])
        ctx.grad_scale = grad_scale
        return total / denominator

    @staticmethod
    def backward(ctx, grad: Tensor):
        backward_faults.backward_started()  # a failure from here on is told to every rank
        return grad * ctx.grad_scale, None, None, None


def token_losses(logits: Tensor, targets: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Per-token cross entropy ``[B, S]`` (0 where the target is ignored), computed in at least
    float32 (float64 logits stay float64). ``logits [B, S, V]``, ``targets [B, S]`` already shifted."""
    cdtype = torch.promote_types(logits.dtype, torch.float32)
    flat = logits.reshape(-1, logits.shape[-1]).to(cdtype)
    ce = F.cross_entropy(flat, targets.reshape(-1).to(flat.device), ignore_index=ignore_index, reduction="none")
    return ce.view(targets.shape)


def sp_token_mean(local_sum: Tensor, batch: LocalBatch, group: dist.ProcessGroup | None,
                  denominator: float | None = None) -> Tensor:
    """The global token mean from this rank's summed token losses (see :class:`_GlobalTokenMean`).
    ``denominator``: a ``num_items_in_batch`` the loss function was given (N over every dp rank,
    as with :func:`seqpar.shard_batch`'s own); default: the batch's."""
    if denominator is None:
        denominator, grad_scale = batch.denominator, batch.grad_scale
        denominator = denominator if denominator > 0 else 1.0
    else:
        denominator = denominator if denominator > 0 else 1.0
        grad_scale = batch.sp_size * batch.dp_size / denominator  # averaged over every dp x sp rank
    return _GlobalTokenMean.apply(local_sum, group, float(denominator), grad_scale)


def tp_group_of(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The tensor-parallel group of ``mesh`` when it has more than one rank (the logits are then
    vocabulary-parallel: :mod:`.vocab_parallel`), else None."""
    return axis_group(mesh, Axis.TP.value) if tp_size(mesh) > 1 else None


def token_losses_over(logits: Tensor, targets: Tensor, tp_group: dist.ProcessGroup | None, vocab: int | None,
                      ignore_index: int = IGNORE_INDEX) -> Tensor:
    """:func:`token_losses`, or with ``tp_group`` the same from vocabulary-parallel logits
    (``[B, S, V/tp]`` of a ``vocab``-row head)."""
    if tp_group is None:
        return token_losses(logits, targets, ignore_index)
    if vocab is None:
        raise ValueError("vocabulary-parallel logits need the vocabulary size (transformers passes vocab_size)")
    return -vocab_parallel_log_probs(logits, targets, tp_group, int(vocab), ignore_index)


def make_loss_function(mesh: DeviceMesh) -> Callable[..., Tensor]:
    """A transformers ``loss_function`` (``model.loss_function = ...``) for batches from
    :func:`seqpar.shard_batch`: the exact global token-weighted mean on every SP rank. On a mesh
    with tp > 1 the logits are this rank's vocabulary shard and the loss reduces over tp too
    (:mod:`.vocab_parallel`): the value is the same on every rank."""
    group = axis_group(mesh, Axis.SP.value)
    tp_group = tp_group_of(mesh)

    def seqpar_causal_lm_loss(logits: Tensor, labels: Tensor | None = None, vocab_size: int | None = None,
                              num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
                              shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
        if torch.compiler.is_compiling():  # dynamo cannot break a graph inside the with-block below (the
            # loss's host read does): a compiled loss does not publish its own exception (a limit,
            # docs/guides/attention.md); attention failures are still checked at the loss's all-reduce
            return loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, kwargs)
        with faults.publishing("the loss"):  # an exception here is told to every rank
            return loss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, kwargs)

    def loss(logits: Tensor, labels: Tensor | None, vocab_size: int | None, num_items_in_batch: Any,
             ignore_index: int, shift_labels: Tensor | None, kwargs: dict[str, Any]) -> Tensor:
        batch, targets, denominator = sharded_loss_inputs(kwargs, labels, shift_labels, num_items_in_batch,
                                                          tuple(logits.shape[:2]))
        per_token = token_losses_over(logits, targets, tp_group, vocab_size, ignore_index)
        if batch.loss_weights is not None:
            per_token = per_token * batch.loss_weights.to(per_token)
        return sp_token_mean(per_token.sum(), batch, bin_group(mesh, batch, group), denominator)

    return seqpar_causal_lm_loss


def bin_group(mesh: DeviceMesh, batch: LocalBatch, group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The sp group ``batch`` was sharded over: ``group`` (the job mesh's), or the block's group of a
    dynamic schedule's bin (:mod:`seqpar.comm.degrees`)."""
    bmesh = batch.shard.state.mesh
    if bmesh is None or bmesh is mesh or not is_block_of(mesh, bmesh):
        return group
    return axis_group(bmesh, Axis.SP.value)


def sharded_loss_inputs(kwargs: dict[str, Any], labels: Tensor | None, shift_labels: Tensor | None,
                        num_items_in_batch: Any, shape: tuple[int, ...]) -> tuple[LocalBatch, Tensor, float | None]:
    """What a seqpar loss function reads from transformers' call: ``(the LocalBatch, the local
    targets [B, S_local], the denominator override or None)``. ``shape``: ``[B, S_local]`` of the
    model's output. Raises ValueError for a batch that did not come from shard_batch, a model whose
    attention bypassed seqpar, or targets of the wrong shape (the same on every rank)."""
    batch = kwargs.get(BATCH_KWARG)
    if not isinstance(batch, LocalBatch):
        raise ValueError("a seqpar-parallelized model computes its loss from a sharded batch: call "
                         "model(**seqpar.shard_batch(batch, mesh)), or seqpar.unparallelize(model) first")
    if batch.attention_calls == 0:
        raise Refused("the model's attention never went through seqpar (it does not use "
                      "transformers' AttentionInterface?): its loss would use local attention only")
    targets = shift_labels if shift_labels is not None else labels
    if targets is None or tuple(targets.shape) != shape:
        raise ValueError(f"labels must be the [batch, local_seq_len] = {list(shape)} targets shard_batch returns")
    denominator = None
    if num_items_in_batch is not None and batch.num_items_in_batch is None:
        denominator = float(num_items_in_batch.item() if isinstance(num_items_in_batch, Tensor)
                            else num_items_in_batch)
    return batch, targets, denominator


def gather_log_probs(logits: Tensor, labels: Tensor | dict[str, Any], mesh: DeviceMesh, *,
                     shard: SeqShard | LocalBatch | None = None, ignore_index: int = IGNORE_INDEX,
                     vocab_size: int | None = None) -> Tensor:
    """Per-token log-probabilities of the targets over the whole sequence, on every SP rank.

    ``logits [B, S_local, V]``; ``labels``: the shifted local targets ``[B, S_local]`` (the
    ``labels`` of :func:`shard_batch`), or the local batch dict itself. Returns ``[B, S]`` in the
    original token order (0 where the target is ignored), differentiable: every SP rank may compute
    the same sequence-level loss (DPO, RL) from it, and back-propagates into its own logits only
    (an all-gather whose backward keeps this rank's slice, times the SP size), so *averaging* the
    parameter gradients over the SP ranks (DDP / FSDP2 / :func:`sync_gradients`) gives the exact
    gradient -- over dp x sp, the dp ranks' mean of it. ``shard`` (or a local batch dict) gives uneven lengths and
    the layout; without it the shards are taken as equal and contiguous. On a mesh with tp > 1,
    ``logits`` are this rank's vocabulary shard ``[B, S_local, V/tp]`` of a ``vocab_size``-row head
    (:mod:`.vocab_parallel`; None: the widths summed over tp, one tiny all-reduce).
    """
    labels, shard = labels_and_shard(labels, shard)
    group = axis_group(as_mesh(mesh, "gather_log_probs"), Axis.SP.value)
    check_failures(group)  # no log-probabilities from a failed forward (free when nothing to check)
    tp_group = tp_group_of(mesh)
    if tp_group is not None:
        if vocab_size is None:
            width = torch.tensor([float(logits.shape[-1])], dtype=torch.float64,
                                 device=collectives.comm_device(tp_group))
            collectives.all_reduce(width, group=tp_group)
            vocab_size = int(width.item())
        picked = vocab_parallel_log_probs(logits, labels, tp_group, vocab_size, ignore_index)
        return gather_token_values(picked, group, shard)
    cdtype = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(cdtype), dim=-1)
    valid = labels != ignore_index
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid  # [B, S_local]
    return gather_token_values(picked, group, shard)


def labels_and_shard(labels: Tensor | dict[str, Any], shard: SeqShard | LocalBatch | None
                     ) -> tuple[Tensor, SeqShard | None]:
    """``(local targets [B, S_local], SeqShard or None)`` from the arguments of :func:`gather_log_probs`."""
    if isinstance(labels, dict):
        shard = labels[BATCH_KWARG]
        labels = labels["labels"]
    if isinstance(shard, LocalBatch):
        shard = shard.shard
    return labels, shard


class ScaleGrad(torch.autograd.Function):
    """Forward: the identity. Backward: ``grad * factor``. Not a collective: it pre-scales a
    rank's share of a gradient by the number of ranks that will average it (see the module
    docstring), where the value itself must stay unscaled."""

    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.factor, None


def scale_grad(x: Tensor, factor: float) -> Tensor:
    """``x`` unchanged, its gradient times ``factor`` (:class:`ScaleGrad`): a rank's share
    pre-scaled for the average over ``factor`` ranks (or dp ranks) taken afterwards."""
    return ScaleGrad.apply(x, float(factor))


def gather_token_values(picked: Tensor, group: dist.ProcessGroup, shard: SeqShard | None) -> Tensor:
    """``[B, S_local] -> [B, S]`` in the original token order on every rank of the SP ``group``;
    the backward keeps this rank's slice, times the SP size (see :func:`gather_log_probs`)."""
    sizes = shard.seq_lens if shard is not None else None
    p = dist.get_world_size(group)
    if p > 1:  # every SP rank back-propagates the same loss: its slice, scaled for the average
        picked = ScaleGrad.apply(picked, float(p))
    full = gather_seq(picked, dim=1, group=group, sizes=sizes, grad="slice")  # [B, S] in layout order
    if shard is not None and shard.positions is not None:
        full = full.index_select(1, inverse_permutation(shard.positions).to(full.device))
    return full


GRAD_BUCKET_BYTES = 4 * 2**20
"""The most bytes :func:`sync_gradients` flattens into one all-reduce: the sync's extra memory is at
most one bucket, not a second copy of every gradient (which sat on top of every gradient at the end
of the backward: the peak of a short step). 4 MiB: at 16 MiB the bucket was still a short step's
peak (P=4, S=4096 of benchmarks/bench_alst.py's model); a bucket more is one all-reduce more,
~1-3 ms on gloo."""


def _average_grads(grads: list[Tensor], group: dist.ProcessGroup) -> None:
    """Every gradient summed over the group and divided by its size (a SUM and a division: gloo has
    no ReduceOp.AVG), per dtype in buckets of at most :data:`GRAD_BUCKET_BYTES`: a gradient at least
    that large (and contiguous) is reduced in place, smaller ones are flattened together, one
    all-reduce per bucket. The same buckets on every rank (the same gradients, in order); the same
    sums element by element as one flat all-reduce."""
    world = dist.get_world_size(group)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for gs in by_dtype.values():
        bucket: list[Tensor] = []
        size = 0
        for g in gs:
            n = g.numel() * g.element_size()
            if n >= GRAD_BUCKET_BYTES and g.is_contiguous():
                collectives.all_reduce(g, group=group)
                g.div_(world)
                continue
            if bucket and size + n > GRAD_BUCKET_BYTES:
                _average_bucket(bucket, group, world)
                bucket, size = [], 0
            bucket.append(g)
            size += n
        if bucket:
            _average_bucket(bucket, group, world)


def _average_bucket(grads: list[Tensor], group: dist.ProcessGroup, world: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    collectives.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def sync_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Average every parameter's gradient over the sp and dp ranks of ``mesh`` (per axis and dtype,
    in buckets of at most :data:`GRAD_BUCKET_BYTES`; on an N-D mesh over ``"dp_sp"``), completing the
    gradient contract of the seqpar loss: what stock DDP over the dp x sp ranks does, for a model
    without a wrapper. Never over tp: a tensor-parallel parameter's gradient (a DTensor on the ``"tp"``
    axis) is already whole for its shard on every tp rank
    (:mod:`seqpar.integrations.distributed.tensor_parallel`), and its local shard is what is averaged.
    A parameter only some ranks hold (an expert shard, :mod:`seqpar.batch.grad_groups`) is averaged
    over the ranks that hold the same shard instead. Parameters without a gradient count as zeros
    (every rank must send the same buffers). Raises ValueError for FSDP-sharded (DTensor) gradients;
    an exception here is told to every rank (:mod:`seqpar.comm.faults`)."""
    with faults.publishing("sync_gradients"):
        _sync_gradients(model, mesh)


def _tp_param(p: Tensor, mesh: DeviceMesh) -> bool:
    """A DTensor of tensor parallelism: on a 1-D mesh named ``"tp"`` of an N-D seqpar mesh."""
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None)
    return is_nd(mesh) and tuple(names or ()) == (Axis.TP.value,)


def _local_grads(model: nn.Module, mesh: DeviceMesh) -> list[tuple[nn.Parameter, Tensor]]:
    """Every trainable parameter with its gradient as a plain tensor (a TP DTensor's local shard,
    whole for its shard), zeros for a parameter without one. Raises ValueError for FSDP's DTensors."""
    out = []
    for p in (p for p in model.parameters() if p.requires_grad):
        dtensor = type(p).__name__ == "DTensor" or type(p.grad).__name__ == "DTensor"
        if dtensor and not _tp_param(p, mesh):
            raise ValueError("sync_gradients got FSDP-sharded (DTensor) parameters: FSDP reduces gradients "
                             "itself -- shard over every dp x sp rank (seqpar.apply_fsdp(model, mesh)) and "
                             "drop the sync_gradients call")
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if dtensor:
            assert not any(type(q).__name__ == "Partial" for q in grad.placements), "a partial TP gradient"
            grad = grad.to_local()
        out.append((p, grad))
    return out


def _sync_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    as_mesh(mesh, "sync_gradients")
    pairs = _local_grads(model, mesh)
    if not pairs:
        return
    own = {id(p): s.group for s in grad_groups.sharded_params(model) for p in s.params if p.requires_grad}
    replicated = [g for p, g in pairs if id(p) not in own]
    axes = (Axis.DP_SP.value,) if is_nd(mesh) else (Axis.SP.value, Axis.DP.value)
    for axis in axes:
        if replicated and has_axis(mesh, axis) and axis_size(mesh, axis) > 1:
            _average_grads(replicated, axis_group(mesh, axis))
    for group in dict.fromkeys(own.values()):  # each shard over the ranks that hold it (first-seen order)
        if dist.get_world_size(group) > 1:
            _average_grads([g for p, g in pairs if own.get(id(p)) is group], group)
