"""Every trainer class TRL 1.16 ships (``trl`` and ``trl.experimental``), exact under
:func:`seqpar.parallelize_trainer` or refused by name with the reason: the one list
(:data:`seqpar.integrations.trainer.mixin.TRL_TRAINERS`, keyed by where TRL defines the class).
A TRL trainer class not listed here is refused until it is classified, and
``tests/integrations/test_trl_registry.py`` enumerates TRL's classes so that a new release's trainer
fails a test.

Exact: ``SFTTrainer`` (the Trainer integration's token mean), ``DPOTrainer``, ``RewardTrainer``,
``KTOTrainer``, ``GRPOTrainer``, ``RLOOTrainer`` (TRL's own loss over a sharded stand-in model; each
held against the same script without seqpar in ``tests/integrations/test_trl_objectives.py`` and
``test_trl_rl.py``). The others compute their loss from a forward of their own on full-vocabulary
logits, from a teacher, or from rollouts made elsewhere, which seqpar's TRL integration does not shard:
they are refused rather than run unverified.
"""

from __future__ import annotations

from ..trainer.mixin import TRL_TRAINERS, TrlEntry
from .dynamic import DynamicPairMethods, check_pair_dynamic
from .grpo import SeqParGRPOMixin, setup_grpo
from .kto import SeqParKTOMixin
from .mixins import SeqParDPOMixin, SeqParRewardMixin, setup_trl

_OWN_FORWARD = ("its loss reads full-vocabulary logits [B, S, V] from a forward of its own, which seqpar's TRL "
                "integration does not shard (it shards TRL's fused per-token LM head)")
_TEACHER = ("its loss is a divergence from a teacher's full next-token distributions (logits [B, S, V] of the "
            "student and of a local or served teacher), which seqpar's TRL integration does not shard")
_UNVERIFIED = "; not verified exact under seqpar"

_SFT = TrlEntry("trl.SFTTrainer")  # the Trainer integration's causal-LM token mean
_DPO = TrlEntry("trl.DPOTrainer", SeqParDPOMixin, setup_trl, DynamicPairMethods, check_pair_dynamic)
_REWARD = TrlEntry("trl.RewardTrainer", SeqParRewardMixin, setup_trl, DynamicPairMethods, check_pair_dynamic)
_KTO = TrlEntry("trl.KTOTrainer", SeqParKTOMixin, setup_trl, None, check_pair_dynamic)  # refuses a schedule by name
_GRPO = TrlEntry("trl.GRPOTrainer", SeqParGRPOMixin, setup_grpo, None, check_pair_dynamic)
_RLOO = TrlEntry("trl.RLOOTrainer", SeqParGRPOMixin, setup_grpo, None, check_pair_dynamic)
_DISTILLATION = TrlEntry("trl.DistillationTrainer", refused=_TEACHER + _UNVERIFIED)


def _refused(name: str, why: str) -> TrlEntry:
    return TrlEntry(name, refused=why + _UNVERIFIED)


TRL_TRAINERS.update({
    # trl: the stable trainers
    "trl.trainer.sft_trainer.SFTTrainer": _SFT,
    "trl.trainer.dpo_trainer.DPOTrainer": _DPO,
    "trl.trainer.reward_trainer.RewardTrainer": _REWARD,
    "trl.trainer.kto_trainer.KTOTrainer": _KTO,
    "trl.trainer.grpo_trainer.GRPOTrainer": _GRPO,
    "trl.trainer.rloo_trainer.RLOOTrainer": _RLOO,
    "trl.trainer.distillation_trainer.DistillationTrainer": _DISTILLATION,
    # trl.experimental: deprecated aliases of stable trainers (their __init__ only warns)
    "trl.experimental.kto.KTOTrainer": _KTO,
    "trl.experimental.distillation.DistillationTrainer": _DISTILLATION,
    # trl.experimental: the others
    "trl.experimental.online_dpo.online_dpo_trainer.OnlineDPOTrainer": _refused(
        "trl.experimental.online_dpo.OnlineDPOTrainer", "it generates and ranks completions with a judge or reward "
        "model each step, then " + _OWN_FORWARD),
    "trl.experimental.cpo.cpo_trainer.CPOTrainer": _refused(
        "trl.experimental.cpo.CPOTrainer", _OWN_FORWARD + " (CPO's SimPO loss runs exactly in your own loop: "
        "seqpar.objectives.SimPO)"),
    "trl.experimental.orpo.orpo_trainer.ORPOTrainer": _refused(
        "trl.experimental.orpo.ORPOTrainer", _OWN_FORWARD + " (ORPO's loss runs exactly in your own loop: "
        "seqpar.objectives.ORPO)"),
    "trl.experimental.tpo.tpo_trainer.TPOTrainer": _refused("trl.experimental.tpo.TPOTrainer", _OWN_FORWARD),
    "trl.experimental.a2po.a2po_trainer.A2POTrainer": _refused(
        "trl.experimental.a2po.A2POTrainer", "it samples value estimates from the reference before training, and "
        + _OWN_FORWARD),
    "trl.experimental.gmpo.gmpo_trainer.GMPOTrainer": _refused(
        "trl.experimental.gmpo.GMPOTrainer", "GRPO's loop with a loss of its own (the geometric mean of the token "
        "ratios), not run through seqpar's GRPO integration's tests"),
    "trl.experimental.bema_for_ref_model.dpo_trainer.DPOTrainer": _refused(
        "trl.experimental.bema_for_ref_model.DPOTrainer", "BEMA rewrites the reference model's weights from a "
        "callback during training (use trl.DPOTrainer, exact)"),
    "trl.experimental.async_grpo.async_grpo_trainer.AsyncGRPOTrainer": _refused(
        "trl.experimental.async_grpo.AsyncGRPOTrainer", "its rollouts come from a vLLM server through a background "
        "worker and are packed by its own code, while seqpar's GRPO integration generates on every rank"),
    "trl.experimental.gkd.gkd_trainer.GKDTrainer": _refused("trl.experimental.gkd.GKDTrainer", _TEACHER),
    "trl.experimental.gold.gold_trainer.GOLDTrainer": _refused(
        "trl.experimental.gold.GOLDTrainer", _TEACHER + " (across two tokenizers)"),
    "trl.experimental.iw_opd.iw_opd_trainer.IWOPDTrainer": _refused("trl.experimental.iw_opd.IWOPDTrainer", _TEACHER),
    "trl.experimental.sdft.sdft_trainer.SDFTTrainer": _refused("trl.experimental.sdft.SDFTTrainer", _TEACHER),
    "trl.experimental.sdpo.sdpo_trainer.SDPOTrainer": _refused("trl.experimental.sdpo.SDPOTrainer", _TEACHER),
    "trl.experimental.server_distillation.server_distillation_trainer.ServerDistillationTrainer": _refused(
        "trl.experimental.server_distillation.ServerDistillationTrainer", _TEACHER),
    "trl.experimental.async_distillation.async_distillation_trainer.AsyncDistillationTrainer": _refused(
        "trl.experimental.async_distillation.AsyncDistillationTrainer", _TEACHER + ", generated by vLLM servers in "
        "background workers"),
})
