"""``torch.compile`` of a parallelized diffusers transformer (tiny Wan and Flux, float64, P = 2, gloo):
no graph break inside a transformer block -- the attention modules' routed SDPA calls trace into
seqpar's functional all-to-alls and opaque ops (seqpar.attention.ops) -- and the compiled loss and
every gradient equal the eager parallelized model's (backend ``aot_eager``: dynamo and AOT autograd
without generating code). The breaks that remain are at the model's edges (the forward's entry,
which builds its shard plan and checks the inputs agree, and the exit's backward mark), counted by
``torch._dynamo.explain``. Both in `make verify` (heavy: a compile of each takes one to three minutes
on this 2-core CPU)."""

import copy
import inspect
import sys

import pytest
import torch

from seqpar.comm.launch import run_distributed

pytestmark = pytest.mark.distributed

CASES = [pytest.param("WanTransformer3DModel", ("WanTransformerBlock",), marks=pytest.mark.heavy),
         pytest.param("FluxTransformer2DModel", ("FluxTransformerBlock", "FluxSingleTransformerBlock"),
                      marks=pytest.mark.heavy)]


def _compiled(rank, world, name, block_names):
    import seqpar
    from seqpar.integrations.diffusers import flow_matching_loss, shard_output
    from seqpar.testing.diffusers_specs import make_inputs
    from seqpar.testing.diffusers_zoo import build_dit, dit_class

    torch.set_num_threads(1)
    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    module = sys.modules[dit_class(name).__module__]
    spans = []
    for block in block_names:
        lines, first = inspect.getsourcelines(getattr(module, block).forward)
        spans.append((inspect.getsourcefile(getattr(module, block)), first, first + len(lines)))
    base, inputs = build_dit(name), make_inputs(name)
    model = seqpar.parallelize(copy.deepcopy(base), mesh, output="sharded")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**inputs)
    in_blocks = [b for b in explained.break_reasons
                 if any(f.filename == path and a <= f.lineno < z for f in b.user_stack or [] for path, a, z in spans)]
    with torch.no_grad():
        whole = torch.full(tuple(base(**inputs).sample.shape), 0.5, dtype=torch.float64)  # a target
    results = []
    for compiled in (False, True):
        m = seqpar.parallelize(copy.deepcopy(base), mesh, output="sharded")
        run = torch.compile(m, backend="aot_eager") if compiled else m
        loss = flow_matching_loss(run(**inputs).sample, shard_output(m, whole), mesh=mesh)
        loss.backward()
        seqpar.sync_gradients(m, mesh)
        results.append((float(loss.detach()), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (loss_e, grads_e), (loss_c, grads_c) = results
    worst = max(float((grads_e[n] - grads_c[n]).abs().max()) for n in grads_e)
    return explained.graph_break_count, len(in_blocks), abs(loss_e - loss_c), worst


@pytest.mark.parametrize("name,blocks", CASES)
def test_compiled_blocks_have_no_graph_break_and_match_eager(name, blocks):
    for breaks, in_blocks, loss_diff, grad_diff in run_distributed(_compiled, 2, name, blocks, timeout=900):
        print(f"{name}: {breaks} graph breaks, {in_blocks} inside a block; compiled vs eager: loss {loss_diff:.1e}, "
              f"gradients {grad_diff:.1e}")
        assert in_blocks == 0
        assert loss_diff <= 1e-12 and grad_diff <= 1e-12
