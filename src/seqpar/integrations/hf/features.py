"""What the installed versions allow: the versions against :data:`seqpar.compat.CHECKED_ON`, and
per feature that reaches into transformers' internals whether it is available here, how, or why not
(what ``seqpar env`` prints; ``parallelize`` warns about a model's own gaps:
:mod:`~seqpar.integrations.mixers.availability`)::

    feature_report() -> [FeatureStatus(feature, available, detail), ...]
      "versions: transformers"                    installed vs checked on
      "state passing: Qwen3NextGatedDeltaNet"     one per recurrent mixer class: the kernels its forward
                                                  reaches (directly or through a helper), or why not
      "parallelism: tp"                           one per parallel dimension of the N-D mesh
"""

from __future__ import annotations

import importlib
from importlib import metadata

from ...compat import CHECKED_ON, FeatureStatus, kernel_route
from ..distributed.available import parallelism_report
from ..mixers import HANDLED_MIXERS, STATE

MIXER_MODELING = {"Qwen3NextGatedDeltaNet": "qwen3_next", "Qwen3_5GatedDeltaNet": "qwen3_5",
                  "Qwen3_5MoeGatedDeltaNet": "qwen3_5_moe", "OlmoHybridGatedDeltaNet": "olmo_hybrid",
                  "KimiLinearDeltaAttention": "kimi_linear", "BailingHybridDeltaAttention": "bailing_hybrid",
                  "BambaMixer": "bamba", "NemotronHMamba2Mixer": "nemotron_h", "Zamba2MambaMixer": "zamba2",
                  "GraniteMoeHybridMambaLayer": "granitemoehybrid", "FalconH1Mixer": "falcon_h1",
                  "JambaMambaMixer": "jamba", "ZambaMambaMixer": "zamba"}
"""Each state-passing mixer class -> the transformers model type whose modeling file defines it."""


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def version_report() -> list[FeatureStatus]:
    """Each package of :data:`CHECKED_ON`: available when the installed version is one checked on."""
    out = []
    for package, checked in CHECKED_ON.items():
        have = _installed(package)
        ok = have is not None and have.split("+")[0] in checked
        out.append(FeatureStatus(f"versions: {package}", ok, f"installed {have or 'none'}, checked on "
                                 f"{', '.join(checked)}" + ("" if ok else ": untested, see the rows below")))
    return out


def state_passing_report() -> list[FeatureStatus]:
    """One row per class whose family lists state passing: the kernels its forward reaches, or why not."""
    out = []
    for cls_name, model_type in sorted(MIXER_MODELING.items()):
        family, feature = HANDLED_MIXERS[cls_name], f"state passing: {cls_name}"
        assert family.state is not None and STATE in family.modes, cls_name
        try:
            module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
            cls = getattr(module, cls_name)
        except (ImportError, AttributeError) as e:
            out.append(FeatureStatus(feature, False, f"not in this transformers ({e})"))
            continue
        route = kernel_route(cls, family.state.names)
        if route is None:
            fallback = "split by heads or gathered" if "heads" in family.modes else "gathered"
            out.append(FeatureStatus(feature, False, f"{cls_name}.forward does not reach "
                                     f"{', '.join(family.state.names)}: runs {fallback}, memory per rank does "
                                     "not divide by P"))
            continue
        how = ", ".join(n if via is None else f"{n} (through {via})" for n, via in route.items())
        out.append(FeatureStatus(feature, True, f"swaps {how}"))
    return out


def feature_report() -> list[FeatureStatus]:
    """Every row: :func:`version_report`, :func:`state_passing_report`, then the parallel dimensions
    (:func:`seqpar.integrations.distributed.available.parallelism_report`)."""
    return [*version_report(), *state_passing_report(), *parallelism_report()]
