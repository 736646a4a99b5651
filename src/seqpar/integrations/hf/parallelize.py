"""Any transformers causal LM, sequence-parallel in one call, through public registration points only.

``parallelize(model, mesh)`` registers a seqpar attention function with
``transformers.AttentionInterface`` under a fresh name, bound to the mesh once (the function and
its named pieces: :mod:`~seqpar.integrations.hf.attention`), and switches the model's decoder (``config`` or
``config.text_config``) to it with ``model.set_attn_implementation``.
The name is not registered with ``AttentionMaskInterface``, so transformers builds no mask at all
(its masks would describe the local shard); seqpar's masks come from the batch's SeqShard, built
once by :func:`seqpar.shard_batch` and carried to every layer in ``model(**local)`` keywords (and
caught by a forward pre-hook on the model, for decoder layers that drop them). What the suppressed
masks would have said per layer -- a window, a chunk -- and the layer's sinks are read by
:mod:`~seqpar.integrations.hf.layer_spec`::

    model(**local)                           local = shard_batch(batch, mesh)
      decoder layer
        q, k, v    # [B, H, S/P, D]          the model's projections, norms, RoPE: untouched
        seqpar attention fn                  spec from the call: scaling, sliding_window, softcap,
          STRATEGIES[strategy]                 dropout, module.is_causal; mask from the SeqShard
            local kernel                     the model's own sdpa / eager function (Ulysses)
        out        # [B, S/P, H, D]
      logits       # [B, S/P, V]
      loss_function                          seqpar's: exact global token mean (seqpar.batch.loss)

The local kernel is the model's own implementation where it can be wrapped: ``sdpa``, ``eager`` (the
modeling file's function, which is what carries Gemma 2's softcap) and any function registered
together with transformers' ``sdpa_mask`` or ``eager_mask`` (that says which mask format it takes).
Anything else (flash_attention_*, flex_attention) runs on seqpar's ``auto`` kernel. Ring and
hybrid need a kernel that returns the log-sum-exp, so they use seqpar's (:func:`attention_kernel`
says in words which one a parallelized model runs). ``unparallelize`` restores the implementation
and the loss function. Under ``torch.compile`` the model's plain ``sdpa`` gives way to seqpar's varlen
lse kernel (the same math) inside an opaque op, so no layer breaks the graph
(:mod:`seqpar.attention.ops`); an eager function runs as it runs without compilation.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ... import compat
from ...attention.dispatch import STRATEGIES, check_strategy, resolve_strategy
from ...attention.kernels import KernelArg
from ...batch.local_batch import BATCH_KWARG
from ...batch.loss import make_loss_function
from ...comm.agree import check, share
from ...comm.mesh import Axis, as_mesh, axis_group, axis_size, has_axis, submesh, tp_size
from ...errors import Refused
from ..diffusers.parallelize import parallelize_diffusers
from ..distributed.fsdp import check_gradient_reduction
from ..distributed.tensor_parallel import apply_tp, check_tp
from ..mixers import check_token_mixers, token_mixers, warn_mode_gaps, wrap_token_mixers
from ..models import decoder_config, is_diffusers_model
from ..moe.expert_parallel import apply_ep, remove_ep
from ..peft import unwrap_peft
from ..state import ParallelState, ensure_state, set_loss_function, state_of, undo
from ..vlm.encoder import install_vision
from ..vlm.families import family_of
from .attention import AttentionBinding, LastBatch, make_attention
from .kernel import original_function
from .published import publish_forward_errors
from .router_losses import check_router_losses, install_router_losses

_names = itertools.count()


def parallelize(model: nn.Module, mesh: DeviceMesh, *, strategy: str = "ulysses", kernel: KernelArg | None = None,
                ep: dist.ProcessGroup | DeviceMesh | None = None, output: str | None = None) -> nn.Module:
    """Make a transformers model -- or a diffusers transformer -- sequence-parallel over the ``"sp"``
    axis of ``mesh`` (in place).

    A diffusers ``ModelMixin`` (Flux, SD3, Wan, ...) goes to
    :func:`seqpar.integrations.diffusers.parallelize.parallelize_diffusers`: called with the whole
    inputs on every rank, it returns the whole output (``output="whole"``, the default) or this
    rank's tokens (``output="sharded"``); ``output`` applies to diffusers models only.

    Feed it ``model(**seqpar.shard_batch(batch, mesh))``; ``out.loss`` is then the exact loss of the
    whole batch on every SP rank (see :mod:`seqpar.batch.loss` for the gradient contract). ``strategy``:
    any of ``seqpar.attention.dispatch.STRATEGIES`` ("ulysses", "ring", "hybrid") or ``"auto"`` (see
    :func:`seqpar.attention.dispatch.resolve_strategy`).
    ``kernel``: None (the model's own attention where it can be wrapped, else seqpar's) or any
    kernel :func:`seqpar.sp_attention` accepts. Returns the model.

    Hybrid models: the Mamba, Mamba2, Gated DeltaNet, Kimi and LFM2 short-convolution layers of
    :data:`~seqpar.integrations.mixers.HANDLED_MIXERS` are exact too. LFM2's short convolutions take a halo of the
    previous rank's last inputs; the recurrent layers run *state passing* (each rank its own
    tokens, the scan's state across ranks: compute and memory O(S/P), communication independent
    of S) or, where measured faster, split by heads (each rank its share of the heads on the
    whole sequence), see :mod:`~seqpar.integrations.mixers`, :func:`~seqpar.integrations.mixers.set_mixer_mode` and
    :func:`~seqpar.integrations.mixers.describe_token_mixers`.

    ``ep``: expert parallelism for an MoE model (default: the mesh's own ``"ep"`` axis,
    ``init_mesh(ep=...)``) -- a ProcessGroup or 1-D DeviceMesh whose ranks are a subset of
    ``mesh``'s dp x sp ranks (EP folded over them: :mod:`seqpar.integrations.moe.layout`);
    each rank then holds a shard of every layer's experts and tokens travel to them and back
    (:func:`seqpar.integrations.moe.expert_parallel.apply_ep`), while every dense layer keeps SP. Every
    rank of the world calls parallelize together then. A model whose experts seqpar cannot shard is
    refused (:class:`seqpar.Refused`), never run without EP.

    Tensor parallelism: on a mesh with ``tp > 1`` (``seqpar.init_mesh(tp=..., sp=...)``) the model
    is first split over the ``"tp"`` axis by its own plan
    (:mod:`seqpar.integrations.distributed.tensor_parallel`): each tp rank holds its share of the
    heads, which the strategy then runs over sp (Ulysses splits them again, ring runs them whole);
    the head is vocabulary-parallel (``out.logits`` is this rank's ``[B, S/sp, V/tp]`` shard) and the
    loss reduces over tp. Tensor parallelism cannot be undone in place (:func:`unparallelize`
    refuses it); a model without a plan, hybrid token mixers and vision-language models are
    Refused at ``tp > 1``.

    Raises ValueError if the model is not a transformers model whose attention goes through
    ``AttentionInterface``, has no attention heads, mixes tokens by other means too (convolutions,
    linear attention, recurrences, indexed attention) or numbers tokens in a way seqpar cannot feed
    global positions to (:mod:`~seqpar.integrations.mixers`), is already parallelized, if the strategy is unknown or the
    mesh has no ``"sp"`` axis -- the same on every rank, before any collective.
    """
    if is_diffusers_model(model):
        if ep is not None or tp_size(mesh) > 1:
            raise Refused("a diffusers transformer runs sequence parallelism alone: give a mesh without tp "
                          "(and no ep); tensor and expert parallelism apply to transformers models")
        return parallelize_diffusers(model, mesh, strategy=strategy, kernel=kernel, output=output or "whole")
    if output is not None:
        raise ValueError(f"output={output!r} applies to diffusers models; a transformers model returns its shard's "
                         "logits and the exact loss: drop output")
    check_strategy(strategy)
    axis_group(as_mesh(mesh, "parallelize"), Axis.SP.value)  # raises without an sp axis
    if strategy == "hybrid":  # raise now, not at the first forward
        axis_group(mesh, Axis.ULYSSES.value)
        axis_group(mesh, Axis.RING.value)
    from transformers import AttentionInterface, PreTrainedModel

    outer, model = model, unwrap_peft(model)  # a peft PeftModel: the transformers model it wraps (adapters inside)
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"seqpar.parallelize wraps transformers models ({type(model).__name__} is not a "
                         "PreTrainedModel); in your own module call seqpar.sp_attention instead of attention")
    record = state_of(model)
    if record is not None and record.parallel is not None:
        raise ValueError("this model is already parallelized: call seqpar.unparallelize(model) first")
    config, sub = decoder_config(model.config)
    check_token_mixers(model)  # a model seqpar cannot make exact is refused, never run on shards
    tp = tp_size(mesh)
    if tp > 1:
        check_tp_model(model, sub, tp)
    if ep is None and has_axis(mesh, Axis.EP.value) and axis_size(mesh, Axis.EP.value) > 1:
        ep = axis_group(mesh, Axis.EP.value)  # the mesh's own expert parallelism (init_mesh(ep=...))
    if ep is not None and tp > 1:
        raise Refused(f"expert parallelism with tensor parallelism (tp={tp}) is not composed yet: the experts' "
                      "shards would need splitting over tp too; use tp=1 with ep, or ep=1 with tp")
    # a feature the installed transformers does not allow: one warning (rank 0), the model runs in its fallback
    warn_mode_gaps(model, dist.get_world_size(axis_group(mesh, Axis.SP.value)))
    check_router_losses(model)  # a z-loss over the positions
    strategy = resolve_strategy(strategy, mesh, int(config.num_attention_heads) // tp)  # a tp rank's heads
    original = compat.attn_implementation(config)
    if original is not None and original.startswith("seqpar_"):
        raise ValueError(f"the model already uses a seqpar attention ({original!r}): unparallelize it first")
    if original == "sdpa" and getattr(config, "attn_logit_softcapping", None) and kernel is None:
        raise Refused(f"{type(model).__name__} uses attn_logit_softcapping, which transformers' sdpa does not "
                      "support: load it with attn_implementation='eager' (or pass kernel='auto')")
    name = f"seqpar_{strategy}_{next(_names)}"  # no "flash" in it: transformers would fetch a Hub kernel
    last = LastBatch()
    AttentionInterface.register(name, make_attention(AttentionBinding(mesh, strategy, kernel, original, config, last,
                                                                      family_of(model).causal_mask)))
    model.set_attn_implementation(name if sub is None else {sub: name})
    if compat.attn_implementation(config) != name:
        AttentionInterface.register(name, _released)
        raise Refused(f"{type(model).__name__} does not route its attention through transformers' "
                      "AttentionInterface, so seqpar cannot wrap it (its attention would stay local)")

    agreed = []

    def catch_batch(_module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        last.batch = kwargs.get(BATCH_KWARG)
        if not agreed and not torch.compiler.is_compiling():  # once per parallelize, before any layer's collective
            check_same_strategy(mesh, strategy)
            agreed.append(True)
        # a step that will have gradients: are they reduced over every rank? (Eager calls only: the
        # check reads process groups and wrapper state, which would break a compiled graph at its
        # first line; so a forward traced by torch.compile skips it: a known limit, docs/guides/attention.md)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            check_gradient_reduction(model, mesh)

    record = ensure_state(model)
    record.parallel = ParallelState(
        name=name, original=original, sub_config=sub, strategy=strategy, kernel=kernel,
        num_heads=int(config.num_attention_heads),
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads), tp=tp)
    try:
        record.push("parallel", f"attention implementation {original!r}",
                    functools.partial(_set_attention, model, original, sub))
        hook = model.register_forward_pre_hook(catch_batch, with_kwargs=True)
        record.push("parallel", "the forward pre-hook catching the batch", hook.remove)
        record.push("parallel", "the loss function", functools.partial(set_loss_function, model, model.loss_function))
        model.loss_function = make_loss_function(mesh)
        # images: encoded once over the SP ranks, routed to the ranks that hold their tokens
        record.push("parallel", "the vision pre-hook", install_vision(model, mesh).remove)
        # Mamba, Gated DeltaNet, short convolutions
        record.push("parallel", "the token mixers", wrap_token_mixers(model, mesh, lambda: last.batch))
        # MoE: the router aux loss over the whole batch, not each rank's shard
        record.push("parallel", "the router-loss hook", install_router_losses(model, mesh).remove)
        if ep is not None:  # MoE: each rank a shard of the experts, the tokens travel to them (collective)
            apply_ep(model, ep, mesh=mesh, last_batch=lambda: last.batch)
            record.push("parallel", "the experts' shards", functools.partial(remove_ep, model))
        publish_forward_errors(model, record)  # an exception in the forward is told to every rank
        if tp > 1:  # last: it cannot be undone, so nothing may fail after it
            apply_tp(model, submesh(mesh, Axis.TP.value))
    except BaseException:
        undo(model, "parallel")  # nothing half-installed stays behind
        raise
    return outer


def check_tp_model(model: nn.Module, sub_config: str | None, tp: int) -> None:
    """Raise (the same on every rank, before anything changes) unless ``model`` can be split over
    ``tp`` ranks exactly: its plan (:func:`~seqpar.integrations.distributed.tensor_parallel.check_tp`),
    no token mixers beside attention (seqpar's wrappers read their weights whole), no vision tower."""
    if sub_config is not None:
        raise Refused(f"tensor parallelism (tp={tp}) of a vision-language model ({type(model).__name__}) is not "
                      "supported: its vision tower and routing run whole on every rank; use tp=1")
    mixers = {type(m).__name__ for _, m in token_mixers(model)}
    if mixers:
        raise Refused(f"tensor parallelism (tp={tp}) with seqpar's token mixers ({', '.join(sorted(mixers))}) is not "
                      "supported: their sequence-parallel wrappers read the weights whole; use tp=1")
    check_tp(model, tp)


def check_same_strategy(mesh: DeviceMesh, strategy: str) -> None:
    """Raise the same ValueError on every rank of the sp group unless every rank parallelized its
    model with the same strategy: the layers' attention skips per-call validation (shard_batch
    checked the batch), and ranks on different strategies would pair different collectives -- a
    hang, or gloo aborting the process. One tiny all-gather, at a model's first forward."""
    names = sorted(STRATEGIES)
    table = share({"strategy": float(names.index(strategy))}, axis_group(mesh, Axis.SP.value))
    check(table, what="parallelized model", same=("strategy",), describe=lambda _: "the strategy",
          hint=f"({', '.join(f'{i} = {n}' for i, n in enumerate(names))}): call seqpar.parallelize(model, mesh, "
               "strategy=...) with the same strategy on every rank")


def _set_attention(model: nn.Module, implementation: str | None, sub_config: str | None) -> None:
    model.set_attn_implementation(implementation if sub_config is None else {sub_config: implementation})


def attention_kernel(model: nn.Module) -> str:
    """Which local attention kernel a parallelized model runs, in words, for its device and dtype
    (``seqpar train`` prints it): the choice of ``kernel="auto"`` made visible."""
    from ...attention.kernels import cuda_candidates, lse_kernel_for
    from ...attention.spec import AttnSpec

    record = state_of(model)
    state = record.parallel if record is not None else None
    if state is None:
        raise ValueError("this model is not parallelized by seqpar")
    if state.kernel is not None:
        return f"{getattr(state.kernel, 'name', state.kernel)} (as passed to parallelize)"
    param = next(model.parameters())
    if is_diffusers_model(model):  # the attention modules' SDPA calls run the device's lse kernel
        name = lse_kernel_for(param.device, param.dtype, AttnSpec())
        lean = " (Ulysses keeps no gathered output)" if state.strategy == "ulysses" else ""
        return f"{name} (varlen, returns lse){lean}; cross-attention to whole text: the model's own"
    config, _ = decoder_config(model.config)
    spec = AttnSpec(softcap=getattr(config, "attn_logit_softcapping", None))
    varlen = lse_kernel_for(param.device, param.dtype, spec)
    if varlen == "fastest":  # several verified CUDA kernels: auto measures them
        varlen = (f"the fastest of {' / '.join(cuda_candidates(param.device, param.dtype, spec))} per shape class, "
                  "measured on first use (seqpar.attention.kernels.describe_kernels())")
    if state.strategy != "ulysses":
        return f"{varlen} (varlen, returns lse; {state.strategy} merges the blocks)"
    if state.original == "sdpa":
        return (f"the model's sdpa on rows SDPA's causal flag describes; {varlen} (varlen, no S x S mask) on "
                "padded or packed rows and cut windows")
    if state.original == "eager":
        return "the model's eager attention (it computes the S x S scores and takes a dense mask, as eager does)"
    fn, _ = original_function(state.original, model)
    return (f"the model's {state.original}" if fn is not None
            else f"auto: sdpa or {varlen} (the model's {state.original!r} cannot be wrapped)")


def _released(*args: Any, **kwargs: Any) -> Any:
    raise ValueError("this seqpar attention belongs to a model parallelize refused")


def unparallelize(model: nn.Module) -> nn.Module:
    """Undo :func:`parallelize` (and :func:`seqpar.reduce_memory`, if it was called): the original
    attention implementation and loss function come back. The registered seqpar function stays
    registered: a deep copy of the parallelized model (an EMA or DPO reference model) still uses it."""
    outer, model = model, unwrap_peft(model)
    record = state_of(model)
    if record is None or record.parallel is None:
        raise ValueError("this model is not parallelized by seqpar")
    if record.parallel.tp > 1:
        raise Refused(f"this model is split over tp={record.parallel.tp}: its weights are sharded DTensors, which "
                      "cannot be put back in place; write a plain checkpoint with seqpar.save_pretrained and load it")
    undo(model)  # every step, newest first: reduce_memory's (made after parallelize) before parallelize's
    return outer


@contextlib.contextmanager
def parallelized(model: nn.Module, mesh: DeviceMesh, *, strategy: str = "ulysses",
                 kernel: KernelArg | None = None, ep: dist.ProcessGroup | DeviceMesh | None = None,
                 output: str | None = None) -> Iterator[nn.Module]:
    """``with seqpar.parallelized(model, mesh) as m:`` -- :func:`parallelize`, undone on exit."""
    parallelize(model, mesh, strategy=strategy, kernel=kernel, ep=ep, output=output)
    try:
        yield model
    finally:
        unparallelize(model)
