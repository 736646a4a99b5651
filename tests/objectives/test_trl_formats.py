"""TRL's data formats read as TRL reads them (:mod:`seqpar.objectives.trl_formats`): for each format --
standard and conversational, explicit and implicit prompt (Anthropic HH's shared turns, or shared
text), paired and unpaired preference, prompt-completion -- the tokens equal those TRL 1.16's own
dataset preparation makes (``DPOTrainer`` / ``KTOTrainer`` / ``SFTTrainer._prepare_dataset``, TRL's
``extract_prompt`` and ``unpair_preference_dataset``) with a tiny offline BPE tokenizer and chat
template. An implicit-prompt pair whose sides share nothing is a ValueError naming the row."""

from __future__ import annotations

import pytest
from trl_fixtures import chat_tokenizer, tiny_lm

from seqpar.objectives.trl_formats import (
    HFTokenizer,
    extract_prompt,
    kl_completions,
    tokenize_pair,
    tokenize_prompt_completion,
    unpair_rows,
    unpaired_rows,
)


def _u(text: str) -> dict:
    return {"role": "user", "content": text}


def _a(text: str) -> dict:
    return {"role": "assistant", "content": text}


PAIRS = {
    "text-explicit": [{"prompt": "what is two plus", "chosen": " two four", "rejected": " a cat"},
                      {"prompt": "tell me a story", "chosen": " once upon a time", "rejected": " be brief</s>"}],
    "text-implicit": [{"chosen": "what is two plus two four", "rejected": "what is two plus two the quick"},
                      {"chosen": "hello how are you fine thanks", "rejected": "hello how are you blue"},
                      {"chosen": "which color is the sky blue", "rejected": "which color is the skyline"}],
    "chat-explicit": [{"prompt": [_u("what is two plus two")], "chosen": [_a("four")], "rejected": [_a("a cat")]},
                      {"prompt": [{"role": "system", "content": "be brief"}, _u("hello")],
                       "chosen": [_a("fine thanks")], "rejected": [_a("the sky")]}],
    "chat-implicit": [  # Anthropic HH: both sides repeat the conversation, then differ in the last answer
        {"chosen": [_u("what is two plus two"), _a("four")], "rejected": [_u("what is two plus two"), _a("five")]},
        {"chosen": [_u("hello how are you"), _a("fine thanks"), _u("tell me a story"), _a("once upon a time")],
         "rejected": [_u("hello how are you"), _a("fine thanks"), _u("tell me a story"), _a("no")]}],
}
UNPAIRED = {
    "text": [{"prompt": "what is two plus", "completion": " two four", "label": True},
             {"prompt": "tell me a", "completion": " story", "label": False},
             {"prompt": "hello how", "completion": " are you", "label": True}],
    "chat": [{"prompt": [_u("what is two plus two")], "completion": [_a("four")], "label": False},
             {"prompt": [_u("name a fruit")], "completion": [_a("apple pear")], "label": True}],
}


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def trainers(tmp_path_factory, tok):
    """TRL's DPO, KTO and SFT trainers (their _prepare_dataset is what is compared)."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer

    out = str(tmp_path_factory.mktemp("formats"))
    common = dict(output_dir=out, report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=2)
    pairs = Dataset.from_list(PAIRS["text-explicit"])
    return {
        "dpo": DPOTrainer(model=tiny_lm(vocab=256), ref_model=tiny_lm(seed=1, vocab=256), args=DPOConfig(**common),
                          train_dataset=pairs, processing_class=tok),
        "kto": KTOTrainer(model=tiny_lm(vocab=256), ref_model=tiny_lm(seed=1, vocab=256),
                          args=KTOConfig(**common, loss_type="apo_zero_unpaired"),
                          train_dataset=Dataset.from_list(UNPAIRED["text"]), processing_class=tok),
        "sft": SFTTrainer(model=tiny_lm(vocab=256), args=SFTConfig(**common, shuffle_dataset=False),
                          train_dataset=Dataset.from_list(UNPAIRED["text"]).remove_columns("label"),
                          processing_class=tok),
    }


def _prepared(trainer, kind: str, rows: list[dict], tok) -> list[dict]:
    from datasets import Dataset

    data = Dataset.from_list(rows)
    if kind == "sft":
        return list(trainer._prepare_dataset(data, tok, trainer.args, False, None, "x"))
    return list(trainer._prepare_dataset(data, tok, trainer.args, "x"))


def _where(name: str, n: int) -> list[str]:
    return [f"{name}.jsonl:{i + 1}" for i in range(n)]


@pytest.mark.parametrize("name", list(PAIRS))
def test_preference_pairs_tokenize_as_dpo_trainer(trainers, tok, name):
    rows = PAIRS[name]
    want = _prepared(trainers["dpo"], "dpo", rows, tok)
    for row, w, where in zip(rows, want, _where(name, len(rows)), strict=True):
        got = tokenize_pair(row, HFTokenizer(tok), where)
        assert got == (w["prompt_ids"], w["chosen_ids"], w["rejected_ids"]), (name, row)
        assert got[0] and got[1] and got[2]


@pytest.mark.parametrize("name", ["text-implicit", "chat-implicit"])
def test_implicit_prompts_are_trls_extract_prompt(name):
    from trl.data_utils import extract_prompt as trl_extract

    for row, where in zip(PAIRS[name], _where(name, 9), strict=False):
        assert extract_prompt(row, where) == trl_extract(row)


@pytest.mark.parametrize("name", ["text", "chat"])
def test_unpaired_rows_tokenize_as_kto_trainer(trainers, tok, name):
    rows = UNPAIRED[name]
    want = _prepared(trainers["kto"], "kto", rows, tok)
    got = unpaired_rows(rows, _where(name, len(rows)))
    assert len(got) == len(want)
    for row, w in zip(got, want, strict=True):
        assert tokenize_prompt_completion(row, HFTokenizer(tok), "x") == (w["prompt_ids"], w["completion_ids"])
        assert row["label"] == w["label"]


@pytest.mark.parametrize("name", ["text-explicit", "chat-implicit"])
def test_paired_rows_unpair_for_kto_as_trl_does(trainers, tok, name):
    """KTO on a paired file: TRL extracts the prompt, unpairs (chosen rows, then rejected rows), tokenizes."""
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    rows = PAIRS[name]
    want = _prepared(trainers["kto"], "kto", rows, tok)
    got = unpaired_rows(rows, _where(name, len(rows)))
    assert [r["label"] for r in got] == [r["label"] for r in want] == [True] * len(rows) + [False] * len(rows)
    for row, w in zip(got, want, strict=True):
        assert tokenize_prompt_completion(row, HFTokenizer(tok), "x") == (w["prompt_ids"], w["completion_ids"])
    explicit = [extract_prompt(r, "x") if "prompt" not in r else r for r in rows]
    assert unpair_rows(explicit) == list(unpair_preference_dataset(Dataset.from_list(explicit)))


def test_kto_kl_completions_rotate_as_trls(trainers, tok):
    """KTO's KL estimate runs on completions rotated by one within each batch (TRL's data order)."""
    rows = UNPAIRED["text"] * 2  # 6 rows: batches of 2 (per_device_train_batch_size)
    kto = trainers["kto"]
    kto.calculate_KL = True
    try:
        want = _prepared(kto, "kto", rows, tok)
    finally:
        kto.calculate_KL = False
    completions = [tokenize_prompt_completion(r, HFTokenizer(tok), "x")[1] for r in rows]
    assert kl_completions(completions, 2) == [w["KL_completion_ids"] for w in want]
    assert kl_completions(completions, 2) != completions


def test_unpairing_keeps_trls_block_order():
    rows = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}", "id": i} for i in range(5)]
    got = unpair_rows(rows, block=2)
    assert [(r["completion"], r["label"], r["id"]) for r in got] == [
        ("c0", True, 0), ("c1", True, 1), ("r0", False, 0), ("r1", False, 1), ("c2", True, 2), ("c3", True, 3),
        ("r2", False, 2), ("r3", False, 3), ("c4", True, 4), ("r4", False, 4)]


@pytest.mark.parametrize("name", ["text", "chat"])
def test_prompt_completion_rows_tokenize_as_sft_trainer(trainers, tok, name):
    rows = [{k: v for k, v in r.items() if k != "label"} for r in UNPAIRED[name]]
    want = _prepared(trainers["sft"], "sft", rows, tok)
    for row, w in zip(rows, want, strict=True):
        p, c = tokenize_prompt_completion(row, HFTokenizer(tok), "x")  # SFT: labels -100 on the prompt
        assert p + c == w["input_ids"] and [-100] * len(p) + c == w["labels"]


NO_PREFIX = [
    ({"chosen": [_u("what is two plus two"), _a("four")], "rejected": [_u("hello"), _a("fine")]}, "messages"),
    ({"chosen": "four", "rejected": "nine"}, "text"),
    ({"chosen": " four", "rejected": " nine"}, "text"),  # only a space in common: it goes with the completions
    ({"chosen": [_u("hi")], "rejected": [_u("hi"), _a("there")]}, "messages"),  # TRL's prompt: no message
]


@pytest.mark.parametrize("row,what", NO_PREFIX)
def test_an_implicit_pair_sharing_nothing_is_a_value_error_naming_the_row(row, what):
    with pytest.raises(ValueError, match=rf"hh.jsonl:7: 'chosen' and 'rejected' share no beginning \({what}\)"):
        extract_prompt(row, "hh.jsonl:7")


def test_malformed_rows_are_value_errors_naming_the_row():
    with pytest.raises(ValueError, match="pairs.jsonl:2: 'chosen' and 'rejected' must both be strings or both"):
        extract_prompt({"chosen": "a b", "rejected": [_a("b")]}, "pairs.jsonl:2")
    with pytest.raises(ValueError, match="kto.jsonl:2: an unpaired preference row needs 'prompt', 'completion' and"):
        unpaired_rows([UNPAIRED["text"][0], {"prompt": "p", "completion": "c"}], ["kto.jsonl:1", "kto.jsonl:2"])
    with pytest.raises(ValueError, match="kto.jsonl:1: 'label' must be true"):
        unpaired_rows([{"prompt": "p", "completion": "c", "label": 1}], ["kto.jsonl:1"])
    with pytest.raises(ValueError, match="kto.jsonl:2: a file mixes paired"):
        unpaired_rows([UNPAIRED["text"][0], PAIRS["text-explicit"][0]], ["kto.jsonl:1", "kto.jsonl:2"])
