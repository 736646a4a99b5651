"""seqpar train's data, read by what it is (no worker processes): every file format into records, chat
and prompt/completion records into tokens and loss masks -- equal, token for token, to TRL's
SFTTrainer preparation of the same file with the same tokenizer -- and documents into rows
(packing keeps each conversation a document; the overflow policy)."""

import json
import os

import pytest
from chat_fixtures import PLAIN_TEMPLATE, chat_tokenizer, chats, write_jsonl

from seqpar.batch.targets import IGNORE_INDEX as IGNORE
from seqpar.train.data import build_rows, describe_rows, load_text_data, resolve_overflow
from seqpar.train.formats import CHAT, PROMPT_COMPLETION, TEXT, count_kinds, read_file, read_records
from seqpar.train.tokenizer import ByteTokenizer, Document, HFTokenizer, encode_records


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


# --------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------

def test_text_and_json_records(tmp_path):
    (tmp_path / "a.txt").write_text("plain text document")
    write_jsonl(tmp_path / "b.jsonl", [{"text": "one"}, {"messages": chats(1)[0]},
                                       {"prompt": "p", "completion": "c"},
                                       {"prompt": [{"role": "user", "content": "q"}],
                                        "completion": [{"role": "assistant", "content": "a"}]}])
    (tmp_path / "c.json").write_text(json.dumps([{"body": "x"}, {"body": chats(1)[0]}]))  # a JSON array
    recs = read_records([str(tmp_path / f) for f in ("a.txt", "b.jsonl")])
    assert [r.kind for r in recs] == [TEXT, TEXT, CHAT, PROMPT_COMPLETION, PROMPT_COMPLETION]
    assert recs[0].text == "plain text document" and recs[1].text == "one" and recs[2].messages == tuple(chats(1)[0])
    assert recs[3].prompt == "p" and recs[4].completion == ({"role": "assistant", "content": "a"},)
    assert recs[2].where.endswith("b.jsonl:2")
    arr = read_file(str(tmp_path / "c.json"), "body")  # --text-field naming a list of messages: chat
    assert [r.kind for r in arr] == [TEXT, CHAT] and arr[1].where.endswith("c.json[1]")
    assert count_kinds(recs) == {TEXT: 2, CHAT: 1, PROMPT_COMPLETION: 2}


def _dataset(rows):
    from datasets import Dataset

    return Dataset.from_list(rows)


def test_parquet_arrow_and_saved_datasets(tmp_path):
    rows = [{"text": "first"}, {"text": "second"}]
    ds = _dataset(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    from datasets import DatasetDict

    DatasetDict({"train": ds, "test": _dataset([{"text": "held"}])}).save_to_disk(str(tmp_path / "dict"))
    DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "nodtrain"))
    shard = next(f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow"))
    for path in ("d.parquet", "saved", f"saved/{shard}", "dict"):
        assert [r.text for r in read_file(str(tmp_path / path))] == ["first", "second"], path
    chat_rows = [{"messages": c} for c in chats(2)]
    _dataset(chat_rows).to_parquet(str(tmp_path / "chat.parquet"))
    got = read_file(str(tmp_path / "chat.parquet"))
    assert [r.kind for r in got] == [CHAT, CHAT] and [list(r.messages) for r in got] == chats(2)
    with pytest.raises(ValueError, match="'validation'.*no 'train'"):
        read_file(str(tmp_path / "nodtrain"))


BAD = {  # file name, content (bytes or rows), the words the error must hold
    "binary.txt": (b"PAR1\x15\x04\x00\x01", ["binary.txt", "binary file", "NUL byte", "*.parquet"]),
    "latin1.txt": ("caf\xe9".encode("latin-1"), ["latin1.txt", "not UTF-8"]),
    "role.jsonl": ([{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}],
                   ["role.jsonl:1", "messages[1]", "'bot'", "assistant"]),
    "content.jsonl": ([{"messages": [{"role": "user", "content": 3}]}], ["content.jsonl:1", "must be a string"]),
    "mixed.jsonl": ([{"prompt": "p", "completion": [{"role": "assistant", "content": "a"}]}],
                    ["both be strings or both lists"]),
    "notext.parquet": ([{"body": "x"}], ["notext.parquet", "no 'text' column", "['body']", "--text-field"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_files_are_refused_by_name(tmp_path, name):
    content, needles = BAD[name]
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif name.endswith(".parquet"):
        _dataset(content).to_parquet(str(path))
    else:
        write_jsonl(path, content)
    with pytest.raises(ValueError) as e:
        read_records([str(path)])
    for n in needles:
        assert n in str(e.value), (n, str(e.value))


def test_directory_that_is_not_a_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        read_file(str(tmp_path / "d"))


# --------------------------------------------------------------------------------------------
# tokens and loss masks, against TRL's SFTTrainer
# --------------------------------------------------------------------------------------------

def _trl_examples(tok, rows, tmp_path, **sft):
    """TRL's own preparation of ``rows`` (its train_dataset): input_ids and labels per example."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from seqpar.integrations.models import build_model

    model, _ = build_model("tiny-llama", vocab_size=len(tok))
    args = SFTConfig(output_dir=str(tmp_path / "trl"), packing=False, max_length=None, report_to=[], use_cpu=True,
                     **sft)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    return [(ex["input_ids"], ex["labels"]) for ex in trainer.train_dataset]


def _labels(doc: Document) -> list[int]:
    return [i if t else IGNORE for i, t in zip(doc.ids, doc.targets, strict=True)]


def test_chat_tokens_and_masks_equal_trls(tok, tmp_path):
    """Multi-turn chats (a system turn, two to four assistant turns): seqpar's tokens and targets are
    TRL's input_ids and labels with assistant_only_loss=True, example for example."""
    rows = [{"messages": c} for c in chats(10)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    docs = encode_records(read_records([path]), HFTokenizer(tok), "responses")
    ref = _trl_examples(tok, rows, tmp_path, assistant_only_loss=True)
    assert len(docs) == len(ref) == 10
    for doc, (ids, labels) in zip(docs, ref, strict=True):
        assert doc.ids == ids and _labels(doc) == labels
    assert sum(sum(d.targets) for d in docs) < sum(len(d.ids) for d in docs) / 2  # the prompts carry no loss
    every = encode_records(read_records([path]), HFTokenizer(tok), "all")
    assert [d.ids for d in every] == [d.ids for d in docs] and all(all(d.targets) for d in every)


def test_prompt_completion_equal_trls(tok, tmp_path):
    """Strings (EOS appended, the tokenizer's own special tokens) and messages (the prompt with the
    generation prompt): loss on the completion only, as TRL's completion_only_loss."""
    rows = [{"prompt": "what is two plus two", "completion": " four"},
            {"prompt": "tell me a story", "completion": " once upon a time"}]
    msgs = [{"prompt": c[:-1], "completion": c[-1:]} for c in chats(4)]
    for data in (rows, msgs):
        path = write_jsonl(tmp_path / "pc.jsonl", data)
        docs = encode_records(read_records([path]), HFTokenizer(tok), "responses")
        ref = _trl_examples(tok, data, tmp_path)
        for doc, (ids, labels) in zip(docs, ref, strict=True):
            assert doc.ids == ids and _labels(doc) == labels
            assert 0 < sum(doc.targets) < len(doc.ids)


def test_chat_needs_a_template_with_generation_markers(tok, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in chats(2)])
    recs = read_records([path])
    with pytest.raises(ValueError, match="has no chat template.*--chat-template"):
        encode_records(recs, HFTokenizer(chat_tokenizer(template=None)), "responses")
    with pytest.raises(ValueError, match="needs a transformers tokenizer .* give --tokenizer DIR"):
        encode_records(recs, ByteTokenizer(), "responses")
    with pytest.raises(ValueError, match=r"\{% generation %\}.*--train-on all"):
        encode_records(recs, HFTokenizer(chat_tokenizer(template=PLAIN_TEMPLATE)), "responses")
    docs = encode_records(recs, HFTokenizer(chat_tokenizer(template=PLAIN_TEMPLATE)), "all")  # no mask needed
    assert all(all(d.targets) for d in docs)


# --------------------------------------------------------------------------------------------
# documents into rows
# --------------------------------------------------------------------------------------------

def _docs(*lengths, prompt=2):
    """Documents of the given lengths, distinct ids, the first ``prompt`` tokens without a target."""
    out, start = [], 10
    for n in lengths:
        out.append(Document(list(range(start, start + n)), [i >= prompt for i in range(n)]))
        start += n
    return out


def test_packing_keeps_each_conversation_whole_with_its_mask():
    """truncate (the default for chats): a document never crosses a row edge; positions restart at
    each document and every token keeps its target or not."""
    docs = _docs(5, 4, 6, 3)
    rows, stats = build_rows(docs, 10, packing=True, pad_id=0, overflow="truncate")
    assert [r["input_ids"].tolist()[:9] for r in rows[:1]] == [list(range(10, 19))]
    assert rows[0]["position_ids"].tolist()[:9] == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert rows[0]["attention_mask"].tolist() == [1] * 9 + [0]  # the 6-token chat did not fit: next row
    assert rows[1]["position_ids"].tolist()[:9] == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    for row in rows:
        n = int(row["attention_mask"].sum())
        starts = (row["position_ids"][:n] == 0).nonzero().flatten().tolist() + [n]
        for a, b in zip(starts, starts[1:], strict=False):
            doc = next(d for d in docs if d.ids[0] == int(row["input_ids"][a]))
            assert row["input_ids"][a:b].tolist() == doc.ids and row["labels"][a:b].tolist() == _labels(doc)
    assert stats.longer == 0 and stats.rows == 2 and stats.targets == sum(sum(d.targets[1:]) for d in docs)


def test_overflow_split_or_truncate():
    docs = _docs(25, 4)
    rows, stats = build_rows(docs, 10, packing=False, pad_id=0, overflow="split")
    assert [int(r["attention_mask"].sum()) for r in rows] == [10, 10, 5, 4]
    assert (stats.longer, stats.pieces, stats.dropped_tokens) == (1, 3, 0)
    rows, stats = build_rows(docs, 10, packing=False, pad_id=0, overflow="truncate")
    assert [int(r["attention_mask"].sum()) for r in rows] == [10, 4]
    assert (stats.longer, stats.pieces, stats.dropped_tokens) == (1, 1, 15)
    rows, _ = build_rows(docs, 10, packing=True, pad_id=0, overflow="split")  # wraps at row edges (plain text)
    assert [r["position_ids"].tolist() for r in rows][2][:9] == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert resolve_overflow("auto", [TEXT]) == "split" and resolve_overflow("auto", [TEXT, CHAT]) == "truncate"
    assert "--overflow truncate: 1 longer than --seq-len 10 cut to it (15 tokens dropped" in describe_rows(
        {CHAT: 2}, stats, tokenizer="t", seq_len=10, packing=True, overflow="truncate", train_on="responses")


def test_a_chat_without_a_response_is_left_out_and_said(tok, tmp_path):
    only_user = [{"role": "user", "content": "hello"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in chats(20)] + [{"messages": only_user}])
    data = load_text_data([path], HFTokenizer(tok), text_field="text", train_on="responses", seq_len=64,
                          packing=True, overflow="auto", seed=0, eval_rows=8)
    what = data.describe()
    assert what.startswith("21 chats") and "(packed), loss on responses only" in what
    assert "1 without a target left out" in what and "--overflow truncate" in what
    assert "held-out row" in what and "capped at a tenth" in what  # --eval-rows 8 > a tenth of the rows
    assert data.max_token_id == max(int(r["input_ids"].max()) for r in data.train + data.eval) < len(tok)
    assert all(int((r["labels"] != IGNORE).sum()) > 0 for r in data.train)


def test_an_added_token_the_data_never_uses_is_not_refused(tmp_path):
    """A tokenizer with an added token past the model's vocabulary (Qwen2's tokenizer reports
    len(tok) == vocab_size + 1): only the ids the data really uses must have an embedding."""
    from chat_fixtures import chat_checkpoint

    from seqpar.train.config import TrainConfig
    from seqpar.train.job import prepare_job
    from seqpar.train.tokenizer import load_hf_tokenizer

    ckpt = chat_checkpoint(tmp_path / "ckpt", max_position_embeddings=64)
    tok = load_hf_tokenizer(ckpt)
    tok.add_tokens(["<|unused|>"])
    tok.save_pretrained(ckpt)
    assert len(load_hf_tokenizer(ckpt)) == 301
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over a lazy dog")
    (tmp_path / "b.txt").write_text("the quick <|unused|> fox")
    cfg = TrainConfig(model=ckpt, data=[str(tmp_path / "a.txt")], seq_len=32, save_dir=str(tmp_path / "run"))
    job = prepare_job(cfg)
    assert job.data.vocab_size == 301 and job.data.max_token_id < 300
    with pytest.raises(ValueError, match="token ids up to 300 .* embeds 300"):
        prepare_job(cfg.replace(data=[str(tmp_path / "b.txt")]))
