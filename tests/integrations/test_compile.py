"""``torch.compile`` of a parallelized model (tiny Llama, float64, P = 2, gloo): no graph break inside a
decoder layer -- Ulysses on plain, padded and packed rows, ring, and hybrid (ring 2 x ulysses 1) --,
the compiled loss and every gradient equal to the eager model's over batches of different layouts
(with autograd, and without: then each call checks its own failures), batches of a layout seen
before compiling nothing, and a kernel failing on one rank inside the compiled model still raising
on every rank, at the loss or at the end of the backward.

``torch._dynamo.explain`` counts the breaks. Before seqpar's attention ran as traceable functional
all-to-alls around opaque ops (``seqpar.attention.ops``) it found 18 (plain) / 42 (padded) / 50
(packed) on Ulysses, most of them inside the layers, and ring models did not compile at all. Those
left are the loss's (its all-reduce read on the host, the batch's failure check run eagerly): after
the last layer. Backend ``aot_eager`` for the parity: dynamo and AOT autograd as with inductor,
without generating code (CPU). ``-s`` prints the figures.
"""

import copy
import inspect

import pytest
import torch

import seqpar
from seqpar.comm.launch import run_distributed
from seqpar.testing.model_parity import GRAD_TOL, LOSS_TOL, ModelCase, case_batch, make_model

pytestmark = pytest.mark.distributed  # every test here starts gloo worker processes

P = 2
KINDS = ("plain", "padded", "packed")
# what make test runs; the rest of the grid is heavy (make verify): each compile takes tens of seconds here
BREAKS = [("ulysses", "padded")]
BREAKS_HEAVY = [(s, k) for s in ("ulysses", "ring", "hybrid") for k in KINDS if (s, k) not in BREAKS]
PARITY, PARITY_HEAVY = ["ulysses"], ["ring", "hybrid"]
FAILURES = [("ulysses", "backward")]
FAILURES_HEAVY = [("ulysses", "forward"), ("ring", "forward"), ("ring", "backward")]
# batches of different layouts, then layouts seen before with other tokens: those must compile nothing
BATCHES = {False: [("plain", "contiguous", 0), ("packed", "zigzag", 1), ("plain", "contiguous", 2)],
           True: [("plain", "contiguous", 0), ("padded", "contiguous", 1), ("packed", "contiguous", 2),
                  ("packed", "zigzag", 3), ("plain", "contiguous", 4), ("padded", "contiguous", 5),
                  ("packed", "zigzag", 6)]}


def _meshes():
    return {"ulysses": seqpar.init_mesh(sp=P, device_type="cpu"),
            "hybrid": seqpar.init_mesh(sp=P, ulysses=1, ring=P, device_type="cpu")}


def _mesh(meshes, strategy):
    return meshes["hybrid" if strategy == "hybrid" else "ulysses"]


def _in_layer(frames) -> bool:
    """Whether a break's user stack passes through a decoder layer's forward."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    lines, first = inspect.getsourcelines(LlamaDecoderLayer.forward)
    path = inspect.getsourcefile(LlamaDecoderLayer)
    return any(f.filename == path and first <= f.lineno < first + len(lines) for f in frames)


def _breaks(meshes, cases) -> dict:
    """Per strategy and batch kind: graph breaks of one forward, those inside a decoder layer, and
    where each break is (its innermost frame)."""
    out = {}
    for strategy, kind in cases:
        torch._dynamo.reset()
        mesh = _mesh(meshes, strategy)
        model = make_model(ModelCase())
        seqpar.parallelize(model, mesh, strategy=strategy)
        local = seqpar.shard_batch(case_batch(ModelCase(batch=kind, seq=16), model.config.vocab_size), mesh,
                                   layout="zigzag" if strategy != "ulysses" else "contiguous")
        explained = torch._dynamo.explain(model)(**local)
        stacks = [b.user_stack for b in explained.break_reasons]
        out[(strategy, kind)] = {
            "breaks": explained.graph_break_count, "in_layers": sum(_in_layer(st) for st in stacks),
            "where": sorted({f"{st[-1].filename.split('/')[-1]}:{st[-1].name}" for st in stacks if st})}
    return out


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _parity(meshes, strategies, heavy: bool) -> dict:
    """Eager and compiled copies of one model on the same batches: loss and gradient differences
    (with autograd, and without: checked per call), and the graphs compiled so far after each batch."""
    from torch._dynamo.utils import counters

    out = {}
    for strategy in strategies:
        torch._dynamo.reset()
        counters.clear()
        mesh = _mesh(meshes, strategy)
        eager = make_model(ModelCase())
        compiled = copy.deepcopy(eager)
        for m in (eager, compiled):
            seqpar.parallelize(m, mesh, strategy=strategy)
        run = torch.compile(compiled, backend="aot_eager")
        rows = []
        batches = BATCHES[heavy]
        for i, (kind, layout, seed) in enumerate(batches):
            batch = case_batch(ModelCase(batch=kind, seq=16, seed=seed), eager.config.vocab_size)
            losses, grads = [], []
            for fn, m in ((eager, eager), (run, compiled)):  # each its own shard of the batch: its own plans
                m.zero_grad(set_to_none=True)
                loss = fn(**seqpar.shard_batch(batch, mesh, layout=layout)).loss
                loss.backward()
                losses.append(float(loss.detach()))
                grads.append(_grads(m))
            graphs = counters["stats"]["unique_graphs"]
            no_grad = [0.0, 0.0]
            if heavy or i == len(batches) - 1:  # without autograd (another graph): checked per call, inside the ops
                with torch.no_grad():
                    no_grad = [float(f(**seqpar.shard_batch(batch, mesh, layout=layout)).loss) for f in (eager, run)]
            rows.append({"batch": (kind, layout), "loss": abs(losses[0] - losses[1]),
                         "no_grad": abs(no_grad[0] - no_grad[1]),
                         "same_params": set(grads[0]) == set(grads[1]) and len(grads[0]) > 0,
                         "grad": max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0]),
                         "graphs": graphs})
        out[strategy] = rows
    return out


def _failures(meshes, cases, world: int) -> dict:
    """A kernel failing on the last rank inside the compiled model (dynamo's eager backend), forward
    or backward: what each rank raised, and where (the loss, or the backward)."""
    from seqpar.attention import kernels
    from seqpar.testing.attention_faults import FailingLseKernel

    out = {}
    for strategy, when in cases:
        torch._dynamo.reset()
        kernels.KERNELS["failing"] = FailingLseKernel(world - 1, when)  # by name: the ops run it
        mesh = _mesh(meshes, strategy)
        model = make_model(ModelCase())
        seqpar.parallelize(model, mesh, strategy=strategy, kernel="failing")
        run = torch.compile(model, backend="eager")
        batch = case_batch(ModelCase(batch="packed", seq=16), model.config.vocab_size)
        seen = {"raised": None, "message": "", "cause": None, "at": "forward"}
        try:
            loss = run(**seqpar.shard_batch(batch, mesh)).loss
            seen["at"] = "backward"
            loss.backward()
            seen["at"] = None
        except Exception as e:
            seen.update(raised=type(e).__name__, message=str(e),
                        cause=type(e.__cause__).__name__ if e.__cause__ is not None else None)
        del kernels.KERNELS["failing"]
        seqpar.unparallelize(model)
        seqpar.parallelize(model, mesh, strategy=strategy)  # the groups and the failure record still work
        model(**seqpar.shard_batch(batch, mesh)).loss.backward()
        seen["after"] = True
        out[(strategy, when)] = seen
    return out


def _worker(rank, world, heavy):
    torch.set_num_threads(1)
    meshes = _meshes()
    return {"breaks": _breaks(meshes, BREAKS_HEAVY if heavy else BREAKS),
            "parity": _parity(meshes, PARITY_HEAVY if heavy else PARITY, heavy),
            "failures": _failures(meshes, FAILURES_HEAVY if heavy else FAILURES, world)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_worker, P, False, timeout=1500, pg_timeout=120)


@pytest.fixture(scope="module")
def heavy_runs():
    return run_distributed(_worker, P, True, timeout=3000, pg_timeout=120)


def _check_breaks(runs, case) -> None:
    for rank, r in enumerate(runs):
        seen = r["breaks"][case]
        print(f"rank {rank} {case}: {seen}")
        assert seen["in_layers"] == 0, seen
        assert seen["breaks"] <= 3, seen  # the loss's: its all-reduce read on the host, the failure check


def _check_parity(runs, strategy) -> None:
    for rank, r in enumerate(runs):
        for row in r["parity"][strategy]:
            print(f"rank {rank} {strategy}: {row}")
            assert row["same_params"], row
            assert row["loss"] <= LOSS_TOL and row["no_grad"] <= LOSS_TOL, row
            assert row["grad"] <= GRAD_TOL, row


def _check_steady(runs, strategy) -> None:
    for r in runs:
        rows, seen = r["parity"][strategy], set()
        for before, row in zip([None, *rows], rows, strict=False):
            if row["batch"] in seen:  # a layout seen before: nothing new to compile
                assert row["graphs"] == before["graphs"], rows
            seen.add(row["batch"])


def _check_failure(runs, case) -> None:
    from seqpar.testing.attention_faults import Crash, crash_problems

    strategy, when = case
    per_rank = [r["failures"][case] for r in runs]
    assert crash_problems(Crash(strategy, when), per_rank) == []
    assert [seen["at"] for seen in per_rank] == [when] * P  # the loss, or the end of the backward


@pytest.mark.parametrize("case", BREAKS, ids="-".join)
def test_no_graph_break_inside_a_decoder_layer(runs, case):
    _check_breaks(runs, case)


@pytest.mark.heavy
@pytest.mark.parametrize("case", BREAKS_HEAVY, ids="-".join)
def test_no_graph_break_inside_a_decoder_layer_grid(heavy_runs, case):
    _check_breaks(heavy_runs, case)


@pytest.mark.parametrize("strategy", PARITY)
def test_compiled_loss_and_gradients_equal_eager(runs, strategy):
    _check_parity(runs, strategy)
    _check_steady(runs, strategy)


@pytest.mark.heavy
@pytest.mark.parametrize("strategy", PARITY_HEAVY)
def test_compiled_loss_and_gradients_equal_eager_grid(heavy_runs, strategy):
    _check_parity(heavy_runs, strategy)
    _check_steady(heavy_runs, strategy)


@pytest.mark.parametrize("case", FAILURES, ids="-".join)
def test_a_kernel_failure_inside_the_compiled_model_raises_on_every_rank(runs, case):
    _check_failure(runs, case)


@pytest.mark.heavy
@pytest.mark.parametrize("case", FAILURES_HEAVY, ids="-".join)
def test_a_kernel_failure_inside_the_compiled_model_raises_on_every_rank_grid(heavy_runs, case):
    _check_failure(heavy_runs, case)
