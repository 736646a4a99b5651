"""The tables ``seqpar bench`` writes and prints, shared by its modes: CSV rows with fixed number
formats, and right-aligned numbers that show "-" where there is none."""

from __future__ import annotations

import math
from typing import Any

_FORMATS = {"mem_mib": ".1f", "rss_mib": ".1f", "mem_ratio": ".3f", "time_ratio": ".3f", "growth": ".3f",
            "step_s": ".4f", "peak_mib": ".1f", "cap_mib": ".1f", "vs_off": ".3f", "vs_p1": ".3f"}


def write_csv(rows: list[dict[str, Any]], path: str, fields: list[str]) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            extra: dict[str, Any] = {}
            if "seq_len" in r:
                extra["tokens_per_rank"] = -(-r["seq_len"] // r["nproc"])
            if "mem_mib_per_rank" in r:
                extra["mem_mib_per_rank"] = ";".join(str(m) for m in r["mem_mib_per_rank"])
            w.writerow({**r, **{k: format(r[k], f) for k, f in _FORMATS.items() if k in r}, **extra})


def num(x: float | None, spec: str, width: int) -> str:
    """``x`` formatted with ``spec`` in ``width`` columns; "-" for None or nan."""
    return f"{'-':>{width}}" if x is None or math.isnan(x) else f"{x:>{width}{spec}}"
