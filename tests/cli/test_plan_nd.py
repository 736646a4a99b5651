"""``seqpar plan --gpus N --gpu-memory M`` and :func:`seqpar.planner.nd.plan_nd`: the chosen layout fits
the memory, respects the rules (tp inside a node and dividing the heads, ep dividing the experts and
dp_shard x sp), builds a mesh :func:`seqpar.comm.dims.resolve_dims` accepts, and the CLI prints what
the library chose (its dimensions, switches, memory per GPU, bytes per layer per dimension, reason)."""

from __future__ import annotations

import json

import pytest

from seqpar.cli.main import main
from seqpar.comm.dims import resolve_dims
from seqpar.planner import format_bytes
from seqpar.planner.nd import SWITCH_LADDER, ModelShape, plan_nd

LLAMA_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256)
MOE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
           num_key_value_heads=4, head_dim=64, vocab_size=151936, num_experts=64, num_experts_per_tok=8,
           moe_intermediate_size=768)
GB80 = 80 * 10**9


def _shape(cfg: dict, moe: bool = False) -> ModelShape:
    extra = dict(experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                 expert_intermediate=cfg["moe_intermediate_size"]) if moe else {}
    return ModelShape(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                      layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
                      kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], vocab_size=cfg["vocab_size"],
                      **extra)


def _check_layout(c, shape: ModelShape, gpus: int, per_node: int) -> None:
    assert c.dp_replicate * c.dp_shard * c.sp * c.tp == gpus
    assert per_node % c.tp == 0 and shape.heads % c.tp == 0 and shape.kv_heads % c.tp == 0
    assert c.memory.phase_peak() <= GB80
    dims = resolve_dims(gpus, **c.mesh_kwargs())  # init_mesh takes it as it is
    assert (dims.dp_replicate, dims.dp_shard, dims.sp, dims.tp, dims.ep) == (c.dp_replicate, c.dp_shard, c.sp, c.tp,
                                                                            c.ep)


def test_a_70b_model_at_256k_on_64_gpus():
    shape = _shape(LLAMA_70B)
    p = plan_nd(shape, gpus=64, gpus_per_node=8, gpu_memory=GB80, seq_len=262144)
    _check_layout(p.chosen, shape, 64, 8)
    fits = [c for c in p.candidates if c.feasible]
    assert p.chosen.seconds_per_layer == min(c.seconds_per_layer for c in fits)
    assert all(c.memory.phase_peak() > GB80 for c in p.candidates if not c.feasible)
    # a switch lighter than the chosen one would not fit the chosen layout
    lighter = SWITCH_LADDER[:SWITCH_LADDER.index(p.chosen.switches)]
    assert all(c.memory.phase_peak() > GB80 for c in p.candidates
               if c.switches in lighter and c.label == p.chosen.label)
    assert set(p.chosen.bytes_per_layer) == {"sp", "tp", "dp", "ep"}


def test_moe_layouts_split_the_experts_and_never_tile_them():
    shape = _shape(MOE, moe=True)
    p = plan_nd(shape, gpus=32, gpus_per_node=8, gpu_memory=GB80, seq_len=131072)
    _check_layout(p.chosen, shape, 32, 8)
    assert any(c.ep > 1 for c in p.candidates)
    for c in p.candidates:
        assert shape.experts % c.ep == 0 and (c.dp_shard * c.sp) % c.ep == 0 and not c.switches.tiled_mlp


def test_nothing_fits_says_what_it_would_need():
    with pytest.raises(ValueError, match="no layout of 8 GPUs fits 4194304 tokens.*the leanest"):
        plan_nd(_shape(LLAMA_70B), gpus=8, gpus_per_node=8, gpu_memory=GB80, seq_len=4 * 2**20)
    with pytest.raises(ValueError, match="--gpus 12 must be a multiple of --gpus-per-node 8"):
        plan_nd(_shape(LLAMA_70B), gpus=12, gpus_per_node=8, gpu_memory=GB80, seq_len=4096)


def test_cli_prints_the_chosen_layout(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MOE))
    assert main(["plan", "--model", str(cfg), "--gpus", "32", "--gpu-memory", "80GB", "--seq-len", "131072",
                 "--moe"]) == 0
    out = capsys.readouterr().out
    p = plan_nd(_shape(MOE, moe=True), gpus=32, gpus_per_node=8, gpu_memory=GB80, seq_len=131072)
    c = p.chosen
    assert f"chosen: {c.label} ({c.strategy}); memory switches: {c.switches.label}" in out
    assert f"reason: {p.reason}" in out and f"memory per GPU ({format_bytes(c.memory.phase_peak())})" in out
    assert "seqpar.init_mesh(" + ", ".join(f"{k}={v}" for k, v in c.mesh_kwargs().items()) + ")" in out
    assert f"ep {format_bytes(c.bytes_per_layer['ep'])}" in out and "64 experts (top 8, width 768)" in out
    assert main(["plan", "--model", str(cfg), "--gpus", "32", "--seq-len", "131072"]) != 0
    assert "give --gpu-memory" in capsys.readouterr().err
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps(LLAMA_70B))
    assert main(["plan", "--model", str(dense), "--gpus", "64", "--gpu-memory", "80GB", "--moe"]) != 0
    assert "names no experts" in capsys.readouterr().err
