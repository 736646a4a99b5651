"""The per-module pieces of :func:`seqpar.reduce_memory`: a per-token MLP run in sequence tiles, and a
decoder layer checkpointed (optionally with its input parked in host memory).

Both are installed as an instance ``forward``: a small callable object holding the module, its tile
or offload flag and the model's :class:`TileContext` (nothing else is set on the module). The
model's parameter names, ``state_dict`` and FSDP2's per-layer hooks stay as they are; a deep copy of
the model copies the object with it, bound to the copy's module and the copy's context; deleting
the instance attribute (:func:`untile`) restores the class's forward.

Tiled MLP (one autograd Function: "tiles without grad in forward, each tile recomputed with grad
in backward")::

    x    # [B, S_local, H]
    forward:  y[:, tile] = mlp(x[:, tile])  for n tiles, under no_grad: only x is saved
    backward: per tile, y_t = mlp(x[:, tile]) again with grad, autograd.grad(y_t, (x_t, params), g_t)
              -> one tile's intermediates ([B, T, 3.5 H] for a gated MLP) alive at a time

The tile count ``n = ceil(longest local shard / tile)`` is the same on every SP rank (the shard
lengths of the batch are known everywhere), so a rank with a shorter shard runs empty tiles rather
than fewer calls: a module holding a collective never waits on a peer that skipped one. Without a
fixed tile, the tile follows the shard (:func:`seqpar.batch.tiles.mlp_tile_for` of the longest local
shard, so again the same on every rank): ``[B, tile, I]`` stays within the shard's ``[B, S_local, H]``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ...batch.tiles import mlp_tile_for
from ...errors import Refused
from ..state import TileContext

PER_TOKEN_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP", "Gemma3MLP",
                            "CohereMLP", "GraniteMLP", "Olmo2MLP", "Phi3MLP", "FeedForward"})
"""MLP classes accepted for tiling: gated MLPs of linear layers and an activation, token by token
(their forward is ``down(act(gate(x)) * up(x))`` or the fused gate_up form), and diffusers'
``FeedForward`` (an activation module with its projection -- GELU, GEGLU, SwiGLU... --, dropout, the
output projection). MoE blocks are not accepted: their routers feed load-balancing statistics over
the whole sequence."""

def is_per_token_mlp(mlp: nn.Module) -> bool:
    """True for an accepted MLP class (:data:`PER_TOKEN_MLPS`) made of linear layers and a
    parameter-free activation only."""
    if type(mlp).__name__ not in PER_TOKEN_MLPS or next(mlp.buffers(), None) is not None:
        return False
    return all(isinstance(m, nn.Linear) or not any(True for _ in m.parameters(recurse=False))
               for m in mlp.modules() if m is not mlp)


def agreed_tiles(local_len: int, longest: int | None, tile: int) -> int:
    """How many tiles every rank runs: ``ceil(longest shard / tile)`` (at least 1)."""
    return max(1, math.ceil(max(local_len, longest or 0) / tile))


class _TiledMLP(torch.autograd.Function):
    """Forward: the MLP tile by tile without grad, keeping only its input. Backward: each tile
    recomputed with grad and differentiated at once, parameter gradients summed over the tiles --
    the recompute is what keeps a single tile's intermediates alive instead of all of them."""

    @staticmethod
    def forward(ctx, mlp: nn.Module, n: int, tile: int, x: Tensor, *params: Tensor) -> Tensor:
        run = type(mlp).forward
        out = torch.cat([run(mlp, x[:, i * tile:(i + 1) * tile]) for i in range(n)], dim=1)  # [B, S, H]
        ctx.mlp, ctx.n, ctx.tile = mlp, n, tile
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.mlp.parameters()]
        wanted = [p for p in params if p.requires_grad]
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[3] else None
        grads: list[Tensor | None] = [None] * len(wanted)
        run = type(ctx.mlp).forward
        for i in range(ctx.n):
            sl = slice(i * ctx.tile, (i + 1) * ctx.tile)
            with torch.enable_grad():
                xt = x[:, sl].detach().requires_grad_(grad_x is not None)
                yt = run(ctx.mlp, xt)
                inputs = ([xt] if grad_x is not None else []) + wanted
                got = torch.autograd.grad(yt, inputs, grad[:, sl], allow_unused=True) if inputs else ()
            if grad_x is not None:
                grad_x[:, sl] = got[0]
                got = got[1:]
            # summed in place: one [I, H] buffer per weight, not a new sum beside the old one each tile
            grads = [g if acc is None else acc if g is None else acc.add_(g)
                     for acc, g in zip(grads, got, strict=True)]
        by_param = dict(zip(map(id, wanted), grads, strict=True))
        return (None, None, None, grad_x, *(by_param.get(id(p)) for p in params))


def mlp_width(mlp: nn.Module) -> int:
    """The intermediate width ``I`` of an accepted MLP: its down projection's input (the widest
    input of its linear layers, for a class that names it otherwise)."""
    down = getattr(mlp, "down_proj", None)
    if isinstance(down, nn.Linear):
        return down.in_features
    return max(m.in_features for m in mlp.modules() if isinstance(m, nn.Linear))


class _TiledForward:
    """``mlp.forward`` with tiled_mlp: the MLP in the agreed number of sequence tiles, of ``tile``
    tokens, or (``tile`` None) of :func:`~seqpar.batch.tiles.mlp_tile_for` the longest shard."""

    def __init__(self, mlp: nn.Module, tile: int | None, context: TileContext) -> None:
        self.mlp, self.tile, self.context = mlp, tile, context
        self.width = mlp_width(mlp)

    def __call__(self, x: Tensor) -> Tensor:
        mlp = self.mlp
        if x.dim() != 3:
            raise Refused(f"{type(mlp).__name__} got a {x.dim()}-D input; tiled_mlp splits [batch, seq, hidden] "
                          "along the sequence: use tiled_mlp=False for this model")
        longest = max(x.shape[1], self.context.longest or 0)  # the same on every SP rank
        tile = self.tile or mlp_tile_for(longest, x.shape[-1], self.width)
        n = agreed_tiles(x.shape[1], self.context.longest, tile)
        self.context.tiles_run.append(n)
        if not torch.is_grad_enabled():
            run = type(mlp).forward
            return torch.cat([run(mlp, x[:, i * tile:(i + 1) * tile]) for i in range(n)], dim=1)
        return _TiledMLP.apply(mlp, n, tile, x, *mlp.parameters())


def tile_mlp(mlp: nn.Module, tile: int | None, context: TileContext) -> None:
    """Run ``mlp`` in sequence tiles of ``tile`` tokens (None: following the shard; in place;
    :func:`untile` undoes it)."""
    mlp.forward = _TiledForward(mlp, tile, context)


class _ToHost(torch.autograd.Function):
    """Forward: copy the layer's input into pinned host memory (asynchronous on the device's stream).
    Backward: the gradient goes back to the device -- the copy is the identity on values."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.device = x.device
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        return host

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.to(ctx.device, non_blocking=True)


class _CheckpointedForward:
    """``layer.forward`` with checkpoint="layers" / "offload": the layer under a non-reentrant
    checkpoint, its recompute run with the batch's context of the forward."""

    def __init__(self, layer: nn.Module, offload: bool, context: TileContext) -> None:
        self.layer, self.offload, self.context = layer, offload, context

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, context = self.layer, self.context
        run = type(module).forward
        if not torch.is_grad_enabled():
            return run(module, *args, **kwargs)  # nothing is saved for a backward: nothing to checkpoint
        if not args and "hidden_states" in kwargs:
            args, kwargs = (kwargs.pop("hidden_states"),), kwargs
        longest = context.longest  # the recompute runs in the backward, maybe after other batches' forwards
        x = args[0] if args else None  # hidden_states [B, S_local, H]
        park = self.offload and isinstance(x, Tensor) and x.device.type != "cpu"  # the CPU: in host memory already

        def layer(h: Tensor | None, *rest: Any, **kw: Any) -> Any:
            with context.using(longest):
                if h is None:
                    return run(module, **kw)
                return run(module, h.to(x.device, non_blocking=True) if park else h, *rest, **kw)

        if not args:  # every input by keyword: checkpointed all the same, nothing to park
            return checkpoint(lambda **kw: layer(None, **kw), use_reentrant=False, **kwargs)
        # non-reentrant: the recompute repeats the layer's collectives in the same order on every rank
        return checkpoint(layer, _ToHost.apply(x) if park else x, *args[1:], use_reentrant=False, **kwargs)


def checkpoint_layer(layer: nn.Module, offload: bool, context: TileContext) -> None:
    """Checkpoint ``layer`` (non-reentrant); ``offload``: keep its saved input in pinned host memory."""
    layer.forward = _CheckpointedForward(layer, offload, context)


def untile(module: nn.Module) -> None:
    """Undo :func:`tile_mlp` or :func:`checkpoint_layer` on ``module``."""
    if isinstance(module.__dict__.get("forward"), (_TiledForward, _CheckpointedForward)):
        del module.__dict__["forward"]
