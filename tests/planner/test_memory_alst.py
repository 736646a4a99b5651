"""The planner's memory models of a step, seqpar's (seqpar.planner.memory: ``StepMemory.phase_peak``)
and ALST's (seqpar.planner.memory_alst), by hand, and against the peaks that the bench's own
trials measure here (peak RSS of fresh gloo processes, :func:`seqpar.bench.try_step` with each
system's worker): within 10%, both systems, P = 2, on benchmarks/bench_alst.py's model."""

import math

import pytest

from seqpar import bench
from seqpar.planner.memory import MemorySwitches, parameter_count, step_memory
from seqpar.planner.memory_alst import LOGIT_SHARD_BYTES, alst_step_memory, logit_shards

SHAPE = dict(hidden_size=64, intermediate_size=224, layers=2, heads=8, kv_heads=2, head_dim=16, vocab_size=4096)


def test_alst_step_memory_by_hand():
    t, h, i, q, g, v, b, layers, u = 1000, 64, 224, 128, 32, 4096, 4, 2, 2
    n = parameter_count(**SHAPE)
    m = alst_step_memory(tokens=t, ulysses=u, **SHAPE)
    assert (m.weights, m.gradients, m.optimizer) == (n * b, n * b, 2 * n * 4)
    assert m.kept == layers * t * h * b and m.other == 4 * t * h * b
    assert m.loss == 3 * t * v * 4  # one shard: 1000 x 4096 fp32 logits are far below 1 GiB
    assert m.head_gradient == v * h * b
    assert m.layer == t * (4 * h + 3 * q + 2 * g) * b + 4 * t * 8 + 2 * t * (q + 2 * g) * b + 5 * h * i * b
    assert m.loss_phase == m.weights + m.optimizer + m.head_gradient + m.kept + m.other + m.loss
    assert m.backward_phase == m.weights + m.optimizer + m.gradients + m.kept + m.other + m.layer
    assert m.total == max(m.loss_phase, m.backward_phase) == m.loss_phase  # the loss's logits dominate here


def test_alst_loss_shards_follow_arctic_training():
    # ArcticTraining's SFTTrainer.loss: ceil(fp32 logits / 1 GiB) shards, the last one shorter
    assert logit_shards(1000, 4096) == 1
    assert logit_shards(LOGIT_SHARD_BYTES // (4 * 4096), 4096) == 1
    assert logit_shards(LOGIT_SHARD_BYTES // (4 * 4096) + 1, 4096) == 2
    t = 200_000
    m = alst_step_memory(tokens=t, ulysses=4, **SHAPE)
    k = math.ceil(t * 4096 * 4 / LOGIT_SHARD_BYTES)
    assert m.loss == 3 * -(-t // k) * 4096 * 4
    # KV heads fewer than the ranks are replicated up to them (DeepSpeed's kv_replication_factor)
    assert alst_step_memory(tokens=10, ulysses=4, **SHAPE).layer > alst_step_memory(tokens=10, ulysses=2, **SHAPE).layer
    with pytest.raises(ValueError, match="tokens must be a positive integer"):
        alst_step_memory(tokens=0, ulysses=2, **SHAPE)


def test_seqpar_phase_peak_by_hand():
    t, h, b, v = 1000, 64, 4, 4096
    sw = MemorySwitches(tiled_loss=True, tiled_mlp=True, checkpoint="layers", loss_tile=256, mlp_tile=100)
    m = step_memory(tokens=t, **SHAPE, switches=sw)
    assert m.kept == 2 * t * h * b and m.logits == 256 * v * 4  # the inputs kept; one fp32 tile of logits
    assert m.recompute == m.layers - m.kept + m.mlp  # one layer rebuilt, with its MLP tile
    assert m.head_gradient == v * h * 4 + t * h * b  # the tiled loss's grad_w (fp32) and grad_h
    fixed = m.weights + m.optimizer + m.other + m.kept
    assert m.phase_peak() == fixed + max(m.head_gradient + m.logits, m.gradients + m.recompute)
    assert m.phase_peak() < m.total  # the phases never overlap: an upper bound made closer
    off = step_memory(tokens=t, **SHAPE)
    flight = t * 224 * b  # per layer, an MLP gradient [T, I] is in flight in the backward, not kept
    assert off.kept == off.mlp + off.layers - 2 * flight and off.recompute == flight  # nothing recomputed
    offload = step_memory(tokens=t, **SHAPE, switches=MemorySwitches(checkpoint="offload"))
    assert offload.phase_peak(on_cpu=True) == step_memory(
        tokens=t, **SHAPE, switches=MemorySwitches(checkpoint="layers")).phase_peak()


def test_bfloat16_terms_by_hand():
    """What a narrower dtype adds (measured by seqpar.bench.census at the bfloat16 peaks): each
    RMSNorm's float32 copy of its input (none with a fused norm), and the tiled loss's grad_w
    product of a tile with its float32 copy."""
    t, h, v, layers = 1000, 64, 4096, 2
    sw = MemorySwitches(tiled_loss=True, tiled_mlp=True, checkpoint="layers", loss_tile=256, mlp_tile=100)
    bf16, fused = (step_memory(tokens=t, **SHAPE, dtype_bytes=2, switches=sw, fused_norm=f) for f in (False, True))
    assert bf16.other - fused.other == t * h * 4  # the final norm's copy
    assert bf16.recompute - fused.recompute == 2 * t * h * 4  # the rebuilt layer's two norms
    assert bf16.logits == fused.logits == 256 * v * (4 + 2) + v * h * (2 + 4)  # the tile's gradient stage
    off, off_fused = (step_memory(tokens=t, **SHAPE, dtype_bytes=2, fused_norm=f) for f in (False, True))
    assert off.kept - off_fused.kept == layers * 2 * t * h * 4
    f32 = step_memory(tokens=t, **SHAPE, switches=sw)
    assert f32 == step_memory(tokens=t, **SHAPE, switches=sw, fused_norm=True)  # float32: no copy to make
    assert f32.logits == 256 * v * 4  # its tile made the gradient in place, its product summed in place


# ---------------------------------------------------------------- estimates vs measured peaks

def _both(rank, world, case):
    """Both systems' step peak in these processes, seqpar's first (ALST's registration changes the
    process's attention and MLP classes for good): each from its own baseline, as the bench."""
    from seqpar.bench.alst import alst_peak_worker
    from seqpar.bench.side_by_side import seqpar_peak_worker

    mine = seqpar_peak_worker(rank, world, case, None)["peak_mib"]
    return mine, alst_peak_worker(rank, world, case, None)["peak_mib"]


@pytest.mark.heavy  # a whole script or launcher run (make verify): make test stays under 10 minutes
@pytest.mark.distributed
def test_both_models_within_10_percent_of_measured_peaks():
    """benchmarks/bench_alst.py's model and systems, P = 2, S = 2048 (the bench measures S = 4k-16k:
    its table prints each model's ratio there too)."""
    import importlib.util
    from pathlib import Path

    from seqpar.comm.launch import run_distributed

    path = Path(__file__).parents[2] / "benchmarks" / "bench_alst.py"
    spec = importlib.util.spec_from_file_location("bench_alst", path)
    bench_alst = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_alst)
    sw = MemorySwitches(tiled_loss=True, tiled_mlp=True, checkpoint="offload")
    case = bench.BenchCase("tiny-llama", bench_alst.model_config("quarter", 8), 2, "ulysses", 2048, sizing="builtin",
                           switches=sw)
    per_rank = run_distributed(_both, 2, case, timeout=600, env={"OMP_NUM_THREADS": "1"})
    for i, system in enumerate(("seqpar", "alst")):
        measured = max(r[i] for r in per_rank)
        predicted = bench_alst.estimate_mib(system, case)
        assert 0.9 <= predicted / measured <= 1.1, (system, predicted, measured)
