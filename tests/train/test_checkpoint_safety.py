"""Checkpoints are data, never code: a 2-step run's checkpoint with one file replaced by a pickle
that would create a file when loaded is refused at --resume and at seqpar export, naming the file,
and the file is never created; on every rank when the workers read it; DCP's non-tensor items too."""

import os
import pickle
import shutil

import pytest
import torch
from torch import nn

from seqpar.cli.main import main
from seqpar.comm.launch import run_distributed
from seqpar.train import TrainConfig
from seqpar.train import checkpoint as ckpt
from seqpar.train.export import export_checkpoint
from seqpar.train.job import prepare_job
from seqpar.train.launcher import run_local
from seqpar.train.safe_load import PickledObject, check_plain, dcp_load, pickled_globals

pytestmark = pytest.mark.distributed  # the run and the resume start gloo workers


class _Payload:
    """Unpickling it runs ``open(marker, "w")``: a file appears if anything loads it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


OPTIONS = dict(seq_len=16, micro_batch=2, steps=2, save_every=1, progress=False, plot=False, eval_rows=2,
               tiled_loss=False, tiled_mlp=False, checkpoint="none")
CLI = ["--seq-len", "16", "--micro-batch", "2", "--steps", "2", "--save-every", "1", "--no-progress", "--no-plot",
       "--eval-rows", "2", "--no-tiled-loss", "--no-tiled-mlp", "--checkpoint", "none"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 2-step seqpar train run of 2 ranks (checkpoints at steps 1 and 2)."""
    save_dir = tmp_path_factory.mktemp("safety") / "run"
    run_local(prepare_job(TrainConfig(save_dir=str(save_dir), **OPTIONS)))
    return save_dir


def _poisoned(run_dir, tmp_path, name, raw):
    """A copy of the run whose latest checkpoint's ``name`` is a payload pickle (``raw``: pickle.dumps,
    else torch.save); returns (save dir, the poisoned file, the marker the payload would create)."""
    save_dir = tmp_path / "run"
    shutil.copytree(run_dir, save_dir)
    latest = ckpt.latest_checkpoint(str(save_dir))
    marker = str(tmp_path / "payload-ran")
    target = os.path.join(latest, name)
    if raw:
        with open(target, "wb") as f:
            pickle.dump({"step": 2, "x": _Payload(marker)}, f)
    else:
        torch.save({"step": 2, "x": _Payload(marker)}, target)
    return save_dir, target, marker


@pytest.mark.parametrize("name,raw", [("trainer.pt", False), ("trainer.pt", True), ("rng_rank1.pt", False),
                                      (".metadata", True)])
def test_a_pickled_object_is_refused_at_resume_and_export(run_dir, tmp_path, capsys, name, raw):
    save_dir, target, marker = _poisoned(run_dir, tmp_path, name, raw)
    cfg = TrainConfig(save_dir=str(save_dir), resume=True, **OPTIONS)
    with pytest.raises(PickledObject, match="holds a pickled object") as e:
        prepare_job(cfg)
    assert target in str(e.value) and "io.open" in str(e.value)
    # --resume-fallback does not step around it: a pickled object is no accident to fall back from
    with pytest.raises(PickledObject):
        prepare_job(cfg.replace(resume_fallback=True))
    assert main(["train", "--resume", "--save-dir", str(save_dir), *CLI]) == 2
    assert target in capsys.readouterr().err
    with pytest.raises(ValueError, match="holds a pickled object") as e:
        export_checkpoint(str(save_dir), str(tmp_path / "hf"))
    assert target in str(e.value)
    assert main(["export", str(save_dir), "--out", str(tmp_path / "hf")]) == 2
    assert target in capsys.readouterr().err
    assert not os.path.exists(marker)
    assert not os.path.exists(tmp_path / "hf") or not os.listdir(tmp_path / "hf")


def test_the_intact_run_resumes_and_exports(run_dir, tmp_path):
    save_dir = tmp_path / "run"
    shutil.copytree(run_dir, save_dir)
    latest = ckpt.latest_checkpoint(str(save_dir))
    check_plain(latest)  # what seqpar train writes passes, DCP's .metadata included
    assert prepare_job(TrainConfig(save_dir=str(save_dir), resume=True, **OPTIONS)).resume_from == latest
    assert export_checkpoint(str(save_dir), str(tmp_path / "hf")).step == 2


def _load_on_every_rank(rank, world, path):
    model = nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    try:
        ckpt.load_checkpoint(path, model, opt, sched)
    except ValueError as e:
        return type(e).__name__, str(e)
    return None


def test_every_rank_refuses_in_the_workers(run_dir, tmp_path):
    """load_checkpoint (the workers' read) checks every file on every rank and agrees in one fence:
    rank 1's own RNG file poisoned, both ranks raise a ValueError naming it -- no hang."""
    save_dir, target, marker = _poisoned(run_dir, tmp_path, "rng_rank1.pt", raw=False)
    results = run_distributed(_load_on_every_rank, 2, ckpt.latest_checkpoint(str(save_dir)), pg_timeout=60)
    for kind, text in results:
        assert kind in ("ValueError", "PickledObject") and target in text
    assert not os.path.exists(marker)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_non_tensor_items_are_read_as_data(tmp_path):
    """DCP stores a state dict's non-tensor values (optimizer hyper-parameters) as torch.save bytes
    and its default planner reads them with weights_only=False; dcp_load refuses an object there."""
    import torch.distributed.checkpoint as dcp

    marker = str(tmp_path / "payload-ran")
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    dcp.save({"w": torch.ones(3), "lr": 0.5, "betas": (0.9, 0.99)}, checkpoint_id=good, no_dist=True)
    dcp.save({"w": torch.ones(3), "lr": _Payload(marker)}, checkpoint_id=bad, no_dist=True)
    state = {"w": torch.zeros(3), "lr": 0.0, "betas": (0.0, 0.0)}
    dcp_load(state, good, no_dist=True)
    assert state["lr"] == 0.5 and state["betas"] == (0.9, 0.99) and state["w"].sum() == 3
    with pytest.raises(PickledObject, match="lr") as e:
        dcp_load({"w": torch.zeros(3), "lr": 0.0}, bad, no_dist=True)
    assert bad in str(e.value)
    assert not os.path.exists(marker)


def test_pickled_globals_reads_names_without_running_them():
    assert pickled_globals(pickle.dumps({"a": [1, 2.0, "x"], "b": (None, True)})) == set()
    assert pickled_globals(pickle.dumps(_Payload("m"), protocol=0)) == {"io.open"}
    assert pickled_globals(pickle.dumps(_Payload("m"), protocol=4)) == {"io.open"}
    assert pickled_globals(b"not a pickle") is None
    # STACK_GLOBAL's operands not pushed right before it (here: popped pushes in between): not guessed
    tricky = b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x8c\x05torch\x8c\x07float320\x30\x93."
    assert pickled_globals(tricky) == {"?"}
