"""A case's pieces: its model (built, parallelized, the memory switches on) and AdamW, its batch, the
layout its strategy trains with, its mesh, and one training step (forward, backward, gradient sync,
AdamW)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .case import BenchCase, model_fields


def build(case: BenchCase, mesh: Any, device: torch.device) -> tuple[Any, Any]:
    """``(model, AdamW)`` for ``case``: its built-in model on ``device``, parallelized over ``mesh``
    with its strategy, its memory switches on."""
    import seqpar
    from seqpar.integrations.models import build_model
    from seqpar.train.config import DTYPES

    torch.manual_seed(case.seed)
    model, _ = build_model(case.model, dtype=DTYPES[case.dtype], **model_fields(case))
    model.to(device)
    seqpar.parallelize(model, mesh, strategy=case.strategy)
    if case.switches.any:
        reduce_memory = getattr(seqpar, "reduce_memory", None)
        if reduce_memory is None:
            raise ValueError("this seqpar has no reduce_memory: run without the memory switches")
        reduce_memory(model, mesh, **case.switches.kwargs())
    return model, adamw(model)


def adamw(model: Any) -> torch.optim.Optimizer:
    """The bench's optimizer, the same for every system it measures: AdamW, fused (one in-place update
    per parameter; the loop implementation makes two temporaries of a parameter's size, which were a
    short step's peak -- ALST's recipe uses DeepSpeed's fused / CPU Adam, in place as well)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def prepare(case: BenchCase, mesh: Any, device: torch.device) -> tuple[Any, Any]:
    """``(model, optimizer)`` for ``case``, after one small step: gradients and AdamW states exist."""
    from seqpar.train.demo_data import CopyTask

    model, opt = build(case, mesh, device)
    warm = CopyTask(max(CopyTask.min_seq_len, 4 * case.nproc)).row(0)
    train_step(model, opt, mesh, {k: v[None].to(device) for k, v in warm.items()}, layout_for(case.strategy))
    return model, opt


def train_step(model: Any, opt: Any, mesh: Any, batch: dict[str, torch.Tensor], layout: str) -> None:
    """One training step on the full batch: sharded over ``mesh``, forward, backward, gradient sync, AdamW."""
    import seqpar

    local = seqpar.shard_batch(batch, mesh, layout=layout)
    model(**local).loss.backward()
    seqpar.sync_gradients(model, mesh)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench_batch(seq_len: int, doc_len: int = 0, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row (``[1, seq_len]`` tensors) of the copy task; with ``doc_len`` its ``position_ids``
    restart every ``doc_len`` tokens, so :func:`seqpar.shard_batch` sees packed documents."""
    from seqpar.train.demo_data import CopyTask

    batch = {k: v[None] for k, v in CopyTask(seq_len, seed).row(0).items()}
    if doc_len:
        batch["position_ids"] = (torch.arange(seq_len) % doc_len)[None]  # [1, S]
    return batch


def layout_for(strategy: str) -> str:
    """The layout a strategy trains with (as ``seqpar train``): doc-zigzag balances a ring's causal
    work per packed document, Ulysses needs none."""
    return "contiguous" if strategy == "ulysses" else "doc-zigzag"


def mesh_for(case: BenchCase, device_type: str) -> Any:
    """The mesh a case runs on: ``sp = nproc`` (hybrid: split into ulysses x ring), the rest dp."""
    import seqpar

    kw: dict[str, int] = {"sp": case.nproc, "dp": dist.get_world_size() // case.nproc}
    if case.strategy == "hybrid":
        from seqpar.integrations.models import builtin_config
        from seqpar.planner import hybrid_split

        heads = builtin_config(case.model, **model_fields(case)).num_attention_heads
        kw["ulysses"], kw["ring"] = hybrid_split(case.nproc, heads)
    return seqpar.init_mesh(**kw, device_type=device_type)
