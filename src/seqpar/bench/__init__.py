"""``seqpar bench``'s measurement harness (layer 7: below the CLI, which parses and prints).

``seqpar bench``: per-rank peak memory and step time of a training step, P ranks vs 1.

One training step (forward, backward, gradient sync, AdamW) of a model on one row of N tokens,
sequence-parallel over P ranks, compared with the same step on one rank -- or, with ``--packing``,
the same row packed with short documents compared with the plain causal row. Memory is what the
step adds on top of what existed after a warm-up step (weights, gradients and optimizer states exist
by then), so the ratio shows how the sequence-length dependent part -- activations -- behaves:

* CPU: the peak of live tensor storage created in one step (:class:`seqpar.testing.memory.LiveMemory`:
  counted, not sampled, so the same on every run), measured on the first, untimed step. The peak
  resident set size of the timed steps is kept beside it (``rss_mib``; each configuration runs in
  fresh worker processes, the peak reset after the baseline with ``/proc/self/clear_refs``).
* CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``) after a reset.

Step time is the median over the timed steps; with more workers than cores (CPU) it measures the
machine's contention, not seqpar.

``--max-seq`` (:func:`max_seq`) measures differently: each trial is one step from fresh processes
(:func:`step_peak`), its peak resident memory counted from the runtime baseline (weights, AdamW states,
gradients and activations all count, as on a GPU), under a per-rank cap a watchdog enforces.

One module per responsibility::

    case.py         BenchCase, the grids of cases, their checks before any process starts
    build.py        the model, optimizer, batch, layout and mesh of a case; one training step
    measurement.py  seqpar bench's numbers: live-tensor / allocator peak and step time, per rank
    probes.py       /proc probes: current and peak resident memory, resetting the peak
    malloc.py       glibc tuned so that the resident peak is the peak of what a step holds
    watchdog.py     the thread that stops a worker past its memory cap
    peak.py         --max-seq's trial: one step's resident peak from fresh processes, under the cap
    search.py       --max-seq's search: the planner's estimate where it starts, doubling, bisection
    report.py       rows post-processed: ratios against 1 rank, packed against plain, max-seq ratios
    census.py       what a step's live peak is made of, by tensor kind
    alst.py         the peer: DeepSpeed's ALST set up on a case's model (benchmarks/bench_alst.py)
    side_by_side.py seqpar on ALST's row, and both systems against the unsharded model
"""

from .build import bench_batch, layout_for, mesh_for, prepare
from .case import SIZINGS, BenchCase, cases, check_cases, model_fields, packing_cases
from .measurement import measure, probe_step, run_case, torchrun_rows
from .peak import Trial, step_peak, try_step
from .report import add_max_seq_ratios, add_packing_ratios, add_ratios
from .search import estimate, max_seq, predicted_max
from .watchdog import OVER_CAP_EXIT

__all__ = [
    "BenchCase",
    "OVER_CAP_EXIT",
    "SIZINGS",
    "Trial",
    "add_max_seq_ratios",
    "add_packing_ratios",
    "add_ratios",
    "bench_batch",
    "cases",
    "check_cases",
    "estimate",
    "layout_for",
    "max_seq",
    "measure",
    "mesh_for",
    "model_fields",
    "packing_cases",
    "predicted_max",
    "prepare",
    "probe_step",
    "run_case",
    "step_peak",
    "torchrun_rows",
    "try_step",
]
