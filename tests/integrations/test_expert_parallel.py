"""Expert parallelism with sequence parallelism (seqpar.integrations.moe; issue 46, item 3), float64,
gloo, 4 ranks: parallelize(model, mesh, ep=group) + shard_batch + sync_gradients against the
unsharded model (loss 1e-9, every gradient 1e-8: an expert shard against its rows of the stacked
tensor) and against the same code without EP (seqpar.testing.ep_parity); every dense projection runs
on this rank's shard only (dense layers keep SP with EP on); skewed routers (an expert taking most
rows, one taking none); refusals and contract errors on every rank; the experts' replica groups
sync_gradients reduces over; DDP and FSDP2 refused around sharded experts (seqpar's shorthands before
they touch a weight, a stock wrapper at its first forward); an export gathers them whole.
`make test`: two parity cases and the rest in one spawn; the grid and the EP zoo are heavy."""

import pytest
import torch

from seqpar.comm.launch import run_distributed
from seqpar.testing.ep_parity import EPCase, build_moe, compare_ep

pytestmark = pytest.mark.distributed

HOT_COLD = (3.0, 0.0, 0.0, -30.0)  # expert 0 takes a row of every token, expert 3 none
QUICK = [EPCase("qwen3_moe", skew=HOT_COLD),  # dp2 x sp2, ep over sp, Ulysses, padded rows
         EPCase("mixtral", batch="packed", seq=17, strategy="ring", dp=1, sp=4, fold="strided")]


def _worker(rank, world, export_dir):
    import torch.distributed as dist

    import seqpar
    from seqpar.batch import grad_groups
    from seqpar.errors import Refused
    from seqpar.integrations.state import state_of
    from seqpar.testing.zoo import build_tiny

    torch.set_num_threads(1)
    out = {"rows": [compare_ep(c) for c in QUICK]}
    mesh = seqpar.init_mesh(sp=2, device_type="cpu")  # dp2 x sp2
    over_sp, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    dense = build_tiny("llama")
    try:
        seqpar.parallelize(dense, mesh, ep=over_sp)
        out["dense"] = None
    except Refused as e:
        out["dense"] = (str(e), state_of(dense) is None)  # refused, and nothing left installed
    try:
        seqpar.parallelize(build_moe(EPCase("qwen3_moe", experts=3)), mesh, ep=dist.group.WORLD)
        out["ep > E"] = None
    except ValueError as e:
        out["ep > E"] = str(e)
    uneven, _ = dist.new_subgroups_by_enumeration([[0], [1, 2, 3]])
    try:
        seqpar.parallelize(build_tiny("qwen3_moe"), mesh, ep=uneven)
        out["fold"] = None
    except ValueError as e:
        out["fold"] = str(e)
    model = build_tiny("qwen3_moe")
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    seqpar.parallelize(model, mesh, ep=over_sp)
    found = grad_groups.sharded_params(model)
    out["replicas"] = [(s.what, len(s.params), dist.get_process_group_ranks(s.group)) for s in found]
    out["shapes"] = [tuple(p.shape) for s in found for p in s.params]
    seqpar.save_pretrained(model, export_dir, mesh)
    try:
        seqpar.apply_ddp(model, mesh)
        out["ddp"] = None
    except Refused as e:
        out["ddp"] = str(e)
    try:
        seqpar.apply_fsdp(model, mesh)
        out["fsdp"] = None
    except Refused as e:
        out["fsdp"] = str(e)
    seqpar.unparallelize(model)
    out["after"] = (grad_groups.sharded_params(model),
                    max(float((p.detach() - whole[n]).abs().max()) for n, p in model.named_parameters()))
    stock = build_tiny("qwen3_moe")  # a wrapper built by hand is refused at its first training forward
    seqpar.parallelize(stock, mesh, ep=over_sp)
    ddp = torch.nn.parallel.DistributedDataParallel(stock, process_group=dist.group.WORLD)
    ids = torch.arange(32).view(2, 16) % 50
    try:
        ddp(**seqpar.shard_batch({"input_ids": ids, "labels": ids}, mesh))
        out["stock ddp"] = None
    except Refused as e:
        out["stock ddp"] = str(e)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float64)
        out["export"] = max(float((p.detach() - whole[n]).abs().max()) for n, p in saved.named_parameters())
    return out


def _expert_rows(rows):
    """Every rank's rows: global expert id -> total rows it ran on, per source rank, for each layer."""
    per_layer = {}
    for row in rows:
        for layer, experts in row["loads"].items():
            per_layer.setdefault(layer, {}).update(experts)
    return per_layer


def test_ep_with_sp_exact_and_refusals(tmp_path):
    outs = run_distributed(_worker, 4, str(tmp_path / "export"), timeout=600)
    for i, case in enumerate(QUICK):
        rows = [o["rows"][i] for o in outs]
        for r in rows:
            assert r["ok"], (r["label"], r["failed"], r["worst"], r["grad_max"], r["grad_max_sp"])
            assert not r["f32"] and r["loss_diff"] <= 1e-9 and r["grad_max"] <= 1e-8  # float64-exact families
            assert r["dense_tokens_ok"] and r["dense_tokens"], r["label"]  # dense projections: this shard only
            assert len(r["sharded"]) == 4, r["sharded"]  # 2 layers x (gate_up_proj, down_proj)
        if case.skew == HOT_COLD:
            for layer, experts in _expert_rows(rows).items():
                totals = {e: sum(by_source) for e, by_source in experts.items()}
                # top-2: every token picked expert 0 (half of all rows), none picked expert 3
                assert totals[3] == 0 and totals[0] == sum(totals.values()) // 2, (layer, totals)
    for rank, out in enumerate(outs):
        message, clean = out["dense"]
        assert "LlamaForCausalLM declares no expert-parallel plan" in message and clean, out["dense"]
        assert "ep=4 exceeds the 3 experts" in out["ep > E"], out["ep > E"]
        assert "have different sizes [1, 3]: choose one ep" in out["fold"], out["fold"]
        replicas = [0, 2] if rank % 2 == 0 else [1, 3]  # ep over sp {0, 1}, {2, 3}: same experts on 0 and 2
        assert out["replicas"] == [(f"the experts of model.layers.{i}.mlp.experts", 2, replicas) for i in range(2)]
        assert out["shapes"] == [(2, 64, 32), (2, 32, 32)] * 2, out["shapes"]  # 2 of the 4 experts
        for wrapper in ("ddp", "fsdp", "stock ddp"):  # refused, saying what to do instead
            assert "use no wrapper and seqpar.sync_gradients(model, mesh)" in out[wrapper], (wrapper, out[wrapper])
        assert out["after"] == ([], 0.0), out["after"]  # unparallelize gathers the experts back, whole
    assert outs[0]["export"] == 0.0  # the written checkpoint holds every expert
