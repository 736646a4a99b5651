"""The model half of the seeded fuzz (:mod:`seqpar.testing.fuzz`): a float64 tiny-llama under
``parallelize`` + ``shard_batch`` on a drawn full batch, against the same model unsharded.

The batch follows the rules the reference needs to agree with seqpar's target rules
(:mod:`seqpar.batch.targets`) by a plain shift: labels are the ignore index at padding, at the first
real token after padding and at every document start. The reference runs each real, same-document
run of tokens of each row as its own sequence (its own position ids), so it does not depend on
transformers' handling of padding masks (an all-padding row) or packing.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch.targets import IGNORE_INDEX
from .fuzz_cases import FuzzCase, Outcome
from .model_parity import ModelCase, compare_models, make_model, precision_floor

ODD_DOC_RATE = 0.2  # a new packed document at about one token in five


def _keep(mask: str, b: int, s: int, g: torch.Generator) -> Tensor:
    """``[B, S]`` bool: real tokens under padding ``mask`` (right, left, or an all-padding first row)."""
    keep = torch.ones(b, s, dtype=torch.bool)
    if mask not in ("right", "left", "empty-row"):
        return keep
    for row in range(b):
        n = int(torch.randint(0, s + 1, (1,), generator=g))
        if mask == "empty-row" and row == 0:
            n = s
        if mask == "left" or (mask == "empty-row" and row % 2):
            keep[row, :n] = False
        else:
            keep[row, s - n:] = False
    return keep


def _positions(mask: str, b: int, s: int, g: torch.Generator) -> Tensor:
    """``[B, S]`` position ids: restarting at 0 at random document starts for packed rows."""
    if mask not in ("packed", "cu_seqlens"):
        return torch.arange(s).expand(b, s).clone()
    starts = torch.rand(b, s, generator=g) < ODD_DOC_RATE
    starts[:, 0] = True
    pos = torch.empty(b, s, dtype=torch.long)
    for row in range(b):
        last = 0
        for i in range(s):
            last = i if starts[row, i] else last
            pos[row, i] = i - last
    return pos


def fuzz_batch(case: FuzzCase, vocab: int, rank: int) -> tuple[dict[str, Tensor], float | None]:
    """``(full batch, num_items_in_batch or None)`` of a model case as ``rank`` sees it (the case's
    ``odd_rank`` gets its ``odd`` disagreement)."""
    g = torch.Generator().manual_seed(case.seed)
    b, s = case.batch, case.seq
    ids = torch.randint(0, vocab, (b, s), generator=g)
    keep = _keep(case.mask, b, s, g)
    pos = _positions(case.mask, b, s, g)
    labels = ids.clone()
    first_real = keep & ~torch.cat([torch.zeros(b, 1, dtype=torch.bool), keep[:, :-1]], dim=1)
    labels[~keep | first_real | (pos == 0)] = IGNORE_INDEX
    if case.labels == "ignored":
        labels[:] = IGNORE_INDEX
    batch: dict[str, Tensor] = {"input_ids": ids, "labels": labels}
    if case.mask in ("right", "left", "empty-row"):
        batch["attention_mask"] = keep.long()
    elif case.mask == "packed":
        batch["position_ids"] = pos
    elif case.mask == "cu_seqlens":  # DataCollatorWithFlattening's keys: offsets in the flattened [B * S]
        flat = (pos.reshape(-1) == 0).nonzero().flatten()
        cu = torch.cat([flat, torch.tensor([b * s])]).to(torch.int32)
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
        batch["max_length_q"] = batch["max_length_k"] = int(torch.diff(cu).max())
    count = int((labels[:, 1:] != IGNORE_INDEX).sum())
    items = float(count) if count and torch.rand((), generator=g) < 0.5 else None
    if case.labels == "short":
        batch["labels"] = labels[:, :-1]
    odd = case.odd if rank == case.odd_rank else None
    if odd == "ids":
        batch["input_ids"] = ids.clone()
        batch["input_ids"][0, 0] = (ids[0, 0] + 1) % vocab
    elif odd == "seq":
        batch = {k: v[:, :-1] if isinstance(v, Tensor) and v.dim() == 2 else v for k, v in batch.items()}
    elif odd == "mask-given":
        if "attention_mask" in batch:
            del batch["attention_mask"]
        else:
            batch["attention_mask"] = torch.ones(b, s, dtype=torch.long)
    elif odd == "items":
        items = float(count + 1)
    elif odd == "labels":
        batch["labels"] = batch["labels"].clone()
        batch["labels"][0, -1] = 0 if int(batch["labels"][0, -1]) == IGNORE_INDEX else IGNORE_INDEX
    return batch, items


def _runs(keep: Tensor, pos: Tensor) -> list[tuple[int, int]]:
    """The ``[a, b)`` runs of one row's real tokens that belong to one document."""
    out, start = [], None
    for i in range(keep.numel()):
        new_doc = i > 0 and int(pos[i]) != int(pos[i - 1]) + 1
        if start is not None and (not keep[i] or new_doc):
            out.append((start, i))
            start = None
        if keep[i] and start is None:
            start = i
    if start is not None:
        out.append((start, keep.numel()))
    return out


def fuzz_reference(model: nn.Module, batch: dict[str, Tensor] | None, scale: int
                   ) -> tuple[float, dict[str, Tensor | None]]:
    """The unsharded token-mean loss of ``batch`` and every gradient, back-propagated at ``scale``
    (the SP size, as :func:`seqpar.testing.model_parity.reference_grads`); a batch without targets
    has loss 0 and no gradient. ``batch`` None (bad input: no reference exists): a NaN loss."""
    if batch is None:
        return float("nan"), {n: None for n, _ in model.named_parameters()}
    ids, labels = batch["input_ids"], batch["labels"]
    b, s = ids.shape
    keep = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones(b, s, dtype=torch.bool)
    if "position_ids" in batch:
        pos = batch["position_ids"].expand(b, s)
    elif "cu_seq_lens_q" in batch:
        flat = torch.arange(b * s)
        cu = batch["cu_seq_lens_q"].long()
        pos = (flat - cu[torch.searchsorted(cu, flat, right=True) - 1]).view(b, s)
    else:
        pos = torch.arange(s).expand(b, s)
    model.zero_grad(set_to_none=True)
    total, n = torch.zeros((), dtype=torch.float64), 0
    for row in range(b):
        for a, e in _runs(keep[row], pos[row]):
            logits = model(input_ids=ids[row:row + 1, a:e], position_ids=pos[row:row + 1, a:e], use_cache=False).logits
            targets = labels[row, a + 1:e]
            total = total + F.cross_entropy(logits[0, :-1], targets, ignore_index=IGNORE_INDEX, reduction="sum")
            n += int((targets != IGNORE_INDEX).sum())
    if n == 0:
        return 0.0, {name: None for name, _ in model.named_parameters()}
    (total / n * scale).backward()
    grads = {name: None if p.grad is None else p.grad / scale for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(total.detach()) / n, grads

_MODELS: dict[tuple[int, int], tuple] = {}


def _model(heads: int, kv_heads: int) -> tuple:
    """``(float64 tiny-llama, its precision floor)`` for a head count, built once per process."""
    if (heads, kv_heads) not in _MODELS:
        model = make_model(ModelCase(heads=heads, kv_heads=kv_heads))
        vocab = model.config.vocab_size
        packed = fuzz_batch(FuzzCase(0, 1, "model", "ulysses", 2, 17, heads, kv_heads, 8, True, None, "packed",
                                     "float64", "contiguous", "ok", None, 0), vocab, 0)[0]
        _MODELS[(heads, kv_heads)] = (model, precision_floor(model, packed))
    return _MODELS[(heads, kv_heads)]


def run_model(case: FuzzCase, meshes: dict[str, DeviceMesh]) -> Outcome:
    """A float64 tiny-llama under ``parallelize`` + ``shard_batch`` against the same model unsharded."""
    rank = dist.get_rank()
    model, floor = _model(case.heads, case.kv_heads)
    vocab = model.config.vocab_size
    batch, items = fuzz_batch(case, vocab, rank)
    layout = case.layout
    if case.odd == "layout" and rank == case.odd_rank:
        layout = "zigzag" if layout != "zigzag" else "contiguous"
    strategy = case.strategy
    if case.odd == "strategy" and rank == case.odd_rank:
        strategy = "ring" if strategy == "ulysses" else "ulysses"
    mesh = meshes["hybrid" if case.strategy == "hybrid" else "flat"]  # one mesh for all: the majority's
    reference = fuzz_reference(model, batch if case.invalid is None else None, case.world)
    row = compare_models(copy.deepcopy(model), batch, mesh, strategy=strategy, reference=reference, floor=floor,
                         layout=layout, num_items=items)
    if case.invalid is not None:
        return Outcome("inexact", f"rank {rank} ran through {case.invalid}")
    return Outcome("exact" if row["ok"] else "inexact",
                   f"loss diff {row['loss_diff']:.3g}, grad diff {row['grad_max']:.3g} ({row['worst_param']})")
