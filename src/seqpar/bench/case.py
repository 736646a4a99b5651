"""What one measurement is (:class:`BenchCase`), the grids of cases ``seqpar bench`` runs, and their
checks before any process starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..planner.memory import SWITCHES_OFF, MemorySwitches

SIZINGS = ("train", "builtin")


@dataclass(frozen=True)
class BenchCase:
    model: str
    model_config: str
    nproc: int
    strategy: str  # "ulysses", "ring", "hybrid" ("ulysses" at nproc 1: no communication)
    seq_len: int
    steps: int = 3
    dtype: str = "float32"
    seed: int = 0
    doc_len: int = 0  # > 0: the row packs documents of doc_len tokens (position ids restart); 0: one causal row
    switches: MemorySwitches = SWITCHES_OFF  # seqpar.reduce_memory's switches, applied after parallelize
    sizing: str = "train"  # "train": model_config over seqpar train's size; "builtin": over the built-in's own


def model_fields(case: BenchCase) -> dict[str, Any]:
    """The config fields a case builds its built-in model with: ``model_config`` over seqpar train's
    size and the copy task's vocabulary (``sizing="train"``), or over the built-in's own config
    (``"builtin"``, e.g. small-llama3's 8,192-token vocabulary). Either way ``model_config`` may set
    ``vocab_size`` (checked by :func:`check_cases` to cover the task's token ids)."""
    import json

    from seqpar.train.config import TrainConfig, model_overrides
    from seqpar.train.demo_data import CopyTask

    fields: dict[str, Any] = {"max_position_embeddings": case.seq_len}
    if case.sizing == "train":
        fields["vocab_size"] = CopyTask(max(case.seq_len, CopyTask.min_seq_len)).vocab_size
        return {**fields, **model_overrides(TrainConfig(model=case.model, model_config=case.model_config))}
    model_overrides(TrainConfig(model_config=case.model_config))  # the same JSON checks
    return {**fields, **(json.loads(case.model_config) if case.model_config else {})}


def cases(model: str, model_config: str, seq_lens: list[int], nprocs: list[int], strategies: list[str],
          steps: int, dtype: str) -> list[BenchCase]:
    """The 1-rank baseline for every length, then every (P, strategy, length) that applies
    (hybrid needs P >= 4)."""
    out = [BenchCase(model, model_config, 1, "ulysses", n, steps, dtype) for n in seq_lens]
    for p in nprocs:
        if p == 1:
            continue
        for s in strategies:
            if s == "hybrid" and p < 4:
                continue
            out += [BenchCase(model, model_config, p, s, n, steps, dtype) for n in seq_lens]
    return out


def packing_cases(model: str, model_config: str, seq_lens: list[int], nprocs: list[int], strategies: list[str],
                  steps: int, dtype: str, doc_len: int) -> tuple[list[BenchCase], list[str]]:
    """Every (P, strategy, length) twice: one causal row, and the row packed with ``doc_len``-token
    documents. Also returns what was left out and why (hybrid below P = 4, P = 1)."""
    out, skipped = [], []
    for p in nprocs:
        if p == 1:
            skipped.append("P=1: the packing table compares sequence-parallel strategies; use --nproc >= 2")
            continue
        for s in strategies:
            if s == "hybrid" and p < 4:
                skipped.append(f"hybrid at P={p}: it splits the ranks into ulysses x ring, each >= 2, so it needs "
                               "P >= 4 (add --nproc 4)")
                continue
            out += [BenchCase(model, model_config, p, s, n, steps, dtype, doc_len=d)
                    for n in seq_lens for d in (0, doc_len)]
    return out, skipped


def check_cases(all_cases: list[BenchCase]) -> None:
    """Bad input before any process starts: ValueError naming the option."""
    from seqpar.integrations.models import BUILTIN_MODELS, builtin_config
    from seqpar.train.demo_data import CopyTask

    for c in all_cases:
        if c.model not in BUILTIN_MODELS:
            raise ValueError(f"--model {c.model!r}: seqpar bench takes a built-in config name "
                             f"({', '.join(BUILTIN_MODELS)})")
        if c.seq_len < max(8, 2 * c.nproc):
            raise ValueError(f"--seq-lens {c.seq_len} is too short for {c.nproc} ranks: use >= "
                             f"{max(8, 2 * c.nproc)}")
        if c.sizing not in SIZINGS:
            raise ValueError(f"sizing {c.sizing!r}: choose one of {SIZINGS}")
        need = CopyTask(max(c.seq_len, CopyTask.min_seq_len)).vocab_size
        vocab = model_fields(c).get("vocab_size") or builtin_config(c.model).vocab_size
        if vocab < need:
            raise ValueError(f"--model-config vocab_size {vocab} is smaller than the {need} token ids of the bench's "
                             f"copy task: use vocab_size >= {need}")
        if c.doc_len and not 2 <= c.doc_len < c.seq_len:
            raise ValueError(f"--packing {c.doc_len}: a packed row needs documents of 2 to seq_len - 1 tokens; "
                             f"use a smaller --packing or longer --seq-lens than {c.seq_len}")
    if os.cpu_count() and max(c.nproc for c in all_cases) > 64:
        raise ValueError("--nproc above 64 local processes is not what seqpar bench is for: use torchrun")
