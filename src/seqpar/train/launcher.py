"""Starting a ``seqpar train`` job: local gloo workers, or the ranks torchrun started.

Local workers come from :func:`seqpar.comm.launch.run_distributed` (forkserver, one thread each, file
rendezvous, a collective timeout). What this module adds is what a command line needs: turning
the ranks' failures into one message -- a bad option (ValueError) as that one line, a dead or hung
worker as which rank and why, with the last complete checkpoint named.

Under torchrun, on one host or many (one agent per host), each rank beats in the job's store
(:mod:`seqpar.comm.liveness`), so when a host -- an agent and its ranks -- is lost, the others stop
with a RankFailed that names the lost ranks, said once per agent; when the lost agent served the
store (rank 0's), they say that instead -- also when their own agent, which notices first, stops
them with SIGTERM. A worker dies with its agent (a worker without its agent is orphaned: it would
go on training beside the job that replaces it).
"""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

from seqpar.comm import faults, liveness
from seqpar.comm.launch import Failure, WorkerError, run_distributed
from seqpar.errors import RankFailed

from .config import TrainConfig, collective_timeout
from .job import Job, prepare_job
from .loop import RunSummary, die_with_parent, local_worker, run_training

_SIGNALS = {-s.value: s.name for s in signal.Signals}


def under_torchrun() -> bool:
    """True in a process torchrun (or another torch.distributed launcher) started as one rank."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


class JobFailed(RuntimeError):
    """A worker died, hung or raised something other than a bad-input ValueError."""


def _describe(rank: int, f: Failure) -> str:
    if f.kind == "died":
        code = f.exit_code
        return f"rank {rank} died (exit code {code}{', ' + _SIGNALS[code] if code in _SIGNALS else ''})"
    if f.kind == "hung":
        return f"rank {rank} hung"
    msg = f"{f.error_type}: {f.message}" if f.error_type else "failed"
    return f"rank {rank}: {msg if len(msg) <= 200 else msg[:200] + '...'}"


def run_local(job: Job, *, stop_after: int | None = None) -> RunSummary:
    """Run ``job`` on ``job.world`` local gloo workers; rank 0's summary.

    Raises ValueError (one message) for bad input found by a worker, :class:`JobFailed` when a
    worker dies, hangs or crashes -- after every worker has been stopped.
    """
    try:
        results = run_distributed(local_worker, job.world, pickle.dumps(job), stop_after, timeout=10.0**7,
                                  pg_timeout=collective_timeout(job.cfg, "cpu"), env={"OMP_NUM_THREADS": "1"})
    except WorkerError as e:
        for rank in sorted(e.errors):
            if e.errors[rank].bad_input:  # the same message on every rank: say it once
                raise ValueError(e.errors[rank].message) from None
        lost = [r for r in sorted(e.errors) if e.errors[r].kind in ("died", "hung")]
        if lost:  # the others only failed because these ranks went away: do not list their errors
            others = [r for r in range(job.world) if r not in lost]
            lines = [_describe(r, e.errors[r]) for r in lost]
            if others:
                lines.append(f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} stopped")
        else:
            lines = [_describe(r, e.errors[r]) for r in sorted(e.errors)]
        raise JobFailed("; ".join(lines)) from None
    return results[0]


def _attempt_prefix() -> str | None:
    """The store prefix of this torchrun attempt (None on the first): see :func:`restart_store`."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return None if attempt == "0" else f"seqpar/attempt_{attempt}"


def restart_store(timeout: timedelta) -> dict:
    """``init_process_group`` keywords for a group torchrun's agent restarted (``--max-restarts``):
    the agent's store under a prefix of its own per attempt; none on the first attempt.

    The agent keeps one store across restarts (torch 2.13, static and c10d rendezvous alike) and
    the workers use it without a prefix per attempt, so a restarted rank can read the addresses
    the killed attempt's ranks published and fail connecting to a dead port (gloo, measured: about
    every other restart), and seqpar's fault channel would read the killed attempt's faults."""
    env = os.environ
    prefix = _attempt_prefix()
    if prefix is None or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    import torch.distributed as dist

    world = int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(prefix, store), "rank": int(env["RANK"]), "world_size": world}


def speaks_for_agent(rank: int, local_rank: int, local_world: int, culprits: Collection[int]) -> bool:
    """Whether ``rank`` says another rank's failure for its torchrun agent (ranks ``rank -
    local_rank`` .. ``+ local_world``): the agent's lowest rank that is not a ``culprit``. Pure."""
    base = rank - local_rank
    return next((r for r in range(base, base + local_world) if r not in culprits), None) == rank


class _Reporter:
    """Says a RankFailed once per torchrun agent (through ``say``), on the rank :func:`speaks_for_agent` picks."""

    def __init__(self, say: Callable[[RankFailed], None]) -> None:
        self.say, self.said = say, False

    def __call__(self, error: RankFailed) -> None:
        fault: Any = error.fault
        culprits = set(getattr(fault, "lost", ()) or ()) or {getattr(fault, "rank", -1)}
        env = os.environ
        if self.said or not speaks_for_agent(int(env["RANK"]), int(env.get("LOCAL_RANK", 0)),
                                             int(env.get("LOCAL_WORLD_SIZE", 1)), culprits):
            return
        self.said = True
        try:
            self.say(error)
        except Exception:  # a signal handler's print can meet the main thread's: never fail the stop
            pass


def _start_liveness(report: _Reporter) -> liveness.Liveness:
    """This rank's beats over a store client of its own (:mod:`seqpar.comm.liveness`), and the
    SIGTERM handler that says why torchrun's agent stops this rank when another rank is the cause."""
    import torch.distributed as dist

    env = os.environ
    store: Any = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                               timeout=timedelta(seconds=liveness.STORE_TIMEOUT_S))
    prefix = _attempt_prefix()
    live = liveness.start(dist.PrefixStore(prefix, store) if prefix else store)
    liveness.watch(live)

    def on_sigterm(signum: int, frame: Any) -> None:
        cause = liveness.stop_cause(live)
        if cause is not None and not cause.bad_input:  # bad input: said by rank 0 (seqpar.cli.train)
            report(faults.rank_failed(cause))
        signal.signal(signum, signal.SIG_DFL)  # then die of it, as without this handler
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    return live


def placement_warning(roster: list[liveness.Member], inner: int, what: str) -> str | None:
    """What to say when blocks of ``inner`` consecutive ranks (``what``: "sp group") span torchrun
    agents or hosts: their collectives then cross hosts. None when every block sits in one."""
    spanning = liveness.spanning_groups(roster, inner)
    if not spanning:
        return None
    n = len(spanning)
    shown = "; ".join(liveness.describe_ranks(g, roster) for g in spanning[:4])
    return (f"warning: {n} {what}{'s span' if n > 1 else ' spans'} more than one torchrun agent, so "
            f"{'their' if n > 1 else 'its'} all-to-alls cross hosts: {shown}{' ...' if n > 4 else ''}. torchrun "
            f"numbers each agent's ranks consecutively: give every agent --nproc-per-node a multiple of {inner}")


def run_torchrun(cfg: TrainConfig, *, say: Callable[[str], None] = print,
                 report: Callable[[RankFailed], None] = print) -> RunSummary | None:
    """Run as one rank of a torchrun job: NCCL and one GPU per rank when CUDA is there, else gloo.
    Options are checked before the process group starts (a ValueError is the same on every rank).
    Returns the summary on rank 0, None elsewhere. ``say`` (rank 0) gets a placement warning;
    ``report`` gets a RankFailed once per agent -- from :func:`run_training`, or the cause
    of a SIGTERM from torchrun's agent. A RankFailed is raised on every rank."""
    import torch
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if cfg.nproc is not None and cfg.nproc != world:
        raise ValueError(f"--nproc {cfg.nproc} does not match torchrun's world size {world}: omit --nproc")
    job = prepare_job(cfg, world)
    die_with_parent()
    if job.plan_reason and int(os.environ.get("RANK", 0)) == 0:  # --plan auto: what it chose, once
        print(f"seqpar train: {job.plan_reason}", flush=True)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kw = {}
    if backend == "nccl":
        kw["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))  # eager NCCL init, bound
        torch.cuda.set_device(kw["device_id"])
    else:
        torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    timeout = collective_timeout(cfg, "cuda" if backend == "nccl" else "cpu")  # NCCL's watchdog too
    kw.update(restart_store(timedelta(seconds=timeout)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout), **kw)
    reporter = _Reporter(report)
    live = _start_liveness(reporter)
    warning = placement_warning(live.roster, job.sp, "sp group")
    if warning and dist.get_rank() == 0:
        say(warning)
    # no destroy_process_group on the way out of a failure: while a peer still waits in a collective
    # it hangs (gloo, measured); the exception ends this process, which frees the peer
    try:
        summary = run_training(job)
    except RankFailed as e:
        if not isinstance(e, ValueError):  # bad input: said once for the job, as any ValueError
            reporter(e)
        raise
    live.stop()
    dist.barrier()
    dist.destroy_process_group()
    return summary if int(os.environ["RANK"]) == 0 else None
