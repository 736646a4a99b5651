"""The cost model a dynamic SP schedule balances with, bound to a model's shapes: what ``seqpar
train --sp-schedule dynamic`` uses, and a default for a loop of one's own. Only the schedule's
degrees and placement follow it; exactness does not."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .schedule import Cost
from .work import H100, Machine, Shapes, bin_seconds

CPU_GLOO = Machine(flops_per_s=2e10, bytes_per_s=1e9, collective_s=1e-3, bin_s=5e-3)
"""A CPU rank on gloo, roughly: one thread's matmuls, an all-to-all's ~1 ms (PLATFORM.md). A guess,
not a fit (benchmarks/bench_dynamic_sp.py refits on the machine)."""


def config_shapes(text_config: Any, dtype_bytes: int) -> Shapes:
    """The cost model's view of a transformers decoder config (a VLM's text config:
    ``seqpar.integrations.models.decoder_config``)."""
    c = text_config
    heads = int(c.num_attention_heads)
    return Shapes(heads=heads, kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                  head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
                  hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size),
                  layers=int(c.num_hidden_layers), vocab_size=int(c.vocab_size), dtype_bytes=dtype_bytes)


def model_cost(text_config: Any, *, dtype_bytes: int, device_type: str, strategy: str = "ulysses",
               machine: Machine | None = None) -> Cost:
    """``cost(docs, degree)``: :func:`seqpar.planner.work.bin_seconds` at the config's shapes on
    ``machine`` (measured: :func:`seqpar.planner.calibrate.measure_machine`), else on an H100
    (``device_type`` "cuda") or a gloo CPU rank (:data:`CPU_GLOO`); the same on every rank."""
    shapes = config_shapes(text_config, dtype_bytes)
    machine = machine if machine is not None else H100 if device_type == "cuda" else CPU_GLOO

    def cost(docs: Sequence[int], degree: int) -> float:
        return bin_seconds(docs, degree, shapes, machine, strategy=strategy)

    return cost
