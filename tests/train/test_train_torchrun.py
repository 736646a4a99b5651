"""seqpar train under torchrun (gloo on this CPU: the path GPUs take with NCCL), and option sources:
a YAML / TOML config file under the command line."""

import os
import shutil
import subprocess
import sys

import pytest

from seqpar.cli.main import build_parser
from seqpar.cli.train import config_from_args

TORCHRUN = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")


def _torchrun(*args, timeout=180):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([TORCHRUN, "--nproc-per-node", "2", "-m", "seqpar.cli.main", "train", "--no-progress",
                           *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.heavy  # a whole script or launcher run (make verify): make test stays under 10 minutes
@pytest.mark.distributed
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_torchrun_trains_and_reports_once(tmp_path):
    p = _torchrun("--seq-len", "32", "--steps", "3", "--save-every", "2", "--save-dir", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("seqpar train: 3 steps") == 1, p.stdout  # rank 0 only
    assert "sp=2 x dp=1" in p.stdout and "held-out" in p.stdout
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000002", "step_00000003"]


@pytest.mark.heavy  # a whole script or launcher run (make verify): make test stays under 10 minutes
@pytest.mark.distributed
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
def test_torchrun_bad_input_said_once(tmp_path):
    p = _torchrun("--data", str(tmp_path / "missing.jsonl"))
    assert p.returncode != 0
    assert p.stderr.count("seqpar train: error:") == 1 and "missing.jsonl" in p.stderr, p.stderr
    # torchrun itself reports a failed child with its own traceback; none comes from the ranks
    assert "seqpar/train" not in p.stderr and "seqpar/cli" not in p.stderr, p.stderr


@pytest.mark.parametrize("ext, text", [("yaml", "seq_len: 512\nlr: 0.001\ndata: [a.jsonl, b.txt]\nsteps: 5\n"),
                                       ("toml", 'seq-len = 512\nlr = 1e-3\ndata = ["a.jsonl", "b.txt"]\nsteps = 5\n')])
def test_config_file_then_command_line(tmp_path, ext, text):
    path = tmp_path / f"opts.{ext}"
    path.write_text(text)
    args = build_parser().parse_args(["train", "--config", str(path), "--steps", "9"])
    cfg = config_from_args(args)
    assert cfg.seq_len == 512 and cfg.lr == 1e-3 and cfg.data == ["a.jsonl", "b.txt"]
    assert cfg.steps == 9  # the command line wins
    assert cfg.sp == 2  # untouched options keep their defaults
