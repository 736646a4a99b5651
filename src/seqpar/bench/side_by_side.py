"""seqpar and ALST (:mod:`.alst`) side by side on the same model, row and machine: seqpar's step on
ALST's row for the peak probes, and both systems' loss and gradients against the unsharded model
(:func:`exactness_worker`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .alst import lm_row, model_vocab
from .case import BenchCase


def seqpar_peak_worker(rank: int, world: int, case: BenchCase, cap_bytes: int | None, live: bool | str = False
                       ) -> dict[str, Any]:
    """seqpar's step (:func:`seqpar.bench.peak.step_peak`: the case's strategy and memory switches) on
    the row ALST trains on (:func:`.alst.lm_row`), on one of ``world`` fresh local processes."""
    from .build import mesh_for
    from .peak import step_peak

    row = lm_row(case.seq_len, model_vocab(case), case.seed)
    return step_peak(case, mesh_for(case, "cpu"), cap_bytes, live, batch=row)


def seqpar_cuda_worker(rank: int, world: int, case: BenchCase, cap_bytes: int | None, live: bool | str = False
                       ) -> dict[str, Any]:
    """seqpar on this process's GPU at P = 1: the model with ``reduce_memory`` (no mesh: nothing to
    shard) and AdamW, its step's allocator peak (:func:`seqpar.bench.peak.measured_cuda_step`)."""
    import seqpar

    from .alst import case_model, warm_config
    from .build import adamw
    from .peak import measured_cuda_step

    if world != 1:
        raise ValueError(f"the GPU row runs one process per GPU (P = 1), got {world}")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    row = lm_row(case.seq_len, model_vocab(case), case.seed)

    def build(c: BenchCase) -> tuple[Any, Any]:
        model = seqpar.reduce_memory(case_model(c, device), **c.switches.kwargs())
        opt = adamw(model)
        one_step(model, opt, lm_row(16, model.config.vocab_size, c.seed + 1))
        return model, opt

    def one_step(model: Any, opt: Any, batch: dict[str, torch.Tensor]) -> None:
        model(**{k: v.to(device) for k, v in batch.items()}).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    from dataclasses import replace

    return measured_cuda_step(lambda: build(replace(case, model_config=warm_config(case))), lambda: build(case),
                              lambda built: one_step(*built, row), device)


def _reference(case: BenchCase, row: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsharded model's loss (the mean cross entropy of every next token, computed in the model's
    dtype from its logits) and every parameter's gradient."""
    from .alst import case_model

    model = case_model(case, torch.device("cpu"))
    logits = model(input_ids=row["input_ids"], position_ids=row["position_ids"]).logits  # [1, S, V]
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], row["labels"][0, 1:])  # in the logits' dtype
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _errors(loss: torch.Tensor, model: Any, ref_loss: torch.Tensor, ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``loss_err``, ``grad_err`` (the largest absolute gradient difference), ``grad_max`` (the largest
    reference gradient), ``worst`` (the parameter with the largest difference) and ``scale`` (its
    gradient's norm over the reference's: 1 where only rounding differs)."""
    grads = dict(model.named_parameters())
    errs = {n: float((grads[n].grad - g).abs().max()) for n, g in ref.items()}
    worst = max(errs, key=errs.__getitem__)
    scale = float(grads[worst].grad.norm() / ref[worst].norm().clamp(min=1e-300))
    return {"loss": float(ref_loss), "loss_err": abs(float(loss) - float(ref_loss)), "grad_err": errs[worst],
            "grad_max": max(float(g.abs().max()) for g in ref.values()), "worst": worst, "scale": scale}


def exactness_worker(rank: int, world: int, case: BenchCase, with_alst: bool) -> dict[str, dict[str, Any]]:
    """One forward + backward of ``case`` (its dtype: float64 for the check) through the unsharded model,
    seqpar (``parallelize`` + ``reduce_memory`` with the case's switches) and, with ``with_alst``,
    ALST; each system's ``loss_err`` (absolute) and ``grad_err`` (the largest absolute difference of
    any parameter's gradient, beside ``grad_max``, the largest reference gradient). ALST runs last:
    its registration changes the process's attention and MLP classes."""
    import seqpar

    from . import alst
    from .build import mesh_for

    row = lm_row(case.seq_len, model_vocab(case), case.seed)
    ref_loss, ref = _reference(case, row)
    mesh = mesh_for(case, "cpu")
    model = alst.case_model(case, torch.device("cpu"))
    seqpar.parallelize(model, mesh, strategy=case.strategy)
    seqpar.reduce_memory(model, mesh, **case.switches.kwargs())
    local = seqpar.shard_batch({k: row[k] for k in ("input_ids", "labels", "position_ids")}, mesh)
    loss = model(**local).loss
    loss.backward()
    seqpar.sync_gradients(model, mesh)
    out = {"seqpar": _errors(loss, model, ref_loss, ref)}
    if with_alst:
        model = alst.case_model(case, torch.device("cpu"))
        built = alst.assemble(model, alst.register(model, world), torch.device("cpu"))
        loss = alst.forward_backward(built, alst.loader_batch(built, row))
        out["alst"] = _errors(loss, model, ref_loss, ref)
    dist.barrier()
    return out
