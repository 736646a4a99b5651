"""Run a function on P local processes joined in a gloo process group (CPU), cheaply and safely.

Used by the tests, ``seqpar verify``, ``seqpar bench`` and ``seqpar train`` when not started by
torchrun. Processes come from a forkserver with torch, seqpar and transformers' modeling code
preloaded (fast, and safe after the parent ran multi-threaded torch ops); rendezvous goes through
a file, so there are no ports to collide; the process group has a short timeout and the parent a
deadline, so a hang becomes an error that carries every stuck rank's Python traceback.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import faults


@dataclass(frozen=True)
class Failure:
    """How one rank failed: ``kind`` is ``"raised"`` (``error_type`` and ``message`` are the
    exception's class name and text; ``bad_input`` says it is a ValueError, seqpar's error for user
    input), ``"died"`` (``exit_code``) or ``"hung"``; ``text`` holds the traceback, or the stack the
    rank was stuck in."""

    kind: str
    text: str
    error_type: str | None = None
    message: str = ""
    bad_input: bool = False
    exit_code: int | None = None

    def __str__(self) -> str:
        return self.text


class WorkerError(RuntimeError):
    """One or more ranks raised, died or hung; ``errors`` maps rank -> :class:`Failure`."""

    def __init__(self, errors: dict[int, Failure], what: str = "raised") -> None:
        self.errors = errors
        body = "\n".join(f"--- rank {r} ---\n{f.text}" for r, f in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) {what}:\n{body}")


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank: int, world: int, init_file: str, trace_dir: str, pg_timeout: float, fn: Callable,
            args: tuple, queue: Any, env: dict[str, str]) -> None:
    torch.set_num_threads(1)
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world)})
    trace = open(os.path.join(trace_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 -- lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=trace, all_threads=False)
    status, payload = "ok", b""
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        payload = _dumps(fn(rank, world, *args))
    except BaseException as e:  # report everything, KeyboardInterrupt included, then leave
        status = "err"
        try:
            faults.stop(e, "a worker")  # told to every rank before this process leaves (peers wake up)
        except Exception as converted:  # a transport error caused by another rank's fault: that fault
            e = converted
        text = "".join(traceback.format_exception(e))
        payload = _dumps(Failure("raised", text, type(e).__name__, str(e), bad_input=isinstance(e, ValueError)))
    queue.put((rank, status, payload))
    queue.close()
    queue.join_thread()  # the result must be in the pipe before os._exit below
    if status == "ok" and not faults.met_fault():  # after a fault a peer may wait forever: just leave
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:
            pass
    trace.flush()
    os._exit(0)  # skip interpreter teardown: gloo threads sometimes abort it


PRELOAD = ("torch", "torch.distributed", "seqpar", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama")
"""What the forkserver imports once, for every worker it forks. Most workers build a transformers
model: imported in each worker, transformers' modeling code (and Llama's, the built-in models')
cost about 3 s of CPU per process here -- a 4-rank job that builds a tiny Llama took 7-8 s to
start, 0.25 s with it preloaded (measured 2026-12-02, transformers 5.24). Names, not imports: a
module that is not installed is skipped (multiprocessing ignores its ImportError)."""


def launch_context() -> Any:
    """The multiprocessing context workers come from: a forkserver with :data:`PRELOAD` imported."""
    ctx = mp.get_context("forkserver")
    try:
        ctx.set_forkserver_preload(list(PRELOAD))
    except Exception:
        pass
    return ctx


def run_distributed(fn: Callable[..., Any], nproc: int, *args: Any, timeout: float = 300.0,
                    pg_timeout: float = 60.0, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` gloo processes; return each rank's result.

    ``fn`` must be importable (module level). Raises :class:`WorkerError` with every failing
    rank's traceback if a rank raises, or with the stuck ranks' stacks after ``timeout`` seconds.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    ctx = launch_context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="seqpar-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, nproc, init_file, tmp, pg_timeout, fn, args, queue, dict(env or {})))
                 for r in range(nproc)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, Failure] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < nproc:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if errors and remaining > 5.0:
                    deadline = time.monotonic() + 5.0  # peers of a failed rank may be blocked: give them a moment
                try:
                    rank, status, payload = queue.get(timeout=min(remaining, 1.0))
                except Exception:
                    if all(not p.is_alive() for p in procs) and queue.empty():
                        break
                    continue
                if status == "ok":
                    results[rank] = _loads(payload)
                else:
                    errors[rank] = _loads(payload)
            missing = [r for r in range(nproc) if r not in results and r not in errors]
            if missing:
                for r in missing:
                    if procs[r].is_alive():
                        os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(0.5)
                for r in missing:
                    trace = os.path.join(tmp, f"rank{r}.txt")
                    stack = open(trace).read().strip() if os.path.exists(trace) else "(no stack: died early)"
                    alive, code = procs[r].is_alive(), procs[r].exitcode
                    what = "hung (no result within the deadline)" if alive else "died without a result"
                    errors[r] = Failure("hung" if alive else "died", f"{what} (exit code {code})\n{stack}",
                                        exit_code=code)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
        if errors:
            raise WorkerError(errors, "failed")
        return [results[r] for r in range(nproc)]
