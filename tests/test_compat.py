"""seqpar.compat: each shim over a private torch / transformers / accelerate name does what it
claims on the installed versions (the versions it was checked on: compat.CHECKED_ON). Unit tests,
plus one 2-process gloo run for the distributed shims; the CUDA kernels' numerics need a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from seqpar import compat
from seqpar.attention.reference import reference_attention
from seqpar.comm.launch import run_distributed

# ---------------------------------------------------------------------------------------------
# torch: kernels, autograd, dynamo, modules
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_attention_returns_out_and_lse_and_its_backward_the_gradients(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out, lse = compat.cpu_flash_attention(q, k, v, 0.0, causal, scale=0.3)  # [B, H, S, D], [B, H, S]
    ref_out, ref_lse = reference_attention(*(x.transpose(1, 2) for x in (q, k, v)), causal=causal, scale=0.3)
    assert torch.allclose(out, ref_out.transpose(1, 2), atol=1e-12, rtol=0)
    assert torch.allclose(lse, ref_lse, atol=1e-12, rtol=0)  # [B, H, S] both
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dq, dk, dv = compat.cpu_flash_attention_backward(dout, q, k, v, out, lse, 0.0, causal, scale=0.3)
    want = torch.autograd.grad(ref_out.transpose(1, 2), (q, k, v), dout)
    for got, ref in zip((dq, dk, dv), want, strict=True):
        assert torch.allclose(got, ref, atol=1e-12, rtol=0)


CUDA_OPS = {  # shim: (the aten op, the leading arguments seqpar passes by position)
    compat.cuda_flash_attention: ("_scaled_dot_product_flash_attention",
                                  ["query", "key", "value", "dropout_p", "is_causal", "return_debug_mask"]),
    compat.cuda_flash_attention_backward: ("_scaled_dot_product_flash_attention_backward",
                                           ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q",
                                            "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal",
                                            "philox_seed", "philox_offset"]),
    compat.cuda_efficient_attention: ("_scaled_dot_product_efficient_attention",
                                      ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p",
                                       "is_causal"]),
    compat.cuda_efficient_attention_backward: ("_scaled_dot_product_efficient_attention_backward",
                                               ["grad_out_", "query", "key", "value", "attn_bias", "out",
                                                "logsumexp", "philox_seed", "philox_offset", "dropout_p",
                                                "grad_input_mask", "is_causal"]),
    compat.cudnn_attention: ("_scaled_dot_product_cudnn_attention",
                             ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                              "return_debug_mask"]),
    compat.cudnn_attention_backward: ("_scaled_dot_product_cudnn_attention_backward",
                                      ["grad_out", "query", "key", "value", "out", "logsumexp", "philox_seed",
                                       "philox_offset", "attn_bias", "cum_seq_q", "cum_seq_k", "max_q", "max_k",
                                       "dropout_p", "is_causal"]),
}


@pytest.mark.parametrize("shim", list(CUDA_OPS), ids=lambda f: f.__name__)
def test_cuda_attention_ops_take_the_arguments_seqpar_passes(shim):
    """On any build: the op exists and its schema starts with the arguments attention/cuda.py passes
    by position (their numerics run where a GPU is: the gpu test below and tests/attention's)."""
    name, leading = CUDA_OPS[shim]
    schema = getattr(torch.ops.aten, name).default._schema
    assert [a.name for a in schema.arguments[:len(leading)]] == leading
    assert "scale" in [a.name for a in schema.arguments if a.kwarg_only]
    assert name in shim.__doc__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flash_and_efficient_attention_return_out_and_lse():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 64, generator=g, dtype=torch.float32) for _ in range(3))
    ref_out, ref_lse = reference_attention(*(x.double().transpose(1, 2) for x in (q, k, v)), causal=True)
    q, k, v = (x.cuda() for x in (q, k, v))
    fl_out, fl_lse = compat.cuda_flash_attention(q.half(), k.half(), v.half(), 0.0, True, False)[:2]
    ef_out, ef_lse = compat.cuda_efficient_attention(q, k, v, None, True, 0.0, True)[:2]
    for out, lse, tol in ((fl_out, fl_lse, 2e-3), (ef_out, ef_lse[..., :64], 1e-4)):
        assert torch.allclose(out.double().cpu(), ref_out.transpose(1, 2), atol=tol, rtol=0)
        assert torch.allclose(lse.double().cpu(), ref_lse, atol=tol, rtol=0)


def test_queue_backward_callback_runs_once_when_the_backward_ends():
    events = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            compat.queue_backward_callback(lambda: events.append(("callback", x.grad is not None)))
            events.append("backward")
            return grad

    x = torch.ones(3, requires_grad=True)
    (Probe.apply(x) * 2).sum().backward()
    assert events == ["backward", ("callback", True)]  # after the leaf's gradient was accumulated


def test_fail_on_recompile_limit_sets_dynamo_flag_inside_only():
    before = torch._dynamo.config.fail_on_recompile_limit_hit
    with compat.fail_on_recompile_limit():
        assert torch._dynamo.config.fail_on_recompile_limit_hit is True
    assert torch._dynamo.config.fail_on_recompile_limit_hit == before


def test_fake_process_group_is_one_rank_of_many_whose_collectives_move_nothing():
    import torch.distributed as dist

    with compat.fake_process_group(2, 4):
        assert (dist.get_rank(), dist.get_world_size()) == (2, 4)
        mine, out = torch.ones(3), [torch.zeros(3) for _ in range(4)]
        dist.all_gather(out, mine)
        assert all(torch.equal(o, mine) for o in out)  # every "rank" answers with this rank's input
        got = torch.full((3,), 5.0)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 3), dist.P2POp(dist.irecv, got, 1)]):
            work.wait()
        assert torch.equal(got, torch.full((3,), 5.0))  # nothing arrived
    assert not dist.is_initialized()


def test_dispatch_mode_sees_aten_ops_and_tells_plain_tensors_from_wrapper_subclasses():
    seen = []

    class Record(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(2) + 1
    assert torch.ops.aten.add.Tensor in seen
    assert not compat.is_traceable_wrapper_subclass(torch.ones(2))  # a DTensor: see the distributed test



# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------


def _tiny_llama():
    from seqpar.integrations.models import build_model

    model, _ = build_model("tiny-llama", dtype=torch.float32)
    return model


def test_attn_implementation_reads_what_set_attn_implementation_set():
    model = _tiny_llama()
    model.set_attn_implementation("eager")
    assert compat.attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sdpa")
    assert compat.attn_implementation(model.config) == "sdpa"


def test_experts_implementation_reads_what_from_config_set():
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    for name in ("eager", "batched_mm"):
        model = AutoModelForCausalLM.from_config(config, experts_implementation=name)
        assert compat.experts_implementation(model.config) == name
    assert compat.experts_implementation(object()) is None  # a config without experts


def test_set_tp_size_is_what_transformers_and_accelerate_read():
    from accelerate.utils.other import get_model_tp_size

    model = _tiny_llama()
    assert model.tp_size is None and get_model_tp_size(model) is None
    compat.set_tp_size(model, 2)
    assert model.tp_size == 2 and get_model_tp_size(model) == 2


def test_decoder_block_classes_names_the_decoder_layer():
    model = _tiny_llama()
    assert compat.decoder_block_classes(model) == {"LlamaDecoderLayer"}
    assert {type(m).__name__ for m in model.model.layers} == {"LlamaDecoderLayer"}
    assert compat.decoder_block_classes(nn.Linear(2, 2)) == set()


def test_mark_uninitialized_makes_initialize_weights_run_again():
    model = _tiny_llama()
    weight = model.model.layers[0].mlp.up_proj.weight
    torch.manual_seed(1)
    model.initialize_weights()
    first = weight.detach().clone()
    torch.manual_seed(2)
    model.initialize_weights()  # every module is flagged initialized: nothing changes
    assert torch.equal(weight, first)
    compat.mark_uninitialized(model)
    torch.manual_seed(2)
    model.initialize_weights()
    assert not torch.equal(weight, first)


def test_init_weights_override_routes_every_module_init_and_is_removed_after():
    model = _tiny_llama()
    seen = []

    def wrap(original):
        def init_one(module):
            seen.append(type(module).__name__)
            original(module)
        return init_one

    from transformers import PreTrainedModel

    pretrained = [m for m in model.modules() if isinstance(m, PreTrainedModel)]  # LlamaForCausalLM, LlamaModel
    model.to_empty(device="cpu")  # fresh tensors, as materialize has them
    compat.mark_uninitialized(model)
    with compat.init_weights_override(pretrained, wrap):
        model.initialize_weights()
    initialized = {type(m).__name__ for m in model.modules()}
    assert set(seen) == initialized  # every module went through the override
    assert all("_init_weights" not in vars(m) for m in pretrained)
    with pytest.raises(RuntimeError, match="boom"), compat.init_weights_override(pretrained, wrap):
        raise RuntimeError("boom")
    assert all("_init_weights" not in vars(m) for m in pretrained)


# ---------------------------------------------------------------------------------------------
# accelerate
# ---------------------------------------------------------------------------------------------


def _prepared(data, num: int, index: int):
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    return prepare_data_loader(DataLoader(data, batch_size=2), num_processes=num, process_index=index,
                               put_on_device=False)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(24))


@pytest.mark.parametrize("data", [list(range(24)), _Stream()], ids=["map-style", "iterable"])
def test_split_prepared_loader_hands_out_another_share(data):
    def batches(loader):
        return [b.tolist() for b in loader]

    loader = _prepared(data, 4, 3)  # as accelerate prepares it for 4 processes
    assert compat.split_prepared_loader(loader, 2, 1)
    assert batches(loader) == batches(_prepared(data, 2, 1))  # as if prepared for 2
    assert compat.split_prepared_loader(loader, 1, 0)
    assert batches(loader) == [[i, i + 1] for i in range(0, 24, 2)]  # every batch, once
    from torch.utils.data import DataLoader

    assert not compat.split_prepared_loader(DataLoader(data), 2, 1)  # not accelerate's


# ---------------------------------------------------------------------------------------------
# torch.distributed (2 gloo processes)
# ---------------------------------------------------------------------------------------------


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    out: dict = {}
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    flat = compat.flatten_mesh(mesh[("a", "b")], "ab")
    out["flat"] = (flat.size(), mesh["ab"].size(), dist.get_process_group_ranks(mesh.get_group("ab")))
    grid = compat.unflatten_mesh(flat, (world, 1), ("c", "d"))
    out["unflat"] = (grid.mesh.tolist(), dist.get_process_group_ranks(grid.get_group("c")),
                     grid._get_root_mesh() is mesh)

    seen = []
    model = nn.Linear(2, 2)
    model.register_forward_pre_hook(lambda *a: seen.append(compat.active_ddp_module()))
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp(torch.ones(1, 2))
    model(torch.ones(1, 2))
    out["ddp"] = (seen[0] is ddp, seen[1] is None, compat.active_ddp_module() is None)

    one = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    root = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(root[0], mesh=one)
    fully_shard([root[1], root[2]], mesh=mesh["b"])  # one group of two modules
    fully_shard(root, mesh=one)  # the root: no parameter of its own
    out["fsdp"] = [[m.mesh.tolist() for m in compat.fsdp_meshes(x)] for x in (root[0], root[1], root[2], root)]
    out["not fsdp"] = compat.fsdp_meshes(nn.Linear(2, 2))
    root(torch.ones(1, 2)).sum().backward()  # mid-step too: the same meshes, sharded or not
    out["fsdp after"] = [m.mesh.tolist() for m in compat.fsdp_meshes(root[0])]
    out["dtensor"] = compat.is_traceable_wrapper_subclass(root[0].weight) and isinstance(root[0].weight, DTensor)

    store = compat.default_store()  # the store init_process_group made: every rank reaches the same one
    store.set(f"compat-from-{rank}", str(rank))
    out["store"] = [store.get(f"compat-from-{r}").decode() for r in range(world)]
    dist.barrier()  # the last collective: nothing pending when the groups go
    compat.abort_all_groups()
    out["aborted"] = not dist.is_initialized()
    return out


@pytest.fixture(scope="module")
def dist_results():
    return run_distributed(_worker, 2, timeout=120)


@pytest.mark.distributed
def test_flatten_mesh_names_one_group_over_the_dims(dist_results):
    for r in dist_results:
        assert r["flat"] == (2, 2, [0, 1])


@pytest.mark.distributed
def test_unflatten_mesh_splits_a_flat_view_on_the_same_root(dist_results):
    for r in dist_results:
        assert r["unflat"] == ([[0], [1]], [0, 1], True)


@pytest.mark.distributed
def test_active_ddp_module_is_the_running_ddp_and_none_outside(dist_results):
    for r in dist_results:
        assert r["ddp"] == (True, True, True)


@pytest.mark.distributed
def test_fsdp_meshes_are_the_meshes_fully_shard_got(dist_results):
    for r in dist_results:
        assert r["fsdp"] == [[[0, 1]], [[0, 1]], [[0, 1]], []]  # the root holds no parameter of its own
        assert r["not fsdp"] == [] and r["fsdp after"] == [[0, 1]] and r["dtensor"]


@pytest.mark.distributed
def test_default_store_is_the_one_every_rank_reaches_and_abort_all_groups_ends_them(dist_results):
    for r in dist_results:
        assert r["store"] == ["0", "1"] and r["aborted"]


# ---------------------------------------------------------------------------------------------
# transformers: recurrent mixers' kernel functions (each family's names: test_state_passing)
# ---------------------------------------------------------------------------------------------

def test_kernels_replaced_swaps_a_modeling_global_and_restores_it_on_error():
    import importlib

    module = importlib.import_module("transformers.models.bamba.modeling_bamba")
    assert compat.modeling_module(module.BambaMixer) is module
    original = module.mamba2_chunk_scan
    with pytest.raises(RuntimeError, match="inside"):
        with compat.kernels_replaced(module, {"mamba2_chunk_scan": lambda *a, **k: None}) as saved:
            assert saved["mamba2_chunk_scan"] is original and module.mamba2_chunk_scan is not original
            raise RuntimeError("inside")
    assert module.mamba2_chunk_scan is original


def test_calls_kernels_reads_the_globals_a_forward_calls():
    import importlib

    import transformers

    module = importlib.import_module("transformers.models.bamba.modeling_bamba")
    assert compat.calls_kernels(module.BambaMixer, ("mamba2_chunk_scan", "causal_conv1d_fn"))
    assert not compat.calls_kernels(module.BambaMixer, ("a_kernel_it_does_not_call",))
    route = compat.kernel_route(module.BambaMixer, ("mamba2_chunk_scan", "causal_conv1d_fn",
                                                    "mamba2_split_conv1d_scan_combined"))
    if transformers.__version__.startswith("5.24."):  # forward calls them itself
        assert route == dict.fromkeys(route)
    else:  # 5.25: through the helpers that read the cache
        assert route == {"mamba2_chunk_scan": "mamba2_scan_forward", "causal_conv1d_fn": "causal_conv1d_forward",
                         "mamba2_split_conv1d_scan_combined": None}, route


_HELPER_MODULE = """
def kernel(x):
    return x

def helper(x):
    return kernel(x) + 1

def deeper(x):
    return helper(x)

class Mixer:
    def forward(self, x):
        return helper(x) + deeper(x) + other(x)

def other(x):
    return x
"""


def test_kernel_route_follows_one_helper_of_the_same_module(tmp_path, monkeypatch):
    import importlib
    import sys

    (tmp_path / "seqpar_route_probe.py").write_text(_HELPER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module("seqpar_route_probe")
    try:
        assert compat.kernel_route(probe.Mixer, ("kernel", "other")) == {"kernel": "helper", "other": None}
        assert compat.kernel_route(probe.Mixer, ("missing",)) is None  # not defined in the module
        monkeypatch.setattr(probe, "helper", lambda x: x)  # defined still; its source still reads kernel
        assert compat.calls_kernels(probe.Mixer, ("kernel",))
    finally:
        sys.modules.pop("seqpar_route_probe", None)


def test_kernel_signature_is_the_functions_even_as_a_kernels_module():
    import importlib

    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    fn = module.causal_conv1d_fn  # a plain function (5.24), an nn.Module instance (5.25 with kernels)
    assert list(compat.kernel_signature(fn).parameters)[:4] == ["hidden_states", "weight", "bias", "activation"]
    call = compat.KernelCall(fn, (torch.ones(1, 2, 3), torch.ones(2, 2)), {"activation": None})
    assert call["weight"].shape == (2, 2) and call["bias"] is None


def test_kernelized_funcs_is_empty_for_a_model_nobody_kernelized():
    from seqpar.testing.zoo import build_tiny

    model = build_tiny("qwen3_next", layer_types=["linear_attention", "full_attention"], num_hidden_layers=2)
    assert all(compat.kernelized_funcs(m) == set() for m in model.modules())


def test_kernel_call_keeps_the_callers_convention():
    seen = []

    def kernel(query, key, value, g=None, beta=None, initial_state=None, **kwargs):
        seen.append((query, key, value, g, initial_state, kwargs))
        return "out"

    call = compat.KernelCall(kernel, ("q", "k", "v"), {"g": "g", "cu_seqlens": None})
    assert call["initial_state"] is None and call["value"] == "v" and call["beta"] is None
    assert call.replace(value="v2", initial_state="s")() == "out"
    assert seen == [("q", "k", "v2", "g", "s", {"cu_seqlens": None})]
    assert call.values["value"] == "v"  # replace() leaves the call as it was


def test_load_balancing_loss_func_is_the_modeling_modules():
    import importlib

    module = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    assert compat.load_balancing_loss_func(module.Qwen3MoeForCausalLM) is module.load_balancing_loss_func
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    with pytest.raises(ValueError, match="no load_balancing_loss_func"):
        compat.load_balancing_loss_func(llama.LlamaForCausalLM)


@pytest.mark.parametrize("module_name", compat.TRL_GATHER_MODULES)
def test_trl_generation_gathers_are_the_module_globals_grpo_and_rloo_call_and_come_back(module_name):
    """GRPOTrainer and RLOOTrainer read gather / gather_object as their module's globals (the reward
    gather, the logs)."""
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    assert "rewards_per_func = gather(rewards_per_func)" in source and "gather_object(" in source
    old = module.gather, module.gather_object
    with compat.trl_generation_gathers(module_name, len, list):
        assert (module.gather, module.gather_object) == (len, list)
    assert (module.gather, module.gather_object) == old
    with pytest.raises(ValueError, match="generation trainer modules"):
        with compat.trl_generation_gathers("trl.trainer.dpo_trainer", len, list):
            pass


def test_float64_loss_log_is_the_trainers_running_loss_sum():
    """transformers' Trainer sums the step losses in place into _tr_loss (reset by train()) and logs
    its mean over the processes; made float64 with float32 steps, it holds the float32 sum and a mean
    of equal copies is exact."""
    import inspect
    from types import SimpleNamespace

    from transformers import Trainer

    source = inspect.getsource(Trainer)
    assert "self._tr_loss = torch.tensor(0.0" in source and "self._tr_loss += tr_loss_step" in source
    trainer = SimpleNamespace(_tr_loss=torch.tensor(0.0))
    plain = torch.tensor(0.0)
    for loss in (0.6975272562512633, 0.1234567891234, -0.06009571999311447):
        step = torch.tensor(loss, dtype=torch.float64)
        plain += step  # the script without seqpar: float32 += a float64 loss
        returned = compat.float64_loss_log(trainer, step)  # training_step's value, then the Trainer's +=
        trainer._tr_loss += returned
        assert trainer._tr_loss.dtype == torch.float64 and trainer._tr_loss.item() == plain.item()
    assert trainer._tr_loss.repeat(3).mean().item() == plain.item()


# ---------------------------------------------------------------------------------------------
# diffusers
# ---------------------------------------------------------------------------------------------


def test_diffusers_cp_plan_reads_the_context_parallel_plan_as_plain_data():
    """ModelMixin._cp_plan (ContextParallelInput / ContextParallelOutput): Flux's splits its four inputs
    at the model and gathers proj_out; Wan's splits RoPE's two output items; SD3 declares none."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

    assert "diffusers" in compat.CHECKED_ON
    flux = compat.diffusers_cp_plan(FluxTransformer2DModel)
    assert flux == {"": {"hidden_states": (1, 3), "encoder_hidden_states": (1, 3), "img_ids": (0, 2),
                         "txt_ids": (0, 2)}, "proj_out": [(1, 3)]}
    wan = compat.diffusers_cp_plan(WanTransformer3DModel)
    assert wan["rope"] == {0: (1, 4), 1: (1, 4)} and wan["proj_out"] == [(1, 3)]
    assert compat.diffusers_cp_plan(SD3Transformer2DModel) is None


# ---------------------------------------------------------------------------------------------
# deepspeed (the peer of benchmarks/bench_alst.py)
# ---------------------------------------------------------------------------------------------


def test_deepspeed_skip_cpu_shm_build_keeps_its_comm_backend_from_compiling():
    import importlib

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # (deepspeed.comm.torch as an attribute is torch)
    compat.deepspeed_skip_cpu_shm_build()
    assert ds_torch.build_shm_op() is None  # what TorchBackend.__init__ calls: nothing to compile, no op
