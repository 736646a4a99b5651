"""The longest sequence per rank in one call: ``seqpar.reduce_memory(model, mesh)``.

Three switches, each exact (float64 parity with the plain model), each undone by
:func:`restore_memory` (and by :func:`seqpar.unparallelize`): every change is an undo step on the
model's record (:mod:`~seqpar.integrations.state`)::

    model(**local)                      forward pre-hook: the batch's shard lengths; logits_to_keep=1 with labels
      decoder                           forward hook: its last hidden state  # [B, S_local, H]
        layer i    checkpoint="layers"  non-reentrant checkpoint; "offload": its input in pinned host memory
          mlp      tiled_mlp            sequence tiles, recomputed per tile in backward (.tiling)
      lm_head                           runs on the last token only (what .logits holds)
      loss_function  tiled_loss         head + cross entropy in tiles from the hidden state (.tiled_head)

Only public points of transformers are used: hooks on modules the model owns, the ``logits_to_keep``
argument of its forward, ``model.loss_function``, and an instance ``forward`` on its MLP and decoder
layer modules (parameter names and ``state_dict`` unchanged).

**What ``.logits`` holds with tiled_loss**: when ``labels`` are passed (and no ``logits_to_keep``),
the logits of each row's last local token only, ``[B, 1, V]`` -- no ``[S, V]`` tensor is made. Without
labels the model returns its full logits as usual. Per-token losses and argmax accuracy without the
logits: :func:`token_stats`.

The head must be exactly reproducible: an ``nn.Linear`` (bias allowed), with the final-logit
softcapping (Gemma 2/3), ``logit_scale`` (Cohere) and ``logits_scaling`` (Granite) the model has. On
the first call with labels the model's own last-token logits are compared with the tiled head's;
any other transformation of the logits is refused there (ValueError on every SP rank), never
approximated.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ... import compat
from ...batch.local_batch import BATCH_KWARG, LocalBatch
from ...batch.loss import bin_group
from ...batch.targets import IGNORE_INDEX
from ...batch.tiled_loss import check_tile, tiled_token_stats
from ...batch.tiles import DEFAULT_LOSS_TILE
from ...comm.guard import check_failures
from ...comm.mesh import Axis, axis_group
from ...errors import Refused
from ..models import is_diffusers_model
from ..state import MemoryState, ensure_state, set_loss_function, state_of, undo
from .tiled_head import TiledLossFunction, decoder_of, last_hidden, output_head, shifted_targets
from .tiling import TileContext, checkpoint_layer, is_per_token_mlp, tile_mlp, untile

CHECKPOINT_MODES = ("none", "layers", "offload")


def _layers(model: nn.Module) -> list[nn.Module]:
    names = compat.decoder_block_classes(model)
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def _mlps(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    if is_diffusers_model(model):  # a DiT block's feed-forwards (image and text streams): diffusers' FeedForward
        mlps = [m for layer in layers for m in layer.modules() if type(m).__name__ == "FeedForward"]
        if not mlps:
            raise Refused(f"tiled_mlp: no diffusers FeedForward in {type(model).__name__}'s blocks: "
                          "use tiled_mlp=False")
        return mlps
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if not layers or any(m is None for m in mlps):
        raise Refused(f"tiled_mlp: no MLP found in {type(model).__name__}'s decoder layers (layer.mlp): "
                      "use tiled_mlp=False")
    refused = sorted({type(m).__name__ for m in mlps if not is_per_token_mlp(m)})
    if refused:
        raise Refused(f"tiled_mlp: {', '.join(refused)} is not a module seqpar knows to be per-token (accepted: "
                      "gated MLPs such as LlamaMLP, Qwen3MLP, Gemma2MLP; not MoE blocks): use tiled_mlp=False")
    return mlps


def _offload_mode(model: nn.Module) -> str:
    device = next(model.parameters()).device
    if device.type == "cpu":
        return "no-op on the CPU (the saved inputs already live in host memory): plain layer checkpoints"
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint='offload' needs pinned host memory, which this {device.type} host cannot "
                         f"give ({e}): use checkpoint='layers'") from None
    return f"layer inputs parked in pinned host memory, copied asynchronously on the {device.type} stream"


def reduce_memory(model: nn.Module, mesh: DeviceMesh | None = None, *, tiled_loss: bool | None = None,
                  tiled_mlp: bool = True, checkpoint: str = "layers", loss_tile: int = DEFAULT_LOSS_TILE,
                  mlp_tile: int | None = None) -> nn.Module:
    """Turn on the memory switches of a transformers causal LM (in place; returns the model).

    Call after :func:`seqpar.parallelize` (``mesh``: the same mesh) or on a plain model (``mesh``
    None), before :func:`seqpar.apply_fsdp`. ``tiled_loss``: loss from the hidden states in tiles
    of ``loss_tile`` tokens (``.logits`` then holds the last token only, see the module doc).
    ``tiled_mlp``: each decoder layer's MLP in tiles of ``mlp_tile`` tokens, recomputed in backward;
    None: tiles that follow the shard, chosen per call from its tokens
    (:func:`seqpar.batch.tiles.mlp_tile_for`: a tile's ``[tile, intermediate]`` within the shard's
    ``[T, hidden]``).
    ``checkpoint``: "none", "layers" (non-reentrant per decoder layer) or "offload" (also parks
    each layer's input in pinned host memory; on the CPU the same as "layers").

    Raises ValueError (deterministic, so the same on every rank, before any collective) for a tile
    that is not a positive int, an unknown checkpoint mode, offload without pinned memory, a head or
    MLP that cannot be tiled exactly, a parallelized model without its mesh, or a second call.
    """
    dit = is_diffusers_model(model)
    if dit and tiled_loss:
        raise ValueError(f"tiled_loss=True: {type(model).__name__} is a diffusers transformer, with no vocabulary head "
                         "to tile (its flow-matching loss is per element already): omit tiled_loss or pass False")
    tiled_loss = not dit if tiled_loss is None else tiled_loss
    check_tile(loss_tile, "loss_tile")
    if mlp_tile is not None:
        check_tile(mlp_tile, "mlp_tile")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint={checkpoint!r}: choose one of {list(CHECKPOINT_MODES)}")
    record = state_of(model)
    if record is not None and record.memory is not None:
        raise ValueError("reduce_memory was already called on this model: call seqpar.restore_memory(model) first")
    if record is not None and record.parallel is not None and mesh is None:
        raise ValueError("this model is parallelized: pass reduce_memory the mesh it was parallelized with")
    flag = next((f for f in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(type(model), f)),
                "is_gradient_checkpointing")
    if checkpoint != "none" and getattr(model, flag, False):
        raise ValueError("the model already uses transformers' / diffusers' gradient checkpointing: disable it "
                         "(model.gradient_checkpointing_disable() / disable_gradient_checkpointing()) or pass "
                         "checkpoint='none'")
    layers = _layers(model)
    if checkpoint != "none" and not layers:
        raise Refused(f"checkpoint={checkpoint!r}: no decoder layers found in {type(model).__name__} "
                      "(its _no_split_modules): use checkpoint='none'")
    mlps = _mlps(model, layers) if tiled_mlp else []
    if tiled_loss:
        output_head(model)
        decoder_of(model)
        if "logits_to_keep" not in inspect.signature(model.forward).parameters:
            raise Refused(f"tiled_loss: {type(model).__name__}.forward takes no logits_to_keep, so its head would "
                          "make the full logits anyway: use tiled_loss=False")
    offload = _offload_mode(model) if checkpoint == "offload" else ""
    state = MemoryState(tiled_loss, tiled_mlp, checkpoint, loss_tile, mlp_tile, mesh, TileContext(), mlps,
                        layers if checkpoint != "none" else [], offload)
    record = ensure_state(model)
    record.memory = state
    try:
        for mlp in state.mlps:
            tile_mlp(mlp, mlp_tile, state.context)
            record.push("memory", f"tiled {type(mlp).__name__}", functools.partial(untile, mlp))
        for layer in state.layers:
            checkpoint_layer(layer, checkpoint == "offload", state.context)
            record.push("memory", f"checkpointed {type(layer).__name__}", functools.partial(untile, layer))
        hook = model.register_forward_pre_hook(_BeforeForward(state), with_kwargs=True)
        record.push("memory", "the model's forward pre-hook", hook.remove)
        if tiled_loss:
            hook = decoder_of(model).register_forward_hook(_CatchHidden(state))
            record.push("memory", "the decoder's forward hook", hook.remove)
            record.push("memory", "the loss function",
                        functools.partial(set_loss_function, model, getattr(model, "loss_function", None)))
            model.loss_function = TiledLossFunction(model, state)
    except BaseException:
        undo(model, "memory")  # nothing half-installed stays behind
        raise
    return model


class _BeforeForward:
    """The model's forward pre-hook: the batch's shard lengths for the MLP tiles, and
    ``logits_to_keep=1`` when labels are passed (the head then runs on the last token only). A
    callable object, not a closure, so that a deep copy of the model hooks its own state."""

    def __init__(self, state: MemoryState) -> None:
        self.state = state

    def __call__(self, _module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        state = self.state
        batch = kwargs.get(BATCH_KWARG)
        state.context.longest = max(batch.shard.seq_lens) if isinstance(batch, LocalBatch) else None
        state.hidden = None
        labelled = kwargs.get("labels") is not None or kwargs.get("shift_labels") is not None
        state.catch = labelled
        if state.tiled_loss and labelled and not kwargs.get("logits_to_keep"):
            kwargs = {**kwargs, "logits_to_keep": 1}
        return args, kwargs


class _CatchHidden:
    """The decoder's forward hook: keeps its last hidden state for the loss of the same call."""

    def __init__(self, state: MemoryState) -> None:
        self.state = state

    def __call__(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self.state.catch:  # a call without labels (generation) keeps nothing alive here
            self.state.hidden = last_hidden(output)


@dataclass(frozen=True)
class TokenStats:
    """Per-token results of :func:`token_stats`: ``losses [B, S_local]`` (0 where ignored),
    ``correct [B, S_local]`` (argmax == target), ``valid [B, S_local]`` (a target exists)."""

    losses: Tensor
    correct: Tensor
    valid: Tensor


@torch.no_grad()
def token_stats(model: nn.Module, batch: dict[str, Any], *, tile: int | None = None) -> TokenStats:
    """Evaluate ``model`` on ``batch`` (a local batch of :func:`seqpar.shard_batch`, or a plain
    batch with ``labels``) without making its logits: per-token losses and argmax hits, ``tile``
    tokens at a time (default: the model's loss_tile, else :data:`DEFAULT_LOSS_TILE`). Sum them over
    the SP ranks for totals. Raises ValueError without labels."""
    record = state_of(model)
    state = record.memory if record is not None else None
    labels = batch.get("labels")
    if labels is None:
        raise ValueError("token_stats needs the batch's labels")
    sharded = isinstance(batch.get(BATCH_KWARG), LocalBatch)
    targets = labels if sharded else shifted_targets(labels, None, IGNORE_INDEX)
    captured: list[Tensor] = []
    hook = decoder_of(model).register_forward_hook(lambda _m, _a, out: captured.append(last_hidden(out)))
    try:
        model(**{k: v for k, v in batch.items() if k not in ("labels", "loss_weights")}, logits_to_keep=1)
    finally:
        hook.remove()
    if sharded and state is not None and state.mesh is not None:
        # as the loss (over a dynamic schedule's bin's block): nothing from a failed forward
        check_failures(bin_group(state.mesh, batch[BATCH_KWARG], axis_group(state.mesh, Axis.SP.value)))
    tile = tile or (state.loss_tile if state is not None else DEFAULT_LOSS_TILE)
    losses, correct = tiled_token_stats(captured[-1], output_head(model), targets, tile=tile)
    return TokenStats(losses, correct, targets != IGNORE_INDEX)


def restore_memory(model: nn.Module) -> nn.Module:
    """Undo :func:`reduce_memory`: its own undo steps popped, newest first; :func:`seqpar.parallelize`'s
    stay (:func:`seqpar.unparallelize` pops both). A no-op on a model without the switches. Returns
    the model."""
    undo(model, "memory")
    return model


def memory_switches(model: nn.Module) -> dict[str, Any]:
    """What :func:`reduce_memory` turned on for ``model``, for printing (all off when not called)."""
    record = state_of(model)
    state = record.memory if record is not None else None
    if state is None:
        return {"tiled_loss": False, "tiled_mlp": False, "checkpoint": "none"}
    out: dict[str, Any] = {"tiled_loss": state.tiled_loss, "tiled_mlp": state.tiled_mlp,
                           "checkpoint": state.checkpoint}
    if state.tiled_loss:
        head = output_head(model)
        extras = [f"{k}={getattr(head, k)}" for k in ("scale", "divide", "softcap") if getattr(head, k) is not None]
        out["loss_tile"] = state.loss_tile
        out["head"] = " ".join([f"Linear {head.weight.shape[1]}->{head.weight.shape[0]}",
                                "with bias" if head.bias is not None else "no bias", *extras])
        out["logits"] = "last token only when labels are passed (token_stats for per-token results)"
    if state.tiled_mlp:
        out["mlp_tile"] = state.mlp_tile if state.mlp_tile is not None else "follows the shard (mlp_tile_for)"
        out["mlp"] = f"{len(state.mlps)} x {type(state.mlps[0]).__name__}"
    if state.checkpoint != "none":
        out["layers"] = f"{len(state.layers)} x {type(state.layers[0]).__name__}"
    if state.checkpoint == "offload":
        out["offload"] = state.offload
    return out
