"""seqpar train for fine-tuning, on 2 gloo workers (one launch for the whole module): chat data with
packing against the unsharded model (float32, 1e-6), LoRA against the same LoRA model unsharded
(float64, with and without FSDP2), and a LoRA chat run with periodic evaluation, tensorboard and
--export-hf: resumed exactly, its export reloaded in a fresh process giving the run's held-out loss,
and `seqpar export` writing the same files from the checkpoint."""

import json
import os
import subprocess
import sys

import pytest
import torch
from chat_fixtures import chat_checkpoint, chats, write_jsonl

from seqpar.batch.targets import IGNORE_INDEX as IGNORE
from seqpar.comm.launch import run_distributed
from seqpar.train import TrainConfig
from seqpar.train.job import make_data, prepare_job
from seqpar.train.loop import _gather_stats, run_training, start_run
from seqpar.train.report import read_metrics
from seqpar.train.tokenizer import HFTokenizer, encode_records, load_hf_tokenizer

pytestmark = pytest.mark.distributed

LORA = dict(lora_r=4, lora_alpha=8.0)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _first_step(cfg, world):
    """Step 1 on this rank: the global loss, the full batch, the full gradients of what trains, and
    the full state dict (the unsharded reference is built from it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    trainer = start_run(prepare_job(cfg, world))
    batch = trainer.steps.micro_batches(0)[0]  # dp = 1: every rank reads the whole batch
    share, _ = trainer.steps.forward_backward(0)
    loss, _, _ = _gather_stats(trainer.ctx, share)
    grads = {n: _full(p.grad).detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    return {"loss": loss, "batch": batch, "grads": grads, "state": {k: v.clone() for k, v in state.items()},
            "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)}


def _own_loop(world, out_dir):
    """seqpar's API in a user's own loop: parallelize / unparallelize a peft PeftModel, and
    seqpar.save_pretrained of a model sharded by FSDP2 after an optimizer step."""
    from peft import LoraConfig, get_peft_model

    import seqpar
    from seqpar.integrations.models import build_model

    mesh = seqpar.init_mesh(sp=world)
    torch.manual_seed(0)
    base, _ = build_model("tiny-llama")
    loss_function = base.loss_function
    peft = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    out = {"parallelized": seqpar.parallelize(peft, mesh) is peft, "kernel": seqpar.attention_kernel(peft)}
    out["sp_loss"] = float(peft(**seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss.detach())
    out["unparallelized"] = seqpar.unparallelize(peft) is peft
    out["restored"] = (base.config._attn_implementation, base.loss_function is loss_function)
    out["plain_loss"] = float(peft(input_ids=ids, labels=ids).loss.detach())
    model, _ = build_model("tiny-llama")
    seqpar.parallelize(model, mesh)
    seqpar.apply_fsdp(model, mesh)
    model(**seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh)).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    out["saved"] = seqpar.save_pretrained(model, out_dir, mesh)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out["state"] = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return out


def _finetune(rank, world, cases, runs, out_dir):
    out = {"own_loop": _own_loop(world, out_dir)}
    out.update({name: _first_step(cfg, world) for name, cfg in cases.items()})
    for name, (cfg, stop_after) in runs.items():  # one after the other, as torchrun ranks run them
        out[name] = run_training(prepare_job(cfg, world), stop_after=stop_after)
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("finetune")
    ckpt = chat_checkpoint(tmp / "ckpt")
    data = write_jsonl(tmp / "chat.jsonl", [{"messages": c} for c in chats(40)])
    base = TrainConfig(model=ckpt, data=[data], packing=True, seq_len=64, sp=2, micro_batch=2, progress=False,
                       plot=False, loss_tile=24, mlp_tile=16, save_dir=str(tmp / "unused"))
    cases = {"chat": base.replace(dtype="float32", seq_len=128),  # several chats per row
             "lora": base.replace(dtype="float64", **LORA),
             "lora_fsdp": base.replace(dtype="float64", fsdp="on", **LORA)}
    run = base.replace(steps=5, lr=1e-2, warmup=1, save_every=2, eval_every=2, eval_rows=4, report_to="tensorboard",
                       export_hf=True, plot=True, **LORA)
    runs = {"straight": (run.replace(save_dir=str(tmp / "straight")), None),
            "first_part": (run.replace(save_dir=str(tmp / "parts"), export_hf=False), 3),
            "resumed": (run.replace(save_dir=str(tmp / "parts"), resume=True), None)}
    results = run_distributed(_finetune, 2, cases, runs, str(tmp / "own_loop"), timeout=600)[0]
    return {"tmp": tmp, "ckpt": ckpt, "data": data, "cases": cases, "runs": runs, **results}


def _doc_spans(row):
    """``(start, end)`` of each document of a packed row (positions restart at 0), padding left out."""
    n = int(row["attention_mask"].sum())
    starts = (row["position_ids"][:n] == 0).nonzero().flatten().tolist() + [n]
    return list(zip(starts, starts[1:], strict=False))


def _reference_loss(model, batch):
    """The unsharded model's loss on a packed batch: each document alone through the plain
    transformers model (no seqpar), the token-weighted mean of every target's NLL."""
    total, count = 0.0, 0
    for row in range(batch["input_ids"].shape[0]):
        r = {k: v[row] for k, v in batch.items()}
        for a, b in _doc_spans(r):
            ids, labels = r["input_ids"][a:b], r["labels"][a:b]
            logits = model(input_ids=ids[None]).logits[0]  # [n, V]
            targets = labels[1:]
            keep = targets != IGNORE
            logp = torch.log_softmax(logits[:-1].double(), dim=-1)
            total = total - logp[keep].gather(1, targets[keep][:, None]).sum()
            count += int(keep.sum())
    return total / count


def test_chat_rows_hold_the_chats_and_step_1_loss_equals_the_unsharded_model(env):
    """Chat data, packed, sp=2 (float32): every document of step 1's rows is a tokenized chat (truncated
    to --seq-len) with its assistant-only targets, and the loss is the plain model's, document by
    document, within 1e-6."""
    from transformers import AutoModelForCausalLM

    got = env["chat"]
    tok = load_hf_tokenizer(env["ckpt"])
    from seqpar.train.formats import read_records

    n = env["cases"]["chat"].seq_len  # chats are truncated to it (--overflow auto)
    docs = {(tuple(d.ids[:n]), tuple(i if t else IGNORE for i, t in zip(d.ids[:n], d.targets[:n], strict=True)))
            for d in encode_records(read_records([env["data"]]), HFTokenizer(tok), "responses")}
    batch = got["batch"]
    seen = 0
    for row in range(batch["input_ids"].shape[0]):
        for a, b in _doc_spans({k: v[row] for k, v in batch.items()}):
            assert (tuple(batch["input_ids"][row, a:b].tolist()), tuple(batch["labels"][row, a:b].tolist())) in docs
            seen += 1
    assert seen > batch["input_ids"].shape[0]  # packed: some row holds several chats
    model = AutoModelForCausalLM.from_pretrained(env["ckpt"], dtype=torch.float32)
    with torch.no_grad():
        ref = float(_reference_loss(model, batch))
    assert abs(got["loss"] - ref) <= 1e-6, (got["loss"], ref)


@pytest.mark.parametrize("name", ["lora", "lora_fsdp"])
def test_lora_step_equals_the_same_lora_model_unsharded(env, name):
    """LoRA at sp=2 (float64; replicated, and FSDP2 with the base read by rank 0): only the adapters
    train, and their gradients and the loss are those of the same LoRA model without seqpar."""
    from transformers import AutoModelForCausalLM

    from seqpar.train.lora import add_lora

    got, cfg = env[name], env["cases"][name]
    assert got["trainable"] and all(".lora_" in n for n in got["trainable"])
    assert set(got["grads"]) == set(got["trainable"])  # the frozen base gets no gradient
    model = AutoModelForCausalLM.from_pretrained(env["ckpt"], dtype=torch.float64)
    add_lora(model, cfg)
    model.load_state_dict(got["state"], strict=True)  # the adapters' values as seqpar drew them
    loss = _reference_loss(model, got["batch"])
    loss.backward()
    assert abs(got["loss"] - float(loss.detach())) <= 1e-9, (got["loss"], float(loss.detach()))
    params = dict(model.named_parameters())
    worst = max(float((got["grads"][n] - params[n].grad).abs().max()) for n in got["grads"])
    assert worst <= 1e-8, worst
    assert max(float(g.abs().max()) for n, g in got["grads"].items() if ".lora_B." in n) > 1e-4  # not trivially zero


def test_peft_model_parallelized_and_restored_and_save_pretrained_under_fsdp2(env):
    """parallelize(PeftModel) runs its inner transformers model under SP (the loss equals the plain
    PeftModel's after unparallelize, which restores attention and loss); seqpar.save_pretrained of an
    FSDP2-sharded model writes the full weights a fresh from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    got = env["own_loop"]
    assert got["parallelized"] and got["unparallelized"] and got["restored"] == ("sdpa", True)
    assert "sdpa" in got["kernel"]
    assert abs(got["sp_loss"] - got["plain_loss"]) <= 1e-6, (got["sp_loss"], got["plain_loss"])
    assert got["saved"] == str(env["tmp"] / "own_loop")
    loaded = AutoModelForCausalLM.from_pretrained(got["saved"]).state_dict()
    assert set(loaded) == set(got["state"]) and all(torch.equal(loaded[k], got["state"][k]) for k in loaded)


def test_lora_run_resumes_exactly_and_trains_adapters_only(env):
    straight, _ = read_metrics(env["runs"]["straight"][0].save_dir)
    parts, _ = read_metrics(env["runs"]["resumed"][0].save_dir)
    assert [m["step"] for m in parts] == [1, 2, 3, 4, 5]
    for a, b in zip(straight, parts, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a, b)
    assert env["resumed"].resumed_step == 3 and env["resumed"].final_eval == env["straight"].final_eval
    s = env["straight"]
    assert s.lora == "LoRA r=4, alpha=8 on all-linear" and 0 < s.trainable < s.params / 10
    assert s.last_loss < s.first_loss
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from seqpar.train.checkpoint import load_model_weights
    from seqpar.train.lora import add_lora

    base = load_file(os.path.join(env["ckpt"], "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(env["ckpt"])
    add_lora(model, env["runs"]["straight"][0])
    load_model_weights(s.checkpoint, model)
    for name, t in model.state_dict().items():
        if ".lora_" not in name:
            assert torch.equal(t, base[name.replace(".base_layer.", ".")]), name  # the base is frozen
    assert max(float(t.abs().max()) for n, t in model.state_dict().items() if ".lora_B." in n) > 0


def test_evaluations_metrics_summary_plot_and_tensorboard(env):
    s, save_dir = env["straight"], env["runs"]["straight"][0].save_dir
    train, evals = read_metrics(save_dir)
    assert [m["step"] for m in train] == [1, 2, 3, 4, 5]
    assert [m["step"] for m in evals] == [0, 2, 4, 5]  # before training, --eval-every 2, the final one
    assert [(st, e.loss) for st, e in s.evals] == [(m["step"], m["eval_loss"]) for m in evals[1:]]
    assert evals[-1]["eval_loss"] == s.final_eval.loss and evals[0]["eval_loss"] == s.first_eval.loss
    summary = json.load(open(os.path.join(save_dir, "summary.json")))
    assert summary["final_eval"]["loss"] == s.final_eval.loss and summary["steps"] == 5
    assert summary["export"] == s.export and summary["lora"] == s.lora
    with open(s.plot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(save_dir, "tensorboard"))
    acc.Reload()
    for tag, key, lines in (("train/loss", "loss", train), ("eval/loss", "eval_loss", evals)):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [m["step"] for m in lines]
        assert [e.value for e in events] == pytest.approx([m[key] for m in lines], rel=1e-7)  # stored as float32


RELOAD = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(sys.argv[1])
rows = torch.load(sys.argv[2])
total, count = 0.0, 0
with torch.no_grad():
    for r in rows:
        n = int(r["attention_mask"].sum())
        starts = (r["position_ids"][:n] == 0).nonzero().flatten().tolist() + [n]
        for a, b in zip(starts, starts[1:]):
            logits = model(input_ids=r["input_ids"][a:b][None]).logits[0, :-1].double()
            targets = r["labels"][a + 1:b]
            keep = targets != -100
            total -= torch.log_softmax(logits, -1)[keep].gather(1, targets[keep][:, None]).sum().item()
            count += int(keep.sum())
print(repr(total / count), len(tok))
"""


def test_export_reloads_in_a_fresh_process_with_the_runs_held_out_loss(env, tmp_path):
    """--export-hf (LoRA merged): AutoModelForCausalLM.from_pretrained in a new process, on the run's
    held-out rows, gives the loss the run reported at its end."""
    s = env["straight"]
    cfg = env["runs"]["straight"][0]
    held_out = make_data(cfg, load_hf_tokenizer(cfg.model)).eval
    torch.save(held_out, tmp_path / "rows.pt")
    files = set(os.listdir(s.export))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files, files
    p = subprocess.run([sys.executable, "-c", RELOAD, s.export, str(tmp_path / "rows.pt")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 0, p.stderr
    loss, vocab = p.stdout.split()
    assert int(vocab) == len(load_hf_tokenizer(cfg.model))
    assert abs(float(loss) - s.final_eval.loss) <= 1e-6, (float(loss), s.final_eval.loss)


def test_seqpar_export_writes_the_same_model_and_the_adapter(env, tmp_path, capsys):
    from safetensors.torch import load_file

    from seqpar.cli.main import main

    s = env["straight"]
    assert main(["export", s.checkpoint, "--out", str(tmp_path / "merged")]) == 0
    assert "LoRA adapters merged" in capsys.readouterr().out
    a, b = load_file(os.path.join(s.export, "model.safetensors")), load_file(str(tmp_path / "merged/model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    save_dir = env["runs"]["straight"][0].save_dir  # a save dir: its latest checkpoint
    assert main(["export", save_dir, "--out", str(tmp_path / "adapter"), "--lora-export", "adapter"]) == 0
    assert "AutoPeftModelForCausalLM" in capsys.readouterr().out
    from peft import AutoPeftModelForCausalLM

    merged = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).merge_and_unload().state_dict()
    assert set(merged) == set(a) and max(float((merged[k] - a[k]).abs().max()) for k in a) <= 1e-6
    assert main(["export", s.checkpoint, "--out", str(tmp_path / "adapter")]) == 2
    assert "not empty" in capsys.readouterr().err
