"""Measured per-rank memory of one training step on an N-D layout (tp x sp x dp), for the planner's
memory model (:func:`seqpar.planner.memory.step_memory`) to be held against.

On every rank: a Llama-shaped model (float32 or bfloat16) built from a config, parallelized over the layout's mesh
(tensor parallelism by the model's plan, then the strategy over sp), optionally with the memory
switches and FSDP2, AdamW, one warm step (the optimizer states exist), then one step under the
deterministic live-tensor probe (:class:`.memory.LiveMemory`). The rank's peak is what it held
before the step -- the local shards of the weights and the AdamW states, counted storage by storage
-- plus the probe's peak above that during the forward and the backward (FSDP2's reduce-scatters
included)::

    measured = weights + optimizer states (before the step)  +  peak live bytes of forward + backward
             = what step_memory's ``total`` estimates (weights + optimizer + gradients + activations)

What follows the backward is measured apart, as the memory model leaves it out: ``sync`` (the
flat per-dtype buffers :func:`seqpar.sync_gradients` all-reduces, about twice the gradients, once the
activations are gone) and ``optimizer_step`` (AdamW's temporaries above the gradients).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..batch.loss import sync_gradients
from ..batch.sharding import shard_batch
from ..comm.mesh import init_mesh
from ..integrations.distributed.fsdp import apply_fsdp
from ..integrations.hf.parallelize import parallelize
from ..integrations.memory.switches import reduce_memory
from ..integrations.models import build_model
from ..planner.memory import MemorySwitches
from .memory import LiveMemory


@dataclass(frozen=True)
class Layout:
    """One measured layout: ``init_mesh`` keyword arguments, the strategy, the memory switches, and
    whether FSDP2 shards the model over dp x sp (else :func:`seqpar.sync_gradients`)."""

    mesh: tuple[tuple[str, int], ...]
    strategy: str = "ulysses"
    switches: MemorySwitches = field(default_factory=MemorySwitches)
    fsdp: bool = False
    dtype: str = "float32"  # "float32" or "bfloat16" (the model's dtype; AdamW states in it too)

    @property
    def label(self) -> str:
        parts = [f"{k}{v}" for k, v in self.mesh]
        return (" x ".join(parts) + f" {self.strategy} switches={self.switches.label}" + " fsdp" * self.fsdp
                + f" {self.dtype}")


def _storage_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if type(t).__name__ == "DTensor" else t
        storage = local.untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def _backward(model: nn.Module, mesh: Any, batch: dict[str, Tensor], layout: Layout) -> None:
    """Forward and backward of one step (FSDP2's reduce-scatters inside; the sync and AdamW apart)."""
    local = shard_batch(batch, mesh, layout="contiguous" if layout.strategy == "ulysses" else "zigzag")
    model(**local).loss.backward()


def _sync(model: nn.Module, mesh: Any, layout: Layout) -> None:
    if not layout.fsdp:
        sync_gradients(model, mesh)


def _batch(seq: int, vocab: int, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def measure_layouts(rank: int, world: int, config: dict[str, int], seq: int, layouts: list[Layout]
                    ) -> list[dict[str, int]]:
    """Every layout on this rank (a float32 or bfloat16 tiny-llama of ``config``, ``seq`` tokens):
    ``{"before": bytes held before the step, "step": peak bytes of the
    step above them}`` (module doc). Every rank calls it with the same arguments."""
    torch.set_num_threads(1)
    out = []
    for layout in layouts:
        mesh = init_mesh(device_type="cpu", **dict(layout.mesh))
        torch.manual_seed(0)
        model, _ = build_model("tiny-llama", dtype=getattr(torch, layout.dtype), **config)
        parallelize(model, mesh, strategy=layout.strategy)
        if layout.switches.any:
            reduce_memory(model, mesh, **layout.switches.kwargs())
        if layout.fsdp:
            apply_fsdp(model, mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _backward(model, mesh, _batch(min(seq, 64), config["vocab_size"], 1), layout)
        _sync(model, mesh, layout)
        opt.step()  # AdamW states now exist
        opt.zero_grad(set_to_none=True)
        batch = _batch(seq, config["vocab_size"], 2)
        gc.collect()
        before = _storage_bytes(list(model.parameters()) + [t for st in opt.state.values() for t in st.values()
                                                            if isinstance(t, Tensor) and t.dim() > 0])
        with LiveMemory() as probe:
            _backward(model, mesh, batch, layout)
        gc.collect()
        with LiveMemory() as sync:  # sync_gradients' flat buffers beside the gradients (not in the model)
            _sync(model, mesh, layout)
        with LiveMemory() as update:  # AdamW's step: its temporaries beside the gradients (not in the model)
            opt.step()
        opt.zero_grad(set_to_none=True)
        out.append({"before": before, "step": probe.peak_bytes, "sync": sync.peak_bytes,
                    "optimizer_step": update.peak_bytes})
        del model, opt
        gc.collect()
    return out
