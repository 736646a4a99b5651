"""Checkpoints complete or absent, checked before a resume -- file work only, no processes (the
distributed save failures are in test_fault_suite.py): a re-save never deletes the complete
checkpoint before its replacement is committed (a crash between the two renames leaves one); a
truncated, corrupt or missing file is refused at --resume naming it, and --resume-fallback takes the
newest intact one; --resume auto starts afresh without a checkpoint; another dp resumes when a
step reads the same rows, and is refused otherwise naming the option."""

import os

import pytest
import torch

from seqpar.train import checkpoint as ckpt
from seqpar.train.config import TrainConfig
from seqpar.train.job import check_resumable, prepare_job
from seqpar.train.manifest import files_of_rank, write_manifest


def _fake_checkpoint(save_dir, step, cfg, *, dp=1, world=1, folder=None):
    """A checkpoint laid out as save_checkpoint writes one (random bytes for the DCP shards), with manifests."""
    path = os.path.join(ckpt.checkpoint_root(str(save_dir)), folder or f"step_{step:08d}")
    os.makedirs(path)
    torch.save({"config": cfg.to_dict(), "dp": dp, "sp": 1, "world": world, "step": step, "scheduler": {}},
               os.path.join(path, ckpt.TRAINER_FILE))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(os.urandom(100))
    for r in range(world):
        with open(os.path.join(path, f"__{r}_0.distcp"), "wb") as f:
            f.write(os.urandom(3000 + step))
        torch.save({"rank": r}, os.path.join(path, f"rng_rank{r}.pt"))
        write_manifest(path, r, files_of_rank(path, r, [ckpt.TRAINER_FILE, ".metadata"] if r == 0 else []))
    return path


def test_a_resave_keeps_a_complete_checkpoint_at_every_moment(tmp_path, monkeypatch):
    cfg = TrainConfig(seq_len=64)
    old = _fake_checkpoint(tmp_path, 4, cfg)
    tmp = _fake_checkpoint(tmp_path, 4, cfg, folder=".tmp-step_00000004")
    renames = []
    real = os.rename

    def crash_on_commit(src, dst):
        renames.append(os.path.basename(dst))
        if os.path.basename(src).startswith(".tmp-"):
            raise KeyboardInterrupt  # killed between moving the old one aside and committing the new one
        real(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_commit)
    with pytest.raises(KeyboardInterrupt):
        ckpt._commit(str(tmp_path), tmp, old, keep=2)
    assert renames == [".replaced-step_00000004", "step_00000004"]
    (step, path), = ckpt.complete_checkpoints(str(tmp_path))  # the moved-aside one still counts
    assert step == 4 and os.path.basename(path) == ".replaced-step_00000004" and ckpt.damaged(path) == []
    monkeypatch.setattr(os, "rename", real)
    ckpt._commit(str(tmp_path), tmp, old, keep=2)  # the next save of that step commits and cleans up
    assert sorted(os.listdir(ckpt.checkpoint_root(str(tmp_path)))) == ["step_00000004"]
    assert ckpt.complete_checkpoints(str(tmp_path)) == [(4, old)]


def test_damaged_names_every_damaged_file(tmp_path):
    cfg = TrainConfig(seq_len=64)
    path = _fake_checkpoint(tmp_path, 2, cfg, world=2)
    assert ckpt.damaged(path) == []
    shard = os.path.join(path, "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(1000)
    with open(os.path.join(path, ".metadata"), "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    os.remove(os.path.join(path, "rng_rank1.pt"))
    bad = ckpt.damaged(path)
    assert f"__1_0.distcp: 1000 bytes, {3002} written (truncated)" in bad
    assert ".metadata: corrupt (its CRC-32 differs from the one written)" in bad
    assert "rng_rank1.pt: missing" in bad and len(bad) == 3
    os.remove(os.path.join(path, "manifest_rank1.json"))
    assert any("manifest_rank1.json: missing" in b for b in ckpt.damaged(path))
    with open(os.path.join(path, ckpt.TRAINER_FILE), "wb") as f:
        f.write(b"not a pickle")
    assert ckpt.damaged(path)[0].startswith("trainer.pt: unreadable")


def test_resume_refuses_a_damaged_checkpoint_and_falls_back_only_if_asked(tmp_path):
    cfg = TrainConfig(seq_len=64, steps=20, save_dir=str(tmp_path), nproc=1, sp=1)
    good = _fake_checkpoint(tmp_path, 4, cfg)
    latest = _fake_checkpoint(tmp_path, 8, cfg)
    with open(os.path.join(latest, "__0_0.distcp"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"step_00000008 is damaged \(__0_0.distcp: 10 bytes, 3008 written "
                                         r"\(truncated\)\): --resume-fallback .* \(step 4 is the next to try\)"):
        prepare_job(cfg.replace(resume=True))
    job = prepare_job(cfg.replace(resume=True, resume_fallback=True))
    assert (job.resume_from, job.resume_step) == (good, 4)
    assert any("skipped the damaged checkpoint" in n and "step_00000008" in n for n in job.resume_notes)
    with open(os.path.join(good, ".metadata"), "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="every checkpoint .* is damaged"):
        prepare_job(cfg.replace(resume=True, resume_fallback=True))
    with pytest.raises(ValueError, match="--resume-fallback chooses the checkpoint --resume continues from"):
        prepare_job(cfg.replace(resume_fallback=True))


def test_resume_auto_continues_if_it_can_and_starts_afresh_otherwise(tmp_path):
    cfg = TrainConfig(seq_len=64, steps=20, save_dir=str(tmp_path), nproc=1, sp=1, resume="auto")
    fresh = prepare_job(cfg)
    assert fresh.resume_from is None and fresh.replaces == ()
    with pytest.raises(ValueError, match="no complete checkpoint .* --resume auto: continue if there is one"):
        prepare_job(cfg.replace(resume=True))
    path = _fake_checkpoint(tmp_path, 6, cfg.replace(resume=False))
    assert prepare_job(cfg).resume_from == path
    with pytest.raises(ValueError, match="--resume takes no value or 'auto'"):
        prepare_job(cfg.replace(resume="always"))


def test_another_dp_resumes_when_a_step_reads_the_same_rows(tmp_path):
    cfg = TrainConfig(seq_len=64, steps=20, save_dir=str(tmp_path), nproc=1, sp=1)
    job = prepare_job(cfg.replace(grad_accum=2))  # dp 1 x 2 micro-batches: the rows dp 2 x 1 read
    state = {"config": cfg.to_dict(), "dp": 2, "sp": 1, "step": 3}
    (note,) = check_resumable(job, state, "ckpt")
    assert "dp 2 -> 1, --grad-accum 1 -> 2" in note and "DCP reshards" in note
    with pytest.raises(ValueError, match=r"rows per step.*use --grad-accum 2 \(the rows per step must stay"):
        check_resumable(prepare_job(cfg), state, "ckpt")
    assert check_resumable(prepare_job(cfg), {**state, "dp": 1}, "ckpt") == []  # nothing changed: no note
