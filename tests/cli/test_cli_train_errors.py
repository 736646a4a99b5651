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
    # fine-tuning data and checkpoints (issue 25)
    from datasets import Dataset

    Dataset.from_list([{"body": "no text column"}]).to_parquet(str(d / "nocol.parquet"))
    (d / "role.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                           {"role": "bot", "content": "yo"}]}) + "\n")
    (d / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": "yo"}]}) + "\n")
    (d / "data.parquet.txt").write_bytes(b"PAR1\x15\x04\x15\x00\x15\x02")
    (d / "noprefix.jsonl").write_text(json.dumps({"chosen": "yes", "rejected": "no"}) + "\n")
    (d / "rollouts.jsonl").write_text("".join(json.dumps({"prompt_ids": [5, 6, 7], "completion_ids": [8] * n,
                                                          "reward": float(n)}) + "\n" for n in (2, 40)))
    (d / "noweights").mkdir()
    model.config.save_pretrained(d / "noweights")
    (d / "notcausal").mkdir()
    import transformers

    transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(d / "notcausal")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(d / "notcausal" / "model.safetensors"))
    import shutil

    shutil.copytree(d / "ckpt", d / "ckpt_tok")
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, "hi": 4, "yo": 5}
    word = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    word.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=word, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                            unk_token="[UNK]").save_pretrained(d / "ckpt_tok")  # a tokenizer without a chat template
    shutil.copytree(d / "ckpt", d / "earlier" / "checkpoints" / "step_00000007")
    torch.save({"step": 7}, d / "earlier" / "checkpoints" / "step_00000007" / "trainer.pt")
    (d / "exported" / "hf").mkdir(parents=True)
    (d / "exported" / "hf" / "config.json").write_text("{}")
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
    # issue 25: fine-tuning data, checkpoints, save dirs and options
    "parquet without the text column": (lambda d: ["--data", str(d / "nocol.parquet")],
                                        ["nocol.parquet", "no 'text' column", "['body']", "--text-field"]),
    "binary file named as text": (lambda d: ["--data", str(d / "data.parquet.txt")],
                                  ["data.parquet.txt", "binary file", "*.parquet"]),
    "chat row with an unknown role": (lambda d: ["--data", str(d / "role.jsonl")],
                                      ["role.jsonl:1", "messages[1]", "'bot'", "rename it"]),
    "chat data for a built-in's bytes": (lambda d: ["--data", str(d / "chat.jsonl")],
                                         ["chat.jsonl:1", "needs a transformers tokenizer", "--tokenizer DIR"]),
    "chat data, template-less tokenizer": (lambda d: ["--model", str(d / "ckpt_tok"), "--data", str(d / "chat.jsonl"),
                                                      "--seq-len", "32"], ["TokenizersBackend", "no chat template",
                                                                           "--chat-template"]),
    "checkpoint without weights": (lambda d: ["--model", str(d / "noweights"), "--seq-len", "32"],
                                   ["noweights", "holds no weights"]),
    "config that is not a causal LM": (lambda d: ["--model", str(d / "notcausal"), "--seq-len", "32"],
                                       ["notcausal", "cannot build a causal LM", "ViTConfig"]),
    "save dir holding checkpoints": (lambda d: ["--save-dir", str(d / "earlier")],
                                     ["holds 1 checkpoint of an earlier run", "step 7", "--resume", "--overwrite"]),
    "resume and overwrite": (lambda d: ["--resume", "--overwrite"], ["--resume", "--overwrite", "choose one"]),
    "resume auto and overwrite": (lambda d: ["--resume", "auto", "--overwrite"], ["--resume", "--overwrite"]),
    "resume fallback without resume": (lambda d: ["--resume-fallback"],
                                       ["--resume-fallback chooses the checkpoint", "give --resume too"]),
    "save dir holding an export": (lambda d: ["--save-dir", str(d / "exported")],
                                   ["holds an earlier run's export", "--overwrite"]),
    "lora alpha without rank": (lambda d: ["--lora-alpha", "16"], ["--lora-alpha", "without --lora-r"]),
    "lora rank negative": (lambda d: ["--lora-r", "-1"], ["--lora-r must be >= 0"]),
    "eval every negative": (lambda d: ["--eval-every", "-1"], ["--eval-every must be >= 0"]),
    "adam eps zero": (lambda d: ["--adam-eps", "0"], ["--adam-eps must be > 0", "got 0.0"]),
    "tokenizer dir missing": (lambda d: ["--tokenizer", str(d / "none")], ["--tokenizer", "no such directory"]),
    "chat template for bytes": (lambda d: ["--chat-template", str(d / "good.txt"), "--data", str(d / "good.txt")],
                                ["--chat-template needs a transformers tokenizer"]),
    "lora targets matching nothing": (lambda d: ["--lora-r", "2", "--lora-targets", "nope"],
                                      ["--lora-targets nope", "not found"]),
    # issue 49: TRL's formats and RL rollouts
    "implicit prompt sharing nothing": (lambda d: ["--objective", "dpo", "--data", str(d / "noprefix.jsonl"),
                                                   "--seq-len", "64"], ["noprefix.jsonl:1", "share no beginning"]),
    "rollout longer than the row": (lambda d: ["--objective", "grpo", "--data", str(d / "rollouts.jsonl"),
                                               "--seq-len", "32"], ["rollouts.jsonl:2", "--seq-len 32"]),
    "ppo on rewards": (lambda d: ["--objective", "ppo", "--data", str(d / "rollouts.jsonl"), "--seq-len", "64"],
                       ["rollouts.jsonl:1", "per completion token", "--objective grpo"]),
    "an rl option for dpo": (lambda d: ["--objective", "dpo", "--kl-coef", "0.1"],
                             ["--kl-coef does nothing for --objective dpo", "--objective grpo / ppo"]),
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


def test_problem_only_a_worker_sees_is_reported_once(files):
    """A bad option the parent did not check (a job prepared with other options than it runs with):
    the workers find it -- peft, once the model is built -- and it comes back as one ValueError."""
    import dataclasses

    from seqpar.train.config import TrainConfig
    from seqpar.train.job import prepare_job
    from seqpar.train.launcher import run_local

    cfg = TrainConfig(seq_len=32, steps=1, progress=False, save_dir=str(files / "w"))
    job = dataclasses.replace(prepare_job(cfg), cfg=cfg.replace(lora_r=2, lora_targets=["nope"]))
    with pytest.raises(ValueError, match="--lora-targets nope: Target modules {'nope'} not found"):
        run_local(job)


def test_vocabulary_checked_against_the_ids_the_data_uses(files, capsys, tmp_path):
    """The byte tokenizer of a checkpoint without its own: text whose bytes reach id 198 does not fit
    the checkpoint's 128 embeddings (found before any worker starts); plain ASCII text does."""
    (tmp_path / "accents.txt").write_text("caf\u00e9 na\u00efve")
    code, err = _run(capsys, "--model", str(files / "ckpt"), "--data", str(tmp_path / "accents.txt"), "--seq-len",
                     "32", "--steps", "1", "--save-dir", str(files / "w"))
    _assert_one_line(code, err, "the data uses token ids up to 198", "embeds 128", "its own tokenizer")
    from seqpar.train.config import TrainConfig
    from seqpar.train.job import prepare_job

    job = prepare_job(TrainConfig(model=str(files / "ckpt"), data=[str(files / "good.txt")], seq_len=32,
                                  save_dir=str(tmp_path / "w")))
    assert job.data.max_token_id < 128 < job.data.vocab_size == 259  # fits: only the ids used count


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
    from seqpar.integrations.models import BUILTIN_MODELS

    flat = " ".join(out.split())
    for name in BUILTIN_MODELS:
        assert name in flat, name
    for words in ("*.parquet, *.arrow and datasets.save_to_disk directories", "*.jsonl / *.json",
                  "binary files are refused", "at most a tenth of the rows", "{% generation %}"):
        assert words in flat, words
