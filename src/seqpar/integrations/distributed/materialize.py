"""Sharded initialisation: a model built on the meta device, sharded (FSDP2), then given real weights
-- without any rank holding the whole model.

    with torch.device("meta"):
        model, _ = build_model("small-llama3")       # no memory, no RNG drawn
    seqpar.parallelize(model, mesh)
    seqpar.apply_fsdp(model, mesh)                    # parameters become sharded DTensors (still meta)
    torch.manual_seed(seed)
    materialize(model, device)                        # this rank's shards, initialized

:func:`materialize` runs the model's own initialisation (transformers' ``initialize_weights``: its
``_init_weights`` per module, in its order) on full-size CPU temporaries of one module's own
parameters at a time, and keeps only this rank's shard of each. The weights are therefore the same
bits whatever the sharding (FSDP2 over any number of ranks, or none): those of ``to_empty`` +
``initialize_weights()`` on the whole model after the same ``torch.manual_seed``. A rank's peak is
its shards plus the largest module's own parameters in float32.

:func:`load_full_state_dict` fills a sharded model from a full state dict that only rank 0 holds
(rank 0 reads the checkpoint; each tensor is broadcast in turn and every rank keeps its shard).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ... import compat
from ...errors import Refused


def _local_part(full: Tensor, like: Tensor) -> Tensor:
    """This rank's part of ``full`` for a parameter laid out as ``like`` (a DTensor: its local
    shard, split locally without communication; a plain tensor: all of it)."""
    if hasattr(like, "placements"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return full


def _write(target: Tensor, full: Tensor) -> None:
    local = target.to_local() if hasattr(target, "to_local") else target
    local.copy_(_local_part(full, target))


@contextmanager
def _module_on_temporaries(module: nn.Module, init_dtype: torch.dtype, params: bool) -> Iterator[None]:
    """Give ``module``'s own parameters and buffers full-size CPU tensors (NaN where floating, so a
    value the init never wrote is caught), run the block, then write this rank's part of each back
    into the real (possibly sharded) tensor and restore it. ``params=False``: the parameters'
    temporaries are thrown away (only the buffers are kept)."""
    # assigning to a registered name replaces the parameter / buffer in place (nn.Module.__setattr__)
    saved: list[tuple[bool, str, Tensor]] = []  # (is a parameter, name, the real tensor)
    own = [(False, n, t) for n, t in module.named_buffers(recurse=False, remove_duplicate=False)]
    own += [(True, n, t) for n, t in module.named_parameters(recurse=False, remove_duplicate=False)]
    for is_param, name, real in own:
        dtype = init_dtype if real.is_floating_point() else real.dtype
        temp = torch.empty(tuple(real.shape), dtype=dtype)
        if temp.is_floating_point():
            temp.fill_(float("nan"))
        setattr(module, name, nn.Parameter(temp, requires_grad=real.requires_grad) if is_param else temp)
        saved.append((is_param, name, real))
    try:
        yield
        with torch.no_grad():
            for is_param, name, real in saved:
                if is_param and not params:
                    continue
                full = getattr(module, name)
                if full.is_floating_point() and bool(full.isnan().any()):
                    raise Refused(f"{type(module).__name__}.{name} is not set by the model's own weight "
                                  "initialisation (_init_weights), so it cannot be initialized sharded: build "
                                  "the model unsharded (--fsdp off) or load its weights from a checkpoint")
                _write(real, full.detach())
    finally:
        for _, name, real in saved:
            setattr(module, name, real)


def _pretrained_modules(model: nn.Module) -> list[nn.Module]:
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel)]


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str, *, init_dtype: torch.dtype = torch.float32,
                params: bool = True) -> nn.Module:
    """Allocate a meta-device (optionally FSDP2-sharded) transformers ``model`` on ``device`` and
    initialize it with its own ``initialize_weights``, drawn from the CPU RNG in ``init_dtype``
    (the dtype a model is built in) and cast to each tensor's dtype.

    The result is bit-identical to ``to_empty`` + ``torch.manual_seed(s)`` + ``initialize_weights()``
    on the unsharded model with the same seed, whatever the sharding. ``params=False``: compute the
    buffers only (e.g. RoPE frequencies, before loading the parameters from a checkpoint). Raises
    ValueError for a parameter or buffer the model's init leaves unset.
    """
    pretrained = _pretrained_modules(model)
    if not pretrained:
        raise ValueError(f"{type(model).__name__} is not a transformers PreTrainedModel: materialize needs its "
                         "_init_weights to initialize the weights")
    model.to_empty(device=device)
    compat.mark_uninitialized(model)  # freshly built on meta: nothing is initialized yet

    def wrap(original: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        def init_one(module: nn.Module) -> None:
            if not params and not list(module.buffers(recurse=False)):
                return
            with _module_on_temporaries(module, init_dtype, params):
                original(module)
        return init_one

    with compat.init_weights_override(pretrained, wrap):  # each module's init runs on temporaries
        pretrained[0].initialize_weights()
    return model


def meta_model(path: str, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of the checkpoint directory ``path`` built on the meta device from its config (no
    weights read), as :func:`seqpar.integrations.models.build_model` would load it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra: dict[str, Any] = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype, **extra)


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor] | None) -> None:
    """Load a full (unsharded) state dict that only rank 0 holds into a sharded or plain ``model``
    on every rank (a collective): each tensor is broadcast from rank 0 in turn and every rank keeps
    its shard, so no rank > 0 ever holds the whole model. ``state_dict`` is ignored on ranks > 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = dict(state_dict or {}) if dist.get_rank() == 0 else {}
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
