"""Vision-language models with images, sequence-parallel against themselves unsharded.

For each family of the VLM zoo (:mod:`.vlm_zoo`): the tiny float64 model, its processor-like batch
(two rows, 1-2 images each, a video where taken, a padded row), the unsharded loss and every
gradient, vision tower included (:func:`~seqpar.testing.vlm_zoo.vlm_reference`); then, for each
strategy, :func:`seqpar.testing.model_parity.compare_models` runs the same batch through
``parallelize`` + ``shard_batch`` + ``sync_gradients``. Outcomes as in the causal-LM zoo: ``exact``,
``refused`` (seqpar raised ValueError on every rank: a mechanism it does not run), ``mismatch``
(silently wrong: a bug), ``crashed`` (any other exception: a bug), or the unsharded status of
:func:`~seqpar.testing.vlm_zoo.run_unsharded` when the family cannot run at all.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..comm.collectives import split_sizes
from ..comm.mesh import axis_group, init_mesh
from ..errors import Refused
from .model_parity import compare_models
from .vlm_inputs import vlm_batch
from .vlm_zoo import build_tiny_vlm, run_unsharded, vlm_reference
from .zoo import agreed_outcome


@dataclass(frozen=True)
class VlmParityRow:
    """One family under one strategy at one SP size."""

    family: str
    strategy: str
    p: int
    outcome: str
    detail: str = ""
    loss_diff: float = 0.0
    grad_max: float = 0.0
    straddling: int = 0  # images whose placeholder tokens cross a shard boundary


def placeholder_runs(model: nn.Module, batch: dict[str, Tensor]) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every run of image / video placeholder tokens in the batch."""
    ids = batch["input_ids"]
    tokens = {getattr(model.config, f"{m}_token_id", None) for m in ("image", "video")} - {None}
    is_mm = torch.zeros_like(ids, dtype=torch.bool)
    for t in tokens:
        is_mm |= ids == t
    runs = []
    for row in range(ids.shape[0]):
        flags = is_mm[row].tolist() + [False]
        start = None
        for i, f in enumerate(flags):
            if f and start is None:
                start = i
            elif not f and start is not None:
                runs.append((row, start, i))
                start = None
    return runs


def straddling(runs: list[tuple[int, int, int]], seq: int, p: int) -> int:
    """How many runs cross a boundary of the contiguous layout at ``p`` ranks."""
    bounds, acc = [], 0
    for n in split_sizes(seq, p)[:-1]:
        acc += n
        bounds.append(acc)
    return sum(any(a < b < e for b in bounds) for _, a, e in runs)


def _straddling_batch(model: nn.Module, p: int) -> dict[str, Tensor]:
    """The family's batch, its images moved (more leading text) until one crosses a shard
    boundary at ``p`` ranks, if any placement does within a few tokens."""
    for lead in range(8):
        batch = vlm_batch(model, lead=lead)
        if p == 1 or straddling(placeholder_runs(model, batch), batch["input_ids"].shape[1], p):
            return batch
    return vlm_batch(model)


def vlm_family_parity(family: str, mesh: DeviceMesh, strategies: tuple[str, ...]) -> list[VlmParityRow]:
    """Every strategy of one family on this rank, collective over ``mesh``."""
    group = axis_group(mesh, "sp")
    p = dist.get_world_size(group)
    try:
        model = build_tiny_vlm(family)
        batch = _straddling_batch(model, p)
        ref = vlm_reference(model, batch)
    except Exception:  # not runnable without seqpar: its own status, measured alone
        status = run_unsharded(family)
        return [VlmParityRow(family, "-", p, status.status, status.detail)]
    runs = placeholder_runs(model, batch)
    rows = []
    for strategy in strategies:
        outcome, detail, loss_diff, grad_max = "exact", "", 0.0, 0.0
        try:
            r = compare_models(copy.deepcopy(model), batch, mesh, strategy=strategy, reference=ref)
            loss_diff, grad_max = r["loss_diff"], r["grad_max"]
            if not r["ok"]:
                outcome, detail = "mismatch", f"worst {r['worst_param']}"
        except Refused as e:
            outcome, detail = "refused", str(e)
        except ValueError as e:
            outcome, detail = "refused", f"(a ValueError, not a Refused) {e}"
        except Exception as e:
            outcome, detail = "crashed", f"{type(e).__name__}: {e}"
        outcome, detail = agreed_outcome(outcome, detail, group)
        rows.append(VlmParityRow(family, strategy, p, outcome, detail[:2000], loss_diff, grad_max,
                                 straddling(runs, batch["input_ids"].shape[1], p)))
    return rows


def run_vlm_parity(rank: int, world: int, families: list[str],
                   strategies: tuple[str, ...] = ("ulysses", "ring")) -> list[VlmParityRow]:
    """The families on ``world`` ranks (SP size = world); returns this rank's rows."""
    torch.set_num_threads(1)
    mesh = init_mesh(sp=world, device_type="cpu")
    rows = []
    for family in families:
        rows.extend(vlm_family_parity(family, mesh, strategies))
    return rows
