"""The planner is pure arithmetic: hand-computed bytes and memory, the split it picks for real model
shapes, what it rules out and why, its errors, and the `seqpar plan` CLI in-process."""

import json

import pytest

import seqpar
from seqpar.cli.main import main
from seqpar.planner import InfeasiblePlanError, plan

LLAMA_8B = dict(heads=32, kv_heads=8, head_dim=128, hidden_size=4096, intermediate_size=14336, layers=32)
SMALL = dict(heads=4, kv_heads=2, head_dim=8, hidden_size=32, intermediate_size=64)  # h = 32, g = 16


def by_split(p, dp, u, r):
    (c,) = [c for c in p.candidates if (c.dp, c.ulysses, c.ring) == (dp, u, r)]
    return c


# ---------------------------------------------------------------- byte and memory formulas, by hand

def test_bytes_small_case_by_hand():
    # N = 16 tokens over 4 ranks, bf16 (2 bytes), d = 8: h = 4*8 = 32, g = 2*8 = 16
    p = plan(**SMALL, world_size=4, devices_per_node=4, seq_len=16)
    # ulysses=2 x ring=2: T = 4 tokens per rank; each ulysses rank gets 2 q heads and 1 KV head (g' = 16)
    c = by_split(p, 1, 2, 2)
    assert c.kv_copies == 2 and c.kv_replication == 1
    assert c.ulysses_bytes == 1 / 2 * 4 * (2 * 32 + 2 * 16) * 2 == 384
    assert c.ring_bytes == 2 * (2 - 1) * 4 * 16 * 2 == 256  # 1 hop of K and V: N/R=8 tokens x 1 KV head
    # pure ulysses=4: every rank needs one of the 2 KV heads -> 4 copies, g' = 4 * 8 = 32
    c = by_split(p, 1, 4, 1)
    assert c.kv_copies == 4 and c.kv_replication == 2
    assert (c.ulysses_bytes, c.ring_bytes) == (3 / 4 * 4 * (2 * 32 + 2 * 32) * 2, 0) == (768, 0)
    # pure ring=4: 2 * N * g * (R-1)/R * bytes
    c = by_split(p, 1, 1, 4)
    assert (c.ulysses_bytes, c.ring_bytes) == (0, 2 * 16 * 16 * 3 / 4 * 2) == (0, 768)
    # dp=2 x ulysses=2: T = 8
    assert by_split(p, 2, 2, 1).ulysses_bytes == 1 / 2 * 8 * (2 * 32 + 2 * 16) * 2 == 768
    assert by_split(p, 4, 1, 1).comm_bytes == 0


def test_ring_moves_one_kv_copy_per_query_head_when_groups_do_not_line_up():
    # 6 query heads, 3 KV heads (groups of 2) over ulysses=2: rank 0 has query heads 0-2 reading KV
    # heads 0, 0, 1; rank 1 has 3-5 reading 1, 2, 2. The all-to-all sends 2 + 2 KV heads; Ulysses then
    # gives each query head its own copy, so the hybrid ring moves 3 + 3. d = 8, N = 16, T = 4.
    p = plan(heads=6, kv_heads=3, head_dim=8, hidden_size=48, world_size=4, devices_per_node=4, seq_len=16)
    c = by_split(p, 1, 2, 2)
    assert c.kv_copies == 4
    assert c.ulysses_bytes == 1 / 2 * 4 * (2 * 48 + 2 * 4 * 8) * 2 == 640
    assert c.ring_bytes == 2 * 1 * 4 * (3 + 3) * 8 * 2 == 768  # measured on gloo: 1408 bytes per rank in all


def test_bytes_match_the_issue_formulas_for_even_gqa():
    n, h, g = 1 << 20, 32 * 128, 8 * 128
    p = plan(**LLAMA_8B, world_size=8, devices_per_node=8, seq_len=n)
    assert by_split(p, 1, 8, 1).ulysses_bytes == 7 / 8 * (n / 8) * (2 * h + 2 * g) * 2
    assert by_split(p, 1, 1, 8).ring_bytes == 2 * n * g * 7 / 8 * 2
    # batch and dtype scale everything linearly
    p4 = plan(**LLAMA_8B, world_size=8, devices_per_node=8, seq_len=n, batch=3, dtype_bytes=4)
    assert by_split(p4, 1, 2, 4).comm_bytes == 6 * by_split(p, 1, 2, 4).comm_bytes


def test_memory_small_case_by_hand():
    p = plan(**SMALL, world_size=4, devices_per_node=4, seq_len=16)
    # ulysses=2 x ring=2, zigzag: 4 chunks of 4, a ring rank holds 8 tokens, 4 per rank (t = 4);
    # a ulysses rank computes q = 2 heads and receives kv = 1 KV head
    saved = 4 * (4 * 32 + 32 + 4 * 64) * 2 + 2 * 4 * ((2 * 2 + 2 * 1) * 8 * 2 + 4 * 2)  # 3328 + 832
    running = 2 * 4 * (2 * 2 + 2 * 1) * 8 * 2 + 2 * 4 * (2 * 1 * 8 * 2 + 16 * 1 * 8 + 4 * 2 * 9)  # 768 + 1856
    assert by_split(p, 1, 2, 2).memory_bytes == saved + running == 6784
    p3 = plan(**{**SMALL, "layers": 3}, world_size=4, devices_per_node=4, seq_len=16)
    assert by_split(p3, 1, 2, 2).memory_bytes == 3 * saved + running
    ck = plan(**{**SMALL, "layers": 3}, world_size=4, devices_per_node=4, seq_len=16, checkpointing=True)
    assert by_split(ck, 1, 2, 2).memory_bytes == 3 * 4 * 32 * 2 + saved + running  # layer inputs + one layer
    # no ring: no K/V buffers; t = 16 / 2 = 8 with dp=2 x ulysses=2
    saved_u = 8 * (4 * 32 + 32 + 4 * 64) * 2 + 2 * 8 * ((2 * 2 + 2 * 1) * 8 * 2 + 4 * 2)
    assert by_split(p, 2, 2, 1).memory_bytes == saved_u + 2 * 8 * (2 * 2 + 2 * 1) * 8 * 2


def test_inter_node_bytes_by_hand():
    # 8 ranks, 4 per node. ulysses=2 x ring=4: ring members {0,2,4,6} on nodes 0,0,1,1 -> 2 of 4 hops cross
    p = plan(**SMALL, world_size=8, devices_per_node=4, seq_len=16)
    c = by_split(p, 1, 2, 4)
    assert c.inter_node_bytes == c.ring_bytes / 2 and not c.spans_nodes
    c = by_split(p, 1, 4, 2)  # ring {0,4}: every hop crosses; the ulysses group fills one node
    assert c.inter_node_bytes == c.ring_bytes
    # 2 per node: ulysses=4 spans 2 nodes, 8 of its 12 ordered pairs are across them
    c = by_split(plan(**SMALL, world_size=8, devices_per_node=2, seq_len=16), 2, 4, 1)
    assert c.spans_nodes and c.feasible
    assert c.inter_node_bytes == round(c.ulysses_bytes * 8 / 12)


# ---------------------------------------------------------------- the splits it picks

def test_llama_8b_over_64_ranks_ulysses_in_node_ring_across():
    p = plan(**LLAMA_8B, world_size=64, devices_per_node=8, seq_len=1 << 20)
    assert (p.dp, p.ulysses, p.ring, p.strategy) == (1, 8, 8, "hybrid")
    assert p.mesh_kwargs() == {"sp": 64, "dp": 1, "ulysses": 8, "ring": 8}
    assert by_split(p, 1, 64, 1).why_not == ("ulysses=64 > 32 query heads",)
    assert "ulysses=8 inside each node of 8" in p.reason and "ring=8 across nodes" in p.reason
    assert "pure Ulysses over 64 is out (ulysses=64 > 32 query heads)" in p.reason
    # all 28 factorisations of 64 into dp x ulysses x ring, each once
    assert sorted((c.dp, c.ulysses, c.ring) for c in p.candidates) == sorted(
        (64 // (u * r), u, r) for u in (1, 2, 4, 8, 16, 32, 64) for r in (1, 2, 4, 8, 16, 32, 64) if 64 % (u * r) == 0)
    assert len(p.candidates) == 28
    assert "*    1       8     8" in p.table()


def test_memory_budget_picks_the_smallest_sp_that_fits():
    budget = 40 << 30
    p = plan(**LLAMA_8B, world_size=64, devices_per_node=8, seq_len=1 << 20, memory_budget_bytes=budget,
             checkpointing=True)
    assert p.chosen.memory_bytes <= budget
    assert all(not c.feasible for c in p.candidates if c.sp < p.sp)
    assert (p.dp, p.ulysses, p.ring) == (4, 8, 2)  # ulysses=16 would span nodes
    assert "smallest sequence-parallel degree" in p.reason and "dp=4 for the rest" in p.reason
    assert p.mesh_kwargs() == {"sp": 16, "dp": 4, "ulysses": 8, "ring": 2}


def test_28_heads_over_8_prefers_an_even_split():
    p = plan(heads=28, kv_heads=4, head_dim=128, hidden_size=3584, world_size=8, devices_per_node=8,
             seq_len=131072, layers=28)
    pure = by_split(p, 1, 8, 1)
    # 4,4,4,4,3,3,3,3 query heads; KV heads (groups of 7) received: 1,2,1,2,1,2,1,1
    assert pure.feasible and pure.idle == pytest.approx(1 - 28 / 32) and pure.kv_copies == 11
    assert (p.dp, p.ulysses, p.ring) == (1, 4, 2)  # 7 heads and 1 KV head per rank, nothing idle
    assert p.chosen.idle == 0 and p.chosen.kv_copies == 4
    assert p.chosen.comm_bytes < pure.comm_bytes
    assert "would leave 12% of the heads' work idle" in p.reason


def test_one_kv_head_is_replicated_and_costed():
    p = plan(heads=32, kv_heads=1, head_dim=128, hidden_size=4096, world_size=8, devices_per_node=8, seq_len=8192)
    assert (p.ulysses, p.ring) == (8, 1)
    assert p.chosen.kv_copies == 8 and p.chosen.kv_replication == 8
    # every rank receives the single KV head: g' = 8 * 128 instead of 128
    assert p.chosen.ulysses_bytes == 7 / 8 * 1024 * (2 * 4096 + 2 * 8 * 128) * 2
    ring = by_split(p, 1, 1, 8)
    assert ring.ring_bytes == 2 * 8192 * 128 * 7 / 8 * 2
    assert "KV heads sent 8x" in p.reason and "ulysses=1 x ring=8 moves 5.0x fewer bytes" in p.reason


@pytest.mark.parametrize("per_node", [7, 1])
def test_prime_world_size(per_node):
    p = plan(**LLAMA_8B, world_size=7, devices_per_node=per_node, seq_len=70000)
    assert len(p.candidates) == 3  # (7,1,1), (1,7,1), (1,1,7)
    u7 = by_split(p, 1, 7, 1)
    assert u7.feasible and u7.idle > 0 and u7.spans_nodes == (per_node == 1)
    assert (p.dp, p.ulysses, p.ring) == (1, 1, 7)  # 32 heads do not split evenly over 7
    assert p.strategy == "ring" and p.mesh_kwargs() == {"sp": 7, "dp": 1}


def test_max_ulysses_and_straddling_groups():
    p = plan(**LLAMA_8B, world_size=8, devices_per_node=8, seq_len=4096, max_ulysses=2)
    assert (p.ulysses, p.ring) == (2, 4)
    assert by_split(p, 1, 8, 1).why_not == ("ulysses=8 > max_ulysses=2",)
    p = plan(heads=12, kv_heads=12, head_dim=64, hidden_size=768, world_size=12, devices_per_node=4, seq_len=4096)
    assert "straddle nodes of 4" in by_split(p, 1, 3, 4).why_not[0]  # ranks 3..5 cross a node boundary
    assert "straddle" in by_split(p, 1, 6, 2).why_not[0]
    assert by_split(p, 1, 12, 1).feasible and by_split(p, 1, 12, 1).spans_nodes  # three whole nodes
    assert (p.ulysses, p.ring) == (4, 3)


def test_short_sequences_limit_sp():
    p = plan(heads=8, kv_heads=8, head_dim=16, hidden_size=128, world_size=8, devices_per_node=8, seq_len=5)
    assert by_split(p, 1, 8, 1).why_not == ("5 tokens < sp=8 ranks",)
    assert by_split(p, 2, 1, 4).why_not == ("5 tokens < 8 zigzag chunks (2*ring)",)
    assert (p.dp, p.ulysses, p.ring) == (2, 4, 1)
    assert "larger sp fails" in p.reason
    bidir = plan(heads=8, kv_heads=8, head_dim=16, hidden_size=128, world_size=8, devices_per_node=8, seq_len=5,
                 causal=False)
    assert by_split(bidir, 2, 1, 4).feasible


def test_sp_one_when_world_is_one():
    p = plan(**LLAMA_8B, world_size=1, devices_per_node=1, seq_len=1)
    assert (p.dp, p.sp, p.strategy) == (1, 1, "ulysses") and p.chosen.comm_bytes == 0
    assert "no sequence parallelism" in p.reason


# ---------------------------------------------------------------- errors

def test_impossible_budget_says_what_to_change():
    with pytest.raises(InfeasiblePlanError) as e:
        plan(**LLAMA_8B, world_size=64, devices_per_node=8, seq_len=1 << 20, memory_budget_bytes=1 << 30)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "no split of 1048576 tokens over 64 ranks fits the activation budget of 1.0 GiB" in msg
    assert "the leanest (dp=1 x ulysses=8 x ring=8) needs 86.9 GiB" in msg
    for hint in ("Raise the memory budget to >= 86.9 GiB", "87x the devices", "shorten the sequence",
                 "activation checkpointing"):
        assert hint in msg
    assert len(e.value.candidates) == 28 and not any(c.feasible for c in e.value.candidates)


def test_devices_per_node_must_divide_world_size():
    with pytest.raises(ValueError, match="devices_per_node=3 must divide world_size=8"):
        plan(**LLAMA_8B, world_size=8, devices_per_node=3, seq_len=1024)


@pytest.mark.parametrize("name", ["heads", "kv_heads", "head_dim", "hidden_size", "world_size", "devices_per_node",
                                  "seq_len", "layers", "dtype_bytes", "batch", "memory_budget_bytes", "max_ulysses",
                                  "intermediate_size"])
@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_non_positive_or_non_integer_arguments(name, bad):
    kw = dict(**LLAMA_8B, world_size=8, devices_per_node=8, seq_len=1024)
    kw[name] = bad
    with pytest.raises(ValueError, match=f"{name} must be a positive integer, got {bad!r}"):
        plan(**kw)


def test_heads_must_be_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="heads=32 must be a multiple of kv_heads=6"):
        plan(**{**LLAMA_8B, "kv_heads": 6}, world_size=8, devices_per_node=8, seq_len=1024)


def test_exported():
    assert seqpar.plan is plan and seqpar.Plan.__name__ == "Plan"


# ---------------------------------------------------------------- CLI

ARGS_64 = ["plan", "--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--hidden-size", "4096",
           "--intermediate-size", "14336", "--layers", "32", "--world-size", "64", "--devices-per-node", "8",
           "--seq-len", "1M"]


def test_cli_prints_table_and_choice(capsys):
    assert main(ARGS_64) == 0
    out = capsys.readouterr().out
    assert "comm/layer" in out and "memory/rank" in out and "ok / why not" in out
    assert "ulysses=64 > 32 query heads" in out
    assert "chosen: dp=1 x ulysses=8 x ring=8 (hybrid)" in out
    assert "seqpar.init_mesh(sp=64, dp=1, ulysses=8, ring=8)" in out
    assert "sequence 1048576 tokens" in out


def test_cli_no_fit_exits_2_with_one_line(capsys):
    assert main(ARGS_64 + ["--memory-budget", "1GiB"]) == 2
    cap = capsys.readouterr()
    assert "memory 86.9 GiB > budget 1.0 GiB" in cap.out  # the table still shows why
    assert cap.err.count("\n") == 1 and cap.err.startswith("seqpar plan: error: no split of 1048576 tokens")


def test_cli_sizes_and_bad_values(capsys):
    assert main(ARGS_64 + ["--memory-budget", "40GB", "--checkpointing", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "activation budget per rank: 37.3 GiB" in out and "fp32" in out
    assert main(["plan", "--world-size", "8", "--devices-per-node", "3"]) == 2
    assert "devices_per_node=3 must divide world_size=8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--memory-budget", "lots"])
    assert "is not a size" in capsys.readouterr().err


def test_cli_defaults_run(capsys):
    assert main(["plan"]) == 0
    assert "chosen: dp=1 x ulysses=8 x ring=1 (ulysses)" in capsys.readouterr().out


def test_cli_model_from_config_json(tmp_path, capsys):
    cfg = {"model_type": "llava", "text_config": {"num_attention_heads": 28, "num_key_value_heads": 4,
                                                  "hidden_size": 3584, "num_hidden_layers": 28,
                                                  "intermediate_size": 18944}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "--world-size", "8", "--seq-len", "131072"]) == 0
    out = capsys.readouterr().out
    assert "28 heads / 4 KV heads x 128, hidden 3584, 28 layers" in out
    assert "chosen: dp=1 x ulysses=4 x ring=2 (hybrid)" in out
    # explicit flags win over the config
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--layers", "2"]) == 0
    assert "hidden 3584, 2 layers" in capsys.readouterr().out


def test_cli_model_builtin_and_unknown(capsys):
    assert main(["plan", "--model", "tiny-llama", "--world-size", "4", "--devices-per-node", "4"]) == 0
    assert "4 heads / 2 KV heads x 8, hidden 32, 2 layers (tiny-llama)" in capsys.readouterr().out
    assert main(["plan", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("seqpar plan: error: --model no-such-model: not a local directory or config.json,"
                          " nor a built-in name (tiny-llama, ")
