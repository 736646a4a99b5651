"""Tensor parallelism with sequence parallelism on one N-D mesh: every parameter's gradient and the
loss on every rank equal the unsharded float64 model's (loss 1e-9, gradients 1e-8; a model that
computes in float32 itself, Gemma 2's norms, at float32 precision as in model_parity).

    make test    init_mesh(tp=2, sp=2), 4 gloo ranks: Llama (GQA: 1 KV head per tp rank < sp, so
                 Ulysses replicates it), Qwen3 (per-head q/k norms: gradients summed over tp),
                 Mistral (sliding window), Gemma 2 (softcaps, eager float64), tied embeddings;
                 Ulysses and ring (zigzag); padded, packed and plain rows; the memory switches
                 (tiled vocabulary-parallel loss, tiled MLP, checkpoints) and FSDP2 over dp x sp
                 with TP as its 2-D parameters; plus what is refused, gather_log_probs and
                 save_pretrained of the sharded model.
    make verify  (heavy) init_mesh(dp_shard=2, tp=2, sp=2) and init_mesh(tp=2, ulysses=2, ring=2) on
                 8 ranks: the same families, hybrid included; and dp_replicate=2 x tp2 x sp2 (HSDP
                 with TP under apply_fsdp, and sync_gradients).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from seqpar.comm.dims import MeshDims, resolve_dims
from seqpar.comm.launch import run_distributed
from seqpar.errors import Refused
from seqpar.testing.nd_parity import nd_case, run_nd_parity

FAST = [
    nd_case("tiny-llama", "padded", 16),  # 4 / 2 heads: 1 KV head per tp rank, replicated over sp=2
    nd_case("tiny-qwen3", "packed", 17, "ring"),
    nd_case("tiny-mistral", "plain", 13),
    nd_case("tiny-gemma2", "padded", 15),
    nd_case("tiny-llama", "packed", 17, "ring", heads=8, kv_heads=2, layout="zigzag"),
    nd_case("tiny-llama", "padded", 15, config=(("tie_word_embeddings", True),)),
    nd_case("tiny-qwen3", "padded", 16, memory=True),
    nd_case("tiny-llama", "packed", 16, fsdp=True, memory=True),
]


# ---------------------------------------------------------------------------------------------
# pure: the degrees of a mesh, the vocabulary split, the plan
# ---------------------------------------------------------------------------------------------


def test_resolve_dims_defaults_and_order():
    assert resolve_dims(4, tp=2, sp=2) == MeshDims(dp_shard=1, sp=2, tp=2, ulysses=2)
    d = resolve_dims(16, dp_replicate=2, tp=2, ulysses=2, ring=2)
    assert (d.dp_replicate, d.dp_shard, d.sp, d.tp, d.hybrid, d.grad_ranks) == (2, 1, 4, 2, True, 8)
    assert resolve_dims(8, dp=2, tp=2, sp=2).dp_shard == 2  # dp alone is dp_shard
    assert resolve_dims(8, dp_shard=2, tp=2, sp=2, ep=4).ep == 4
    assert resolve_dims(8, dp_shard=2, tp=2, sp=2).world == 8


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 3, "sp": 2}, "sp=2 x tp=3 = 6 must divide the world size 8"),
    ({"dp_shard": 3, "tp": 2}, "dp_shard=3"),
    ({"dp_replicate": 3, "tp": 2}, "dp_replicate=3 must divide"),
    ({"dp": 4, "dp_shard": 1, "tp": 2}, "dp=4 != dp_replicate=1 x dp_shard=1"),
    ({"ulysses": 2, "ring": 2, "sp": 2}, "ulysses=2 x ring=2 = 4 != sp=2"),
    ({"tp": 2, "sp": 2, "ep": 3}, "ep=3 must divide dp_shard x sp"),
    ({"tp": 0}, "tp=0 must be a positive integer"),
])
def test_resolve_dims_names_the_option_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_dims(8, **kwargs)


def test_vocab_range_is_torch_chunk():
    from seqpar.batch.vocab_parallel import vocab_range

    for vocab in (128, 127, 5):
        for tp in (1, 2, 3, 4):
            chunks = torch.arange(vocab).chunk(tp)
            got = [vocab_range(vocab, tp, r) for r in range(tp)]
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks] + [(vocab, vocab)] * (tp - len(chunks))
            assert got == want, (vocab, tp)


def test_plan_maps_the_models_own_styles():
    from seqpar.integrations.distributed.tensor_parallel import check_tp
    from seqpar.integrations.models import build_model

    model, _ = build_model("tiny-qwen3")
    plan = check_tp(model, 2)
    assert plan["lm_head"] == "colwise_gather_output" and plan["model.embed_tokens"] == "embedding_rowwise"
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan["model.layers.0.self_attn.k_norm"] == "replicated_with_grad_allreduce"


def test_tp_refuses_what_it_cannot_split_exactly():
    from seqpar.integrations.distributed.tensor_parallel import check_tp
    from seqpar.integrations.models import build_model

    model, _ = build_model("tiny-llama")  # 4 query / 2 KV heads
    with pytest.raises(ValueError, match=r"4 query and 2 KV heads, which tp=4 cannot split.*choose tp in \[1, 2\]"):
        check_tp(model, 4)
    model.tp_plan = {}  # no plan: Refused by name
    with pytest.raises(Refused, match="LlamaForCausalLM has no tensor-parallel plan"):
        check_tp(model, 2)
    model, _ = build_model("tiny-llama")
    model.tp_plan = {**model.tp_plan, "model.layers.*.self_attn.q_proj": "packed_colwise"}
    with pytest.raises(Refused, match="packed_colwise"):
        check_tp(model, 2)


def test_tp_refuses_per_head_parameters_outside_the_plan():
    from seqpar.integrations.distributed.tensor_parallel import check_tp
    from seqpar.integrations.models import build_model

    model, _ = build_model("tiny-llama")
    model.model.layers[0].self_attn.sinks = nn.Parameter(torch.zeros(4))  # as GPT-OSS's attention sinks
    with pytest.raises(Refused, match=r"per-head parameters \['sinks'\]"):
        check_tp(model, 2)


# ---------------------------------------------------------------------------------------------
# 4 gloo ranks: init_mesh(tp=2, sp=2)
# ---------------------------------------------------------------------------------------------


def _extras(rank: int, world: int, out_dir: str) -> dict:
    """Beside the grid: what is refused on the tp mesh, gather_log_probs from vocabulary-parallel
    logits, and save_pretrained of the TP-sharded model (a plain checkpoint, equal weights)."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    import seqpar
    from seqpar.comm.degrees import DegreeMeshes
    from seqpar.comm.mesh import axis_group
    from seqpar.testing.model_parity import ModelCase, case_batch, make_model

    torch.set_num_threads(1)
    out: dict = {}
    mesh = seqpar.init_mesh(tp=2, sp=2, device_type="cpu")
    out["groups"] = {a: dist.get_process_group_ranks(axis_group(mesh, a)) for a in ("sp", "tp", "dp", "dp_sp")}
    folded = seqpar.init_mesh(tp=2, sp=2, ep=2, device_type="cpu")  # ep over dp_shard x sp: here the sp ranks
    out["ep"] = [dist.get_process_group_ranks(axis_group(folded, a)) for a in ("ep", "ep_dp")]
    case = ModelCase(model="tiny-llama", batch="padded", seq=15)
    base = make_model(case)
    batch = case_batch(case, 128)
    model = seqpar.parallelize(copy.deepcopy(base), mesh)
    q = model.model.layers[0].self_attn.q_proj.weight
    out["sharded"] = (isinstance(q, DTensor), tuple(q.to_local().shape), tuple(q.shape))
    local = seqpar.shard_batch(batch, mesh)
    logits = model(**{k: v for k, v in local.items() if k not in ("labels", "shift_labels")}).logits
    out["logits"] = tuple(logits.shape)  # [B, S/sp, V/tp]
    mine = seqpar.gather_log_probs(logits, local, mesh)  # [B, S] on every rank
    with torch.no_grad():
        full = F.log_softmax(base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, -1)
    targets = batch["labels"][:, 1:]
    ref = full[:, :-1].gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != -100)
    out["log_probs"] = float((mine[:, :-1].detach() - ref).abs().max())
    try:
        seqpar.unparallelize(model)
    except Refused as e:
        out["unparallelize"] = str(e)
    try:
        seqpar.apply_ddp(model, mesh)
    except Refused as e:
        out["ddp"] = str(e)
    try:
        DegreeMeshes(mesh)
    except Refused as e:
        out["dynamic"] = str(e)
    try:
        seqpar.parallelize(make_model(ModelCase(model="tiny-qwen3-next")), mesh)
    except Refused as e:
        out["mixers"] = str(e)
    where = seqpar.save_pretrained(model, out_dir, mesh)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        back = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float64)
        out["saved"] = max(float((a - b).abs().max()) for a, b in zip(back.state_dict().values(),
                                                                          base.state_dict().values(), strict=True))
    return out


def _grid(rank: int, world: int, out_dir: str) -> dict:
    rows = run_nd_parity(rank, world, [{"tp": 2, "sp": 2}], FAST)
    # the N-D mesh without tp: FSDP2 over its dp_sp view, the same gradients
    rows += run_nd_parity(rank, world, [{"dp_shard": 2, "sp": 2}], [nd_case("tiny-llama", "packed", 17, fsdp=True)])
    return {"rows": rows, "extras": _extras(rank, world, out_dir)}


@pytest.fixture(scope="module")
def tp_sp(tmp_path_factory):
    return run_distributed(_grid, 4, str(tmp_path_factory.mktemp("tp_export")), timeout=600)


def _check_rows(results):
    cases = [[(row["label"], row["layout"]) for row in r["rows"]] for r in results]
    assert cases[0] and all(c == cases[0] for c in cases) and len(set(cases[0])) == len(cases[0])  # every rank, once
    for row in (row for r in results for row in r["rows"]):
        assert row["ok"], row
        assert row["params"] >= 20, row  # every parameter compared


@pytest.mark.distributed
def test_tp2_sp2_equals_the_unsharded_model(tp_sp):
    _check_rows(tp_sp)


@pytest.mark.distributed
def test_tp2_sp2_mesh_shards_and_refusals(tp_sp):
    for rank, r in enumerate(tp_sp):
        e = r["extras"]
        assert e["groups"]["tp"] == [rank - rank % 2, rank - rank % 2 + 1]  # tp innermost: consecutive ranks
        assert e["groups"]["sp"] == [rank % 2, rank % 2 + 2] and e["groups"]["dp_sp"] == e["groups"]["sp"]
        assert e["ep"] == [e["groups"]["sp"], [rank]]  # ep = the sp ranks at this tp index; each holds its experts
        assert e["sharded"] == (True, (16, 32), (32, 32))  # q_proj: 2 of 4 heads per tp rank
        assert e["logits"] == (2, 8 if rank < 2 else 7, 64)  # [B, S/sp, V/tp]: never the whole vocabulary
        assert e["log_probs"] < 1e-12
        assert "tp=2" in e["unparallelize"] and "save_pretrained" in e["unparallelize"]
        assert "DistributedDataParallel" in e["ddp"]
        assert "dynamic SP schedule" in e["dynamic"] and "tp" in e["dynamic"]
        assert "token mixers" in e["mixers"]
    assert tp_sp[0]["extras"]["saved"] == 0.0  # a plain transformers checkpoint, the same weights


# ---------------------------------------------------------------------------------------------
# 8 gloo ranks (heavy): dp_shard=2 x tp=2 x sp=2, and tp=2 x (ring 2 x ulysses 2)
# ---------------------------------------------------------------------------------------------

HEAVY = [
    nd_case(model, batch, seq, strategy)
    for model in ("tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-gemma2")
    for batch, seq, strategy in (("padded", 16, "ulysses"), ("packed", 17, "ring"), ("padded", 15, "hybrid"),
                                 ("packed", 13, "hybrid"))
] + [
    nd_case("tiny-llama", "padded", 16, heads=8, kv_heads=2),
    nd_case("tiny-qwen3", "plain", 15, "ring", layout="zigzag", memory=True),
    nd_case("tiny-llama", "packed", 17, fsdp=True),
    nd_case("tiny-llama", "padded", 16, "hybrid", fsdp=True, memory=True),
]


HSDP = [nd_case("tiny-llama", "padded", 16, fsdp=True), nd_case("tiny-qwen3", "packed", 17, "ring")]


def _heavy(rank: int, world: int) -> list:
    return run_nd_parity(rank, world, [{"dp_shard": 2, "tp": 2, "sp": 2}, {"tp": 2, "ulysses": 2, "ring": 2}],
                         HEAVY) + run_nd_parity(rank, world, [{"dp_replicate": 2, "tp": 2, "sp": 2}], HSDP)


@pytest.mark.distributed
@pytest.mark.heavy
def test_dp2_tp2_sp2_and_hybrid_equal_the_unsharded_model():
    results = run_distributed(_heavy, 8, timeout=1800)
    _check_rows([{"rows": rows} for rows in results])

