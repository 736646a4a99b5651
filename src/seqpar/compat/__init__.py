"""Layer 0: every private torch / transformers / accelerate name seqpar touches, in one room.

Each shim below is the *only* place its outside internal is read or written, says what it relies on,
and has a test of exactly that on the installed versions (``tests/test_compat.py``). When a version
moves, this package (one module per library, every name re-exported here) and that test are what to
check. Layer 0 (imports nothing of seqpar) so that every layer can use it: comm and attention touch
torch internals too. transformers, accelerate, TRL, diffusers and DeepSpeed are imported inside the
shims that need them, never at import time.

Checked on the tested set (``seqpar/tested.txt``: torch 2.13.0's CPU build -- the CUDA attention ops on a
CUDA build where a GPU ran them --, transformers 5.25.0, accelerate 1.16.0) and on the releases before it
that :data:`CHECKED_ON` lists (transformers 5.24.0, accelerate 1.15.0; and torch 2.15.0, newer).

    shim                             outside internal                                  used by
    -------------------------------  ------------------------------------------------  -----------------------
    flatten_mesh                     DeviceMesh._flatten                               comm/mesh.py
    unflatten_mesh                   DeviceMesh._unflatten                             comm/mesh.py (ep_mesh)
    queue_backward_callback          Variable._execution_engine.queue_callback         comm/guard.py, comm/faults.py
    default_store                    distributed_c10d._get_default_store               comm/faults.py
    abort_all_groups                 distributed_c10d._abort_process_group             comm/waits.py
    DCP_METADATA_GLOBALS             DCP .metadata: filesystem._StorageInfo,           train/safe_load.py
                                     serialization._get_layout, _MEM_FORMAT_ENCODING
    cpu_flash_attention(_backward)   aten._scaled_dot_product_flash_attention_for_cpu  attention/flash_cpu.py
                                     (and its _backward)
    cuda_flash_attention(_backward)  aten._scaled_dot_product_flash_attention(_bw)     attention/cuda.py
    cuda_efficient_attention(...)    aten._scaled_dot_product_efficient_attention(_bw) attention/cuda.py
    cudnn_attention(_backward)       aten._scaled_dot_product_cudnn_attention(_bw)     attention/cuda.py
    fail_on_recompile_limit          torch._dynamo.config (fail_on_recompile_limit_hit) attention/flex.py
    fake_process_group               torch.testing._internal.distributed.fake_pg       benchmarks/bench_rank.py,
                                     (FakeStore; importing it registers "fake")        bench_ring_step.py
    TorchDispatchMode,               torch.utils._python_dispatch                      testing/memory.py
      is_traceable_wrapper_subclass
    active_ddp_module                DistributedDataParallel._get_active_ddp_module    integrations/fsdp.py
    fsdp_meshes                      FSDPModule._get_fsdp_state()._fsdp_param_groups   integrations/fsdp.py
    attn_implementation              PretrainedConfig._attn_implementation             integrations/hf.py, zoo
    set_tp_size                      PreTrainedModel._tp_size (what model.tp_size,     integrations/trainer/
                                     accelerate's get_model_tp_size and Trainer read)  parallelism.py
    decoder_block_classes            PreTrainedModel._no_split_modules                 integrations/fsdp, memory
    experts_implementation           PretrainedConfig._experts_implementation         integrations/moe/families.py
    mark_uninitialized               module._is_hf_initialized                         integrations/materialize.py
    init_weights_override            PreTrainedModel._init_weights (shadowed)          integrations/materialize.py
    split_prepared_loader            accelerate's BatchSamplerShard and                integrations/trainer.py
                                     IterableDatasetShard: num_processes, process_index
    float64_loss_log                 Trainer._tr_loss (the loss summed between logs,   integrations/
                                     then averaged over every process)                trl_trainers.py
    trl_generation_gathers           trl.trainer.grpo_trainer's / rloo_trainer's       integrations/trl/grpo.py
                                     module globals gather, gather_object (swapped
                                     for a block; trl 1.16.0)
    kernels_replaced, KernelCall,    a recurrent mixer's modeling-module globals       integrations/mixers/
      calls_kernels, kernel_route,   (causal_conv1d_fn, torch_chunk_gated_delta_rule,  state_*, testing/scans64,
      modeling_module,               chunk_kimi_delta_attention, mamba2_chunk_scan,    integrations/features
      kernel_signature               mamba_selective_scan, mamba_split_conv1d_scan_
                                     combined): swapped for one call of the mixer; read
                                     from forward or a same-module helper (5.25)
    kernelized_funcs                 kernels.get_kernelized_layers (public; the        integrations/mixers/
                                     ``kernels`` package, a dependency of 5.25)        state_passing
    load_balancing_loss_func         a MoE modeling module's load_balancing_loss_func  testing/router64.py,
                                     (called, never replaced: the oracle of the aux    tests/batch/
                                     loss seqpar recomputes over the whole batch)      test_router_loss.py
    diffusers_cp_plan                ModelMixin._cp_plan (ContextParallelInput /       integrations/diffusers/
                                     ContextParallelOutput of models._modeling_parallel:  plan.py
                                     split_dim, expected_dims, split_output, gather_dim;
                                     diffusers 0.42.1)
    deepspeed_skip_cpu_shm_build     deepspeed.ops.__compatible_ops__ (its op probe's  bench/alst.py
                                     cache; deepspeed 0.19.8)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from .deepspeed_internals import DEEPSPEED_SHM_OP, deepspeed_skip_cpu_shm_build
from .diffusers_internals import diffusers_cp_plan
from .torch_internals import (
    DCP_METADATA_GLOBALS,
    abort_all_groups,
    active_ddp_module,
    cpu_flash_attention,
    cpu_flash_attention_backward,
    cuda_efficient_attention,
    cuda_efficient_attention_backward,
    cuda_flash_attention,
    cuda_flash_attention_backward,
    cudnn_attention,
    cudnn_attention_backward,
    default_store,
    fail_on_recompile_limit,
    fake_process_group,
    flatten_mesh,
    fsdp_meshes,
    queue_backward_callback,
    unflatten_mesh,
)
from .trainers_internals import TRL_GATHER_MODULES, float64_loss_log, split_prepared_loader, trl_generation_gathers
from .transformers_internals import (
    KernelCall,
    attn_implementation,
    calls_kernels,
    decoder_block_classes,
    experts_implementation,
    init_weights_override,
    kernel_route,
    kernel_signature,
    kernelized_funcs,
    kernels_replaced,
    load_balancing_loss_func,
    mark_uninitialized,
    modeling_module,
    set_tp_size,
)


def tested_set() -> dict[str, str]:
    """The tested set: every package's version as CI installed and ran it together (``seqpar/tested.txt``,
    pip constraints that ``make install`` applies), by lower-case distribution name."""
    text = (Path(__file__).parents[1] / "tested.txt").read_text()
    pins = (line.split("==", 1) for line in text.splitlines() if "==" in line and not line.startswith("#"))
    return {name.strip().lower().replace("_", "-"): version.strip() for name, version in pins}


_TESTED = tested_set()
CHECKED_ON: dict[str, tuple[str, ...]] = {
    name: tuple(sorted({_TESTED[name], *earlier}))
    for name, earlier in {"torch": ("2.15.0",), "transformers": ("5.24.0",), "accelerate": ("1.15.0",),
                          "diffusers": (), "deepspeed": ()}.items()
    if name in _TESTED}
"""The versions every shim here was tested on (``tests/test_compat.py``), per package: the tested set's
and the other releases whose internals the shims serve (checked with those installed: torch 2.15.0,
the newest on 2026-12-07, by ``make test-latest``: the internals-sensitive tests pass)."""


@dataclass(frozen=True)
class FeatureStatus:
    """One line of a feature report (:func:`seqpar.integrations.hf.features.feature_report`): whether
    ``feature`` (e.g. ``"state passing: Qwen3NextGatedDeltaNet"``) is available with the installed
    versions, and ``detail``: how it is reached, or why it is not and what runs instead."""

    feature: str
    available: bool
    detail: str

__all__ = [
    "CHECKED_ON", "DCP_METADATA_GLOBALS", "FeatureStatus", "KernelCall",
    "TorchDispatchMode", "abort_all_groups", "active_ddp_module",
    "attn_implementation", "calls_kernels", "cpu_flash_attention", "cpu_flash_attention_backward",
    "cuda_efficient_attention", "cuda_efficient_attention_backward", "cuda_flash_attention",
    "cuda_flash_attention_backward", "cudnn_attention", "cudnn_attention_backward", "decoder_block_classes",
    "default_store", "diffusers_cp_plan", "experts_implementation", "fail_on_recompile_limit",
    "fake_process_group", "flatten_mesh", "float64_loss_log", "fsdp_meshes",
    "init_weights_override", "is_traceable_wrapper_subclass", "kernel_route", "kernel_signature", "kernelized_funcs",
    "kernels_replaced", "load_balancing_loss_func", "mark_uninitialized", "modeling_module",
    "queue_backward_callback", "set_tp_size", "split_prepared_loader", "tested_set", "TRL_GATHER_MODULES",
    "trl_generation_gathers", "unflatten_mesh", "DEEPSPEED_SHM_OP", "deepspeed_skip_cpu_shm_build",
]
