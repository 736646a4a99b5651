"""What a run writes beside its checkpoints, in one process: metrics.jsonl lines (steps and
evaluations, cut back on resume), tensorboard and wandb (offline, no network) with the same values,
the loss plot."""

import importlib.util
import json
import os

import pytest

from seqpar.train.report import EvalResult, MetricsLog, plot_losses, read_metrics


def _log_run(save_dir, report_to, steps=(1, 2, 3), resumed_step=None):
    log = MetricsLog(str(save_dir), report_to, resumed_step=resumed_step, config={"steps": 3})
    if resumed_step is None:
        log.eval(0, EvalResult(loss=5.0, accuracy=0.0, targets=10))
    for s in steps:
        log.train({"step": s, "loss": 5.0 - s, "lr": 0.1 * s, "grad_norm": 1.0, "tokens_per_s": 100.0})
        if s % 2 == 0:
            log.eval(s, EvalResult(loss=4.5 - s, accuracy=0.1 * s, targets=10))
    log.close()


def test_metrics_lines_and_resume_cut(tmp_path):
    _log_run(tmp_path, "none")
    train, evals = read_metrics(str(tmp_path))
    assert [m["step"] for m in train] == [1, 2, 3] and [m["step"] for m in evals] == [0, 2]
    assert evals[1] == {"step": 2, "eval_loss": 2.5, "eval_accuracy": 0.2, "eval_targets": 10}
    _log_run(tmp_path, "none", steps=(2, 3), resumed_step=1)  # as a run resumed from step 1's checkpoint
    train, evals = read_metrics(str(tmp_path))
    assert [m["step"] for m in train] == [1, 2, 3] and [m["step"] for m in evals] == [0, 2]
    png = plot_losses(str(tmp_path))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed "
                    "(pip install 'seqpar[logging]')")
def test_tensorboard_gets_the_same_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_run(tmp_path, "tensorboard")
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(0, 5.0), (2, 2.5)]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "eval/accuracy"} <= set(acc.Tags()["scalars"])


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed (pip install "
                    "'seqpar[logging]'; it is left out of the dev extra for its size)")
def test_wandb_offline_without_a_network(tmp_path, monkeypatch):
    """No credentials: the run is logged offline into <save-dir>/wandb (wandb sync can upload it later)."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc credentials either
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log_run(tmp_path, "wandb")
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1, os.listdir(tmp_path / "wandb")
    files = os.listdir(tmp_path / "wandb" / runs[0])
    data = [f for f in files if f.endswith(".wandb")]
    assert data and os.path.getsize(tmp_path / "wandb" / runs[0] / data[0]) > 0
    with open(tmp_path / "metrics.jsonl") as f:
        assert len([json.loads(line) for line in f]) == 5  # the same lines as without wandb
