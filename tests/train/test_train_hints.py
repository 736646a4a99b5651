"""Every hint of a ``seqpar train`` error that names an option is taken at its word: the suggested
command gets past that error (and, followed to the end, runs). Two hints that contradict each other
-- the first asking for an option the second then refuses -- fail here.

Each case is a chain of (the error's hint, the change it suggests), run through the CLI's own
parser and ``prepare_job`` (everything a job checks before any process starts), ending in a command
that prepares."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from chat_fixtures import TEMPLATE, chat_tokenizer, chats, write_jsonl

from seqpar.cli.main import build_parser
from seqpar.cli.train import config_from_args
from seqpar.train.job import prepare_job


def _error(args: list[str]) -> str | None:
    """The ValueError ``seqpar train ARGS`` stops with before any worker starts, or None."""
    ns = build_parser().parse_args(["train", *args])
    try:
        prepare_job(config_from_args(ns))
    except ValueError as e:
        return str(e)
    return None


def _drop(*flags: str):
    """The hint "leave it out": each of ``flags`` removed with the value after it."""
    def fix(args: list[str]) -> list[str]:
        out, i = [], 0
        while i < len(args):
            if args[i] in flags:
                i += 2
                continue
            out.append(args[i])
            i += 1
        return out
    return fix


def _drop_flag(*flags: str):
    """A value-less switch left out."""
    return lambda args: [a for a in args if a not in flags]


def _add(*more: str):
    return lambda args: [*args, *more]


def _number_after(pattern: str):
    """The hint "use --opt >= N": ``--opt N`` from the message (set where it was, or added)."""
    def fix(args: list[str], message: str) -> list[str]:
        m = re.search(pattern, message)
        assert m, (pattern, message)
        flag, value = m.group(1), m.group(2)
        out = list(args)
        if flag in out:
            out[out.index(flag) + 1] = value
            return out
        return [*out, flag, value]
    return fix


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hints")

    write_jsonl(d / "chat.jsonl", [{"messages": c} for c in chats(6)])
    write_jsonl(d / "text.jsonl", [{"text": "hello how are you"}] * 12)
    write_jsonl(d / "pairs.jsonl", [{"prompt": "what is two plus two", "chosen": " four", "rejected": " five"}] * 12)
    chat_tokenizer(template=None).save_pretrained(d / "tok_no_template")  # a tokenizer without a chat template
    (d / "template.jinja").write_text(TEMPLATE)
    earlier = d / "earlier" / "checkpoints" / "step_00000007"
    earlier.mkdir(parents=True)
    (earlier / "trainer.pt").write_bytes(b"")
    (earlier / "COMPLETE").write_text("")
    return d


def _cases(d) -> dict[str, tuple[list[str], list[tuple[str, object]]]]:
    """name -> (the command, [(the hint the error holds, the change it suggests)])."""
    save = ["--save-dir", str(d / "run")]
    chat = ["--data", str(d / "chat.jsonl"), "--seq-len", "64"]
    return {
        # the pair issue 45 found: chat data on a built-in asks for a tokenizer first, then its template
        "chat data on a built-in, then a tokenizer without a template": (chat + save, [
            ("give --tokenizer DIR", _add("--tokenizer", str(d / "tok_no_template"))),
            ("give --chat-template FILE", _add("--chat-template", str(d / "template.jinja")))]),
        "a chat template on a built-in's bytes": (
            ["--data", str(d / "text.jsonl"), "--seq-len", "64", "--chat-template", str(d / "template.jinja"), *save],
            [("--tokenizer DIR", _add("--tokenizer", str(d / "tok_no_template")))]),
        "seq len below the sp degree, then the task": (["--seq-len", "1", *save], [
            ("use --seq-len >=", _number_after(r"use (--seq-len) >= (\d+)")),
            ("copy task: use --seq-len >=", _number_after(r"use (--seq-len) >= (\d+)"))]),
        "seq len below the preference demo": (["--objective", "dpo", "--seq-len", "3", *save],
                                              [("use --seq-len >=", _number_after(r"use (--seq-len) >= (\d+)"))]),
        "sp not dividing the world": (["--sp", "3", "--nproc", "2", *save],
                                      [("choose --sp in", _drop("--sp"))]),
        "dp times sp not the world": (["--sp", "2", "--dp", "2", "--nproc", "2", *save],
                                      [("use --dp 1 or omit it", _drop("--dp"))]),
        "hybrid below sp 4": (["--strategy", "hybrid", *save], [("use ulysses or ring", _drop("--strategy"))]),
        "model config vocab below the data": (["--model-config", '{"vocab_size": 8}', *save],
                                              [("or leave it out", _drop("--model-config"))]),
        "model config positions below seq len": (["--model-config", '{"max_position_embeddings": 16}', *save],
                                                 [("raise it or leave it out", _drop("--model-config"))]),
        "resume without a checkpoint": (["--resume", *save], [("run without --resume", _drop_flag("--resume"))]),
        "save dir of an earlier run": (["--save-dir", str(d / "earlier")],
                                       [("--overwrite deletes it", _add("--overwrite"))]),
        "resume and overwrite": (["--resume", "--overwrite", *save],
                                 [("--overwrite deletes it: choose one", _drop_flag("--resume"))]),
        "lora alpha without a rank": (["--lora-alpha", "16", *save], [("set --lora-r R", _add("--lora-r", "2"))]),
        "beta for sft": (["--beta", "0.2", *save], [("use --objective dpo", _add("--objective", "dpo"))]),
        "dpo loss for simpo": (["--objective", "simpo", "--dpo-loss", "ipo", "--seq-len", "64", *save],
                               [("use --objective dpo", _add("--objective", "dpo"))]),
        "train-on for pairs": (["--objective", "dpo", "--train-on", "all", "--seq-len", "64", *save],
                               [("leave it out", _drop("--train-on"))]),
        "packing the copy task": (["--packing", *save], [("leave it out, or give --data", _drop_flag("--packing"))]),
        "token budget on the static schedule": (["--token-budget", "4096", *save],
                                                [("give --sp-schedule dynamic too", _add("--sp-schedule", "dynamic"))]),
        "cost model on the static schedule": (["--cost-model", "builtin", *save],
                                              [("give --sp-schedule dynamic too", _add("--sp-schedule", "dynamic"))]),
        "dynamic with hybrid": (["--sp-schedule", "dynamic", "--strategy", "hybrid", "--sp", "4", *save],
                                [("use --strategy ulysses or ring", _add("--strategy", "ring"))]),
        "dynamic orpo": (["--objective", "orpo", "--sp-schedule", "dynamic", "--seq-len", "64", *save],
                         [("use --sp-schedule static", _add("--sp-schedule", "static"))]),
        "token budget below a row": (["--sp-schedule", "dynamic", "--token-budget", "100", *save],
                                     [("use --token-budget >=", _number_after(r"use (--token-budget) >= (\d+)"))]),
        "a measured cost model on tiny bins": (["--sp-schedule", "dynamic", "--seq-len", "16", *save],
                                               [("use --cost-model builtin", _add("--cost-model", "builtin"))]),
        "bfloat16 without FSDP2": (["--dtype", "bfloat16", "--fsdp", "off", *save],
                                   [("use --fsdp auto or on", _add("--fsdp", "on"))]),
        "a reward head with LoRA": (["--objective", "reward", "--lora-r", "2", "--seq-len", "64", *save],
                                    [("leave out --lora-r", _drop("--lora-r"))]),
        "preference data for sft": (["--data", str(d / "pairs.jsonl"), "--seq-len", "64", *save],
                                    [("--objective dpo", _add("--objective", "dpo"))]),
    }


CASE_NAMES = list(_cases(Path("/x")))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_each_hint_taken_at_its_word_gets_past_its_error(files, name):
    args, chain = _cases(files)[name]
    for hint, fix in chain:
        message = _error(args)
        assert message is not None and hint in message, (args, hint, message)
        args = fix(args, message) if fix.__code__.co_argcount == 2 else fix(args)
        after = _error(args)
        assert after != message, (args, message)
    assert _error(args) is None, (args, _error(args))
    shutil.rmtree(files / "run", ignore_errors=True)


def test_every_case_names_an_option():
    for name, (_, chain) in _cases(Path("/x")).items():
        assert all(re.search(r"--[a-z]|leave it out|omit it|ulysses or ring", hint) for hint, _ in chain), name
    assert json.dumps(CASE_NAMES)
