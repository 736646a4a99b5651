"""The rollouts reader (:mod:`seqpar.objectives.rollouts`): rows checked and turned into a batch and the
policy objective's inputs, and the step-1 loss of :class:`~seqpar.objectives.PolicyGradient` on them
at sp=2 equal to TRL 1.16's ``GRPOTrainer._compute_loss`` on the same token rows, advantages and
old / reference log-probs (float32, 1e-6: TRL's fused head and seqpar's tiled head are two float32
passes over the vocabulary), for GRPO, DAPO, Dr. GRPO and BNPO aggregations with a KL to the
reference (TRL's k3, with and without its default importance-ratio bias correction) and PPO's
per-token advantages."""

from __future__ import annotations

import json

import pytest
import torch
from trl_fixtures import VOCAB, generation_trainer, tiny_lm

from seqpar.comm.launch import run_distributed
from seqpar.objectives.rollouts import parse_rollouts, rollout_batch, with_advantages

LOSS_TOL = 1e-6


def _rows(seed: int = 0, n_prompts: int = 2, g: int = 4) -> list[dict]:
    """Token-id rollouts: prompts of 3..6 tokens, completions of 2..7, a reward each."""
    gen = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(3, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),), generator=gen).tolist()

    rows = []
    for _ in range(n_prompts):
        prompt = ids(3, 6)
        rows += [{"prompt_ids": prompt, "completion_ids": ids(2, 7),
                  "reward": round(float(torch.rand((), generator=gen)), 3)} for _ in range(g)]
    return rows


def _read(rows: list[dict], **kw):
    return parse_rollouts(((f"rollouts.jsonl:{i + 1}", r) for i, r in enumerate(rows)), **kw)


# ---------------------------------------------------------------------------------------------
# the reader, pure
# ---------------------------------------------------------------------------------------------

def test_rows_become_a_batch_with_inputs_aligned_with_the_labels():
    rows = _rows()
    rows[1]["old_logps"] = None  # a null column counts as absent: then every row must lack it
    for r in rows:
        r.pop("old_logps", None)
        r["ref_logps"] = [-0.5 - 0.1 * k for k in range(len(r["completion_ids"]))]
    got = with_advantages(_read(rows))
    assert [r.group for r in got[:4]] == [tuple(rows[0]["prompt_ids"])] * 4  # grouped by prompt
    batch, inputs = rollout_batch(got, pad_id=0)
    b, s = batch["input_ids"].shape
    assert b == 8 and s == max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    for i, r in enumerate(rows):
        p, c = len(r["prompt_ids"]), len(r["completion_ids"])
        assert batch["input_ids"][i, :p + c].tolist() == r["prompt_ids"] + r["completion_ids"]
        assert batch["labels"][i, p:p + c].tolist() == r["completion_ids"]
        assert (batch["labels"][i, :p] == -100).all() and (batch["labels"][i, p + c:] == -100).all()
        assert batch["attention_mask"][i].sum() == p + c
        assert inputs["ref_logps"][i, p:p + c].tolist() == pytest.approx(r["ref_logps"])
    assert "old_logps" not in inputs and inputs["advantages"].shape == (8,)
    assert inputs["advantages"][:4].sum().abs() < 1e-6  # zero-mean per group


def test_text_rows_go_through_the_tokenizer_and_per_token_advantages_stay_per_token():
    def tokenize(prompt, completion):  # "t5 t9" -> [5, 9]
        p, c = [int(w[1:]) for w in prompt.split()], [int(w[1:]) for w in completion.split()]
        return p + c + [1], [False] * len(p) + [True] * (len(c) + 1)  # the completion ends with EOS

    rows = [{"prompt": "t3 t4", "completion": "t5", "advantage": [0.5, -0.25], "group": "q1"},
            {"prompt": "t3 t4", "completion": "t6 t7", "advantage": [1.0, 2.0, 3.0], "group": "q1"}]
    batch, inputs = rollout_batch(_read(rows, tokenize=tokenize), pad_id=0)
    assert batch["input_ids"].tolist() == [[3, 4, 5, 1, 0], [3, 4, 6, 7, 1]]
    assert inputs["advantages"].tolist() == [[0, 0, 0.5, -0.25, 0], [0, 0, 1.0, 2.0, 3.0]]


BAD = [
    ({"prompt_ids": [3, 4]}, "rollouts.jsonl:2: token ids need both 'prompt_ids' and 'completion_ids'"),
    ({"prompt_ids": [3], "completion_ids": [4, -1], "reward": 1}, "rollouts.jsonl:2: 'completion_ids' must be a list"),
    ({"prompt_ids": [3], "completion_ids": [], "reward": 1}, "rollouts.jsonl:2: the completion has no tokens"),
    ({"prompt_ids": [3], "completion_ids": [4, 99], "reward": 1}, "rollouts.jsonl:2: token id 99 is outside"),
    ({"prompt_ids": [3], "completion_ids": [4]}, "rollouts.jsonl:2: give 'reward' .* or 'advantage', exactly one"),
    ({"prompt_ids": [3], "completion_ids": [4], "reward": 1, "advantage": 1}, "exactly one"),
    ({"prompt_ids": [3], "completion_ids": [4], "reward": "high"}, "rollouts.jsonl:2: 'reward' must be a finite"),
    ({"prompt_ids": [3], "completion_ids": [4], "advantage": float("nan")}, "'advantage' must be a finite"),
    ({"prompt_ids": [3], "completion_ids": [4, 5], "reward": 1, "old_logps": [-1.0]},
     "rollouts.jsonl:2: 'old_logps' has 1 values for 2 completion tokens"),
    ({"prompt_ids": [3], "completion_ids": [4], "reward": 1, "ref_logps": [0.4]},
     r"rollouts.jsonl:2: ref_logps\[0\] = 0.4 is > 0: log-probabilities are <= 0"),
    ({"prompt_ids": [3], "completion_ids": [4], "reward": 1, "group": 1.5}, "'group' must be a string or an integer"),
    ({"prompt": "t3", "completion": "t4", "reward": 1}, "rollouts.jsonl:2: the row gives text; reading text needs"),
    ({"text": "t3 t4", "reward": 1}, "rollouts.jsonl:2: a rollout needs 'prompt' and 'completion'"),
    ({"prompt_ids": [3], "completion_ids": [4], "advantage": 0.1}, "rollouts.jsonl:2: every row must give a reward"),
    ({"prompt_ids": [3], "completion_ids": [4], "reward": 1, "old_logps": [-1.0]},
     "rollouts.jsonl:1: no 'old_logps' while rollouts.jsonl:2 has it"),
]


@pytest.mark.parametrize("row,message", BAD, ids=[m[:40] for _, m in BAD])
def test_a_malformed_row_is_a_value_error_naming_the_row_and_field(row, message):
    good = {"prompt_ids": [3], "completion_ids": [4], "reward": 0.5}
    with pytest.raises(ValueError, match=message):
        _read([good, row], vocab_size=VOCAB)


def test_no_rows_and_missing_advantages_are_value_errors():
    with pytest.raises(ValueError, match="no rollouts"):
        parse_rollouts([])
    with pytest.raises(ValueError, match="rollouts.jsonl:1: no advantage yet"):
        rollout_batch(_read(_rows()[:1]), pad_id=0)
    with pytest.raises(ValueError, match="estimator='ppo'"):
        with_advantages(_read(_rows()[:2]), estimator="ppo")


def test_jsonl_lines_read_as_rows(tmp_path):
    """A JSONL file's objects are rows (the file reading itself is seqpar train's)."""
    path = tmp_path / "rollouts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows()))
    lines = [(f"{path}:{i}", json.loads(line)) for i, line in enumerate(path.read_text().splitlines(), 1)]
    assert len(with_advantages(parse_rollouts(lines), estimator="rloo")) == 8


# ---------------------------------------------------------------------------------------------
# the step-1 loss against TRL's GRPO loss on the same rows
# ---------------------------------------------------------------------------------------------

CASES = {  # TRL's GRPOConfig for each; "per_token": PPO's advantages, one per completion token
    "grpo-kl": dict(loss_type="grpo", beta=0.04),
    "grpo-kl-uncorrected": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False),
    "dapo-kl": dict(loss_type="dapo", beta=0.1, epsilon_high=0.28),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.0),
    "bnpo-kl-per-token": dict(loss_type="bnpo", beta=0.04),
}


def _trl_side(tmp: str) -> tuple[dict, dict[str, list[dict]], dict[str, float]]:
    """The model's weights, each case's rows (with old / reference log-probs near the policy's own, so
    that some ratios clip) and TRL's loss on them."""
    rows_by_case, losses = {}, {}
    trainer = generation_trainer("grpo", tmp, [lambda completions, **k: [0.0] * len(completions)],
                                 model=tiny_lm(seed=0))
    trainer.current_gradient_accumulation_steps = 1  # what the Trainer's loop sets for one micro-batch
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    for case, config in CASES.items():  # the options _compute_loss reads, set as GRPOConfig would set them
        trainer.loss_type, trainer.beta = config["loss_type"], config["beta"]  # beta: a ref_logps column
        trainer.epsilon_high = config.get("epsilon_high", trainer.epsilon_low)
        trainer.args.use_bias_correction_kl = config.get("use_bias_correction_kl", True)
        rows = _rows(seed=1)
        gen = torch.Generator().manual_seed(2)
        for r in rows:  # the policy's own log-probs, then old = own + noise, ref = own - |noise|
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
            c = len(r["completion_ids"])
            with torch.no_grad():
                own = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), c)[0][0]
            r["old_logps"] = (own + 0.3 * torch.randn(c, generator=gen)).clamp(max=0).tolist()
            r["ref_logps"] = (own - 0.2 * torch.rand(c, generator=gen)).clamp(max=0).tolist()
            if case.endswith("per-token"):
                r["advantage"] = torch.randn(c, generator=gen).tolist()
                del r["reward"]
        rollouts = with_advantages(_read(rows))
        rows_by_case[case] = rows
        losses[case] = float(trainer._compute_loss(trainer.model, _trl_inputs(rollouts, trainer)))
    return state, rows_by_case, losses


def _trl_inputs(rollouts, trainer) -> dict:
    """TRL's training inputs for the rollouts: prompts left-padded, completions right-padded."""
    pad = trainer.processing_class.pad_token_id
    prompts = [list(r.ids[:r.targets.index(True)]) for r in rollouts]
    comps = [list(r.ids[r.targets.index(True):]) for r in rollouts]
    p, c = max(map(len, prompts)), max(map(len, comps))
    f32 = dict(dtype=torch.float32)

    def right(values, width, fill=0.0):
        return torch.tensor([list(v) + [fill] * (width - len(v)) for v in values], **f32)

    per_token = isinstance(rollouts[0].advantage, tuple)
    return {
        "prompt_ids": torch.tensor([[pad] * (p - len(x)) + x for x in prompts]),
        "prompt_mask": torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts]),
        "completion_ids": torch.tensor([x + [pad] * (c - len(x)) for x in comps]),
        "completion_mask": torch.tensor([[1] * len(x) + [0] * (c - len(x)) for x in comps]),
        "advantages": right([r.advantage for r in rollouts], c) if per_token else
        torch.tensor([r.advantage for r in rollouts], **f32),
        "old_per_token_logps": right([r.old_logps for r in rollouts], c),
        "ref_per_token_logps": right([r.ref_logps for r in rollouts], c),
        "num_items_in_batch": torch.tensor(float(sum(map(len, comps)))),
    }


def _seqpar_side(rank: int, world: int, state: dict, rows_by_case: dict) -> dict[str, float]:
    torch.set_num_threads(1)
    import seqpar
    from seqpar.objectives import PolicyGradient

    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    out = {}
    for case, rows in rows_by_case.items():
        config = CASES[case]
        model = tiny_lm(seed=0)
        model.load_state_dict(state)
        seqpar.parallelize(model, mesh)
        batch, inputs = rollout_batch(with_advantages(_read(rows)), pad_id=0)
        if not config["beta"]:
            inputs.pop("ref_logps")  # no KL term: the objective takes no reference (it refuses an unused input)
        objective = PolicyGradient(loss_type=config["loss_type"], beta=config["beta"],
                                   epsilon_high=config.get("epsilon_high"), max_completion_length=7,
                                   use_bias_correction_kl=config.get("use_bias_correction_kl", True))
        n = float((batch["labels"] != -100).sum())
        local = seqpar.shard_batch(batch, mesh)
        loss = objective(model, local, mesh, num_units=n if config["loss_type"] == "dapo" else None, **inputs).loss
        out[case] = float(loss.detach())
    return out


@pytest.mark.distributed
def test_step1_loss_equals_trls_grpo_loss_on_the_same_rows(tmp_path):
    state, rows_by_case, want = _trl_side(str(tmp_path))
    results = run_distributed(_seqpar_side, 2, state, rows_by_case, timeout=300.0)
    assert all(abs(v) > 1e-3 for v in want.values()), want
    for rank, got in enumerate(results):
        for case, loss in want.items():
            assert abs(got[case] - loss) <= LOSS_TOL, f"rank {rank} {case}: {got[case]!r} vs TRL's {loss!r}"


# ---------------------------------------------------------------------------------------------
# seqpar train --objective grpo|ppo on a rollouts file: the job's step-1 loss is TRL's
# ---------------------------------------------------------------------------------------------

TRAIN_OPTIONS = {  # seqpar train's options for each case of CASES
    "grpo-kl": dict(objective="grpo", rl_loss="grpo", kl_coef=0.04),
    "dapo-kl": dict(objective="grpo", rl_loss="dapo", kl_coef=0.1, clip_epsilon_high=0.28),
    "dr_grpo": dict(objective="grpo", rl_loss="dr_grpo", max_completion_length=7),
    "bnpo-kl-per-token": dict(objective="ppo", kl_coef=0.04),
}


def _train_step1(tmp_path, state: dict, rows: list[dict], options: dict) -> float:
    """``seqpar train`` (2 local ranks, sp=2, float32) on ``rows`` written as a JSONL file, every row in
    its one step, from a checkpoint of the model TRL's side ran; its step-1 loss."""
    from seqpar.train import TrainConfig, train

    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        model = tiny_lm(seed=0)
        model.load_state_dict(state)
        model.save_pretrained(ckpt)
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = train(TrainConfig(model=str(ckpt), data=[str(path)], seq_len=16, sp=2, micro_batch=len(rows), steps=1,
                                eval_rows=0, dtype="float32", progress=False, plot=False, warmup=1, lr=1e-3,
                                save_dir=str(tmp_path / options["objective"]), overwrite=True, **options))
    return summary.losses[0][1]


@pytest.mark.distributed
@pytest.mark.parametrize("case", [pytest.param("grpo-kl"), *(pytest.param(c, marks=pytest.mark.heavy)
                                                             for c in TRAIN_OPTIONS if c != "grpo-kl")])
def test_seqpar_train_step1_loss_equals_trls_on_a_rollouts_file(tmp_path, case):
    """The whole job -- the file read, tokens and advantages per group, the units, the sharded step --
    gives TRL's GRPOTrainer loss on the same rows (float32, LOSS_TOL)."""
    state, rows_by_case, want = _trl_side(str(tmp_path))
    got = _train_step1(tmp_path, state, rows_by_case[case], TRAIN_OPTIONS[case])
    assert abs(want[case]) > 1e-3 and abs(got - want[case]) <= LOSS_TOL, (case, got, want[case])
