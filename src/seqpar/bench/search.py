"""``seqpar bench --max-seq``'s search: where it starts (the planner's estimate for the case), then
doubling or halving until one length fits and one does not, then bisection -- every length tried
is a real training step (:func:`.peak.try_step`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .case import BenchCase, model_fields
from .peak import Trial, try_step


def estimate(case: BenchCase) -> Any:
    """The planner's :class:`seqpar.planner.memory.StepMemory` for ``case``'s model, strategy and
    switches on its most loaded rank (tiles the case leaves open are :func:`seqpar.reduce_memory`'s)."""
    from seqpar.batch.tiles import DEFAULT_LOSS_TILE
    from seqpar.integrations.models import builtin_config
    from seqpar.planner.cost import largest_shard
    from seqpar.planner.memory import step_memory
    from seqpar.train.config import DTYPES

    cfg = builtin_config(case.model, **model_fields(case))
    u, r = (1, case.nproc) if case.strategy == "ring" else (case.nproc, 1)
    if case.strategy == "hybrid":
        from seqpar.planner import hybrid_split

        u, r = hybrid_split(case.nproc, cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return step_memory(tokens=largest_shard(case.seq_len, u, r, zigzag=r > 1), hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, layers=cfg.num_hidden_layers,
                       heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                       vocab_size=cfg.vocab_size, dtype_bytes=DTYPES[case.dtype].itemsize,
                       tied=bool(cfg.tie_word_embeddings), switches=case.switches, loss_tile=DEFAULT_LOSS_TILE)


def predicted_max(case: BenchCase, cap_bytes: int, granularity: int, limit: int,
                  peak_bytes: Callable[[BenchCase], int] | None = None) -> int:
    """The longest multiple of ``granularity`` tokens the planner's memory model fits in the cap
    (0 if none): only where the search starts. ``peak_bytes``: another system's model of a case's
    peak (default: :func:`estimate`'s, on the CPU)."""
    def fits(n: int) -> bool:
        c = replace(case, seq_len=n)
        return (peak_bytes(c) if peak_bytes else estimate(c).device_peak(on_cpu=True)) <= cap_bytes

    lo, hi = 0, limit // granularity
    while lo < hi:  # largest k with fits(k * granularity)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * granularity) else (lo, mid - 1)
    return lo * granularity


def max_seq(case: BenchCase, cap_bytes: int, *, start: int, granularity: int, precision: float = 0.125,
            limit: int = 1 << 24, timeout: float = 900.0, log: Any = None,
            trial: Callable[[BenchCase], Trial] | None = None) -> tuple[int, list[Trial]]:
    """The longest multiple of ``granularity`` tokens whose full step fits ``cap_bytes`` per rank,
    found by running: from ``start``, double (or halve) until one length fits and one does not,
    then bisect until the gap is below ``precision`` of the fitting length (or one granule).
    ``trial(case)`` runs one length (default :func:`.peak.try_step` of seqpar's step under the cap;
    a peer's harness, or one that reuses lengths it already measured, passes its own).
    Returns ``(longest fitting length or 0, every trial in order)``; ``limit`` bounds the growth
    (the limit itself is tried last, so a fitting limit means "at least the limit")."""
    def run(n: int) -> Trial:
        c = replace(case, seq_len=n)
        t = trial(c) if trial is not None else try_step(c, cap_bytes, timeout)
        trials.append(t)
        if log is not None:
            log(t)
        return t

    trials: list[Trial] = []
    g = granularity
    n = max(g, start // g * g)
    lo, hi = 0, None  # longest that fits, shortest that does not
    if run(n).fits:
        lo = n
        while hi is None and min(2 * lo, limit // g * g) > lo:  # doubling, the limit last
            grow = min(2 * lo, limit // g * g)
            if run(grow).fits:
                lo = grow
            else:
                hi = grow
        if hi is None:
            return lo, trials
    else:
        hi = n
        while lo == 0 and hi > g:
            n = max(g, hi // 2 // g * g)
            if run(n).fits:
                lo = n
            else:
                hi = n
        if lo == 0:
            return 0, trials
    while hi - lo > max(g, precision * lo):
        mid = (lo + hi) // 2 // g * g
        if run(mid).fits:
            lo = mid
        else:
            hi = mid
    return lo, trials
