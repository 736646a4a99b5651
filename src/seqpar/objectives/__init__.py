"""Layer between integrations and testing: training objectives, exact under sequence parallelism.

One small definition per objective (:class:`~seqpar.objectives.seam.Objective`: the rows it needs,
what it takes from the model per token or per sequence, what its loss is a mean over) and one driver,
:func:`compute` (``objective(model, local, mesh, ...)``), used the same way by a user's loop and by
``seqpar train`` (every objective, static and dynamic, training and evaluation). The Trainer / TRL
integration does not use it: TRL's trainers keep their own losses, run on a sharded stand-in model
(:mod:`seqpar.integrations.trl`); the formulas here are TRL's and tested equal to them::

    local = seqpar.shard_batch(batch, mesh)                   # chosen rows, then rejected rows
    out = DPO(beta=0.1)(model, local, mesh, reference=ref)    # the same loss on every SP rank
    out.loss.backward(); seqpar.sync_gradients(model, mesh)

Families: :mod:`.causal_lm` (the token mean), :mod:`.preference` (DPO, SimPO, ORPO, KTO), :mod:`.rl`
(GRPO / DAPO / Dr. GRPO / PPO policy losses), :mod:`.reward` (Bradley-Terry, sequence classification,
value heads), :mod:`.flow_matching` (rectified flow on a diffusers DiT, called with whole
inputs). The per-token and per-sequence quantities live in :mod:`.tokens` and :mod:`.rows`. What
the RL and preference objectives read from data, pure and tested equal to TRL 1.16: advantages per
prompt group (:mod:`.advantages`), rollouts made elsewhere (:mod:`.rollouts`), TRL's dataset formats
and their tokens (:mod:`.trl_formats`).
"""

from .causal_lm import CausalLM
from .flow_matching import WEIGHTINGS, FlowMatching
from .preference import DPO, DPO_LOSSES, KTO, KTOKL, ORPO, SimPO
from .reference import ADAPTERS_OFF
from .reward import BradleyTerry, SequenceClassification, ValueLoss
from .rl import AGGREGATIONS, PolicyGradient
from .seam import Needs, Objective, ObjectiveOutput, Quantities, Takes, Terms, compute
from .tokens import token_logps_entropy

__all__ = [
    "ADAPTERS_OFF",
    "AGGREGATIONS",
    "DPO",
    "DPO_LOSSES",
    "KTO",
    "KTOKL",
    "ORPO",
    "BradleyTerry",
    "CausalLM",
    "FlowMatching",
    "Needs",
    "Objective",
    "ObjectiveOutput",
    "PolicyGradient",
    "Quantities",
    "SequenceClassification",
    "SimPO",
    "Takes",
    "Terms",
    "ValueLoss",
    "WEIGHTINGS",
    "compute",
    "token_logps_entropy",
]
