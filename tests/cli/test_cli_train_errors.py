"""Bad input to seqpar train: one clear line naming the problem, exit code 2, no traceback -- checked in
the parent before any worker starts (and, for what only a worker can see, reported once)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from seqpar.cli.main import main

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes


def _run(capsys, *args):
    code = main(["train", "--no-progress", *args])
    err = capsys.readouterr().err
    return code, err


def _assert_one_line(code, err, *needles):
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("seqpar train: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "empty.txt").write_text("   \n")
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n')
    (d / "nofield.jsonl").write_text('{"text": "fine"}\n{"body": "no text field here"}\n')
    (d / "notstr.jsonl").write_text('{"text": 17}\n')
    (d / "good.txt").write_text("hello world\n")
    (d / "opts.yaml").write_text("seq_len: 64\nbogus_option: 3\n")
    (d / "opts.toml").write_text("seq-len = 'long'\n")
    (d / "notajson").mkdir()
    # a local checkpoint: positions up to 64, 128 token ids, no tokenizer
    from seqpar.integrations.models import build_model

    model, _ = build_model("tiny-llama", max_position_embeddings=64)
    model.save_pretrained(d / "ckpt")
    return d


CASES = {
    "missing data file": (lambda d: ["--data", str(d / "nope.jsonl")], ["nope.jsonl", "no such file"]),
    "empty data file": (lambda d: ["--data", str(d / "empty.txt")], ["empty.txt", "is empty"]),
    "malformed jsonl line": (lambda d: ["--data", str(d / "bad.jsonl")], ["bad.jsonl:3:", "not valid JSON"]),
    "jsonl without the text field": (lambda d: ["--data", str(d / "nofield.jsonl")],
                                     ["nofield.jsonl:2:", "'text'", "--text-field"]),
    "jsonl text not a string": (lambda d: ["--data", str(d / "notstr.jsonl")], ["notstr.jsonl:1:", "string"]),
    "data is a directory": (lambda d: ["--data", str(d / "notajson")], ["is a directory"]),
    "seq len below the sp degree": (lambda d: ["--seq-len", "1"], ["--seq-len 1", "--sp 2"]),
    "seq len below the task": (lambda d: ["--seq-len", "4"], ["--seq-len 4", "copy task"]),
    "seq len below ring shards": (lambda d: ["--seq-len", "3", "--strategy", "ring", "--sp", "4", "--nproc", "4"],
                                  ["--seq-len 3", "doc-zigzag", "--seq-len >= 4"]),
    "sp not dividing the world": (lambda d: ["--sp", "3", "--nproc", "2"], ["--sp 3", "world size 2"]),
    "dp times sp not the world": (lambda d: ["--sp", "2", "--dp", "2", "--nproc", "2"], ["--dp 2"]),
    "hybrid needs sp 4": (lambda d: ["--strategy", "hybrid"], ["hybrid", "--sp"]),
    "model path missing": (lambda d: ["--model", str(d / "no-such-model")], ["no-such-model", "built-in"]),
    "model dir not a checkpoint": (lambda d: ["--model", str(d / "notajson")], ["not a loadable"]),
    "seq len beyond the checkpoint": (lambda d: ["--model", str(d / "ckpt"), "--seq-len", "128"],
                                      ["--seq-len 128", "max_position_embeddings 64"]),
    "model config not json": (lambda d: ["--model-config", "{hidden"], ["--model-config", "JSON"]),
    "model config vocab below the data": (lambda d: ["--model-config", '{"vocab_size": 8}'],
                                          ["vocab_size 8", "67 token ids", "--model-config"]),
    "model config positions below seq len": (lambda d: ["--model-config", '{"max_position_embeddings": 16}'],
                                             ["max_position_embeddings 16", "--seq-len 4096"]),
    "config unknown key": (lambda d: ["--config", str(d / "opts.yaml")], ["bogus_option", "unknown option"]),
    "config wrong type": (lambda d: ["--config", str(d / "opts.toml")], ["seq-len", "int"]),
    "config missing": (lambda d: ["--config", str(d / "none.yaml")], ["none.yaml", "no such file"]),
    "resume without checkpoint": (lambda d: ["--resume", "--save-dir", str(d / "fresh")], ["--resume", "no complete"]),
    "steps zero": (lambda d: ["--steps", "0"], ["--steps"]),
    "loss tile zero": (lambda d: ["--loss-tile", "0"], ["--loss-tile must be >= 1"]),
    "mlp tile negative": (lambda d: ["--mlp-tile", "-2", "--no-tiled-loss"], ["--mlp-tile must be >= 1"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_clear_line(files, capsys, name):
    args, needles = CASES[name]
    code, err = _run(capsys, *args(files))
    _assert_one_line(code, err, *needles)


def test_resume_with_other_options_is_refused(files, capsys, tmp_path):
    """A checkpoint written with other options (here: --seq-len) is not silently continued."""
    from seqpar.train.config import TrainConfig

    ck = tmp_path / "checkpoints" / "step_00000003"
    ck.mkdir(parents=True)
    old = TrainConfig(seq_len=64, save_dir=str(tmp_path)).to_dict()
    torch.save({"config": old, "dp": 1, "step": 3, "scheduler": {}}, ck / "trainer.pt")
    code, err = _run(capsys, "--resume", "--save-dir", str(tmp_path), "--seq-len", "128")
    _assert_one_line(code, err, "--seq-len 64 -> 128")
    code, err = _run(capsys, "--resume", "--save-dir", str(tmp_path), "--seq-len", "64", "--dp", "2", "--nproc", "4")
    _assert_one_line(code, err, "dp=1", "--dp 1")


def test_problem_only_a_worker_sees_is_reported_once(files, capsys):
    """The byte tokenizer needs 259 ids, the checkpoint has 128: found after the model loads in the
    workers, reported as one line."""
    code, err = _run(capsys, "--model", str(files / "ckpt"), "--data", str(files / "good.txt"), "--seq-len", "32",
                     "--steps", "1", "--save-dir", str(files / "w"))
    _assert_one_line(code, err, "259 token ids", "128")


def test_real_process_prints_one_line(files):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-m", "seqpar.cli.main", "train", "--data", str(files / "bad.jsonl")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and "bad.jsonl:3:" in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_help_documents_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    from seqpar.train.config import FIELDS

    for name in FIELDS:
        assert "--" + name.replace("_", "-") in out, name
    assert out.count("(default:") >= len(FIELDS)
    assert json.dumps(4096) in out  # the default sequence length is shown
