"""``seqpar verify`` for vision-language models: ``--model DIR`` on a local VLM checkpoint checks it
with images (loss and every gradient, vision tower included, against the same checkpoint
unsharded); a family seqpar refuses with images exits 1 naming the mechanism. ``--vlm-zoo``'s
table and closing count (the whole zoo runs in test_vlm.py's grids and `make verify`)."""

import pytest

from seqpar.cli.main import main
from seqpar.cli.verify_vlm import print_rows, summary
from seqpar.testing.vlm_parity import VlmParityRow
from seqpar.testing.vlm_zoo import build_tiny_vlm, is_vlm_checkpoint


@pytest.mark.distributed
@pytest.mark.heavy  # ~25 s (two processes, a checkpoint): the engine itself runs in test_vlm.py's P = 2 grid
def test_verify_a_local_vlm_checkpoint_with_images(tmp_path, capsys):
    # Qwen3-VL: M-RoPE positions from its rope index, deepstack features, images and a video
    build_tiny_vlm("qwen3_vl").save_pretrained(tmp_path / "qwen3_vl")
    assert is_vlm_checkpoint(str(tmp_path / "qwen3_vl"))
    assert main(["verify", "--model", str(tmp_path / "qwen3_vl"), "--nproc", "2", "--strategy", "ring"]) == 0
    out = capsys.readouterr().out
    assert "with images" in out and " ring " in out and "1 exact (families)" in out
    assert "qwen3_vl: placeholder merge, M-RoPE, deepstack" in out


@pytest.mark.distributed
@pytest.mark.heavy
def test_verify_a_refused_vlm_checkpoint_names_the_mechanism(tmp_path, capsys):
    # Ovis2: encoder outputs beside the image features, refused by that mechanism (exit 1); Gemma 3,
    # refused here before seqpar had bidirectional spans, is exact now (test_vlm.py's grid)
    build_tiny_vlm("ovis2").save_pretrained(tmp_path / "ovis2")
    assert main(["verify", "--model", str(tmp_path / "ovis2"), "--nproc", "2"]) == 1
    out = capsys.readouterr().out
    assert "refused" in out and "encoder outputs beside" in out


def test_vlm_zoo_table_counts_families_and_fails_on_a_mismatch(capsys):
    rows = [VlmParityRow("exact", loss_diff=1e-16, grad_max=2e-16, family="qwen2_vl", strategy=s, p=2)
            for s in ("ulysses", "ring")]
    rows += [VlmParityRow("refused", "seqpar: bidirectional attention", family="gemma3", strategy=s, p=2)
              for s in ("ulysses", "ring")]
    rows += [VlmParityRow("unbuildable", "AttributeError: ...", family="chameleon", strategy="-", p=2)]
    assert summary(rows, print_rows(rows), "families", 2) == 0
    out = capsys.readouterr().out
    assert "3 families at P=2: 1 exact, 1 refused, 1 unbuildable (families)" in out
    assert "placeholder merge, M-RoPE" in out  # qwen2_vl's mechanisms, from the family table
    bad = rows + [VlmParityRow("mismatch", "worst x", 1e-3, 1e-3, family="llava", strategy="ring", p=2)]
    assert summary(bad, print_rows(bad), "families", 2) == 1
    assert summary(rows[2:4], print_rows(rows[2:4]), "checkpoint", 2, strict=True) == 1
