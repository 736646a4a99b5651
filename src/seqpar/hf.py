"""Any transformers causal LM, sequence-parallel in one call, through public registration points only.

``parallelize(model, mesh)`` registers a seqpar attention function with
``transformers.AttentionInterface`` under a fresh name, bound to the mesh by closure, and switches the
model's decoder (``config`` or ``config.text_config``) to it with ``model.set_attn_implementation``.
The name is not registered with ``AttentionMaskInterface``, so transformers builds no mask at all
(its masks would describe the local shard); seqpar's masks come from the batch's SeqShard, built
once by :func:`seqpar.shard_batch` and carried to every layer in ``model(**local)`` keywords::

    model(**local)                           local = shard_batch(batch, mesh)
      decoder layer
        q, k, v    # [B, H, S/P, D]          the model's projections, norms, RoPE: untouched
        seqpar attention fn                  spec from the call: scaling, sliding_window, softcap,
          sp_attention(strategy)               dropout, module.is_causal; mask from the SeqShard
            local kernel                     the model's own sdpa / eager function (Ulysses)
        out        # [B, S/P, H, D]
      logits       # [B, S/P, V]
      loss_function                          seqpar's: exact global token mean (seqpar.loss)

The local kernel is the model's own implementation where it can be wrapped: ``sdpa``, ``eager`` (the
modeling file's function, which is what carries Gemma 2's softcap) and any function registered
together with transformers' ``sdpa_mask`` or ``eager_mask`` (that says which mask format it takes).
Anything else (flash_attention_*, flex_attention) runs on seqpar's kernels (``sdpa``, or
``reference`` for softcap). Ring and hybrid need a kernel that returns the log-sum-exp, so they
use seqpar's. ``unparallelize`` restores the implementation and the loss function.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .attention import STRATEGIES, resolve_strategy, sp_attention
from .data import BATCH_KWARG, LocalBatch
from .kernels import AttnSpec, MaskInfo, dense_mask, plan_mask
from .layout import inverse_permutation
from .loss import make_loss_function
from .mesh import Axis, MeshOrGroup, axis_group

_ATTR = "_seqpar_parallel"  # our own attribute on the model: how to undo parallelize
_names = itertools.count()


@dataclass
class _Parallel:
    name: str
    original: str
    sub_config: str | None  # None: the top-level config; else e.g. "text_config"
    loss_function: Callable[..., Any]
    strategy: str
    num_heads: int
    num_kv_heads: int


def _attention_config(config: Any) -> tuple[Any, str | None]:
    """The config that holds the decoder's attention heads: ``config`` or ``config.text_config``."""
    if getattr(config, "num_attention_heads", None):
        return config, None
    text = getattr(config, "text_config", None)
    if text is not None and getattr(text, "num_attention_heads", None):
        return text, "text_config"
    raise ValueError(f"{type(config).__name__} has no num_attention_heads (nor text_config.num_attention_heads):"
                     " seqpar.parallelize needs a transformers model with self-attention")


class _LocalHeads:
    """The attention module as the local kernel sees it after Ulysses: every attribute of the real
    module, except that its query heads share each KV head ``n_rep``-fold -- the ratio of this
    rank's head slice, which need not be the config's."""

    def __init__(self, module: nn.Module, n_rep: int) -> None:
        self._module = module
        self.num_key_value_groups = n_rep

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class ModelKernel:
    """The model's own attention function as seqpar's local kernel (a plain callable kernel:
    ``fn(q, k, v, *, spec, mask) -> out``, layouts ``[B, H, S, D]``, differentiable by itself).

    The mask it gets is seqpar's (global positions, window, padding, documents), built once per
    batch and layer kind and shared by all layers: a bool mask for ``sdpa``, an additive one (0 /
    dtype min, as transformers' eager mask) for ``eager``. Rows that see no key at all (padding
    queries) are computed against every key and zeroed, so no NaN can reach the backward.
    """

    def __init__(self, fn: Callable[..., tuple[Tensor, Any]], module: nn.Module, kind: str, batch: LocalBatch
                 ) -> None:
        assert kind in ("bool", "additive")
        self.fn, self.module, self.kind, self.batch = fn, module, kind, batch

    def _mask(self, spec: AttnSpec, mask: MaskInfo, q: Tensor) -> tuple[bool, Tensor | None, Tensor | None]:
        """(is_causal flag, mask in the function's format or None, rows that see a key or None)."""
        key = (self.kind, spec.causal, spec.window, q.dtype, q.device, q.shape[2])
        cache = self.batch.mask_cache
        if key not in cache:
            s = q.shape[2]
            if self.kind == "bool":
                causal, allowed = plan_mask(spec, mask, s, s, q.device)
            else:  # eager applies nothing by itself: always give it the whole mask
                causal, allowed = False, dense_mask(spec, mask, s, s, q.device)
            seen = None
            if allowed is not None:
                seen = allowed.any(dim=-1, keepdim=True)  # [B or 1, 1, S, 1]
                allowed = allowed | ~seen
                if bool(seen.all()):
                    seen = None
                if self.kind == "additive":
                    allowed = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(
                        ~allowed, torch.finfo(q.dtype).min)
            cache[key] = (causal, allowed, seen)
        return cache[key]

    def _in_order(self, mask: MaskInfo) -> tuple[MaskInfo, Tensor | None, Tensor | None]:
        """A permuted layout (zigzag) put back in token order: ``(mask, perm, inverse)``. The
        model's function then sees the sequence exactly as without SP (same key order in its
        reductions, and sdpa keeps its is_causal fast path)."""
        if mask.q_pos is None or mask.k_pos is None or not (mask.q_pos is mask.k_pos or
                                                           torch.equal(mask.q_pos, mask.k_pos)):
            return mask, None, None
        key = ("order", mask.q_pos.data_ptr())
        cache = self.batch.mask_cache
        if key not in cache:
            perm = mask.q_pos
            inv = inverse_permutation(perm)

            def order(t: Tensor | None) -> Tensor | None:
                return None if t is None else t.index_select(1, inv.to(t.device))

            seg = order(mask.q_seg)
            cache[key] = (MaskInfo(key_keep=order(mask.key_keep), q_seg=seg, k_seg=seg), perm, inv)
        return cache[key]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, spec: AttnSpec, mask: MaskInfo | None) -> Tensor:
        # q [B, H, S, D], k / v [B, H_kv, S, D], the whole sequence in layout order
        mask, perm, inv = self._in_order(mask or MaskInfo())
        if inv is not None:
            q, k, v = (t.index_select(2, inv.to(t.device)) for t in (q, k, v))
        causal, attn_mask, seen = self._mask(spec, mask, q)
        extra = {} if spec.softcap is None else {"softcap": spec.softcap}
        out, _ = self.fn(_LocalHeads(self.module, q.shape[1] // k.shape[1]), q, k, v, attn_mask,
                         dropout=spec.dropout, scaling=spec.scale, is_causal=causal, **extra)
        out = out.transpose(1, 2)  # [B, S, H, D] -> [B, H, S, D]
        out = out if seen is None else out * seen
        return out if perm is None else out.index_select(2, perm.to(out.device))


def _eager_function(module: nn.Module) -> Callable[..., Any] | None:
    """The ``eager_attention_forward`` of the module's modeling file (public, module level), if any."""
    return getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)


def _original_function(original: str, module: nn.Module) -> tuple[Callable[..., Any] | None, str]:
    """The model's own attention function and the mask format it takes, or ``(None, "")``.

    The format is read from the mask function registered for the same name: transformers'
    ``sdpa_mask`` (bool) or ``eager_mask`` (additive). "eager" itself is the module's modeling-file
    function. Anything else (flash / flex masks, unknown) is not wrapped.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask, sdpa_mask

    mask_fn = AttentionMaskInterface().get(original)
    kind = "bool" if mask_fn is sdpa_mask else "additive" if mask_fn is eager_mask else ""
    fn = _eager_function(module) if original == "eager" else AttentionInterface().get(original)
    return (fn, kind) if fn is not None and kind else (None, "")


def _make_attention(mesh: MeshOrGroup, strategy: str, kernel: Any, original: str) -> Callable[..., Any]:
    """The attention function registered with transformers, bound to ``mesh`` by closure."""
    import torch.distributed as dist
    from transformers import AttentionInterface

    group = axis_group(mesh, Axis.SP.value)
    p, me = dist.get_world_size(group), dist.get_rank(group)

    def seqpar_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[Tensor, None]:
        # query [B, H, S/P, D] (a non-contiguous view), key / value [B, H_kv, S/P, D]
        batch = kwargs.get(BATCH_KWARG)
        if not isinstance(batch, LocalBatch):
            raise ValueError("this model is sequence-parallel (seqpar.parallelize): feed it "
                             "model(**seqpar.shard_batch(batch, mesh)), or call seqpar.unparallelize(model)")
        if key.shape[2] != query.shape[2]:
            # Not self-attention over the sharded sequence (cross-attention, a cache): per-query
            # attention against keys every rank holds whole is already exact locally.
            fn = _eager_function(module) if original == "eager" else AttentionInterface().get(original)
            if fn is None:
                raise ValueError(f"seqpar cannot run a {original!r} attention whose keys are not the sharded "
                                 "sequence; use attn_implementation='sdpa' or 'eager'")
            return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if attention_mask is not None:
            # transformers builds no mask for seqpar's name, so this one is the model's own
            # (a prefix-LM or image mask...): it describes the local shard, seqpar cannot use it
            raise ValueError(f"{type(module).__name__} passes its own attention mask, which seqpar cannot shard; "
                             "seqpar masks padding and packed documents itself (from shard_batch)")
        if batch.sp_size != p or query.shape[2] != batch.local_len:
            raise ValueError(f"the batch was sharded for sp={batch.sp_size} with {batch.local_len} tokens on rank "
                             f"{me}, but the model runs over sp={p} with {query.shape[2]}: shard the batch with "
                             "the mesh the model was parallelized with")
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
        window = kwargs.get("sliding_window")
        softcap = kwargs.get("softcap")
        kern = kernel
        if kern is None and strategy == "ulysses":
            fn, kind = _original_function(original, module)
            kern = ModelKernel(fn, module, kind, batch) if fn is not None else (
                "reference" if softcap is not None else "sdpa")
        if not query.dtype == key.dtype == value.dtype:
            # under torch.autocast RoPE leaves q, k in float32 while v is bfloat16; the fused
            # all-to-all needs one dtype, and autocast would run attention in v's anyway
            query, key = query.to(value.dtype), key.to(value.dtype)
        out = sp_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mesh=mesh,
                           strategy=strategy, causal=causal, scale=scaling, window=window, softcap=softcap,
                           dropout=dropout, kernel=kern, shard=batch.shard, validate=False)
        batch.attention_calls += 1
        return out, None  # [B, S/P, H, D]

    return seqpar_attention


def parallelize(model: nn.Module, mesh: MeshOrGroup, *, strategy: str = "ulysses", kernel: Any = None
                ) -> nn.Module:
    """Make a transformers model sequence-parallel over the ``"sp"`` axis of ``mesh`` (in place).

    Feed it ``model(**seqpar.shard_batch(batch, mesh))``; ``out.loss`` is then the exact loss of the
    whole batch on every SP rank (see :mod:`seqpar.loss` for the gradient contract). ``strategy``:
    any of ``seqpar.attention.STRATEGIES`` ("ulysses", "ring", "hybrid") or ``"auto"`` (see
    :func:`seqpar.attention.resolve_strategy`).
    ``kernel``: None (the model's own attention where it can be wrapped, else seqpar's) or any
    kernel :func:`seqpar.sp_attention` accepts. Returns the model.

    Raises ValueError if the model is not a transformers model whose attention goes through
    ``AttentionInterface``, has no attention heads, is already parallelized, if the strategy is
    unknown or the mesh has no ``"sp"`` axis -- the same on every rank, before any collective.
    """
    if strategy != "auto" and strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {sorted([*STRATEGIES, 'auto'])}")
    axis_group(mesh, Axis.SP.value)  # raises without an sp axis
    if strategy == "hybrid":  # raise now, not at the first forward
        axis_group(mesh, Axis.ULYSSES.value)
        axis_group(mesh, Axis.RING.value)
    from transformers import AttentionInterface, PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"seqpar.parallelize wraps transformers models ({type(model).__name__} is not a "
                         "PreTrainedModel); in your own module call seqpar.sp_attention instead of attention")
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("this model is already parallelized: call seqpar.unparallelize(model) first")
    config, sub = _attention_config(model.config)
    strategy = resolve_strategy(strategy, mesh, int(config.num_attention_heads))
    original = config._attn_implementation
    if original is not None and original.startswith("seqpar_"):
        raise ValueError(f"the model already uses a seqpar attention ({original!r}): unparallelize it first")
    if original == "sdpa" and getattr(config, "attn_logit_softcapping", None) and kernel is None:
        raise ValueError(f"{type(model).__name__} uses attn_logit_softcapping, which transformers' sdpa does not "
                         "support: load it with attn_implementation='eager' (or pass kernel='reference')")
    name = f"seqpar_{strategy}_{next(_names)}"  # no "flash" in it: transformers would fetch a Hub kernel
    AttentionInterface.register(name, _make_attention(mesh, strategy, kernel, original))
    model.set_attn_implementation(name if sub is None else {sub: name})
    if config._attn_implementation != name:
        AttentionInterface.register(name, _released)
        raise ValueError(f"{type(model).__name__} does not route its attention through transformers' "
                         "AttentionInterface, so seqpar cannot wrap it (its attention would stay local)")
    state = _Parallel(name=name, original=original, sub_config=sub, loss_function=model.loss_function,
                      strategy=strategy, num_heads=int(config.num_attention_heads),
                      num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    model.loss_function = make_loss_function(mesh)
    setattr(model, _ATTR, state)
    return model


def _released(*args: Any, **kwargs: Any) -> Any:
    raise ValueError("this seqpar attention belongs to a model parallelize refused")


def unparallelize(model: nn.Module) -> nn.Module:
    """Undo :func:`parallelize`: the original attention implementation and loss function come
    back. The registered seqpar function stays registered: a deep copy of the parallelized model
    (an EMA or DPO reference model) still uses it."""
    state: _Parallel | None = getattr(model, _ATTR, None)
    if state is None:
        raise ValueError("this model is not parallelized by seqpar")
    model.set_attn_implementation(state.original if state.sub_config is None else {state.sub_config: state.original})
    model.loss_function = state.loss_function
    delattr(model, _ATTR)
    return model


@contextlib.contextmanager
def parallelized(model: nn.Module, mesh: MeshOrGroup, *, strategy: str = "ulysses", kernel: Any = None
                 ) -> Iterator[nn.Module]:
    """``with seqpar.parallelized(model, mesh) as m:`` -- :func:`parallelize`, undone on exit."""
    parallelize(model, mesh, strategy=strategy, kernel=kernel)
    try:
        yield model
    finally:
        unparallelize(model)
