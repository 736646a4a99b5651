"""A batch checked on every SP rank before it is sharded: one all-gather of a row of numbers.

Each rank finds its own batch's problems without communicating (:func:`local_problem`), then one
all-gather (:mod:`seqpar.comm.agree`) compares the ranks' batches by fingerprints (:func:`checksum`)
and raises the same error on every rank (:func:`check_batch`): a malformed batch, or SP ranks that
hold different batches (a data loader sharded over every rank instead of over dp).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..attention.layout import LAYOUTS
from ..comm.agree import MISSING, check, share
from ..errors import Refused
from .local_batch import BATCH_KWARG
from .targets import CU_SEQLENS_KEYS, cu_seqlens_problem
from .visual import ROUTED_KEYS, SPAN_KEYS, fingerprint, refused_key_problem, visual_problem

BATCH_KEYS = ("input_ids", "inputs_embeds", "labels", "attention_mask", "position_ids", "loss_weights")
"""The keys of a batch ``shard_batch`` reads (besides padding-free collators' and processors')."""


def local_problem(batch: Mapping[str, Any]) -> tuple[str | None, int, int]:
    """``(what is wrong with this rank's batch or None, batch size, seq len)``, without communication."""
    if BATCH_KWARG in batch:
        return ("this batch is already sharded (it carries a seqpar LocalBatch): pass the full batch every SP rank "
                "loaded to shard_batch once"), -1, -1
    ids, emb = batch.get("input_ids"), batch.get("inputs_embeds")
    ref = ids if ids is not None else emb
    if ref is None:
        return "the batch has neither input_ids nor inputs_embeds", -1, -1
    if (ids is not None and ids.dim() != 2) or (ids is None and emb.dim() != 3):
        return "input_ids must be [batch, seq_len] (inputs_embeds [batch, seq_len, hidden])", -1, -1
    b, s = int(ref.shape[0]), int(ref.shape[1])
    refused = refused_key_problem(batch)
    if refused is not None:
        return refused, b, s
    if set(batch) - set(BATCH_KEYS) - set(CU_SEQLENS_KEYS) - {"use_cache"} - set(ROUTED_KEYS) - set(SPAN_KEYS):
        return (f"the batch has keys shard_batch does not know: use only {list(BATCH_KEYS)} (and the "
                f"{list(CU_SEQLENS_KEYS)} of DataCollatorWithFlattening, the {list(ROUTED_KEYS + SPAN_KEYS)} of a "
                "vision-language processor)"), b, s
    labels, mask, pos, w = (batch.get(k) for k in ("labels", "attention_mask", "position_ids", "loss_weights"))
    if labels is not None and tuple(labels.shape) != (b, s):
        return "labels must have the shape of input_ids [batch, seq_len]", b, s
    if mask is not None and tuple(mask.shape) != (b, s):
        return ("attention_mask must be a [batch, seq_len] padding mask (1 = token, 0 = padding); 4-D masks are "
                "not supported -- seqpar builds the attention mask itself"), b, s
    if pos is not None and (pos.dim() != 2 or pos.shape[1] != s or pos.shape[0] not in (1, b)):
        return "position_ids must be [batch, seq_len] or [1, seq_len]", b, s
    if w is not None and (labels is None or tuple(w.shape) != (b, s)):
        return "loss_weights must have the shape of labels [batch, seq_len] and need labels", b, s
    return cu_seqlens_problem(batch, b, s) or visual_problem(batch, b, s), b, s


def checksum(t: Tensor | None) -> float:
    """A cheap fingerprint of an integer tensor, exact in float64, to tell whether SP ranks hold the
    same batch (the classic bug: a data loader sharded over all ranks instead of over dp)."""
    if t is None:
        return MISSING
    flat = t.reshape(-1).to(torch.int64)
    w = torch.arange(flat.numel(), device=flat.device) % 65521 + 1
    return float(((flat % 65521) * w).sum() % 2147483647)


_SAME = {
    "batch": "batch size", "seq": "sequence length (dim 1 of input_ids)", "ids": "the batch content (input_ids)",
    "labels": "the label content", "mask": "the attention_mask content",
    "pos": "the position_ids content",
    "weights": "whether loss_weights are given", "layout": "layout", "items": "num_items_in_batch",
    "visual": f"the images / video (the batch's {list(ROUTED_KEYS + SPAN_KEYS)})",
    "generation": "the batch number (how many batches the rank sharded before: a rank skipped or repeated one, "
                  "e.g. an exception caught and ignored on some ranks; seqpar.comm.faults)",
}


def device_problem(devices: set[torch.device], comm: torch.device) -> str | None:
    """Why a batch whose tensors sit on ``devices`` cannot be sharded for a group that talks on
    ``comm`` (:func:`seqpar.comm.collectives.comm_device`), or None. CPU batches suit every group
    (with NCCL their metadata moves to ``comm`` once); refused: tensors on several devices, and a
    CUDA batch on another GPU than the one this rank's NCCL group uses."""
    if len(devices) > 1:
        return (f"the batch's tensors are on different devices ({', '.join(sorted(map(str, devices)))}): put them "
                "on one device (the CPU, or this rank's GPU)")
    dev = next(iter(devices), torch.device("cpu"))
    if dev.type == "cuda" and comm.type == "cuda" and dev.index != comm.index:
        return (f"the batch is on {dev} but this rank's NCCL group talks on {comm}: call "
                "torch.cuda.set_device(local_rank) before init_process_group, or move the batch to that GPU")
    return None


def check_batch(batch: Mapping[str, Any], group: dist.ProcessGroup, layout: str, num_items: float | None,
                device: torch.device, generation: int) -> tuple[int, int]:
    """``(batch size, seq len)`` of this rank's full ``batch`` once every SP rank of ``group`` holds
    a well-formed batch, the same as the others' (content, layout, ``num_items``, batch number
    ``generation``). One all-gather; raises ValueError (Refused for a mechanism seqpar does not run)
    on every rank otherwise."""
    problem, b, s = local_problem(batch)
    if problem is None:  # found on one rank, raised on every rank by the agreement below
        problem = device_problem({t.device for t in batch.values() if isinstance(t, Tensor)}, device)
    ok = problem is None
    facts = {
        "batch": float(b), "seq": float(s),
        "ids": checksum(batch.get("input_ids")) if ok else MISSING,
        "labels": checksum(batch.get("labels")) if ok else MISSING,
        "mask": checksum(batch.get("attention_mask")) if ok else MISSING,
        "pos": checksum(batch.get("position_ids")) if ok else MISSING,
        "weights": 1.0 if ok and batch.get("loss_weights") is not None else 0.0,
        "layout": float(LAYOUTS.index(layout)) if layout in LAYOUTS else MISSING,
        "items": MISSING if num_items is None else float(num_items),
        "visual": fingerprint({k: batch[k] for k in ROUTED_KEYS + SPAN_KEYS if batch.get(k) is not None})
        if ok else MISSING,
        "refused": float(problem is not None and problem == refused_key_problem(batch)),
        "generation": float(generation),  # no batch pairs with another batch's collectives
    }
    table = share(facts, group, problem=problem, device=device)
    if any(table.column("refused")):  # a mechanism seqpar will not run: a Refused, raised on every rank
        raise Refused("seqpar: invalid batch for shard_batch:\n  " + "\n  ".join(
            f"rank {r}: {msg}" for r, msg in enumerate(table.problems) if msg))
    # a malformed batch makes the comparisons meaningless: report only the problem then
    check(table, what="batch for shard_batch", same=[] if any(table.problems) else list(_SAME),
          describe=lambda n: _SAME[n], hint="every SP (and TP) rank must get the same full batch: shard the data "
                                            "loader over the dp ranks only (shard_batch splits the sequence)")
    return b, s
