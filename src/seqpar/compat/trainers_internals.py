"""accelerate's and TRL's private names seqpar touches (see :mod:`seqpar.compat`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# accelerate
# ---------------------------------------------------------------------------------------------


def split_prepared_loader(loader: Any, num: int, index: int) -> bool:
    """Make an accelerate-prepared DataLoader hand out share ``index`` of ``num`` instead of this
    process's share of all processes, by setting its ``BatchSamplerShard`` (map-style data) or
    ``IterableDatasetShard`` (iterable data) ``num_processes`` / ``process_index`` -- the knob
    transformers' Trainer itself turns for its BatchRebalanceSampler. ``num == 1``: one reader of
    the whole set, no batches repeated to even out the processes. Returns False (and changes
    nothing) for a loader without either."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

    sampler = getattr(loader, "batch_sampler", None)
    if isinstance(sampler, BatchSamplerShard):
        sampler.num_processes, sampler.process_index = num, index
        sampler.even_batches = sampler.even_batches and num > 1
        return True
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDatasetShard):
        dataset.num_processes, dataset.process_index = num, index
        return True
    return False


def float64_loss_log(trainer: Any, step_loss: Tensor) -> Tensor:
    """The value to return from ``training_step`` so that the Trainer's running loss sum
    (``_tr_loss``: reset by ``train()``, ``+=`` each step, averaged over every process at logging)
    holds what a float32 sum holds in the script without seqpar, and its mean over SP copies is exact.

    The sum is made float64 (a float32 mean of equal copies, ``(3 y) / 3``, can move by an ulp); the
    step adds ``fl32(acc + loss) - acc``, so the float64 sum stays the float32 sum the plain script
    keeps (float32 += a float64 loss rounds too)."""
    acc = getattr(trainer, "_tr_loss", None)
    if not isinstance(acc, Tensor):
        return step_loss
    if acc.dtype != torch.float64:
        acc = trainer._tr_loss = acc.to(torch.float64)
    total = (acc + step_loss.detach().to(torch.float64)).to(torch.float32).to(torch.float64)
    return total - acc


TRL_GATHER_MODULES = ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer")
"""TRL's generation trainers' modules that import accelerate's ``gather`` / ``gather_object`` as globals."""


@contextlib.contextmanager
def trl_generation_gathers(module_name: str, gather: Callable[[Any], Any],
                           gather_object: Callable[[Any], Any]) -> Iterator[None]:
    """For the block, TRL's GRPO or RLOO module (``module_name``, one of :data:`TRL_GATHER_MODULES`)
    calls ``gather`` / ``gather_object`` in place of accelerate's (it imports them as module globals:
    its reward gather, its completion logs); restored after."""
    import importlib

    if module_name not in TRL_GATHER_MODULES:
        raise ValueError(f"{module_name} is not one of TRL's generation trainer modules {TRL_GATHER_MODULES}")
    module = importlib.import_module(module_name)
    old = module.gather, module.gather_object
    module.gather, module.gather_object = gather, gather_object
    try:
        yield
    finally:
        module.gather, module.gather_object = old
