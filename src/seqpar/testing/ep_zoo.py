"""Every causal-LM family whose config declares an expert-parallel plan, under EP with SP: exact or refused.

The families come from transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config, or text
config, has a ``base_model_ep_plan``), never hand-picked. Each runs one :class:`~.ep_parity.EPCase`
(sp = ep = the world, padded rows, Ulysses) through :func:`~.ep_parity.compare_ep`, its recurrent
scans in float64 as in the SP zoo (:mod:`.scans64`). Outcomes, agreed over the ranks (the worst
rank's wins), as the SP zoo names them (:mod:`.zoo`)::

    exact / exact (float32 model)   every comparison of compare_ep within tolerance
    refused                         parallelize(..., ep=) or the first forward raised seqpar.Refused
    mismatch / crashed              a bug (silently wrong / any other error)
    unbuildable                     transformers cannot build or run the tiny config without seqpar
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .ep_parity import EPCase, build_moe, compare_ep
from .scans64 import float64_scans
from .zoo import VARIANTS, ZooVerdict, agreed_outcome, causal_lm_types, verdict


@dataclass(frozen=True, kw_only=True)
class EPZooRow(ZooVerdict):
    """One family under EP: its outcome (see the module doc) and the worst differences."""

    family: str


def ep_families() -> list[str]:
    """Causal-LM model types whose default config (or text config) declares an expert-parallel plan,
    and the SP zoo's variants of them (:data:`seqpar.testing.zoo.VARIANTS`: a config switch that
    reaches a path the default does not, e.g. Jamba's attention layers)."""
    from transformers import AutoConfig

    out = []
    for model_type in causal_lm_types():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = AutoConfig.for_model(model_type)
        except Exception:  # transformers' own default config does not build: the zoo reports it
            continue
        text = getattr(config, "text_config", None)
        if getattr(config, "base_model_ep_plan", None) or getattr(text, "base_model_ep_plan", None):
            out.append(model_type)
    return out + [name for name, (model_type, _) in VARIANTS.items() if model_type in out]


def ep_zoo_family(family: str, world: int) -> EPZooRow:
    """One family at sp = ep = ``world`` on this rank (collective over the world)."""
    case = EPCase(family=family, seq=11, dp=1, sp=world, ep=world)  # the SP zoo's padded rows (.zoo.BATCHES)
    try:
        model = build_moe(case)
        model(input_ids=torch.arange(6).view(1, 6) % 5, labels=torch.arange(6).view(1, 6) % 5)
    except Exception as e:
        # the same model, built alike on every rank: the same verdict everywhere, no agreement needed
        return EPZooRow("unbuildable", f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                        family=family)
    try:
        with float64_scans(model):
            row = compare_ep(case)
        outcome = ("exact (float32 model)" if row["f32"] else "exact") if row["ok"] else "mismatch"
        detail = "" if row["ok"] else (f"{', '.join(row['failed'])}: worst {row['worst']} {row['grad_max']:.2e}, "
                                       f"vs sp {row['grad_max_sp']:.2e}, floor {row['floor']}")
        loss, grad = row["loss_diff"], row["grad_max"]
    except Exception as e:
        (outcome, detail), loss, grad = verdict(e), 0.0, 0.0
    outcome, detail = agreed_outcome(outcome, detail, dist.group.WORLD)
    return EPZooRow(outcome, detail[:2000], loss, grad, family=family)


def run_ep_zoo(rank: int, world: int, families: list[str] | None = None) -> list[EPZooRow]:
    """The EP zoo on ``world`` ranks; returns this rank's rows."""
    torch.set_num_threads(1)
    return [ep_zoo_family(f, world) for f in families or ep_families()]
