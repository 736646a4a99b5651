"""Expert parallelism's decisions that need no communication (seqpar.integrations.moe: plan, layout,
families): who owns which experts, the send order of a batch's rows and its inverse, the rank
folding contract and the replica groups, and which models' experts seqpar can shard (the model's
own base_model_ep_plan) -- a model it cannot is Refused by name with the reason."""

import pytest
import torch
from torch import nn

from seqpar.errors import Refused
from seqpar.integrations.moe import plan
from seqpar.integrations.moe.families import IMPLEMENTATIONS, experts_of
from seqpar.integrations.moe.layout import fold_problem, replica_ranks


def test_experts_split_by_tensor_split_and_ep_above_experts_is_refused():
    assert plan.owned_experts(4, 2) == [2, 2]
    assert plan.owned_experts(5, 2) == [3, 2]
    assert plan.owned_experts(6, 4) == [2, 2, 1, 1]
    assert [plan.expert_range(5, 2, r) for r in range(2)] == [(0, 3), (3, 2)]
    with pytest.raises(ValueError, match="ep=4 exceeds the 3 experts.*choose ep <= 3"):
        plan.owned_experts(3, 4)


def test_rows_sorted_by_expert_reach_their_owners_and_come_back_in_place():
    g = torch.Generator().manual_seed(0)
    t, k, e = 7, 2, 5
    top = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, k] distinct experts per token
    r = plan.route(top, e)
    experts = top.reshape(-1)[r.order]
    assert torch.equal(experts, experts.sort().values)  # sorted by expert, so grouped by owner
    assert torch.equal(r.tokens, r.order // k)
    assert r.counts.tolist() == [int((top == i).sum()) for i in range(e)]
    owned = plan.owned_experts(e, 2)
    assert plan.per_rank(r.counts.tolist(), owned) == [int((top < 3).sum()), int((top >= 3).sum())]
    rows = torch.randn(t * k, 3, dtype=torch.float64, generator=g)  # results in send order
    back = plan.unsort(rows, r.order, k)  # [T, k, 3]
    for i in range(t * k):
        tok, slot = divmod(int(r.order[i]), k)
        assert torch.equal(back[tok, slot], rows[i])


def test_local_ids_follow_the_received_counts_source_major():
    recv = [[2, 0, 1], [0, 3, 1]]  # from source 0: 2 rows for local expert 0, none for 1, 1 for 2; ...
    ids = plan.local_ids(recv, torch.device("cpu"))
    assert ids.tolist() == [0, 0, 2, 1, 1, 1, 2]
    assert plan.local_ids([[0, 0], [0, 0]], torch.device("cpu")).numel() == 0


def _table(mesh, groups):
    """The fold table of world ranks: every rank's (mesh ranks, its ep group)."""
    of = {r: tuple(g) for g in groups for r in g}
    return [(tuple(mesh), of[r]) for r in range(len(mesh))]


def test_fold_contract_and_replicas():
    # dp2 x sp2, ep over sp: experts 0-1 on {0, 2}, 2-3 on {1, 3}
    t = _table(range(4), [[0, 1], [2, 3]])
    assert fold_problem(t) is None
    assert replica_ranks(t) == [[0, 2], [1, 3]]
    t = _table(range(4), [[0, 2], [1, 3]])  # ep across dp
    assert fold_problem(t) is None and replica_ranks(t) == [[0, 1], [2, 3]]
    t = _table(range(4), [[0, 1, 2, 3]])  # ep = dp x sp: one replica each
    assert fold_problem(t) is None and replica_ranks(t) == [[0], [1], [2], [3]]
    assert "different sizes" in fold_problem(_table(range(4), [[0], [1, 2, 3]]))
    # two meshes (as at two tp ranks): an ep group may not cross them
    two = [((0, 1), (0, 1)), ((0, 1), (0, 1)), ((2, 3), (2, 3)), ((2, 3), (2, 3))]
    assert fold_problem(two) is None and replica_ranks(two) == [[0], [1], [2], [3]]
    crossing = [((0, 1), (0,)), ((0, 1), (1, 2)), ((2, 3), (1, 2)), ((2, 3), (3,))]
    assert "not inside its mesh's dp x sp ranks" in fold_problem(crossing)
    assert "different ep groups" in fold_problem([((0, 1), (0, 1)), ((0, 1), (1,))])


def _tiny(family, **overrides):
    from seqpar.testing.zoo import build_tiny

    return build_tiny(family, **overrides)


@pytest.mark.parametrize("family,params", [
    ("qwen3_moe", ("gate_up_proj", "down_proj")), ("mixtral", ("gate_up_proj", "down_proj")),
    ("gpt_oss", ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")),
])
def test_experts_found_from_the_models_own_plan(family, params):
    found = experts_of(_tiny(family))
    assert [e.name for e in found] == [f"model.layers.{i}.mlp.experts" for i in range(len(found))] and found
    assert all(set(e.params) == set(params) and e.num_experts == 4 for e in found)


def test_dense_layers_are_not_experts():
    found = experts_of(_tiny("deepseek_v3", first_k_dense_replace=1))
    assert [e.name for e in found] == ["model.layers.1.mlp.experts"]  # layer 0 dense; shared experts not cut


def test_models_seqpar_cannot_shard_are_refused_by_name():
    with pytest.raises(Refused, match="LlamaForCausalLM declares no expert-parallel plan"):
        experts_of(_tiny("llama"))
    with pytest.raises(Refused, match="JetMoeForCausalLM declares no expert-parallel plan"):
        experts_of(_tiny("jetmoe"))
    model = _tiny("mixtral")
    model.model.layers[0].mlp.experts.extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(Refused, match=r"holds parameters its plan does not stack by expert \(\['extra'\]\)"):
        experts_of(model)
    model = _tiny("qwen3_moe")
    model.model.layers[1].mlp.experts.num_experts = 3  # its stacked tensors hold 4
    with pytest.raises(Refused, match="do not have its 3 experts on dim 0"):
        experts_of(model)
    model = _tiny("qwen3_moe")
    model.config.base_model_ep_plan = {"blocks.*.moe.experts": "ep_dispatch_experts"}
    with pytest.raises(Refused, match="no module of the model matches it"):
        experts_of(model)


def test_an_experts_kernel_that_cannot_run_on_a_shard_is_refused(monkeypatch):
    from seqpar import compat

    model = _tiny("qwen3_moe")
    assert compat.experts_implementation(model.config) == "eager" and "eager" in IMPLEMENTATIONS
    monkeypatch.setattr(compat, "experts_implementation", lambda config: "deepgemm_megamoe")
    with pytest.raises(Refused, match="experts_implementation='deepgemm_megamoe'.*load it with"):
        experts_of(model)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_each_experts_implementation_runs_on_a_shard(impl):
    """What EP's owner does: the class's own forward on a cut of the stacked tensors (num_experts set
    to the cut's), local expert ids, top-1 with unit weights -- equal, row by row, to the whole
    module on the same experts' global ids (float32: grouped_mm has no float64)."""
    import copy

    from transformers import AutoModelForCausalLM

    from seqpar.testing.zoo import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), experts_implementation=impl)
    whole = model.model.layers[0].mlp.experts
    shard = copy.deepcopy(whole)
    start, n = plan.expert_range(4, 2, 1)  # ep rank 1 of 2: experts 2-3
    for name in ("gate_up_proj", "down_proj"):
        setattr(shard, name, nn.Parameter(getattr(whole, name).detach()[start:start + n].clone()))
    shard.num_experts = n
    x = torch.randn(9, whole.gate_up_proj.shape[-1])
    local = torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1])[:, None]
    ones = torch.ones(9, 1)
    got = type(shard).forward(shard, x, local, ones)
    want = type(whole).forward(whole, x, local + start, ones)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), float((got - want).abs().max())


def test_a_dynamic_schedules_bin_is_refused_before_any_exchange():
    """EP in a dynamic SP schedule's bin: the ranks of an ep group run different numbers of forwards
    there, so the experts' forward refuses it first thing (no collective: here there is no group)."""
    from seqpar.batch.local_batch import LocalBatch
    from seqpar.integrations.moe.expert_parallel import ExpertParallelForward
    from seqpar.integrations.moe.layout import EPLayout

    batch = LocalBatch(None, sp_rank=0, sp_size=2, dp_size=1, denominator=1.0, num_items_in_batch=None,
                       loss_weights=None, grad_ranks=4)  # a bin: grad_ranks given
    forward = ExpertParallelForward(EPLayout(None, None, 2, 0), [2, 2], ("gate_up_proj",), 4, lambda: batch)
    with pytest.raises(Refused, match="dynamic SP schedule's bin.*use the static schedule"):
        forward(nn.Identity(), torch.zeros(3, 8), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
