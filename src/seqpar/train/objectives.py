"""What ``seqpar train --objective NAME`` can train: one :class:`TrainObjective` per name, in one
registry (:data:`OBJECTIVES`), and the kinds of data they train on (:data:`DATA_KINDS`).

An entry says what the CLI and the job need to know, derived where the seam already says it::

    make        the seam objective (:mod:`seqpar.objectives`) for the run's options
    data        the kind of data its units are: "sequences" (documents, chats, prompt / completion:
                one row per unit) or "pairs" (prompt / chosen / rejected: two rows per unit, or a
                packed row of whole pairs)
    accuracy    which of its metrics is the held-out accuracy ("the chosen one won", or the greedy
                accuracy over the targets for sft)
    options     the --options only it reads (--beta, --dpo-loss); given to another objective, they
                are refused by name
    the model   a causal LM, or a sequence-classification model with one output where the objective
                takes a per-sequence score (``takes.per_row``)
    units       what its loss is a mean over (``Objective.unit``): targets, sequences or pairs

    sft      CausalLM: the token mean over the step's targets
    dpo      DPO (--dpo-loss, --beta) against a reference: a frozen copy of the initial model, or the
             model with its LoRA adapters off (--lora-r)
    simpo    SimPO (--beta), reference-free
    orpo     ORPO (--beta), reference-free
    reward   Bradley-Terry on chosen / rejected scores of a sequence-classification head (num_labels=1)
    grpo     GRPO / DAPO / Dr. GRPO on RL rollouts (:mod:`.rollout_data`): the clipped policy loss
             (--rl-loss, --clip-epsilon[-high]) with advantages per prompt group from the rewards
             (--advantages, --scale-rewards), a KL to the reference with --kl-coef
    ppo      PPO's clipped policy loss (token mean) on rollouts with an advantage per token (GAE)
    kto      KTO (--kto-loss, --beta) on unpaired rows (prompt, completion, label), or pairs unpaired
             as TRL does, against a reference; its KL term from each unit's KL row (``kl_rows``)
    flow-matching  rectified flow (--flow-weighting, --logit-mean, --logit-std) on a diffusers video DiT
             (:mod:`.dit_setup`), on "latents": one sample per unit, called with whole inputs on every
             sp rank (the DiT splits its sequences itself: the kind's ``model_splits``)

Pairs come as :mod:`.preference_data` units: sequences c0 r0 c1 r1 ..., the "interleaved" pairing.
A new objective is one entry here (and its data kind, if new).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from seqpar.batch.sharding import count_target_tokens
from seqpar.integrations.trl.dynamic import BATCH_COUPLED
from seqpar.objectives import (
    DPO,
    DPO_LOSSES,
    KTO,
    ORPO,
    BradleyTerry,
    CausalLM,
    FlowMatching,
    Objective,
    PolicyGradient,
    SimPO,
)

from .data import load_text_data
from .demo_data import copy_task_source, preference_demo, rollout_demo, unpaired_demo
from .dit_samples import save_samples
from .latent_data import load_latents
from .preference_data import load_preference_data, load_unpaired
from .rollout_data import load_rollouts
from .sources import DataSource
from .tokenizer import make_tokenizer
from .video_demo import MovingSquares

Options = Any
"""A :class:`seqpar.train.config.TrainConfig` (not imported: the config takes its choices from here)."""


@dataclass(frozen=True)
class DataKind:
    """What one kind of data is read with: ``demo`` (the embedded task, no --data), ``load`` (--data
    files, with the run's tokenizer) and the --options only its reader reads. ``model_splits``: the
    model is called with the whole batch on every sp rank and splits its sequences itself (a
    diffusers DiT), so the batch is not sharded before the objective; ``lora_targets``: the modules
    --lora-r adapts by default."""

    name: str
    demo: Callable[[Options], DataSource]
    load: Callable[[Options, Any], DataSource]
    options: tuple[str, ...] = ()
    model_splits: bool = False
    lora_targets: str | tuple[str, ...] = "all-linear"  # peft: every linear layer but the output head


def _text(cfg: Options, hf_tokenizer: Any) -> DataSource:
    return load_text_data(cfg.data, make_tokenizer(hf_tokenizer), text_field=cfg.text_field, train_on=cfg.train_on,
                          seq_len=cfg.seq_len, packing=cfg.packing, overflow=cfg.overflow, seed=cfg.seed,
                          eval_rows=cfg.eval_rows)


def _pairs(cfg: Options, hf_tokenizer: Any) -> DataSource:
    return load_preference_data(cfg.data, make_tokenizer(hf_tokenizer), seq_len=cfg.seq_len, packing=cfg.packing,
                                seed=cfg.seed, eval_rows=cfg.eval_rows)


def _rollouts(per_token: bool) -> Callable[[Options, Any], DataSource]:
    def load(cfg: Options, hf_tokenizer: Any) -> DataSource:
        return load_rollouts(cfg.data, make_tokenizer(hf_tokenizer), seq_len=cfg.seq_len, packing=cfg.packing,
                             seed=cfg.seed, eval_rows=cfg.eval_rows, estimator=cfg.advantages,
                             scale_rewards=cfg.scale_rewards, per_token_advantages=per_token)
    return load


def _unpaired(cfg: Options, hf_tokenizer: Any) -> DataSource:
    if cfg.packing:
        raise ValueError("--packing: KTO's units keep one sequence per row beside its KL row: leave it out")
    return load_unpaired(cfg.data, make_tokenizer(hf_tokenizer), seq_len=cfg.seq_len, micro_batch=cfg.micro_batch,
                         seed=cfg.seed, eval_rows=cfg.eval_rows)


def _rollout_demo(cfg: Options) -> DataSource:
    return rollout_demo(cfg.seq_len, cfg.seed, cfg.eval_rows, packing=cfg.packing)


DATA_KINDS: dict[str, DataKind] = {
    "sequences": DataKind("sequences", lambda c: copy_task_source(c.seq_len, c.seed, c.eval_rows, packing=c.packing),
                          _text, options=("text_field", "train_on", "overflow")),
    "pairs": DataKind("pairs", lambda c: preference_demo(c.seq_len, c.seed, c.eval_rows, packing=c.packing), _pairs),
    "rollouts": DataKind("rollouts", _rollout_demo, _rollouts(per_token=False)),
    # PPO's: an advantage per completion token (GAE), no rewards to normalise
    "rollouts with token advantages": DataKind("rollouts with token advantages", _rollout_demo,
                                               _rollouts(per_token=True)),
    "unpaired": DataKind("unpaired", lambda c: unpaired_demo(c.seq_len, c.seed, c.eval_rows, packing=c.packing),
                         _unpaired),
    # a DiT's: precomputed latents and text embeddings, one sample per unit (no tokenizer)
    "latents": DataKind("latents", lambda c: MovingSquares(c.seed, c.eval_rows),
                        lambda c, _tok: load_latents(c.data, seed=c.seed, eval_rows=c.eval_rows), model_splits=True,
                        lora_targets=("to_q", "to_k", "to_v", "to_out.0")),
}


def dpo_losses(cfg: Options) -> list[str]:
    """--dpo-loss as a list of TRL loss types (ValueError for an unknown one)."""
    types = [t.strip() for t in cfg.dpo_loss.split(",") if t.strip()]
    unknown = [t for t in types if t not in DPO_LOSSES]
    if unknown or not types:
        raise ValueError(f"--dpo-loss {cfg.dpo_loss!r}: choose from {', '.join(DPO_LOSSES)} (several: joined by "
                         "commas)")
    return types


@dataclass(frozen=True)
class TrainObjective:
    """One ``--objective`` (see the module doc). ``dynamic_problem``: why a dynamic SP schedule cannot
    run it exactly with these options (None: it can)."""

    name: str
    summary: str
    cls: type[Objective]
    make: Callable[[Options], Objective]
    data: str
    accuracy: str | None  # None: the held-out evaluation reports the loss alone
    accuracy_of: str  # what the held-out accuracy counts, in words
    options: tuple[str, ...] = ()
    evaluation: Callable[[Options], Objective] | None = None  # default: make
    dynamic_problem: Callable[[Options], str | None] = field(default=lambda cfg: None)
    kl_rows: bool = False  # each unit's second row is its KL row (KTO): a no-grad estimate, the "kl" input
    defaults: Mapping[str, Any] = field(default_factory=dict)  # options it runs with unless given (the CLI's)
    # at the end of a completed run with --plot, on every rank: a picture of what the model learnt (a path)
    finish: Callable[[Any, DataSource], str] | None = None

    @property
    def scores(self) -> bool:
        """Whether its model is a sequence-classification model (a score head, one output)."""
        return "score" in self.cls.takes.per_row

    def evaluator(self, cfg: Options) -> Objective:
        """The objective a held-out evaluation runs: it reports the :attr:`accuracy` metric."""
        return (self.evaluation or self.make)(cfg)


def _dpo_dynamic(cfg: Options) -> str | None:
    coupled = [t for t in dpo_losses(cfg) if t in BATCH_COUPLED]
    if not coupled:
        return None
    return (f"--dpo-loss {coupled[0]} {BATCH_COUPLED[coupled[0]]}, which a dynamic schedule's bins (other pairs than "
            f"the micro-batch's) would change: use --sp-schedule static or another --dpo-loss (not "
            f"{', '.join(BATCH_COUPLED)})")


def _no_bins(cfg: Options) -> str:
    return (f"--objective {cfg.objective} carries its inputs (advantages, log-probs, labels, KL rows) beside the "
            "rows, which a dynamic schedule's bins do not carry yet: use --sp-schedule static")


RL_OPTIONS = ("kl_coef", "clip_epsilon", "clip_epsilon_high")


def _policy_gradient(cfg: Options, loss_type: str) -> Objective:
    return PolicyGradient(loss_type=loss_type, epsilon=cfg.clip_epsilon, epsilon_high=cfg.clip_epsilon_high,
                          beta=cfg.kl_coef, max_completion_length=cfg.max_completion_length)


OBJECTIVES: dict[str, TrainObjective] = {o.name: o for o in (
    TrainObjective("sft", "the causal-LM token mean: pre-training and SFT", CausalLM, lambda c: CausalLM(),
                   data="sequences", accuracy="accuracy", accuracy_of="answers",
                   evaluation=lambda c: CausalLM(accuracy=True)),
    TrainObjective("dpo", "DPO against a reference (the initial model, or the model with its LoRA adapters off)",
                   DPO, lambda c: DPO(beta=c.beta, loss_type=dpo_losses(c), pairing="interleaved"),
                   data="pairs", accuracy="rewards/accuracies", accuracy_of="pairs (the chosen one preferred)",
                   options=("beta", "dpo_loss"), dynamic_problem=_dpo_dynamic),
    TrainObjective("simpo", "SimPO, reference-free", SimPO, lambda c: SimPO(beta=c.beta, pairing="interleaved"),
                   data="pairs", accuracy="rewards/accuracies", accuracy_of="pairs (the chosen one preferred)",
                   options=("beta",)),
    TrainObjective("orpo", "ORPO, reference-free", ORPO, lambda c: ORPO(beta=c.beta, pairing="interleaved"),
                   data="pairs", accuracy="rewards/accuracies", accuracy_of="pairs (the chosen one preferred)",
                   options=("beta",),
                   dynamic_problem=lambda c: "--objective orpo's NLL term is a token mean over a micro-batch's "
                   "chosen completions, which a dynamic schedule's bins (other pairs than the micro-batch's) would "
                   "change: use --sp-schedule static (dpo, simpo and reward run under dynamic)"),
    TrainObjective("reward", "a reward model: Bradley-Terry on chosen / rejected, a sequence-classification head",
                   BradleyTerry, lambda c: BradleyTerry(pairing="interleaved"), data="pairs", accuracy="accuracy",
                   accuracy_of="pairs (the chosen one preferred)"),
    TrainObjective("grpo", "GRPO / DAPO / Dr. GRPO on RL rollouts: advantages per prompt group, a KL with "
                   "--kl-coef", PolicyGradient, lambda c: _policy_gradient(c, c.rl_loss), data="rollouts",
                   accuracy=None, accuracy_of="", options=("rl_loss", *RL_OPTIONS, "max_completion_length",
                                                          "advantages", "scale_rewards"),
                   dynamic_problem=_no_bins),
    TrainObjective("ppo", "PPO's clipped policy loss on rollouts with an advantage per token", PolicyGradient,
                   lambda c: _policy_gradient(c, "bnpo"), data="rollouts with token advantages", accuracy=None,
                   accuracy_of="", options=RL_OPTIONS, dynamic_problem=_no_bins),
    TrainObjective("kto", "KTO on unpaired rows (prompt, completion, label) against a reference", KTO,
                   lambda c: KTO(beta=c.beta, loss_type=c.kto_loss), data="unpaired", accuracy=None, accuracy_of="",
                   options=("beta", "kto_loss"), kl_rows=True, dynamic_problem=_no_bins),
    TrainObjective("flow-matching", "rectified flow on a diffusers video transformer: logit-normal timesteps, target "
                   "noise - x0, optional SD3 loss weighting; without --data a tiny Wan learns moving squares and "
                   "draws samples.png", FlowMatching,
                   lambda c: FlowMatching(weighting=c.flow_weighting, mean=c.logit_mean, std=c.logit_std),
                   data="latents", accuracy=None, accuracy_of="",
                   options=("flow_weighting", "logit_mean", "logit_std"),
                   dynamic_problem=lambda c: "--objective flow-matching calls a diffusers transformer with whole "
                   "inputs on every sp rank, which a dynamic schedule's bins do not: use --sp-schedule static",
                   defaults=dict(model="tiny-wan", lr=3e-3, warmup=20, steps=300, micro_batch=4, eval_every=100,
                                 checkpoint="none", tiled_mlp=False),
                   finish=save_samples),
)}

OBJECTIVE_OPTIONS = tuple(dict.fromkeys(n for o in OBJECTIVES.values() for n in o.options))
"""Every option only some objectives read: given to another objective, it is refused by name."""


def objective_of(name: str) -> TrainObjective:
    """The registry's entry for ``--objective name``; ValueError naming the choices."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown --objective {name!r}: choose one of {list(OBJECTIVES)}")
    return OBJECTIVES[name]


def units_in(batch: Mapping[str, Tensor], unit: str) -> float:
    """The units of ``unit`` ("token", "sequence", "pair", "sample") in a whole batch (not sharded): its
    targets (as :func:`seqpar.shard_batch` counts them), its sequences (each starts at position 0), half
    of them, or its latents' samples."""
    if unit == "sample":  # latents [B, C, F, H, W]: one sample per row
        return float(batch["latents"].shape[0])
    batch = {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()}  # a unit of [S] or [k, S]: [B, S]
    if unit == "token":
        return float(count_target_tokens(batch))
    pos, mask = batch.get("position_ids"), batch.get("attention_mask")
    if pos is None:  # one sequence per row
        sequences = float(batch["input_ids"].shape[0])
    else:
        starts = (pos == 0) if mask is None else (pos == 0) & (mask > 0)  # [B, S]
        sequences = float(starts.sum())
    return sequences / 2 if unit == "pair" else sequences
