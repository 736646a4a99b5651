"""Auto-resume under an elastic launcher (issue 26, item 6): ``seqpar train --resume auto`` under
``torchrun --max-restarts 1``, where one worker SIGKILLs itself in the middle of a step on the first
attempt only. torchrun's agent stops the group and starts it again; the second attempt finds the
last complete checkpoint, continues from it and ends where an uninterrupted run ends: the same
loss, gradient norm and learning rate at every step and the same final weights, bit for bit.

The kill comes from a small launcher script (written to the test's directory) that patches
``StaticSteps.forward_backward`` on rank 1 of restart 0 (``TORCHELASTIC_RESTART_COUNT``), then runs the
real ``seqpar train`` command line.

Before seqpar gave each attempt a prefix of its own in the agent's store
(:func:`seqpar.train.launcher.restart_store`), the restarted ranks read the killed attempt's gloo
addresses and failed connecting to a dead port -- about every other restart, static and c10d
(``--standalone``) rendezvous alike.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
STEPS, SAVE_EVERY, KILL_AT = 7, 3, 5  # killed in step 5: the last complete checkpoint is step 3

LAUNCHER = '''
import os, signal, sys
from seqpar.train.step import StaticSteps
from seqpar.cli.main import main

kill_at = int(os.environ.get("SEQPAR_TEST_KILL_AT", "0"))
if kill_at and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("RANK") == "1":
    real = StaticSteps.forward_backward

    def forward_backward(self, step):
        if step + 1 == kill_at:  # step is the number of steps done: this is step kill_at
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, step)

    StaticSteps.forward_backward = forward_backward
sys.exit(main(sys.argv[1:]))
'''


def _train(tmp_path, name, kill_at):
    launcher = tmp_path / "launch_train.py"
    launcher.write_text(LAUNCHER)
    save_dir = tmp_path / name
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "SEQPAR_TEST_KILL_AT": str(kill_at)}
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
           str(launcher), "train", "--no-progress", "--seq-len", "32", "--steps", str(STEPS), "--save-every",
           str(SAVE_EVERY), "--save-dir", str(save_dir), "--resume", "auto", "--export-hf", "--no-plot"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-8000:]
    return p, save_dir


def _steps(save_dir):
    """Each step's (loss, grad norm, lr) from metrics.jsonl (a resumed run's file holds every step)."""
    rows = [json.loads(line) for line in open(save_dir / "metrics.jsonl")]
    return {r["step"]: (r["loss"], r["grad_norm"], r["lr"]) for r in rows if "loss" in r and "grad_norm" in r}


def _weights(save_dir):
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(save_dir / "hf") if f.endswith(".safetensors"))
    assert files, os.listdir(save_dir / "hf")
    out = {}
    for f in files:
        out.update(load_file(str(save_dir / "hf" / f)))
    return out


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_a_killed_worker_is_restarted_and_the_run_resumes_exactly(tmp_path):
    killed, killed_dir = _train(tmp_path, "killed", KILL_AT)
    # the first attempt failed (the agent says so), the second resumed from the last complete checkpoint
    assert "failed (exitcode" in killed.stderr, killed.stderr[-4000:]
    assert "resumed     from step 3 (" in killed.stdout, killed.stdout[-3000:]
    plain, plain_dir = _train(tmp_path, "plain", 0)
    assert "failed (exitcode" not in plain.stderr and "resumed" not in plain.stdout, plain.stdout[-2000:]
    got, want = _steps(killed_dir), _steps(plain_dir)
    assert sorted(want) == list(range(1, STEPS + 1)) and got == want, (got, want)
    a, b = _weights(killed_dir), _weights(plain_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        [k for k in a if not torch.equal(a[k], b[k])]
    assert sorted(os.listdir(killed_dir / "checkpoints")) == sorted(os.listdir(plain_dir / "checkpoints"))
