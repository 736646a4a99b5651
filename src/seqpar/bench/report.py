"""Rows post-processed, before the CLI prints them: each row against the 1-rank row of the same
length, packed rows against plain ones (and memory growth when the length doubles), the longest
sequences against the same P without switches and against P = 1."""

from __future__ import annotations

from typing import Any


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``mem_ratio`` / ``time_ratio``: each row over the 1-rank row of the same length."""
    single = {r["seq_len"]: r for r in rows if r["nproc"] == 1}
    for r in rows:
        one = single.get(r["seq_len"])
        r["mem_ratio"] = _ratio(r["mem_mib"], one["mem_mib"]) if one else float("nan")
        r["time_ratio"] = _ratio(r["step_s"], one["step_s"]) if one else float("nan")
    return rows


def add_packing_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``mem_ratio`` / ``time_ratio``: each row over the plain row of the same P, strategy and
    length (1 for the plain row itself); ``growth``: its memory over the same series' at half the
    length (nan where that was not measured) -- 2 where memory is linear in S, 4 where quadratic."""
    by = {(r["nproc"], r["strategy"], r["seq_len"], r["doc_len"]): r for r in rows}
    nan = float("nan")
    for r in rows:
        plain = by.get((r["nproc"], r["strategy"], r["seq_len"], 0))
        half = by.get((r["nproc"], r["strategy"], r["seq_len"] // 2, r["doc_len"])) if r["seq_len"] % 2 == 0 else None
        r["mem_ratio"] = _ratio(r["mem_mib"], plain["mem_mib"]) if plain else nan
        r["time_ratio"] = _ratio(r["step_s"], plain["step_s"]) if plain else nan
        r["growth"] = _ratio(r["mem_mib"], half["mem_mib"]) if half else nan
    return rows


def add_max_seq_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``vs_off``: max_seq over the same (P, strategy) without switches; ``vs_p1``: over P=1 with the
    same switches (nan where that row is missing or 0)."""
    by = {(r["nproc"], r["strategy"], r["switches"]): r["max_seq"] for r in rows}
    p1 = {r["switches"]: r["max_seq"] for r in rows if r["nproc"] == 1}
    nan = float("nan")
    for r in rows:
        off = by.get((r["nproc"], r["strategy"], "off"))
        r["vs_off"] = r["max_seq"] / off if off else nan
        one = p1.get(r["switches"])
        r["vs_p1"] = r["max_seq"] / one if one else nan
    return rows
