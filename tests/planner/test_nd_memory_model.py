"""The planner's memory model at N-D layouts (``seqpar.planner.memory.step_memory`` with ``tp``, ``ep``,
FSDP2, the switches, bfloat16): by hand, against measured per-rank peaks on this CPU, and against
published configurations.

Measured (heavy: ~2 min on 2 cores): 4 gloo ranks, a tiny Llama (hidden 128, MLP 448, 8 query / 4
KV heads of 16, 2 layers, vocabulary 4096), one step of 4096 tokens, the per-rank peak of live
tensors (:mod:`seqpar.testing.nd_memory`: the weights and AdamW states held before the step plus
the live-tensor probe's peak of the forward and backward) within 10% of the estimate,
``StepMemory.phase_peak`` (the larger of the loss phase and the backward phase), at twelve layouts:
sp4 Ulysses and ring, tp4, tp2 x sp2 Ulysses and ring, tp2 x sp2 with the switches, dp_shard2 x tp2
under FSDP2, sp4 under FSDP2 (float32), and sp4 / tp2 x sp2 with and without the switches in
bfloat16; the weights and AdamW states held before the step equal the estimate's exactly.
``StepMemory.total`` (everything at once) is only an upper bound and is not checked there: with
the switches in bfloat16 it is 1.2x the peak.

Published (pure arithmetic, within 25%):

* torchtitan, ``docs/performance.md`` at commit eaea6f6 (pytorch/torchtitan), Table 2: Llama 3.1 8B,
  8 H100 (96 GB), FSDP 2 x CP 4 at 131,072 tokens, local batch 1, full activation checkpointing,
  torch.compile + Float8: 84.0 GiB per GPU (torchtitan's ``max_reserved``). FSDP2's mixed precision
  keeps float32 master weights and gradients, sharded over dp_shard x cp = 8; the loss is computed
  on whole float32 logits. This is torchtitan's CP at 128k; its CP x TP at 128k (Table 6, Llama 3.1
  405B, TP 8 x CP 4 x FSDP 2) also runs pipeline parallelism (PP 8, 1F1B), which seqpar's planner
  does not model, so it is not checked.
* ALST (Bekman et al., arXiv 2506.13996; recipe ``projects/sequence-parallelism/run-h100-sp1-llama-8b.yml``
  in snowflakedb/ArcticTraining): Llama 3.1 8B at 500,000 tokens on one H100 (80 GB), bfloat16,
  DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU, activation checkpoints
  offloaded to the CPU, tiled MLP, Liger's kernels (the recipe's ``model.type: liger``: its fused
  RMSNorm, ``fused_norm=True``, and its fused (tiled) loss); 555,000 tokens failed. The model puts
  that configuration at 45.1 GiB of the 74.5 GiB (phase_peak): it would place the longest fitting sequence near
  830,000 tokens, 1.7x the published 500,000 -- outside 25%, recorded as a strict xfail (see its
  reason) rather than tuned to fit. With transformers' own RMSNorm (its float32 copies are measured
  here) the model would put the longest fit at 520,000 tokens, but the recipe replaces that norm
  with Liger's, which keeps no copy; ZeRO-3's buckets are not measured here.
"""

from __future__ import annotations

import pytest

from seqpar.planner.cost import largest_shard
from seqpar.planner.memory import MemorySwitches, parameter_count, parameter_parts, step_memory

SHAPE = dict(hidden_size=64, intermediate_size=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab_size=1000)
GIB = 2**30


def test_tp_divides_what_it_splits_and_keeps_the_residual_stream_whole():
    t, h, i, q, g, v, b = 100, 64, 128, 64, 32, 1000, 4
    split, whole, expert = parameter_parts(**SHAPE)
    assert split + whole == parameter_count(**SHAPE) and expert == 0 and whole == 2 * 2 * h + h  # the norms
    m = step_memory(tokens=t, **SHAPE, tp=2)
    assert m.weights == (-(-split // 2) + whole) * b
    assert m.logits == t * (v // 2) * (4 + 4)  # the shard's logits and one float32 buffer
    assert m.mlp == 2 * 5 * t * (i // 2) * b
    assert m.layers == 2 * (t * (4 * h + (3 * q + 2 * g) // 2) * b + 4 * t * 4 // 2)
    assert m.other == step_memory(tokens=t, **SHAPE).other  # embedding output, final norm: whole
    bf16 = step_memory(tokens=t, **SHAPE, tp=2, dtype_bytes=2)
    assert bf16.logits == t * (v // 2) * (2 + 4 + 4)  # and the float32 copy of bfloat16 logits


def test_experts_are_divided_by_ep_and_their_tokens_by_the_router():
    moe = dict(SHAPE, experts=8, top_k=2, expert_intermediate=32)
    split, whole, expert = parameter_parts(**{k: v for k, v in moe.items() if k != "top_k"})
    assert expert == 2 * 8 * 3 * 64 * 32 and whole == 2 * (2 * 64 + 64 * 8) + 64  # experts; norms and routers
    one, four = (step_memory(tokens=100, **moe, ep=ep) for ep in (1, 4))
    assert one.weights - four.weights == (expert - expert // 4) * 4
    assert one.mlp == four.mlp == 2 * (5 * 2 * 100 * 32 * 4 + 2 * 100 * 8 * 4)  # top_k tokens' intermediates


def test_states_in_host_memory_leave_one_layer_on_the_device():
    n = parameter_count(**SHAPE)
    m = step_memory(tokens=100, **SHAPE, offload_states=True)
    assert (m.weights, m.gradients, m.optimizer, m.gathered) == (-(-n // 2) * 4, 0, 0, -(-n // 2) * 4)
    master = step_memory(tokens=100, **SHAPE, dtype_bytes=2, param_bytes=4, state_bytes=4)
    assert master.weights == n * 4 and master.optimizer == 2 * n * 4


# ---------------------------------------------------------------- estimates vs measured peaks

CONFIG = dict(hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, head_dim=16, vocab_size=4096, max_position_embeddings=8192)
SEQ = 4096
ON = MemorySwitches(tiled_loss=True, tiled_mlp=True, checkpoint="layers", loss_tile=256, mlp_tile=256)


def _layouts():
    from seqpar.testing.nd_memory import Layout

    sp4, tp2sp2 = (("sp", 4),), (("tp", 2), ("sp", 2))
    return [Layout(sp4), Layout(sp4, "ring"), Layout((("tp", 4), ("sp", 1))), Layout(tp2sp2), Layout(tp2sp2, "ring"),
            Layout(tp2sp2, switches=ON), Layout((("dp_shard", 2), ("tp", 2), ("sp", 1)), fsdp=True),
            Layout((("tp", 1), ("sp", 4)), fsdp=True)] + \
        [Layout(mesh, switches=sw, dtype="bfloat16") for mesh in (sp4, tp2sp2) for sw in (MemorySwitches(), ON)]


def _estimate(layout, world: int = 4):
    mesh = dict(layout.mesh)
    tp, sp = mesh.get("tp", 1), mesh.get("sp", 1)
    ring = layout.strategy == "ring"
    b = 2 if layout.dtype == "bfloat16" else 4
    return step_memory(tokens=largest_shard(SEQ, 1 if ring else sp, sp if ring else 1, zigzag=ring),
                       hidden_size=128, intermediate_size=448, layers=2, heads=8, kv_heads=4, head_dim=16,
                       vocab_size=4096, dtype_bytes=b, state_bytes=b,  # AdamW keeps its states in the model's dtype
                       tp=tp, fsdp_shards=world // tp if layout.fsdp else 1, switches=layout.switches)


@pytest.mark.distributed
@pytest.mark.heavy
def test_estimates_within_10_percent_of_measured_peaks_at_twelve_layouts():
    from seqpar.comm.launch import run_distributed
    from seqpar.testing.nd_memory import measure_layouts

    layouts = _layouts()
    per_rank = run_distributed(measure_layouts, 4, CONFIG, SEQ, layouts, timeout=1500)
    for i, layout in enumerate(layouts):
        measured = max(r[i]["before"] + r[i]["step"] for r in per_rank)
        estimate = _estimate(layout)
        assert min(r[i]["before"] for r in per_rank) == estimate.weights + estimate.optimizer, layout.label
        peak = estimate.phase_peak()
        assert 0.9 <= measured / peak <= 1.1, (layout.label, measured / 2**20, peak / 2**20)


# ---------------------------------------------------------------- published configurations

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, layers=32, heads=32, kv_heads=8, head_dim=128,
                vocab_size=128256)


def test_torchtitan_fsdp2_cp4_at_128k_within_25_percent():
    est = step_memory(tokens=131072 // 4, **LLAMA_8B, dtype_bytes=2, param_bytes=4, fsdp_shards=8,
                      switches=MemorySwitches(checkpoint="layers"))
    assert 0.75 <= est.phase_peak() / (84.0 * GIB) <= 1.25, est.phase_peak() / GIB


@pytest.mark.xfail(strict=True, reason="the model puts ALST's 500K / H100 configuration at 45.1 GiB, i.e. a "
                                       "longest fit near 830K tokens, 1.7x the published 500K (module doc)")
def test_alst_llama_8b_500k_on_one_h100_within_25_percent():
    alst = MemorySwitches(tiled_loss=True, tiled_mlp=True, checkpoint="offload")
    usable = 80 * 10**9  # an H100's 80 GB

    def fits(tokens: int) -> bool:
        return step_memory(tokens=tokens, **LLAMA_8B, dtype_bytes=2, switches=alst, offload_states=True,
                           fused_norm=True).phase_peak() <= usable

    longest = max(n for n in range(100_000, 2_000_001, 10_000) if fits(n))
    assert 0.75 <= longest / 500_000 <= 1.25, longest
