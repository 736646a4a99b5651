"""The tiled loss's side of :func:`seqpar.reduce_memory`: the model's head read as a
:class:`~seqpar.batch.tiled_loss.Head`, the check that it is reproduced exactly, and the loss
function that computes the causal-LM loss from the decoder's hidden state in tiles.

transformers calls ``model.loss_function(logits=..., labels=..., **kwargs)`` with the logits it made;
with ``logits_to_keep=1`` those are the last token's only, so the loss here ignores them (except to
check the head once) and runs the head itself, tile by tile, on the hidden state the decoder's
forward hook caught in the same call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...batch.local_batch import BATCH_KWARG, LocalBatch
from ...batch.loss import bin_group, sharded_loss_inputs, sp_token_mean
from ...batch.targets import IGNORE_INDEX
from ...batch.tiled_loss import Head, tiled_loss_sum
from ...batch.vocab_parallel import vocab_range
from ...comm import faults
from ...comm.agree import check, share
from ...comm.mesh import Axis, axis_group
from ...errors import Refused
from ..state import MemoryState

_HEAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
"""How far the model's own logits may be from the tiled head's (relative to the largest logit):
rounding of the same matmul in another shape, never a missing transformation."""


def output_head(model: nn.Module) -> Head:
    """The model's head as a :class:`Head`, read now (under FSDP2 the unsharded weight). Raises
    ValueError for a head seqpar cannot reproduce exactly."""
    lin = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(lin) is not nn.Linear:
        raise Refused(f"tiled_loss: {type(model).__name__}'s output head is {type(lin).__name__}, not an "
                      "nn.Linear seqpar can tile exactly: use tiled_loss=False")
    config = model.config
    kind = str(getattr(config, "model_type", ""))
    scale = getattr(model, "logit_scale", None) if kind.startswith("cohere") else None
    divide = getattr(config, "logits_scaling", None) if kind.startswith("granite") else None
    weight, bias, group, start = vocab_shard(model, lin)
    return Head(weight, bias, scale=None if scale is None else float(scale),
                divide=None if divide is None else float(divide),
                softcap=getattr(config, "final_logit_softcapping", None) or None, tp_group=group, vocab_start=start)


def vocab_shard(model: nn.Module, lin: nn.Linear) -> tuple[Tensor, Tensor | None, Any, int]:
    """``(weight, bias, tp group or None, first vocabulary row)`` of the head: a tensor-parallel head
    (:mod:`seqpar.integrations.distributed.tensor_parallel`: a ``Shard(0)`` DTensor on the ``"tp"``
    axis) gives its local rows, differentiable (``to_local``), and its group; a plain one itself.
    Raises Refused for a head sharded any other way."""
    weight = lin.weight
    if type(weight).__name__ != "DTensor":
        return weight, lin.bias, None, 0
    from torch.distributed.tensor import Shard

    mesh = weight.device_mesh
    if tuple(mesh.mesh_dim_names or ()) != ("tp",) or tuple(weight.placements) != (Shard(0),):
        raise Refused(f"tiled_loss: {type(model).__name__}'s head is a DTensor on {mesh.mesh_dim_names} with "
                      f"{weight.placements}, not seqpar's vocabulary-parallel head: use tiled_loss=False")
    group = mesh.get_group()
    start = vocab_range(int(weight.shape[0]), mesh.size(), mesh.get_local_rank())[0]
    bias = None if lin.bias is None else lin.bias.to_local()
    return weight.to_local(), bias, group, start


def decoder_of(model: nn.Module) -> nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(decoder, nn.Module) or decoder is model:
        raise Refused(f"tiled_loss: {type(model).__name__} has no separate decoder module (get_decoder()) whose "
                      "hidden states feed the head: use tiled_loss=False")
    return decoder


def last_hidden(output: Any) -> Tensor:
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output[0]  # [B, S_local, H]


def check_head(model: nn.Module, head: Head, hidden: Tensor, logits: Tensor, group: Any) -> None:
    """Once per model: the model's own logits of its kept last tokens against the tiled head's."""
    k = logits.shape[1] if logits.dim() == 3 else 0
    problem = None
    if 0 < k <= hidden.shape[1]:
        with torch.no_grad():
            mine, _ = head.logits(hidden[:, -k:].reshape(-1, hidden.shape[-1]))
            theirs = logits.detach().reshape(mine.shape).to(mine.dtype)
            tol = _HEAD_TOL.get(mine.dtype, 3e-2) * max(1.0, float(theirs.abs().max()))
            diff = float((mine - theirs).abs().max())
        if diff > tol:
            problem = (f"{type(model).__name__}'s logits are not its head's output as seqpar reproduces it (differ "
                       f"by {diff:.3g}): the model transforms them in a way tiled_loss does not know; use "
                       "tiled_loss=False")
    if group is not None:
        check(share({}, group, problem=problem, refused=True), what="tiled_loss head")
    elif problem:
        raise Refused(problem)


class TiledLossFunction:
    """``model.loss_function`` with tiled_loss: the loss from the decoder's hidden state (caught in the
    same call by the forward hook :func:`seqpar.reduce_memory` puts on the decoder), not from the
    logits it is handed (the last token's). Sharded batches get seqpar's exact global token mean
    (:func:`seqpar.batch.loss.sp_token_mean`), plain ones transformers' mean (or sum over
    ``num_items_in_batch``), in float32 at least."""

    def __init__(self, model: nn.Module, state: MemoryState) -> None:
        self.model, self.state = model, state

    def __call__(self, logits: Tensor, labels: Tensor | None = None, vocab_size: int | None = None,
                 num_items_in_batch: Any = None, ignore_index: int = IGNORE_INDEX,
                 shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
        with faults.publishing("the loss"):  # an exception here is told to every rank
            return self._loss(logits, labels, num_items_in_batch, ignore_index, shift_labels, kwargs)

    def _loss(self, logits: Tensor, labels: Tensor | None, num_items_in_batch: Any, ignore_index: int,
              shift_labels: Tensor | None, kwargs: dict[str, Any]) -> Tensor:
        model, state = self.model, self.state
        hidden, state.hidden = state.hidden, None
        if hidden is None:
            raise ValueError("tiled_loss: the decoder's hidden states were not seen in this call (was the model "
                             "called through its forward?)")
        head = output_head(model)
        sharded = isinstance(kwargs.get(BATCH_KWARG), LocalBatch)
        if sharded and state.mesh is None:
            raise ValueError("a sharded batch reached a model whose reduce_memory got no mesh: pass the mesh")
        # a dynamic schedule's bin reduces over the block of ranks it was sharded over
        group = bin_group(state.mesh, kwargs[BATCH_KWARG], axis_group(state.mesh, Axis.SP.value)) if sharded else None
        if sharded:
            batch, targets, denominator = sharded_loss_inputs(kwargs, labels, shift_labels, num_items_in_batch,
                                                              tuple(hidden.shape[:2]))
            weights = batch.loss_weights
        else:
            targets, weights = shifted_targets(labels, shift_labels, ignore_index), None
        if not state.head_checked:
            check_head(model, head, hidden, logits, group)
            state.head_checked = True
        local = tiled_loss_sum(hidden, head, targets, token_weights=weights, tile=state.loss_tile,
                               ignore_index=ignore_index)
        if sharded:
            return sp_token_mean(local, batch, group, denominator)
        # transformers' reduction: the mean over the targets, or the sum over num_items_in_batch
        n = num_items_in_batch if num_items_in_batch is not None else (targets != ignore_index).sum()
        return local / max(float(n.item() if isinstance(n, Tensor) else n), 1.0)


def shifted_targets(labels: Tensor | None, shift_labels: Tensor | None, ignore_index: int) -> Tensor:
    """transformers' causal-LM targets: the label of the next token, ignore_index after the last."""
    if shift_labels is not None:
        return shift_labels
    if labels is None:
        raise ValueError("tiled_loss needs labels (or shift_labels)")
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
