"""Faults during seqpar train, on the real command: a worker killed mid-run, Ctrl-C. Every process of
the job must be gone within seconds, the exit code and message must say what happened, and the last
complete checkpoint must load."""

import os
import signal
import subprocess
import sys
import time

import pytest

from seqpar.train.checkpoint import complete_checkpoints, load_model_weights, read_trainer_state

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def _descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _terminal_signals() -> None:
    """In the child before exec: SIGINT and SIGQUIT at their defaults, as a shell gives a foreground
    job. An ignored disposition survives exec, and Python installs no KeyboardInterrupt handler for
    an ignored SIGINT: measured in a full ``make test`` run, where this pytest process had come to
    ignore both (the job then ignored the Ctrl-C this test sends, rightly, as ``nohup`` would have it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _start(save_dir):
    cmd = [sys.executable, "-m", "seqpar.cli.main", "train", "--seq-len", "64", "--micro-batch", "2", "--steps",
           "100000", "--save-every", "3", "--save-dir", str(save_dir), "--no-progress", "--timeout", "30"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True,  # its own process group, as a shell job would be
                            preexec_fn=_terminal_signals)
    deadline = time.monotonic() + 120
    while len(complete_checkpoints(str(save_dir))) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=10)
            pytest.fail(f"the run did not reach a checkpoint (rc={proc.returncode}):\n{out}\n{err}")
        time.sleep(0.2)
    workers = [p for p in _descendants(proc.pid) if p not in _children().get(proc.pid, [])]
    everything = _descendants(proc.pid)
    assert len(workers) >= 2, (workers, everything)  # the forkserver's children: one per rank
    return proc, workers, everything


def _finish(proc, everything, limit=20.0):
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # fail, but leave no job behind training for 100000 steps
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    took = time.monotonic() - t0
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in everything) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in everything if _alive(p)]
    assert not left, f"processes left behind: {left}"
    assert took < limit, f"took {took:.1f}s to stop"
    return out, err


def _check_last_checkpoint_loads(save_dir):
    from seqpar.integrations.models import build_model
    from seqpar.train.config import TrainConfig, builtin_fields
    from seqpar.train.demo_data import CopyTask

    step, path = complete_checkpoints(str(save_dir))[-1]
    state = read_trainer_state(path)
    assert state["step"] == step
    cfg = TrainConfig(**state["config"])
    model, _ = build_model(cfg.model, **builtin_fields(cfg, CopyTask(cfg.seq_len).vocab_size))
    load_model_weights(path, model)
    return path


def test_a_killed_worker_stops_the_job(tmp_path):
    proc, workers, everything = _start(tmp_path)
    os.kill(workers[-1], signal.SIGKILL)
    out, err = _finish(proc, everything)
    assert proc.returncode == 1, (out, err)
    assert "died" in err and "SIGKILL" in err and "every worker was stopped" in err, err
    path = _check_last_checkpoint_loads(tmp_path)
    assert os.path.abspath(path) in err
    assert "Traceback" not in err


def test_ctrl_c_stops_every_process(tmp_path):
    proc, _, everything = _start(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C: the whole foreground group
    out, err = _finish(proc, everything)
    assert proc.returncode == 130, (out, err)
    assert "interrupted" in err and "last complete checkpoint" in err, err
    _check_last_checkpoint_loads(tmp_path)
