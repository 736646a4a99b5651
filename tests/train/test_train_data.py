"""Pure parts of seqpar train: the copy task's rows, documents into rows (packing, padding), the data
order, the learning-rate schedule, and one run with a checkpoint's own tokenizer (2 workers)."""

import json

import pytest
import torch

from seqpar.batch.targets import IGNORE_INDEX as IGNORE
from seqpar.train import TrainConfig
from seqpar.train.data import TextData, make_rows, read_documents
from seqpar.train.demo_data import BOS, SEP, CopyTask
from seqpar.train.sources import EVAL, row_index
from seqpar.train.step import lr_lambda
from seqpar.train.tokenizer import ByteTokenizer


def test_copy_rows_copy_and_answers_sit_span_plus_one_back():
    task = CopyTask(4096, seed=3)
    r = task.row(5)
    ids, labels = r["input_ids"], r["labels"]
    n = task.span
    assert ids.shape == (4096,) and ids[0] == BOS and ids[n + 1] == SEP
    assert torch.equal(ids[1:n + 1], ids[n + 2:2 * n + 2])
    where = (labels != IGNORE).nonzero().squeeze(1)
    assert len(where) == n and torch.equal(labels[where], ids[where - (n + 1)])
    assert torch.equal(task.row(5)["input_ids"], ids)  # a pure function of (seed, split, index)
    assert not torch.equal(task.row(5, EVAL)["input_ids"], ids) and not torch.equal(task.row(6)["input_ids"], ids)
    with pytest.raises(ValueError, match="--seq-len 3"):
        CopyTask(3)


def test_answer_accuracy_counts_only_targets():
    """The held-out accuracy's hits (the evaluation's CausalLM(accuracy=True) takes them from
    tiled_token_stats): the argmax is the target, counted where there is a target only."""
    from seqpar.batch.tiled_loss import Head, tiled_token_stats

    hidden = torch.eye(4, dtype=torch.float64)[None]  # [1, 4, 4]: token i's logits are row i of the weight
    weight = torch.zeros(5, 4, dtype=torch.float64)
    weight[torch.tensor([1, 2, 3, 4]), torch.arange(4)] = 1.0  # argmax of token i: i + 1
    _, correct = tiled_token_stats(hidden, Head(weight), torch.tensor([[1, IGNORE, 0, 4]]), tile=2)
    assert correct.tolist() == [[True, False, False, True]]


def test_rows_one_document_each_padded():
    rows = make_rows([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]], 4, packing=False, pad_id=0)
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 0], [4, 5, 6, 7], [8, 9, 10, 0]]
    assert rows[0]["attention_mask"].tolist() == [1, 1, 1, 0] and rows[0]["labels"].tolist() == [1, 2, 3, IGNORE]


def test_rows_packed_positions_restart_per_document():
    rows = make_rows([[1, 2, 3], [4, 5, 6, 7], [8, 9]], 5, packing=True, pad_id=0)
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert [r["position_ids"].tolist()[:4] for r in rows] == [[0, 1, 2, 0], [0, 1, 0, 1]]
    assert rows[1]["attention_mask"].tolist() == [1, 1, 1, 1, 0]


def test_text_data_order_is_an_epoch_shuffle_of_the_training_rows():
    rows = make_rows([[i, i + 1] for i in range(0, 40, 2)], 2, packing=False, pad_id=0)
    data = TextData(rows, seed=1, eval_rows=4, vocab_size=50, describe="")
    assert data.n_eval == 2 and len(data.train) == 18  # at most a tenth held out
    epoch0 = [tuple(data.row(k)["input_ids"].tolist()) for k in range(18)]
    epoch1 = [tuple(data.row(k)["input_ids"].tolist()) for k in range(18, 36)]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1 and len(set(epoch0)) == 18
    held = {tuple(r["input_ids"].tolist()) for r in data.eval}
    assert not held & set(epoch0)


def test_row_index_covers_every_row_once():
    seen = [row_index(s, m, d, b, grad_accum=2, dp=3, micro_batch=2)
            for s in range(2) for m in range(2) for d in range(3) for b in range(2)]
    assert sorted(seen) == list(range(24))


def test_lr_warmup_then_cosine():
    f = lr_lambda(TrainConfig(steps=100, warmup=10, min_lr_ratio=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.55) and f(100) == pytest.approx(0.1)


def test_read_documents_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("plain text document")
    (tmp_path / "b.jsonl").write_text('{"body": "one"}\n\n{"body": "two", "x": 1}\n')
    assert read_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], "body") == [
        "plain text document", "one", "two"]
    assert ByteTokenizer().encode("hi") == [1, 3 + ord("h"), 3 + ord("i"), 2]


@pytest.mark.distributed
def test_train_with_the_checkpoints_tokenizer(tmp_path):
    """A local checkpoint with its own tokenizer, packed JSONL data: the tokenizer's ids are used."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from seqpar.integrations.models import build_model
    from seqpar.train.job import prepare_job
    from seqpar.train.launcher import run_local

    words = "the quick brown fox jumps over lazy dog".split()
    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, **{w: i + 4 for i, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                                   unk_token="[UNK]")
    model, _ = build_model("tiny-llama", vocab_size=len(vocab), max_position_embeddings=64)
    model.save_pretrained(tmp_path / "ckpt")
    fast.save_pretrained(tmp_path / "ckpt")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": " ".join(words[i % 8:i % 8 + 3 + i % 4])}) for i in range(40)))
    cfg = TrainConfig(model=str(tmp_path / "ckpt"), data=[str(data)], packing=True, seq_len=32, steps=3,
                      progress=False, save_dir=str(tmp_path / "run"))
    s = run_local(prepare_job(cfg))
    assert s.steps == 3 and "(bytes)" not in s.data, s.data  # the checkpoint's tokenizer, not bytes
    assert all(loss > 0 for _, loss in s.losses)


def test_dtype_auto_is_bfloat16_on_cuda_only():
    from seqpar.train.config import resolve_dtype

    assert resolve_dtype(TrainConfig(), "cuda") == "bfloat16"
    assert resolve_dtype(TrainConfig(), "cpu") == "float32"
    assert resolve_dtype(TrainConfig(fsdp="off"), "cuda") == "float32"  # bf16 needs FSDP2's fp32 master weights
    assert resolve_dtype(TrainConfig(dtype="float64"), "cuda") == "float64"


def test_timeout_default_sized_by_device():
    from seqpar.train.config import CPU_TIMEOUT, CUDA_TIMEOUT, collective_timeout

    assert collective_timeout(TrainConfig(), "cpu") == CPU_TIMEOUT < CUDA_TIMEOUT == collective_timeout(
        TrainConfig(), "cuda")
    assert collective_timeout(TrainConfig(timeout=42.0), "cuda") == 42.0


def test_memory_switches_options():
    from seqpar.train.config import describe_memory, memory_options

    cfg = TrainConfig(checkpoint="offload", loss_tile=512)
    assert memory_options(cfg, "cuda") == dict(tiled_loss=True, tiled_mlp=True, checkpoint="offload", loss_tile=512,
                                               mlp_tile=cfg.mlp_tile)
    assert memory_options(cfg, "cpu")["checkpoint"] == "layers"  # host memory already holds the saved inputs
    off = TrainConfig(tiled_loss=False, tiled_mlp=False, checkpoint="none")
    assert memory_options(off, "cuda") is None and describe_memory(off).startswith("none")
    assert describe_memory(cfg) == "tiled loss (512 tokens), tiled MLP (tiles following the shard), checkpoint offload"
    assert "tiled MLP (96 tokens)" in describe_memory(cfg.replace(mlp_tile=96))


def test_builtin_keeps_its_vocabulary_and_small_llama3_its_shape():
    """The larger of the built-in's vocabulary and the data's, unless --model-config sets it (issue 11);
    small-llama3 is not resized to the CPU demo's size."""
    from seqpar.train.config import TRAIN_SIZE, builtin_fields

    big = TrainConfig(model="small-llama3")
    assert builtin_fields(big, 67)["vocab_size"] == 8192
    assert builtin_fields(big, 9000)["vocab_size"] == 9000
    assert builtin_fields(big.replace(model_config='{"vocab_size": 300}'), 67)["vocab_size"] == 300
    assert "hidden_size" not in builtin_fields(big, 67)
    tiny = builtin_fields(TrainConfig(seq_len=64), 259)
    assert tiny["vocab_size"] == 259 and tiny["max_position_embeddings"] == 64
    assert tiny["hidden_size"] == TRAIN_SIZE["hidden_size"]


def test_summary_reports_cuda_allocated_and_reserved():
    """On CUDA the closing report gives both allocator peaks per rank (reset after setup); on the CPU
    the peak RSS, which includes setup."""
    import dataclasses

    from seqpar.cli.train import format_summary
    from seqpar.train.loop import RunSummary

    base = {f.name: None for f in dataclasses.fields(RunSummary)}
    base.update(steps=2, losses=[(1, 2.0), (2, 1.5)], train_time_s=1.0, data="d", metrics="m", world=2, sp=2, dp=1,
                strategy="ulysses", layout="contiguous", params=10, fsdp=True, tokens_per_step=8,
                replaced_previous=False, reason="", attention="a", dtype="bfloat16", memory="checkpoint layers",
                setup_s=0.0, eval_s=0.0, peak_mem_mib=[100.0, 101.0], peak_reserved_mib=[120.0, 130.0])
    cuda = format_summary(RunSummary(**{**base, "device": "cuda:0"}))
    assert "rank 0: 100 / 120 MiB, rank 1: 101 / 130 MiB (CUDA allocated / reserved" in cuda
    assert "FSDP2, bfloat16)" in cuda and "memory      checkpoint layers" in cuda
    cpu = format_summary(RunSummary(**{**base, "device": "cpu"}))
    assert "rank 0: 100 MiB, rank 1: 101 MiB (peak RSS" in cpu


def test_resume_accepts_a_checkpoint_from_before_the_fine_tuning_options(tmp_path):
    """A checkpoint whose options lack those added since (tokenizer, LoRA, ...) ran at their defaults:
    resuming it with the defaults is the same run; with another value it is refused."""
    from seqpar.train.job import check_resumable, prepare_job

    cfg = TrainConfig(seq_len=64, save_dir=str(tmp_path))
    job = prepare_job(cfg)
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("tokenizer", "train_on", "overflow", "lora_r")}
    check_resumable(job, {"config": old, "dp": job.dp, "step": 1}, "ckpt")
    with pytest.raises(ValueError, match="--lora-r 0 -> 2"):
        check_resumable(prepare_job(cfg.replace(lora_r=2)), {"config": old, "dp": job.dp, "step": 1}, "ckpt")


def test_resume_accepts_a_checkpoint_with_another_mlp_tile(tmp_path):
    """A run from before the tiles followed the shard (--mlp-tile 2048 then) resumes: the MLP is per
    token, its tiles change no value; the change is said."""
    from seqpar.train.job import check_resumable, prepare_job

    cfg = TrainConfig(seq_len=64, save_dir=str(tmp_path))
    job = prepare_job(cfg)
    notes = check_resumable(job, {"config": {**cfg.to_dict(), "mlp_tile": 2048}, "dp": job.dp, "step": 1}, "ckpt")
    assert any("--mlp-tile 2048 -> following the shard" in n for n in notes)


def test_summary_and_banner_say_what_the_run_continued_replaced_trained_and_wrote(tmp_path):
    import dataclasses

    from seqpar.cli.train import describe_start, format_summary
    from seqpar.train.job import prepare_job
    from seqpar.train.loop import RunSummary
    from seqpar.train.report import EvalResult

    base = {f.name: None for f in dataclasses.fields(RunSummary)}
    ev = [(4, EvalResult(2.5, 0.1, 9)), (8, EvalResult(2.0, 0.2, 9))]
    base.update(steps=8, losses=[(5, 3.0), (8, 2.0)], train_time_s=1.0, data="d", metrics="m", world=2, sp=2, dp=1,
                strategy="ulysses", layout="contiguous", params=1000, trainable=40,
                lora="LoRA r=4, alpha=8 on all-linear", fsdp=False, tokens_per_step=8, replaced_previous=False,
                reason="", attention="a", dtype="float32",
                memory="m", setup_s=0.0, eval_s=0.0, peak_mem_mib=[], peak_reserved_mib=[], device="cpu",
                evals=ev, final_eval=ev[-1][1], resumed_from="/r/checkpoints/step_00000004", resumed_step=4,
                replaced_steps=[], export="/r/hf", export_lora="adapter", summary_file="/r/summary.json", plot=None)
    text = format_summary(RunSummary(**base))
    assert "1,000 parameters (40 trained: LoRA r=4, alpha=8 on all-linear)" in text
    assert "evaluations step 4: 2.5000, step 8: 2.0000 (held-out loss)" in text
    assert "resumed     from step 4 (/r/checkpoints/step_00000004)" in text
    assert "exported    /r/hf (peft's LoRA adapter" in text and "summary.json" in text
    merged = format_summary(RunSummary(**{**base, "export_lora": "merged", "replaced_steps": [2, 3]}))
    assert "(save_pretrained, LoRA merged: AutoModelForCausalLM" in merged
    assert "replaced    an earlier run's checkpoints (steps 2, 3; --overwrite)" in merged
    fresh = prepare_job(TrainConfig(seq_len=64, save_dir=str(tmp_path / "run")))
    job = dataclasses.replace(fresh, resume_from="/r/checkpoints/step_00000004",
                              resume_step=4)
    assert "seqpar train: resuming from step 4 (/r/checkpoints/step_00000004)" in describe_start(job)
