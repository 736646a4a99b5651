"""How ``seqpar train`` is built, read from its source (pure AST, nothing run): one path per job.

* The objective is the only way a loss is taken (training, static and dynamic, and evaluation): no
  code in ``seqpar.train`` runs the model itself, reads its ``.logits`` or its own ``.loss``.
* No piece reaches back into an owner object: nothing takes a ``trainer`` argument; the pieces
  share a :class:`seqpar.train.context.RunContext`.
* The objective names, whether an objective trains on pairs and its metrics come from the one
  registry (:data:`seqpar.train.objectives.OBJECTIVES`), not from lists of names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TRAIN = Path(__file__).resolve().parents[2] / "src" / "seqpar" / "train"
CLI_TRAIN = TRAIN.parent / "cli" / "train.py"
MODEL_NAMES = ("model", "policy", "runner")


def _files() -> list[Path]:
    return [*sorted(TRAIN.glob("*.py")), CLI_TRAIN]


def _callee_is_a_model(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in MODEL_NAMES
    return isinstance(func, ast.Attribute) and func.attr in MODEL_NAMES


def model_reads(source: str, name: str = "<src>") -> list[str]:
    """``file:line what`` for every place that runs a model or reads a model output's loss / logits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _callee_is_a_model(node.func):
            found.append(f"{name}:{node.lineno} runs the model ({ast.unparse(node.func)}(...))")
        if isinstance(node, ast.Attribute) and node.attr == "logits":
            found.append(f"{name}:{node.lineno} reads .logits")
        if isinstance(node, ast.Attribute) and node.attr == "loss" and isinstance(node.value, ast.Call):
            found.append(f"{name}:{node.lineno} reads a call's .loss ({ast.unparse(node)})")
    return found


def trainer_arguments(source: str, name: str = "<src>") -> list[str]:
    """``file:line`` for every function that takes an argument named ``trainer``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            found += [f"{name}:{node.lineno} {node.name}({a.arg})" for a in args if a.arg == "trainer"]
    return found


@pytest.mark.parametrize("bad", ["loss = model(**local).loss", "x = self.model(**b).logits",
                                 "out = ctx.policy(**local)", "z = out.logits"])
def test_the_reader_sees_a_model_run_or_its_outputs(bad):
    assert model_reads(bad)


def test_the_reader_lets_the_objective_through():
    assert not model_reads("out = self.objective(ctx.policy, local, ctx.mesh)\nloss = out.loss")
    assert trainer_arguments("def f(trainer: Any) -> None: ...") and not trainer_arguments("def f(ctx): ...")


def test_no_loss_or_logits_read_outside_the_objectives():
    found = [f for p in _files() for f in model_reads(p.read_text(), p.name)]
    assert not found, "seqpar train takes every loss from the objective (seqpar.train.objective_step):\n" + \
        "\n".join(found)


def test_no_piece_takes_the_trainer():
    found = [f for p in _files() for f in trainer_arguments(p.read_text(), p.name)]
    assert not found, found


def test_the_registry_says_what_the_cli_and_the_checks_offer():
    from seqpar.train.config import FIELDS, TrainConfig
    from seqpar.train.objectives import DATA_KINDS, OBJECTIVES

    assert FIELDS["objective"].metadata["choices"] == tuple(OBJECTIVES)
    for spec in OBJECTIVES.values():
        assert spec.data in DATA_KINDS
        assert spec.accuracy is None or spec.accuracy in spec.evaluator(TrainConfig()).metric_names, spec.name
        assert set(spec.options) <= set(FIELDS), spec.name
    text = "".join(p.read_text() for p in _files())
    for literal in ('"dpo", "simpo"', "PAIRED", "in PAIRED"):
        assert literal not in text, literal



def test_the_job_is_prepared_once_per_process():
    """prepare_job reads and tokenizes the data: the parent of local workers calls it (train(), the CLI)
    and hands the job over; only a torchrun rank, which has no parent, prepares its own."""
    calls = {}
    for p in _files():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef):
                for call in ast.walk(node):
                    if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "prepare_job":
                        calls.setdefault(p.name, set()).add(node.name)
    assert calls == {"__init__.py": {"train"}, "launcher.py": {"run_torchrun"}, "train.py": {"run"}}, calls
