"""The same inputs on every rank, checked before the first collective of a forward.

A parallelized diffusers transformer takes its inputs whole on every sp rank (the latents, timesteps
and text embeddings of the batch) and splits them itself. Ranks fed different inputs would compute
a silently wrong result -- or, with different shapes, pair mismatched collectives and hang. So each
forward starts with one small all-gather of a fingerprint of the inputs (:func:`fingerprint`: how
many tensors, a CRC of their names, shapes, dtypes and of the plain arguments, and two float64 sums
of their values) and of the way the model was parallelized; every rank compares the same table and
raises the same ValueError when they differ. Cost: one reduction per input tensor and one
all-gather of 6 numbers per forward (``validate=False`` in ``parallelize`` skips it).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...comm.agree import share

_REL = 1e-10  # float64 sums of the same values in another order (another thread count) differ by far less


def _value_sums(t: Tensor) -> tuple[float, float]:
    x = t.detach().reshape(-1).to(torch.float64).nan_to_num(0.0, 1e300, -1e300)
    if x.numel() == 0:
        return 0.0, 0.0
    ramp = torch.linspace(1.0, 2.0, x.numel(), dtype=torch.float64, device=x.device)  # order matters too
    return float(x.sum()), float((x * ramp).sum())


def fingerprint(args: tuple, kwargs: dict[str, Any], how: str) -> dict[str, float]:
    """Six numbers that differ when the inputs (or ``how`` the model was parallelized) differ."""
    described, total, weighted, count = [how], 0.0, 0.0, 0
    with torch.no_grad():
        for name, value in [*((str(i), a) for i, a in enumerate(args)), *sorted(kwargs.items())]:
            if isinstance(value, Tensor):
                s, w = _value_sums(value)
                count += 1
                total += s * count
                weighted += w
                described.append(f"{name}:{tuple(value.shape)}:{value.dtype}")
            elif isinstance(value, (bool, int, float, str, type(None))):
                described.append(f"{name}={value!r}")
            else:
                described.append(f"{name}:{type(value).__name__}")
    crc = zlib.crc32("|".join(described).encode())
    return {"count": float(count), "crc": float(crc), "sum": total, "weighted": weighted, "abs": abs(total) + 1.0,
            "wabs": abs(weighted) + 1.0}


def check_same_inputs(args: tuple, kwargs: dict[str, Any], group: dist.ProcessGroup, how: str) -> None:
    """Raise the same ValueError on every rank of ``group`` unless every rank passed the same inputs
    (see the module doc); one all-gather."""
    if dist.get_world_size(group) == 1:
        return
    table = share(fingerprint(args, kwargs, how), group)
    first = table.rows[0]
    differ = []
    for r, row in enumerate(table.rows[1:], start=1):
        if row["count"] != first["count"] or row["crc"] != first["crc"]:
            differ.append(f"rank {r} passed other arguments (names, shapes, dtypes, flags) or parallelized the "
                          "model differently than rank 0")
        elif (abs(row["sum"] - first["sum"]) > _REL * max(row["abs"], first["abs"])
              or abs(row["weighted"] - first["weighted"]) > _REL * max(row["wabs"], first["wabs"])):
            differ.append(f"rank {r}'s input values differ from rank 0's")
    if differ:
        raise ValueError("seqpar: a parallelized diffusers model takes the same whole inputs on every sp rank (it "
                         "shards them itself), but:\n  " + "\n  ".join(differ) + "\n  pass every sp rank the same "
                         "latents, timesteps and conditioning (seed them alike; split the batch over dp ranks only)")
