"""``seqpar train --objective``: preference pairs tokenized as TRL's DPOTrainer tokenizes them, and the
step-1 loss of dpo and reward equal to TRL's DPOTrainer / RewardTrainer on the same file, tokenizer and
initial weights (float32, 1e-6), at sp=2 with the memory switches on; the pairs packed; the options
refused with the option to change."""

import json

import pytest
import torch
from chat_fixtures import CHATS, chat_checkpoint, write_jsonl

from seqpar.comm.launch import run_distributed
from seqpar.train import TrainConfig
from seqpar.train.checks import check_config
from seqpar.train.job import prepare_job
from seqpar.train.loop import _gather_stats, run_training, start_run
from seqpar.train.objectives import units_in
from seqpar.train.preference_data import encode_pair, pair_units
from seqpar.train.tokenizer import HFTokenizer, load_hf_tokenizer

pytestmark = pytest.mark.distributed

TEXT_PAIRS = [
    {"prompt": "what is two plus two", "chosen": " four", "rejected": " the quick brown fox"},
    {"prompt": "which color is the sky", "chosen": " blue", "rejected": " apple pear plum and a lazy dog"},
    {"prompt": "tell me a story", "chosen": " once upon a time there was a cat", "rejected": " fine"},
    {"prompt": "name three fruits", "chosen": " apple pear plum", "rejected": " two"},
    {"prompt": "hello how are you", "chosen": " fine thanks", "rejected": " blue blue blue sky"},
]
N = len(TEXT_PAIRS)


def _chat_pairs():
    out = []
    for i, chat in enumerate(CHATS):
        answer = chat[-1]["content"] if chat[-1]["role"] == "assistant" else "four"
        other = CHATS[(i + 2) % len(CHATS)][-1]["content"]
        prompt = [m for m in chat if m["role"] != "assistant"][:2]
        out.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": answer}],
                    "rejected": [{"role": "assistant", "content": other}]})
    return out


def _implicit(pairs):
    """The same pairs in TRL's implicit-prompt format (Anthropic HH's): no "prompt", each side starting
    with it."""
    return [{"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]} for p in pairs]


def _first_step(cfg, world):
    trainer = start_run(prepare_job(cfg, world))
    batch = trainer.steps.micro_batches(0)[0]  # dp = 1: every rank reads the whole step
    share, units = trainer.steps.forward_backward(0)
    loss, _, _ = _gather_stats(trainer.ctx, share)
    trained = sorted(n for n, p in trainer.model.named_parameters() if p.grad is not None)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return {"loss": loss, "units": units, "batch": batch, "eval": trainer.evaluate(), "trained": trained,
            "held_out": list(getattr(trainer.data, "eval", [])), "grads": grads}


def _steps(rank, world, cases, demo):
    out = {name: _first_step(cfg, world) for name, cfg in cases.items()}
    if demo is not None:
        out["demo"] = run_training(prepare_job(demo, world))
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("objective")
    ckpt = chat_checkpoint(tmp / "ckpt")
    text = write_jsonl(tmp / "pairs.jsonl", TEXT_PAIRS)
    many = write_jsonl(tmp / "many.jsonl", TEXT_PAIRS * 4)  # a tenth held out: 2 pairs
    chat = write_jsonl(tmp / "chat_pairs.jsonl", _chat_pairs())
    implicit = write_jsonl(tmp / "implicit_pairs.jsonl", _implicit(TEXT_PAIRS))
    implicit_chat = write_jsonl(tmp / "implicit_chat_pairs.jsonl", _implicit(_chat_pairs()))
    base = TrainConfig(model=ckpt, data=[text], seq_len=48, sp=2, micro_batch=N, dtype="float32", progress=False,
                       plot=False, loss_tile=16, mlp_tile=16, save_dir=str(tmp / "unused"))
    # "sft" beside "sigmoid": at step 1 the policy is its reference, so the sigmoid loss alone is log 2
    # whatever the tokens; the chosen completions' NLL makes the step-1 loss depend on every log-prob
    dpo = base.replace(objective="dpo", dpo_loss="sigmoid,sft")
    cases = {"dpo": dpo, "dpo_chat": dpo.replace(data=[chat]),
             "dpo_implicit": dpo.replace(data=[implicit]), "dpo_chat_implicit": dpo.replace(data=[implicit_chat]),
             "dpo_packed": dpo.replace(packing=True, seq_len=256, micro_batch=1),  # every pair in one row
             "dpo64": dpo.replace(dtype="float64"),
             "dpo_lora": dpo.replace(lora_r=4, lora_alpha=8.0),  # the reference: the adapters off
             "reward": base.replace(objective="reward"),
             "dpo_eval": dpo.replace(data=[many]), "reward_eval": base.replace(objective="reward", data=[many])}
    demo = TrainConfig(objective="dpo", seq_len=64, steps=30, eval_every=10, progress=False, plot=False,
                       save_dir=str(tmp / "demo"))
    results = run_distributed(_steps, 2, cases, demo, timeout=600)[0]
    return {"tmp": tmp, "ckpt": ckpt, "text": text, "chat": chat, "cases": cases, **results}


def _trl_dpo(ckpt, data, seq_len, tmp):
    """TRL's DPOTrainer on the same file: its tokenized dataset and the loss of one batch of every pair."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    tok = load_hf_tokenizer(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    args = DPOConfig(output_dir=str(tmp / "trl"), per_device_train_batch_size=N, max_length=seq_len, beta=0.1,
                     loss_type=["sigmoid", "sft"], use_cpu=True, bf16=False, report_to=[], dataset_num_proc=None)
    trainer = DPOTrainer(model=model, args=args, train_dataset=load_dataset("json", data_files=data, split="train"),
                         processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss = float(trainer.compute_loss(trainer.model, batch))
    return trainer.train_dataset, loss


def _sequences(batch):
    """``{(ids, targets)}`` of a batch of units (padded rows, or packed documents)."""
    out = []
    for row in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][row].sum())
        ids, labels, pos = (batch[k][row, :n].tolist() for k in ("input_ids", "labels", "position_ids"))
        starts = [i for i, p in enumerate(pos) if p == 0] + [n]
        for a, b in zip(starts, starts[1:], strict=False):
            out.append((tuple(ids[a:b]), tuple(x != -100 for x in labels[a:b])))
    return sorted(out)


def _trl_sequences(dataset):
    out = []
    for ex in dataset:
        for c in (ex["chosen_ids"], ex["rejected_ids"]):
            out.append((tuple(ex["prompt_ids"] + c), tuple([False] * len(ex["prompt_ids"]) + [True] * len(c))))
    return sorted(out)


@pytest.mark.parametrize("name", ["dpo", "dpo_chat", "dpo_implicit", "dpo_chat_implicit"])
def test_dpo_tokens_and_step_1_loss_equal_trl(env, name):
    """Text and conversational pairs, with an explicit prompt or an implicit one (the two sides' shared
    beginning, which TRL extracts): every sequence of step 1 (its tokens and completion mask) is one
    of TRL's, all of them are there, and the step-1 loss (sp=2, tiled head and MLP, layer
    checkpoints) equals DPOTrainer's on the same pairs within 1e-6 (float32)."""
    cfg = env["cases"][name]
    dataset, want = _trl_dpo(env["ckpt"], cfg.data[0], cfg.seq_len, env["tmp"] / name)
    got = env[name]
    assert _sequences(got["batch"]) == _trl_sequences(dataset)
    assert got["units"] == N
    assert abs(want - 0.6931) > 0.5  # the NLL term counts
    assert abs(got["loss"] - want) <= 1e-6, (got["loss"], want)


def _logps(model, batch):
    """Each sequence's summed completion log-prob and its token count (float64), plain model, in the
    batch's order (c0 r0 c1 r1 ..., padded rows or packed documents)."""
    out = []
    for row in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][row].sum())
        starts = [i for i, p in enumerate(batch["position_ids"][row, :n].tolist()) if p == 0] + [n]
        for a, b in zip(starts, starts[1:], strict=False):  # each document (sequence) alone
            ids, labels = batch["input_ids"][row, a:b], batch["labels"][row, a:b]
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].to(torch.float64), -1)
            keep = labels[1:] != -100
            out.append((logp[keep].gather(1, labels[1:][keep][:, None]).sum(), keep.sum()))
    return out


def _check_dpo_gradients(got, ckpt, sp):
    """Step 1's loss and every gradient against DPO (sigmoid + sft) on the plain model (1e-10),
    back-propagated at the scale seqpar's loss carries (``sp`` x each rank's share, averaged by
    sync_gradients): Llama's RMSNorm runs in float32 whatever the model's dtype and rounds each
    token's gradient relative to that scale, so at sp=3 an oracle at scale 1 is only float32-close
    (1.1e-8 on embed_tokens); a power of two commutes with the rounding (see seqpar.batch.loss and
    seqpar.testing.model_parity.reference_grads)."""
    import copy

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    ref = copy.deepcopy(model).requires_grad_(False)
    batch = got["batch"]  # rows c0 r0 c1 r1 ...
    pol = _logps(model, batch)
    with torch.no_grad():
        base = _logps(ref, batch)
    c, r = torch.stack([x for x, _ in pol[0::2]]), torch.stack([x for x, _ in pol[1::2]])
    cr, rr = torch.stack([x for x, _ in base[0::2]]), torch.stack([x for x, _ in base[1::2]])
    n_c = sum(int(k) for _, k in pol[0::2])
    loss = -torch.nn.functional.logsigmoid(0.1 * ((c - cr) - (r - rr))).mean() - c.sum() / n_c
    (loss * sp).backward()
    assert abs(got["loss"] - float(loss)) <= 1e-10, (got["loss"], float(loss))
    want = {n: p.grad / sp for n, p in model.named_parameters()}
    assert set(got["grads"]) == set(want)
    worst, name = max((float((got["grads"][n] - want[n]).abs().max()), n) for n in want)
    assert worst <= 1e-10, (worst, name)


def test_dpo_step_1_gradients_equal_the_plain_model(env):
    """float64, sp=2: the loss and every parameter's gradient of step 1 equal DPO (sigmoid + sft)
    computed on the plain model without seqpar, each sequence alone, against a frozen copy (1e-10)."""
    _check_dpo_gradients(env["dpo64"], env["ckpt"], env["cases"]["dpo64"].sp)


@pytest.mark.parametrize("sp, strategy, packing", [(1, "ulysses", False), (3, "ulysses", False), (4, "ring", False),
                                                   (3, "ring", True), (4, "ulysses", True)])
@pytest.mark.heavy
def test_dpo_step_1_gradients_at_other_sp(env, sp, strategy, packing):
    """The same at sp = 1, 3, 4, ulysses and ring, padded and packed pairs (pairs straddle shards)."""
    cfg = env["cases"]["dpo64"].replace(sp=sp, strategy=strategy, packing=packing,
                                        **(dict(seq_len=256, micro_batch=1) if packing else {}))
    got = run_distributed(_steps, sp, {"x": cfg}, None, timeout=600)[0]["x"]
    _check_dpo_gradients(got, env["ckpt"], sp)


def test_packed_pairs_hold_whole_pairs_and_give_the_same_loss(env):
    """--packing: every pair in one row (chosen then rejected), the same sequences as the padded run,
    and the same step-1 loss within 1e-6 (each document attends to itself only)."""
    got = env["dpo_packed"]
    batch = got["batch"]
    assert batch["input_ids"].shape[0] == 1 and units_in(batch, "pair") == got["units"] == N
    assert _sequences(batch) == _sequences(env["dpo"]["batch"])
    assert abs(got["loss"] - env["dpo"]["loss"]) <= 1e-6, (got["loss"], env["dpo"]["loss"])


def test_lora_dpo_reference_is_the_model_with_its_adapters_off(env):
    """--lora-r: the reference is the policy with its adapters off; the adapters start as the identity
    (B = 0), so step 1 equals the full model's (and so TRL's), and only the adapters get gradients;
    the held-out evaluation runs on the same path."""
    got, full = env["dpo_lora"], env["dpo"]
    assert abs(got["loss"] - full["loss"]) <= 1e-6, (got["loss"], full["loss"])
    assert got["trained"] and all(".lora_" in n for n in got["trained"])
    assert got["eval"] is None  # 5 pairs: no held-out tenth
    assert _sequences(got["batch"]) == _sequences(full["batch"])


def test_reward_step_1_loss_equals_trl(env):
    """--objective reward: Bradley-Terry on the scores at each sequence's last real token equals TRL's
    RewardTrainer on the same pairs and initial weights (the new head drawn from the same seed)."""
    from datasets import load_dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    cfg = env["cases"]["reward"]
    tok = load_hf_tokenizer(env["ckpt"])
    torch.manual_seed(cfg.seed)
    model = AutoModelForSequenceClassification.from_pretrained(env["ckpt"], num_labels=1, dtype=torch.float32,
                                                               pad_token_id=tok.pad_token_id)
    args = RewardConfig(output_dir=str(env["tmp"] / "trl_rm"), per_device_train_batch_size=N, max_length=cfg.seq_len,
                        use_cpu=True, bf16=False, report_to=[], center_rewards_coefficient=None)
    trainer = RewardTrainer(model=model, args=args, processing_class=tok,
                            train_dataset=load_dataset("json", data_files=env["text"], split="train"))
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        want = float(trainer.compute_loss(trainer.model, batch))
    got = env["reward"]
    assert got["units"] == N
    assert abs(want - 0.6931) > 1e-3  # the random head's scores differ within pairs
    assert abs(got["loss"] - want) <= 1e-6, (got["loss"], want)


def _completion_nll(model, ids, labels):
    """The mean NLL of a sequence's completion tokens under the plain model (float64)."""
    logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].double(), -1)
    keep = labels[1:] != -100
    return -logp[keep].gather(1, labels[1:][keep][:, None]).mean()


def test_held_out_pairs_loss_and_accuracy_equal_the_plain_models(env):
    """The evaluation of held-out pairs (before any update): dpo's loss is log 2 plus each pair's
    chosen token-mean NLL (the "sft" term), its accuracy 0 (the implicit rewards tie at 0); reward's
    loss and accuracy are Bradley-Terry's on the plain sequence-classification model's scores at
    each sequence's last token -- within 1e-6."""
    import math

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    lm = AutoModelForCausalLM.from_pretrained(env["ckpt"], dtype=torch.float32)
    tok = load_hf_tokenizer(env["ckpt"])
    torch.manual_seed(env["cases"]["reward_eval"].seed)
    rm = AutoModelForSequenceClassification.from_pretrained(env["ckpt"], num_labels=1, dtype=torch.float32,
                                                            pad_token_id=tok.pad_token_id)
    dpo, rew = env["dpo_eval"], env["reward_eval"]
    assert len(dpo["held_out"]) == len(rew["held_out"]) == dpo["eval"].targets == rew["eval"].targets == 2
    losses, bt, won = [], [], []
    with torch.no_grad():
        for unit in dpo["held_out"]:
            n = int(unit["attention_mask"][0].sum())
            losses.append(math.log(2) + float(_completion_nll(lm, unit["input_ids"][0, :n], unit["labels"][0, :n])))
        for unit in rew["held_out"]:
            sc, sr = (float(rm(input_ids=unit["input_ids"][k, :int(unit["attention_mask"][k].sum())][None]).logits)
                      for k in (0, 1))
            bt.append(-float(torch.nn.functional.logsigmoid(torch.tensor(sc - sr, dtype=torch.float64))))
            won.append(float(sc > sr))
    assert abs(dpo["eval"].loss - sum(losses) / 2) <= 1e-6 and dpo["eval"].accuracy == 0.0
    assert abs(rew["eval"].loss - sum(bt) / 2) <= 1e-6, (rew["eval"].loss, bt)
    assert rew["eval"].accuracy == sum(won) / 2


def test_preference_demo_learns_and_logs_its_metrics(env):
    """`seqpar train --objective dpo` without data: the held-out preference accuracy goes from 0 (the
    policy is its reference: the implicit rewards tie) to at least 7 of 8 pairs in 30 steps, the loss
    falls, and every step's line carries the DPO metrics."""
    from seqpar.train.report import read_metrics

    s = env["demo"]
    assert s.first_eval.accuracy == 0.0 and s.final_eval.accuracy >= 7 / 8, (s.first_eval, s.final_eval)
    assert s.losses[0][1] == pytest.approx(0.6931, abs=1e-4) and s.losses[-1][1] < 0.1
    steps, evals = read_metrics(str(env["tmp"] / "demo"))
    assert [e["step"] for e in evals] == [0, 10, 20, 30]
    assert len(steps) == 30 and all("rewards/margins" in m and "logps/chosen" in m for m in steps)


def test_preference_demo_pairs():
    """The demo's pairs: a pure function of (seed, split, index); chosen counts up from the prompt's
    last symbol, rejected differs at every position; held-out pairs are another draw; a unit is two
    padded rows whose targets are the answers."""
    from seqpar.train.demo_data import SPECIALS, CountingPreference, preference_demo
    from seqpar.train.sources import EVAL

    task = CountingPreference(64, seed=3)
    p, c, r = task.pair(5)
    assert (p, c, r) == task.pair(5) and p != task.pair(5, EVAL)[0] and len(p) + len(c) <= 64
    assert all((b - a) % task.symbols == 1 for a, b in zip([p[-2], *c], c, strict=False))
    assert all(x != y for x, y in zip(c, r, strict=True)) and min(c + r) >= SPECIALS
    unit = preference_demo(64, 3, 4, packing=False).row(5)
    assert unit["input_ids"].shape == (2, 64) and int((unit["labels"][0] != -100).sum()) == len(c)
    with pytest.raises(ValueError, match="--packing"):
        preference_demo(64, 3, 4, packing=True)


def test_encode_pair_and_units_by_hand(tmp_path):
    """The pure pieces: a text pair's prompt / completion split and EOS, one pair per unit, packing
    refused for a pair that does not fit a row."""
    tok = HFTokenizer(load_hf_tokenizer(chat_checkpoint(tmp_path / "ckpt")))
    from seqpar.train.formats import to_record

    c, r = encode_pair(to_record(TEXT_PAIRS[0], "x", "text"), tok)
    prompt = tok.sft_text(TEXT_PAIRS[0]["prompt"])
    assert c.ids[:len(prompt)] == prompt and c.ids[-1] == tok.tok.eos_token_id
    assert c.targets == [False] * len(prompt) + [True] * (len(c.ids) - len(prompt))
    units, kept, cut = pair_units([(c, r)], 32, packing=False, pad_id=tok.pad_id)
    assert (kept, cut, units[0]["input_ids"].shape) == (1, 0, (2, 32))
    with pytest.raises(ValueError, match="--seq-len .* --packing"):
        pair_units([(c, r)], len(c.ids) + 1, packing=True, pad_id=tok.pad_id)


@pytest.mark.parametrize("options, match", [
    (dict(objective="nope"), "--objective"),
    (dict(objective="sft", beta=0.2), "--beta does nothing"),
    (dict(objective="dpo", dpo_loss="sigmoid,nope"), "--dpo-loss"),
    (dict(objective="reward", lora_r=4), "--lora-r"),
    (dict(objective="dpo", beta=0.0), "--beta must be > 0"),
    (dict(objective="dpo", train_on="all"), "--train-on all does nothing"),
    (dict(objective="reward", overflow="split"), "--overflow split does nothing"),
])
def test_bad_objective_options_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        check_config(TrainConfig(**options))


def test_parquet_and_jsonl_pairs_give_the_same_units(tmp_path):
    """The same pairs as parquet (read through datasets) and as JSONL: the same units."""
    from datasets import Dataset

    from seqpar.train.preference_data import load_preference_data
    from seqpar.train.tokenizer import ByteTokenizer

    jsonl = write_jsonl(tmp_path / "p.jsonl", TEXT_PAIRS)
    parquet = str(tmp_path / "p.parquet")
    Dataset.from_list(TEXT_PAIRS).to_parquet(parquet)
    kw = dict(seq_len=64, packing=False, seed=0, eval_rows=0)
    a, b = (load_preference_data([f], ByteTokenizer(), **kw) for f in (jsonl, parquet))
    assert len(a.train) == len(b.train) == N
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a.train, b.train, strict=True) for k in x)


def test_preference_file_for_sft_and_text_for_dpo_are_refused(tmp_path):
    pairs = write_jsonl(tmp_path / "p.jsonl", TEXT_PAIRS)
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ValueError, match="--objective dpo"):
        prepare_job(TrainConfig(data=[pairs], seq_len=64, save_dir=str(tmp_path / "a")))
    with pytest.raises(ValueError, match="--objective sft"):
        prepare_job(TrainConfig(data=[str(text)], objective="dpo", seq_len=64, save_dir=str(tmp_path / "b")))
