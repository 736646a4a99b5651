"""Many short distributed jobs from processes started once: the launcher of the fault suite.

A fault ends its job: after it, a process group may hold a collective left pending on some rank,
so no later case may use it (:mod:`seqpar.comm.faults`). Each injected fault therefore needs a job
of its own -- fresh processes, a fresh process group. Starting P processes that import torch,
transformers and seqpar costs seconds per job; forking them is milliseconds. So each rank is a
*zygote*: started once (from the launcher's forkserver, see :mod:`seqpar.comm.launch`), it imports
what the jobs need, runs no torch operation itself (a fork after multi-threaded torch work can
hang), and forks one child per job::

    parent ── job i ──> zygote r ── fork ──> child r: init_process_group(file://<job dir>/rendezvous)
                                              fn(r, P, *args) -> result file (or a Failure), os._exit
            <── done ──  zygote r: waits for the child (deadline: SIGUSR1 for its stack, then SIGKILL)

Results come back as with :func:`seqpar.comm.launch.run_distributed`: a list per rank, or a
:class:`~seqpar.comm.launch.WorkerError` naming every rank that raised, died or hung.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..comm import faults
from ..comm.launch import Failure, WorkerError, launch_context


def _child(rank: int, world: int, job_dir: str, pg_timeout: float, fn: Callable, args: tuple) -> None:
    """One rank of one job (a forked child of the zygote); never returns."""
    trace = open(os.path.join(job_dir, f"stack{rank}.txt"), "w")  # noqa: SIM115 -- lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=trace, all_threads=True)
    status, payload = "ok", None
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(job_dir, 'rendezvous')}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout))
        payload = fn(rank, world, *args)
    except BaseException as e:  # as the local launcher's worker does: tell every rank, report, leave
        status = "err"
        try:
            faults.stop(e, "a worker")
        except Exception as converted:
            e = converted
        payload = Failure("raised", "".join(traceback.format_exception(e)), type(e).__name__, str(e),
                          bad_input=isinstance(e, ValueError))
    torch.save((status, payload), os.path.join(job_dir, f"result{rank}.part"))
    os.replace(os.path.join(job_dir, f"result{rank}.part"), os.path.join(job_dir, f"result{rank}.pt"))
    if status == "ok" and not faults.met_fault():
        try:  # every rank's last collective is complete before any of them closes its sockets
            work = dist.barrier(async_op=True)
            work.wait(timedelta(seconds=pg_timeout))
        except Exception:
            pass
    trace.flush()
    os._exit(0)


def _zygote(rank: int, world: int, conn: Any, preload: Sequence[str], env: dict[str, str]) -> None:
    torch.set_num_threads(1)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    for name in preload:
        importlib.import_module(name)
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        job_dir, fn, args, deadline_s, pg_timeout = job
        pid = os.fork()
        if pid == 0:
            _child(rank, world, job_dir, pg_timeout, fn, args)
        deadline = time.monotonic() + deadline_s
        code = None
        while code is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGUSR1)  # its stack, into stack<rank>.txt
                time.sleep(0.5)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = "hung"
                break
            time.sleep(0.01)
        conn.send(code)


class Zygotes:
    """``nproc`` zygote processes that import ``preload`` once; :meth:`run` runs one job on forks of
    them. Use as a context manager (:meth:`close` stops them)."""

    def __init__(self, nproc: int, *, preload: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        ctx = launch_context()
        self.nproc = nproc
        self.conns, self.procs = [], []
        for r in range(nproc):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_zygote, args=(r, nproc, child, tuple(preload), dict(env or {})), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a zygote did not start")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, pg_timeout: float = 60.0,
            strict: bool = True) -> list[Any]:
        """``fn(rank, nproc, *args)`` on a fresh gloo job (forked ranks); every rank's result. Raises
        :class:`~seqpar.comm.launch.WorkerError` as :func:`~seqpar.comm.launch.run_distributed` does;
        with ``strict=False`` a failed rank's entry is its :class:`~seqpar.comm.launch.Failure` instead."""
        with tempfile.TemporaryDirectory(prefix="seqpar-job-") as job_dir:
            for c in self.conns:
                c.send((job_dir, fn, args, timeout, pg_timeout))
            codes = [c.recv() for c in self.conns]
            results, errors = [], {}
            for r, code in enumerate(codes):
                path = os.path.join(job_dir, f"result{r}.pt")
                stack_file = os.path.join(job_dir, f"stack{r}.txt")
                if code == "hung" or not os.path.exists(path):
                    stack = open(stack_file).read().strip() if os.path.exists(stack_file) else ""
                    kind = "hung" if code == "hung" else "died"
                    errors[r] = Failure(kind, f"{kind} (exit code {code})\n{stack}",
                                        exit_code=None if code == "hung" else code)
                    results.append(errors[r])
                    continue
                status, payload = torch.load(path, weights_only=False)
                results.append(payload)
                if status != "ok":
                    errors[r] = payload
        if errors and strict:
            raise WorkerError(errors, "failed")
        return results

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> Zygotes:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
