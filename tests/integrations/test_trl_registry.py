"""Every trainer class TRL ships is classified: exact under ``seqpar.parallelize_trainer`` or refused by
name with the reason (:mod:`seqpar.integrations.trl.registry`). The classes are enumerated from TRL
itself (``trl`` and every ``trl.experimental`` subpackage), never from a hand-picked list, so a
trainer new in a TRL release fails here until it is classified (``make test-latest`` runs this file
against the newest releases)."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil

import pytest

import seqpar
from seqpar.integrations.trainer.mixin import TRL_TRAINERS, trl_entry, trl_key

EXACT = {"trl.SFTTrainer", "trl.DPOTrainer", "trl.RewardTrainer", "trl.KTOTrainer", "trl.GRPOTrainer",
         "trl.RLOOTrainer"}
"""The trainers the exactness tests hold against the script without seqpar (test_trl_objectives,
test_trl_rl, test_trainer)."""


def trl_trainer_classes() -> dict[str, list[str]]:
    """Every ``transformers.Trainer`` subclass TRL exports publicly: registry key -> its public names."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl
    import trl.experimental
    from transformers import Trainer

    names = ["trl"] + [f"trl.experimental.{m.name}" for m in pkgutil.iter_modules(trl.experimental.__path__)]
    found: dict[str, list[str]] = {}
    for name in names:
        module = importlib.import_module(name)  # a subpackage that cannot import fails the test: say why
        for attr in dir(module):
            value = getattr(module, attr, None)
            if not attr.startswith("_") and inspect.isclass(value) and issubclass(value, Trainer):
                if value.__module__.split(".")[0] == "trl":
                    found.setdefault(trl_key(value), []).append(f"{name}.{attr}")
    return found


@pytest.fixture(scope="module")
def classes() -> dict[str, list[str]]:
    return trl_trainer_classes()


def test_every_trl_trainer_class_is_classified(classes):
    assert "trl.trainer.grpo_trainer.GRPOTrainer" in classes and len(classes) >= 20, sorted(classes)
    missing = {key: where for key, where in classes.items() if key not in TRL_TRAINERS}
    assert not missing, (f"TRL trainer classes seqpar has not classified (add them to "
                         f"seqpar.integrations.trl.registry, exact with a test or refused with the reason): {missing}")
    stale = sorted(set(TRL_TRAINERS) - set(classes))
    assert not stale, f"classified classes TRL no longer ships: {stale}"


def test_the_exact_ones_are_the_tested_ones_and_every_other_says_why(classes):
    exact = {TRL_TRAINERS[key].name for key in classes if TRL_TRAINERS[key].exact}
    assert exact == EXACT, exact
    for key in classes:
        entry = TRL_TRAINERS[key]
        assert entry.exact or len(entry.refused) > 40, (key, entry.refused)
        assert entry.exact == (entry.mixin is not None or entry.name == "trl.SFTTrainer"), key


def test_a_refused_trainer_is_refused_by_name_before_anything_runs(classes):
    """parallelize_trainer raises Refused naming the trainer and the reason (before any mesh exists)."""
    for key, where in classes.items():
        entry = TRL_TRAINERS[key]
        if entry.exact:
            continue
        cls = _load(key)
        with pytest.raises(seqpar.Refused, match=f"TRL's {entry.name} exact: .*not verified"):
            seqpar.parallelize_trainer(object.__new__(cls), sp=2)
        assert any(w == entry.name or w.endswith(f".{cls.__name__}") for w in where), (entry.name, where)


def test_an_unclassified_trl_trainer_is_refused_and_a_users_subclass_keeps_its_parents_entry():
    import trl

    new = type("NewTrainer", (trl.DPOTrainer,), {"__module__": "trl.trainer.new_trainer"})
    with pytest.raises(seqpar.Refused, match=r"NewTrainer \(trl.trainer.new_trainer.NewTrainer\) is not classified"):
        trl_entry(new)
    mine = type("MyKTO", (trl.KTOTrainer,), {})
    assert trl_entry(mine).name == "trl.KTOTrainer"
    assert trl_entry(type("Plain", (object,), {})) is None


def _load(key: str) -> type:
    module, _, name = key.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_guide_lists_every_trainer_as_exact_or_refused():
    """docs/guides/trl.md's table names each classified trainer with its verdict."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "trl.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in text.splitlines()
            if line.startswith("| `trl.")}
    for entry in set(TRL_TRAINERS.values()):
        row = next((verdict for name, verdict in rows.items() if f"`{entry.name}`" in name), None)
        assert row is not None, f"docs/guides/trl.md does not list {entry.name}"
        assert row.startswith("exact" if entry.exact else "refused"), (entry.name, row)
