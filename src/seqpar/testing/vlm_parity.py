"""Vision-language models with images, sequence-parallel against themselves unsharded.

For each family of the VLM zoo (:mod:`.vlm_zoo`): the tiny float64 model, its processor-like batch
(two rows, 1-2 images each, a video where taken, a padded row), the unsharded loss and every
gradient, vision tower included (:func:`~seqpar.testing.vlm_zoo.vlm_reference`); then, for each
strategy, :func:`seqpar.testing.model_parity.compare_models` runs the same batch through
``parallelize`` + ``shard_batch`` + ``sync_gradients``. Outcomes as in the causal-LM zoo: ``exact``,
``exact (float32 model)`` (where the family computes something in float32 itself: :func:`vlm_floor`),
``refused`` (seqpar raised ValueError on every rank: a mechanism it does not run), ``mismatch``
(silently wrong: a bug), ``crashed`` (any other exception: a bug), or the unsharded status of
:func:`~seqpar.testing.vlm_zoo.run_unsharded` when the family cannot run at all.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch.visual import ROUTED_KEYS
from ..comm.collectives import split_sizes
from ..comm.mesh import axis_group, init_mesh
from ..errors import Refused
from ..integrations.vlm.families import frames_apart, per_row
from ..integrations.vlm.features import encoder_rows
from ..integrations.vlm.routing import merge_inputs, units
from .model_parity import FLOAT64_NOISE, Floor, compare_models, precision_floor
from .scans64 import float64_scans
from .vlm_inputs import vlm_batch
from .vlm_zoo import build_tiny_vlm, run_unsharded, vlm_reference
from .zoo import ZooVerdict, agreed_outcome


@dataclass(frozen=True, kw_only=True)
class VlmParityRow(ZooVerdict):
    """One family under one strategy at one SP size."""

    family: str
    strategy: str
    p: int
    f32_rel: float = 0.0  # worst relative difference of a float32-accurate parameter (exact (float32 model))
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


def vision_floor(model: nn.Module, batch: dict[str, Tensor]) -> frozenset[str]:
    """Vision-side parameters whose gradient is float32-accurate only: the same weighted sum of
    every feature row, from the images encoded all at once and one unit at a time (as the SP
    ranks encode them), differs by more than float64 rounding (a float32 interpolation of position
    embeddings, a float32 norm inside the tower)."""
    work = units({k: batch[k] for k in ROUTED_KEYS if k in batch}, frames_apart(model), per_row(model))
    grads = []
    for groups in ([work], [[u] for u in work]):
        model.zero_grad(set_to_none=True)
        offsets = {}
        for group in groups:
            for modality, inputs in merge_inputs(group).items():
                rows, _ = encoder_rows(model, modality, inputs)  # [n, E]
                start = offsets.get(modality, 0)
                offsets[modality] = start + rows.shape[0]
                g = torch.Generator().manual_seed(7 + len(modality))
                w = torch.randn(start + rows.shape[0], rows.shape[1], generator=g, dtype=rows.dtype)[start:]
                (rows * w).sum().backward()
        grads.append({n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None})
    model.zero_grad(set_to_none=True)
    whole, parts = grads
    return frozenset(n for n in whole if n in parts and float((whole[n] - parts[n]).abs().max())
                     > max(FLOAT64_NOISE * float(whole[n].abs().max()), 1e-14))


def vlm_floor(model: nn.Module, batch: dict[str, Tensor]) -> Floor:
    """Where the family is float32-accurate only by its own code (see :class:`~seqpar.testing.
    model_parity.Floor`): the language model's float32 sums measured on the text (precision_floor,
    rows regrouped), the vision tower's by :func:`vision_floor`."""
    text = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    try:
        floor = precision_floor(model, text)
    except Exception:  # a family that cannot run its placeholders without pixels: measured on images only
        floor = Floor()
    return floor | Floor(params=vision_floor(model, batch))


def _straddling_batch(model: nn.Module, p: int) -> dict[str, Tensor]:
    """The family's batch, its images moved (more leading text) until one crosses a shard
    boundary at ``p`` ranks, if any placement does within a few tokens."""
    for lead in range(8):
        batch = vlm_batch(model, lead=lead)
        if p == 1 or straddling(placeholder_runs(model, batch), batch["input_ids"].shape[1], p):
            return batch
    return vlm_batch(model)


def vlm_family_parity(family: str, mesh: DeviceMesh, strategies: tuple[str, ...],
                      build: Callable[[str], nn.Module] | None = None) -> list[VlmParityRow]:
    """Every strategy of one family on this rank, collective over ``mesh``. ``build``: the float64
    model from ``family`` (default: the zoo's tiny model of that model_type; ``seqpar verify
    --model DIR`` passes a checkpoint loader and the directory)."""
    group = axis_group(mesh, "sp")
    p = dist.get_world_size(group)
    with contextlib.ExitStack() as scans:
        try:
            model = (build or build_tiny_vlm)(family)
            # recurrent mixers (state passing) scan in float64 on both sides, as in the text zoo
            scans.enter_context(float64_scans(model))
            batch = _straddling_batch(model, p)
            ref = vlm_reference(model, batch, loss_scale=p)  # seqpar's loss scale (exact for a power of 2)
            floor = vlm_floor(model, batch)
        except Exception as e:  # not runnable without seqpar: its own status, measured alone
            if build is not None:
                return [VlmParityRow("fails", f"{type(e).__name__}: {e}", family=family, strategy="-", p=p)]
            status = run_unsharded(family)
            return [VlmParityRow(status.status, status.detail, family=family, strategy="-", p=p)]
        runs = placeholder_runs(model, batch)
        rows = []
        for strategy in strategies:
            outcome = "exact (float32 model)" if floor else "exact"
            detail, loss_diff, grad_max, f32_rel = "", 0., 0., 0.
            try:
                r = compare_models(copy.deepcopy(model), batch, mesh, strategy=strategy, reference=ref, floor=floor)
                loss_diff, grad_max, f32_rel = r["loss_diff"], r["grad_max"], r["f32_rel"]
                if not r["ok"]:
                    outcome, detail = "mismatch", f"worst {r['worst_param']}"
            except Refused as e:
                outcome, detail = "refused", str(e)
            except ValueError as e:
                outcome, detail = "refused", f"(a ValueError, not a Refused) {e}"
            except Exception as e:
                outcome, detail = "crashed", f"{type(e).__name__}: {e}"
            outcome, detail = agreed_outcome(outcome, detail, group)
            rows.append(VlmParityRow(outcome, detail[:2000], loss_diff, grad_max, family=family, strategy=strategy,
                                     p=p, f32_rel=f32_rel,
                                     straddling=straddling(runs, batch["input_ids"].shape[1], p)))
        return rows


def run_vlm_parity(rank: int, world: int, families: list[str],
                   strategies: tuple[str, ...] = ("ulysses", "ring"),
                   build: Callable[[str], nn.Module] | None = None) -> list[VlmParityRow]:
    """The families on ``world`` ranks (SP size = world); returns this rank's rows. ``build``:
    as in :func:`vlm_family_parity` (a module-level function: it travels to the processes)."""
    torch.set_num_threads(1)
    mesh = init_mesh(sp=world, device_type="cpu")
    rows = []
    for family in families:
        rows.extend(vlm_family_parity(family, mesh, strategies, build))
    return rows
