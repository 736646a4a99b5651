"""Every objective against its float64 oracle at P = 1..4 (one gloo start of 4 processes; P = 2 and 1
run as dp x sp meshes, P = 3 on the first three ranks): padded rows (one left-padded) and packed rows
whose documents -- and chosen / rejected pairs -- straddle shards, odd lengths, tiny Llama with 2 KV
heads (fewer than P = 3, 4), references from a frozen copy, a precomputed column, or LoRA adapters
off. The loss on every rank and every parameter's gradient (after sync_gradients) equal the oracle's
on the unsharded model to model_parity's tolerances. make test runs a covering sample of the grid
(every objective, batch kind, P and reference source), the rest runs under -m heavy.

The padding rule (:mod:`seqpar.batch.targets`: a padding position predicts nothing): batches whose
left-padded row's first real token has a label -- which transformers' sdpa loss would count -- and
9-token rows (at P = 3 and 4 that token starts rank 1's shard): every objective equals the oracle,
which runs each sequence alone and so never predicts that token; make test runs each objective
once (P = 1..4 in turn), -m heavy every objective at every P."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from objective_cases import NEEDS_REFERENCE, OBJECTIVES, Case, make_inputs

import seqpar
from seqpar import objectives as O
from seqpar.batch.targets import targets_after_padding
from seqpar.comm.launch import run_distributed
from seqpar.integrations.models import builtin_config
from seqpar.testing.model_parity import GRAD_TOL, LOSS_TOL, sp_meshes
from seqpar.testing.objective_oracle import make_batch, oracle_terms, sequence_spans
from seqpar.testing.sampling import covering_sample, field_values

WORLD = 4


def _grid() -> list[Case]:
    cases = []
    for name, p, kind in itertools.product(OBJECTIVES, (1, 2, 3, 4), ("padded", "packed")):
        refs = ("frozen", "column") if name in NEEDS_REFERENCE else ("none",)
        for ref in refs:
            cases.append(Case(name, kind, p, seq=13 if kind == "padded" else 19, reference=ref))
    cases.append(Case("dpo-sigmoid", "padded", 2, reference="adapters_off"))
    cases.append(Case("dpo-sigmoid", "packed", 3, seq=19, reference="adapters_off"))
    for name, p in itertools.product(("dpo-sigmoid", "grpo", "bradley_terry", "value"), (2, 4)):
        cases.append(Case(name, "packed", p, seq=19, reference="frozen" if name in NEEDS_REFERENCE else "none",
                          layout="zigzag"))
    return cases


GRID = _grid()
SAMPLE, REST = covering_sample(GRID, 5, field_values)


def _left_padded(name: str, p: int) -> Case:
    ref = ("frozen", "column")[p % 2] if name in NEEDS_REFERENCE else "none"
    return Case(name, "padded", p, seq=9, reference=ref, prompt=0)


LEFT_PADDED = [_left_padded(name, 1 + k % 4) for k, name in enumerate(OBJECTIVES)]
LEFT_PADDED_REST = [_left_padded(name, p) for name in OBJECTIVES for p in (1, 2, 3, 4)
                    if _left_padded(name, p) not in LEFT_PADDED]


def _model(kind: str, seed: int) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = builtin_config("tiny-llama", pad_token_id=0, num_labels=1 if kind != "score3" else 3)
    model = (tf.LlamaForCausalLM if kind == "lm" else tf.LlamaForSequenceClassification)(cfg).to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that attention is peaked (as model_parity draws them)
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64) if p.dim() == 1
                    else torch.randn(p.shape, generator=g, dtype=torch.float64) * (1.5 / p.shape[-1] ** 0.5))
    return model.train()


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, cfg).to(torch.float64)


def _run(case: Case, mesh: Any) -> dict[str, Any]:
    make, model_kind, oracle, names = OBJECTIVES[case.objective]
    policy = _model(model_kind, seed=1)
    if case.reference == "adapters_off":
        policy = _lora(policy)
    batch = make_batch(case.batch, case.seq, 128, seqs=4, seed=7, prompt=case.prompt)
    n = len(sequence_spans(batch))
    inputs = make_inputs(names, batch, n, seed=3)
    num_units = inputs.pop("num_units", None) if "num_units" in names else None
    frozen = None
    ref_rows = ref_tok = None
    if case.objective in NEEDS_REFERENCE:
        if case.reference == "adapters_off":
            with torch.no_grad(), policy.disable_adapter():
                t = oracle_terms(policy, batch)
        else:
            frozen = _model(model_kind, seed=2).requires_grad_(False)
            with torch.no_grad():
                t = oracle_terms(frozen, batch)
        ref_tok = t.logps
        ref_rows = torch.stack([x.sum() for x in ref_tok])
    with torch.no_grad():
        own = oracle_terms(policy, batch) if model_kind == "lm" else None
    if "old_logps" in inputs:  # near the policy's own: ratios inside and outside the clip range
        col = inputs["old_logps"]
        for k, (row, idx) in enumerate(own.where):
            col[row, idx] = col[row, idx] + own.logps[k]
    p = mesh.get_group("sp").size()
    dp = mesh.mesh.numel() // p
    sp_policy = copy.deepcopy(policy)
    # the oracle: each sequence alone, unsharded, backpropagated at the scale the SP ranks' shares carry
    policy.zero_grad(set_to_none=True)
    terms = oracle_terms(policy, batch, kind="lm" if model_kind == "lm" else "score")
    ref_arg = ref_tok if case.objective == "bnpo-kl" else ref_rows
    if num_units is not None:  # dapo: the step's tokens over every dp rank (each holds the same batch)
        num_units = dp * float(sum(m.sum() for m in terms.mask))
    whole = oracle(terms, ref_arg, inputs)  # the mean over the step's units
    (whole * p).backward()
    want_grads = {k: v.grad / p for k, v in policy.named_parameters() if v.grad is not None}
    want = whole / dp if num_units is not None else whole  # each dp rank's loss: its share of the step
    # seqpar
    seqpar.parallelize(sp_policy, mesh)
    kw: dict[str, Any] = dict(inputs)
    if case.objective in NEEDS_REFERENCE:
        if case.reference == "frozen":
            kw["reference"] = seqpar.parallelize(frozen, mesh)
        elif case.reference == "adapters_off":
            kw["reference"] = "adapters_off"
        elif case.objective == "bnpo-kl":  # per token, aligned with the labels
            col = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
            for k, (row, idx) in enumerate(terms.where):
                col[row, idx] = ref_tok[k]
            kw["ref_logps"] = col
        else:
            kw["ref_logps"] = ref_rows
    local = seqpar.shard_batch(batch, mesh, layout=case.layout)
    out = make()(sp_policy, local, mesh, num_units=num_units, **kw)
    out.loss.backward()
    seqpar.sync_gradients(sp_policy, mesh)
    grad_diff = max(float((q.grad - want_grads[k]).abs().max()) for k, q in sp_policy.named_parameters()
                    if q.requires_grad)
    missing = sorted(k for k, q in sp_policy.named_parameters() if q.requires_grad and k not in want_grads)
    return {"loss": float(out.loss.detach()), "want": float(want.detach()), "grad_diff": grad_diff,
            "missing": missing, "n_grads": len(want_grads)}


def _misuse(mesh: Any) -> dict[str, str]:
    """What each misuse raises on this rank (every rank must raise the same ValueError, no hang)."""
    model = seqpar.parallelize(_model("lm", seed=1), mesh)
    batch = make_batch("padded", 13, 128, seqs=3, seed=7)  # 3 sequences: no pairs
    tries = {
        "odd pairs": lambda: O.SimPO()(model, seqpar.shard_batch(batch, mesh), mesh),
        "no reference": lambda: O.DPO()(model, seqpar.shard_batch(batch, mesh), mesh),
        "unknown input": lambda: O.SimPO()(model, seqpar.shard_batch(batch, mesh), mesh, rewards=torch.ones(3)),
        "short advantages": lambda: O.PolicyGradient()(model, seqpar.shard_batch(batch, mesh), mesh,
                                                       advantages=torch.ones(2)),
        "reference not parallelized": lambda: O.KTO()(model, seqpar.shard_batch(batch, mesh), mesh,
                                                      reference=_model("lm", seed=2), desirable=torch.ones(3)),
        "not sharded": lambda: O.SimPO()(model, batch, mesh),
    }
    out = {}
    for name, fn in tries.items():
        try:
            fn()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def _worker(rank: int, world: int, cases: list[Case], misuse: bool = False) -> dict[Any, Any]:
    torch.set_num_threads(1)
    meshes = sp_meshes(world, (1, 2, 3, 4))
    out: dict[Any, Any] = {"misuse": _misuse(meshes[2])} if misuse else {}
    for case in cases:
        mesh = meshes[case.p]
        if mesh is not None:
            out[case] = _run(case, mesh)
    return out


def _check(results: list[dict[Case, dict[str, Any]]], cases: list[Case]) -> None:
    bad = []
    for case in cases:
        rows = [r[case] for r in results if case in r]
        assert len(rows) == (case.p if WORLD % case.p else WORLD), case
        for rank, row in enumerate(rows):
            assert row["n_grads"] > 0 and not row["missing"], (case, row)
            if abs(row["loss"] - row["want"]) > LOSS_TOL or row["grad_diff"] > GRAD_TOL:
                bad.append(f"{case} rank {rank}: loss {row['loss']:.12g} vs {row['want']:.12g}, "
                           f"grad diff {row['grad_diff']:.3g}")
    assert not bad, "\n".join(bad)


@pytest.mark.distributed
def test_sample_covers_the_grid():
    assert sorted(map(repr, SAMPLE + REST)) == sorted(map(repr, GRID))
    met = set().union(*map(field_values, SAMPLE))
    assert met == set().union(*map(field_values, GRID))


@pytest.mark.distributed
def test_objectives_equal_their_oracle():
    results = run_distributed(_worker, WORLD, SAMPLE, True, timeout=600)
    _check(results, SAMPLE)
    expected = {"odd pairs": "3 sequences: an even number", "no reference": "needs reference log-probs",
                "unknown input": "takes no input ['rewards']", "short advantages": "needs 3 values",
                "reference not parallelized": "not parallelized", "not sharded": "seqpar.shard_batch"}
    for r in results:
        for name, text in expected.items():
            assert text in r["misuse"][name], (name, r["misuse"][name])


def _left_padding_is_exercised() -> None:
    batch = make_batch("padded", 9, 128, seqs=4, seed=7, prompt=0)
    assert targets_after_padding(batch["labels"], batch["attention_mask"].bool()) > 0


@pytest.mark.distributed
def test_every_objective_gives_a_padding_position_no_target():
    _left_padding_is_exercised()
    _check(run_distributed(_worker, WORLD, LEFT_PADDED, timeout=600), LEFT_PADDED)


@pytest.mark.distributed
@pytest.mark.heavy
def test_every_objective_gives_a_padding_position_no_target_at_every_p():
    _left_padding_is_exercised()
    assert sorted(map(repr, LEFT_PADDED + LEFT_PADDED_REST)) == sorted(
        repr(_left_padded(name, p)) for name in OBJECTIVES for p in (1, 2, 3, 4))
    _check(run_distributed(_worker, WORLD, LEFT_PADDED_REST, timeout=1800), LEFT_PADDED_REST)


@pytest.mark.distributed
@pytest.mark.heavy
def test_objectives_equal_their_oracle_whole_grid():
    _check(run_distributed(_worker, WORLD, REST, timeout=1800), REST)


def _router_logits_worker(rank, world):
    import transformers

    import seqpar
    from seqpar.errors import Refused
    from seqpar.objectives import CausalLM

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=2,
                                        num_experts_per_tok=1, output_router_logits=True)
    model = transformers.MixtralForCausalLM(config)
    mesh = seqpar.init_mesh(sp=world)
    seqpar.parallelize(model, mesh)
    ids = torch.arange(12)[None] % 64
    local = seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh)
    try:
        CausalLM()(model, local, mesh)
    except Refused as e:
        return str(e)
    return None


@pytest.mark.distributed
def test_a_model_with_router_logits_is_refused_not_run_without_its_aux_loss():
    """A MoE model that outputs router logits adds an aux loss to its own loss, which the objectives
    do not: refused by name on every rank (before any collective) instead of silently left out."""
    for message in run_distributed(_router_logits_worker, 2, timeout=300):
        assert message is not None and "output_router_logits" in message, message
