"""The objective of ``seqpar train`` (``--objective``): every step's loss goes through the objective
seam (:mod:`seqpar.objectives`), so the loop has one way to take a loss::

    n      = step.count(micro-batches)           the step's units over every dp rank
    local  = seqpar.shard_batch(batch, mesh)     this SP rank's slice
    loss   = objective(model, local, mesh, reference=..., num_units=n)   this rank's share of the mean

    sft      CausalLM: the token mean over the step's targets (units: tokens)
    dpo      DPO (--dpo-loss, --beta) against a reference: a frozen copy of the initial model, or the
             model with its LoRA adapters off (--lora-r)                    (units: pairs)
    simpo    SimPO (--beta), reference-free                                   (units: pairs)
    orpo     ORPO (--beta), reference-free                                    (units: pairs)
    reward   Bradley-Terry on chosen / rejected scores of a sequence-classification head (num_labels=1)

Pairs come as :mod:`.preference_data` units: sequences c0 r0 c1 r1 ..., the "interleaved" pairing.
The vocabulary runs in tiles of --loss-tile tokens (--no-tiled-loss: one tile per shard, the whole
``[S_local, V]`` logits at once, as the model's own head).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import seqpar
from seqpar.comm import collectives, faults
from seqpar.comm.mesh import axis_group
from seqpar.integrations.distributed.materialize import meta_model
from seqpar.integrations.models import BUILTIN_MODELS, build_model, builtin_config
from seqpar.objectives import ADAPTERS_OFF, DPO, ORPO, BradleyTerry, CausalLM, Objective, SimPO

from .config import PAIRED, TrainConfig, dpo_losses
from .demo_data import EVAL
from .preference_data import pairs_in
from .report import EvalResult
from .tokenizer import make_tokenizer

Trainer = Any  # a seqpar.train.loop.Trainer (not imported: the loop imports this module)

ACCURACY = {"dpo": "rewards/accuracies", "simpo": "rewards/accuracies", "orpo": "rewards/accuracies",
            "reward": "accuracy"}
"""The objective's metric that says whether the chosen one won (for the held-out preference accuracy)."""


def make_objective(cfg: TrainConfig) -> Objective:
    """The :class:`~seqpar.objectives.Objective` of ``--objective`` and its options."""
    if cfg.objective == "dpo":
        return DPO(beta=cfg.beta, loss_type=dpo_losses(cfg), pairing="interleaved")
    if cfg.objective == "simpo":
        return SimPO(beta=cfg.beta, pairing="interleaved")
    if cfg.objective == "orpo":
        return ORPO(beta=cfg.beta, pairing="interleaved")
    if cfg.objective == "reward":
        return BradleyTerry(pairing="interleaved")
    return CausalLM()


def objective_model(cfg: TrainConfig, hf_tokenizer: Any | None, *, dtype: torch.dtype, **fields: Any) -> nn.Module:
    """The model ``--model`` names (a built-in with config ``fields``, or a checkpoint directory): a
    causal LM, or for ``--objective reward`` a sequence-classification model with one output whose
    head is new (drawn at random; the body is the causal LM's)."""
    if cfg.objective != "reward":
        return build_model(cfg.model, dtype=dtype, **fields)[0]
    from transformers import AutoModelForSequenceClassification

    pad_id = make_tokenizer(hf_tokenizer).pad_id  # transformers' own pooling wants one; seqpar reads the last token
    if cfg.model not in BUILTIN_MODELS:
        torch.manual_seed(cfg.seed)  # the new head: the same draw on every rank
        return AutoModelForSequenceClassification.from_pretrained(cfg.model, num_labels=1, dtype=dtype,
                                                                  pad_token_id=pad_id)
    config = builtin_config(cfg.model, **fields, num_labels=1, pad_token_id=pad_id)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa").to(dtype)


def objective_meta_model(cfg: TrainConfig, *, dtype: torch.dtype) -> nn.Module:
    """The checkpoint ``--model`` on the meta device (FSDP2's sharded loading); ValueError for a reward
    model, whose new head rank 0 alone would draw."""
    if cfg.objective == "reward":
        raise ValueError("--objective reward from a checkpoint builds the reward model from its weights on every "
                         "rank, which FSDP2's sharded loading does not do yet: use --fsdp off or a built-in --model")
    return meta_model(cfg.model, dtype=dtype)


class ObjectiveStep:
    """The objective, its reference and its unit count for a :class:`~seqpar.train.loop.Trainer`
    (built after the model has its weights: a frozen reference copies the initial ones)."""

    def __init__(self, trainer: Trainer) -> None:
        cfg = self.cfg = trainer.cfg
        self.trainer = trainer
        self.objective = make_objective(cfg)
        self.paired = cfg.objective in PAIRED
        self.tile = cfg.loss_tile if cfg.tiled_loss else 1 << 62  # off: the whole shard in one tile
        self.metrics: dict[str, float] = {}  # the objective's metrics of the last step: over its every pair
        # [units, each metric times its units] of this rank's batches so far, each divided by the ranks that
        # hold the same batch (its SP group, or its bin's block): the sum over the job counts each batch once
        self._sums = torch.zeros(1 + len(self.objective.metric_names), dtype=torch.float64, device=trainer.device)
        self.policy = trainer.peft or trainer.model  # ADAPTERS_OFF turns the peft model's adapters off
        self.reference: nn.Module | str | None = None
        if self.objective.needs.reference:
            if trainer.peft is not None:
                self.reference = ADAPTERS_OFF
            elif trainer.use_fsdp:
                raise ValueError(f"--objective {cfg.objective} keeps a frozen copy of the initial model as its "
                                 "reference, which FSDP2 does not shard: add --lora-r (the reference is then the model "
                                 "with its adapters off) or use --fsdp off")
            else:
                self.reference = copy.deepcopy(trainer.model).requires_grad_(False).eval()

    def count(self, batches: list[dict[str, Tensor]]) -> float:
        """The step's units over every dp rank: targets (sft, as shard_batch counts them) or pairs.
        Called once per step: it starts the step's metrics afresh."""
        self.begin_step()
        if not self.paired:
            return seqpar.count_target_tokens(batches, self.trainer.mesh)
        n = torch.tensor([float(sum(pairs_in(b) for b in batches))], dtype=torch.float64, device=self.trainer.device)
        collectives.all_reduce(n, group=axis_group(self.trainer.mesh, "dp"))
        return float(n)

    def begin_step(self) -> None:
        """Start a step's metrics afresh."""
        self.metrics = {}
        self._sums.zero_()

    def finish_step(self, group: dist.ProcessGroup | None = None) -> None:
        """The step's metrics (:attr:`metrics`): the unit-weighted mean of its batches' over every rank of
        the job (``group``: a group of all of them, default the world), so over every pair of the step,
        whichever rank ran it. Collective (one all-reduce of ``1 + metrics`` numbers) when the objective
        has metrics; a rank with no batch adds zeros."""
        names = self.objective.metric_names
        if not names:
            return
        sums = self._sums.to(collectives.comm_device(group or dist.group.WORLD))
        collectives.all_reduce(sums, group=group)
        units, *totals = sums.tolist()
        self.metrics = {k: v / units for k, v in zip(names, totals, strict=True)} if units else {}

    def loss(self, batch: dict[str, Tensor], n_units: float) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, metrics)`` of one micro-batch: this rank's share of the step's mean over ``n_units``."""
        t = self.trainer
        if not self.paired:  # the denominator travels in the batch, as the model's own loss takes it
            local = seqpar.shard_batch(batch, t.mesh, layout=t.job.layout, num_items_in_batch=n_units or None)
            out = self.objective(self.policy, local, t.mesh, tile=self.tile)
            return out.loss, out.metrics  # a token mean has no metrics (CausalLM.metric_names)
        local = seqpar.shard_batch(batch, t.mesh, layout=t.job.layout)
        return self.pair_loss(local, n_units, units=pairs_in(batch), copies=t.job.sp)

    def pair_loss(self, local: dict[str, Any], n_units: float, *, units: float = 0.0, copies: int = 1
                  ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, metrics)`` of a sharded batch of whole pairs (a micro-batch, or a dynamic schedule's
        bin: sharded over its block, the seam reduces over that block): its share of the step's mean
        over ``n_units`` pairs. ``units``: its pairs, whose metrics count in the step's (0: none, as an
        FSDP flush row's); ``copies``: the ranks it is sharded over (each holds the same metrics)."""
        out = self.objective(self.policy, local, self.trainer.mesh, reference=self.reference,
                             num_units=n_units or None, tile=self.tile)
        return self._noted(out, units, copies)

    def _noted(self, out: Any, units: float, copies: int) -> tuple[Tensor, dict[str, Tensor]]:
        names = self.objective.metric_names
        if names and units:
            assert set(out.metrics) == set(names), (sorted(out.metrics), names)  # metric_names is declared
            row = torch.stack([torch.ones((), dtype=torch.float64, device=self._sums.device),
                               *(out.metrics[k].to(self._sums) for k in names)])
            self._sums += row * (units / copies)
        return out.loss, out.metrics

    @torch.no_grad()
    def evaluate(self) -> EvalResult | None:
        """Held-out pairs: the objective's mean loss and the preference accuracy (the chosen sequence
        won: its implicit reward (dpo), its score (reward) or its mean log-prob (simpo, orpo) is higher)."""
        t = self.trainer
        n = t.data.n_eval
        if n == 0:
            return None
        t.model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=t.device)  # loss sum, won, pairs
        mine = list(range(t.dp_rank, n, t.job.dp))
        for i in range(-(-n // t.job.dp)):  # every dp rank runs the same number of forwards
            idx = mine[i] if i < len(mine) else mine[0] if mine else 0
            batch = {k: v.to(t.device) for k, v in t.data.row(idx, EVAL).items()}
            pairs = pairs_in(batch)
            with faults.publishing("the evaluation"):
                local = seqpar.shard_batch(batch, t.mesh, layout=t.job.layout)
                out = self.objective(self.policy, local, t.mesh, reference=self.reference, tile=self.tile)
            won = out.metrics[ACCURACY[self.cfg.objective]]  # the mean over this unit's pairs
            row = torch.stack([out.loss.double() * pairs, won.double() * pairs,
                               torch.tensor(float(pairs), dtype=torch.float64, device=won.device)])
            if i < len(mine):  # else a padding round of a dp rank with fewer units
                totals += row.to(totals)
        t.model.train()
        collectives.all_reduce(totals)  # over every rank: divide the SP copies out below
        loss_sum, won, pairs = (x / t.job.sp for x in totals.tolist())
        return EvalResult(loss=loss_sum / max(pairs, 1), accuracy=won / max(pairs, 1), targets=int(round(pairs)))
