"""Expert parallelism with sequence parallelism against the unsharded model: the parity engine.

Every rank builds the same tiny float64 MoE model (:func:`seqpar.testing.zoo.build_tiny`, eager
experts) and one batch per dp rank (different batches: an owner mixes the tokens of several dp
batches). Three runs of each case::

    reference   the unmodified model on each dp batch, whole (model_parity's oracle, router aux loss
                in float64): loss of this rank's batch, gradients averaged over the dp batches
    sp          parallelize(mesh) + shard_batch + sync_gradients: the same code without EP
    ep          parallelize(mesh, ep=group) + shard_batch + sync_gradients

The ep run is compared with both, every parameter: a replicated one whole, an expert shard with
the rows ``[start, start + n)`` of the other run's stacked tensor; then ``unparallelize`` gathers the
experts back and the whole tensors (values and gradients) are compared too. Against the sp run the
tolerances are the strict ones always (the same code, the same tokens per rank: only the experts'
grouping differs); against the reference they are model_parity's, relative to float32 precision
where the model is float32-exact only by its own code (:func:`seqpar.testing.model_parity.model_floor`).
The dense layers' token counts are recorded on the way: attention and dense MLPs must see this
rank's shard only (they keep SP with EP on).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch.grad_groups import total_grad_norm
from ..batch.loss import sync_gradients
from ..batch.sharding import shard_batch
from ..comm.mesh import init_mesh
from ..integrations.hf.parallelize import parallelize, unparallelize
from ..integrations.mixers import STATE, family_of, set_mixer_mode, token_mixers
from ..integrations.models import decoder_config
from ..integrations.moe.expert_parallel import expert_parallel_modules
from ..integrations.moe.families import experts_of
from ..integrations.moe.plan import expert_range
from .model_parity import F32_RTOL, GRAD_TOL, LOSS_TOL, Floor, ModelCase, case_batch, model_floor, reference_grads
from .zoo import VARIANTS, build_tiny, tiny_config

MOE_LAYERS: dict[str, Any] = {"first_k_dense_replace": 1, "num_dense_layers": 1, "enable_moe_block": True,
                              "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
"""Config fields (where a family's config has them) that give its 2-layer tiny model a dense layer
and an MoE layer (DeepSeek, GLM and LFM2 MoE configs keep their first layers dense; Gemma 4's MoE
block is off by default)."""
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class EPCase:
    """One case: ``family`` (a transformers model type, or a :data:`seqpar.testing.zoo.VARIANTS`
    name), rows (``batch``, ``seq``), ``strategy``, the mesh ``dp x sp``, ``ep`` folded
    ``"contiguous"`` (ep groups of consecutive ranks of the flattened dp x sp mesh: inside the sp
    groups when ep <= sp) or ``"strided"`` (across dp); ``experts``: an expert count (None: the tiny
    config's 4); ``skew``: per-expert router logit bias (None: none); ``checkpointing``: recompute
    the decoder layers in the backward."""

    family: str = "qwen3_moe"
    batch: str = "padded"
    seq: int = 16
    strategy: str = "ulysses"
    dp: int = 2
    sp: int = 2
    ep: int = 2
    fold: str = "contiguous"
    experts: int | None = None
    skew: tuple[float, ...] | None = None
    checkpointing: bool = False

    def label(self) -> str:
        extra = "".join([f" E={self.experts}" if self.experts else "", f" skew={list(self.skew)}" if self.skew else "",
                         " ckpt" if self.checkpointing else ""])
        return (f"{self.family} {self.batch} S={self.seq} {self.strategy} dp{self.dp}xsp{self.sp} ep{self.ep}"
                f"/{self.fold}{extra}")


def build_moe(case: EPCase) -> nn.Module:
    """The case's tiny float64 MoE model (eager experts, router aux loss on), skewed routers included."""
    model_type, variant = VARIANTS.get(case.family, (case.family, {}))
    config = tiny_config(model_type, **variant).to_dict()
    overrides = {**variant, **_moe_overrides(config, case.experts)}
    if isinstance(config.get("text_config"), dict):  # a multimodal model: its decoder's config
        overrides["text_config"] = {**config["text_config"], **_moe_overrides(config["text_config"], case.experts)}
    model = build_tiny(model_type, **overrides)
    if case.skew is not None:
        skew_routers(model, case.skew)
    return model


def _moe_overrides(config: dict[str, Any], experts: int | None) -> dict[str, Any]:
    """:data:`MOE_LAYERS` and the expert count, for the fields ``config`` has."""
    out = {k: v for k, v in MOE_LAYERS.items() if k in config}
    if experts is not None:
        out.update({k: experts for k in EXPERT_COUNTS if k in config})
    return out


def skew_routers(model: nn.Module, bias: tuple[float, ...]) -> None:
    """Add ``bias[e]`` to every router's logit of expert e, so that some experts take most rows
    and others none: through the router's own bias where it has one (GPT-OSS ``bias``, DeepSeek-V3's
    selection bias ``e_score_correction_bias``), else by a forward hook that re-picks the top-k of
    the biased softmax as Mixtral and Qwen3-MoE do (normalized when ``norm_topk_prob``)."""
    for e in experts_of(model):
        block = model.get_submodule(e.name.rpartition(".")[0])
        router = next(m for n, m in block.named_children() if n in ("gate", "router"))
        b = torch.tensor(bias, dtype=torch.float64)
        with torch.no_grad():
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.copy_(b.to(router.e_score_correction_bias))
            elif isinstance(getattr(router, "bias", None), nn.Parameter):
                router.bias.add_(b.to(router.bias))
            else:
                router.register_forward_hook(_BiasedTopK(b))


class _BiasedTopK:
    """Forward hook of a softmax-then-top-k router (Mixtral, Qwen3-MoE): ``logits + bias``, re-picked."""

    def __init__(self, bias: Tensor) -> None:
        self.bias = bias

    def __call__(self, module: nn.Module, _args: Any, out: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, ...]:
        logits = out[0] + self.bias.to(out[0])  # [T, E]
        top, index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), module.top_k, dim=-1)
        if getattr(module, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index


def ep_groups(case: EPCase) -> list[list[int]]:
    """The case's ep groups, as world ranks (the mesh is ``init_mesh(dp=, sp=)``: rank = d * sp + s)."""
    world = case.dp * case.sp
    if case.fold == "contiguous":
        return [list(range(i, i + case.ep)) for i in range(0, world, case.ep)]
    if case.fold == "strided":
        return [list(range(j, world, world // case.ep)) for j in range(world // case.ep)]
    raise ValueError(f"fold={case.fold!r}: choose contiguous or strided")


def _case_meshes(case: EPCase) -> tuple[DeviceMesh, dist.ProcessGroup]:
    """The case's dp x sp mesh and this rank's ep group (collective: every rank of the world)."""
    split = {"ulysses": case.sp // 2, "ring": 2} if case.strategy == "hybrid" else {}
    mesh = init_mesh(sp=case.sp, dp=case.dp, device_type="cpu", **split)
    group, _ = dist.new_subgroups_by_enumeration(ep_groups(case))
    return mesh, group


def _dense(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every linear projection of the model outside its token mixers -- attention, dense MLPs,
    shared experts, routers, the head: the dense layers, which must keep SP with EP on (the experts
    hold stacked tensors; a hybrid's token mixers have SP modes of their own,
    :mod:`seqpar.integrations.mixers`)."""
    mixers = tuple(f"{n}." for n, _ in token_mixers(model))
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith(mixers)]


def _tokens(x: Tensor) -> int:
    """Tokens in a ``[..., H]`` activation (``[B, S, H]`` or ``[B*S, H]``)."""
    return x.numel() // x.shape[-1]


def _expert_rows(forward: Any) -> dict[int, list[int]]:
    """Global expert id -> rows each ep rank sent it at the latest call, for this rank's experts."""
    recv = forward.loads[-1]  # [source][local expert]
    start, _ = expert_range(sum(forward.owned), len(forward.owned), forward.layout.rank)
    return {start + j: [row[j] for row in recv] for j in range(len(recv[0]))}


def _grads(model: nn.Module) -> dict[str, Tensor | None]:
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def _run(model: nn.Module, batch: dict[str, Tensor], mesh: DeviceMesh, case: EPCase,
         ep: dist.ProcessGroup | None) -> tuple[float, dict[str, Tensor | None], dict[str, list[int]], dict[str, Any]]:
    """One parallel run: ``(loss, gradients after sync, tokens seen per dense module, EP record)``;
    the model stays parallelized (the caller unparallelizes it)."""
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    parallelize(model, mesh, strategy=case.strategy, ep=ep)
    if any(STATE in family_of(m).modes for _, m in token_mixers(model)):
        set_mixer_mode(model, STATE)  # as the SP zoo runs them: the same mode in both runs, not a measured one
    seen: dict[str, list[int]] = {}  # tokens each dense projection ran on (rows x positions)
    hooks = [m.register_forward_pre_hook(lambda _m, args, kw, n=n: seen.setdefault(n, []).append(
        _tokens(args[0] if args else kw["hidden_states"])), with_kwargs=True)
        for n, m in _dense(model)]
    try:
        local = shard_batch(batch, mesh)
        outputs = model(**local)
        loss = outputs.loss
        loss.backward()
        sync_gradients(model, mesh)
    finally:
        for h in hooks:
            h.remove()
    aux = getattr(outputs, "aux_loss", None)  # the router aux loss, recomputed over the SP group
    local_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    record = {"aux_loss": float(aux) if isinstance(aux, Tensor) else None, "norm": float(total_grad_norm(model)),
              "local_norm": float(local_norm),  # this rank's gradients alone: its own experts only under EP
              "local_tokens": int(local["seqpar_batch"].local_len) * batch["input_ids"].shape[0],
              "loads": {path: _expert_rows(f) for path, _, f in expert_parallel_modules(model)}}
    return float(loss.detach()), _grads(model), seen, record


def compare_ep(case: EPCase) -> dict[str, Any]:
    """One case on this rank (collective over the world): ``{label, loss_diff, loss_diff_sp, grad_max,
    grad_max_sp, worst, f32, floor, dense_tokens_ok, full_grad_max, aux_loss, norm, loads, failed, ok}``
    (``norm``: :func:`seqpar.batch.grad_groups.total_grad_norm` after the sync); ``loads``
    per experts module, global expert id -> rows from each ep rank (this rank's experts); ``failed``
    names the comparisons out of tolerance, ``ok`` when none is."""
    torch.set_num_threads(1)
    mesh, group = _case_meshes(case)
    me = dist.get_rank()
    d = me // case.sp  # this rank's dp index
    model = build_moe(case)
    vocab = decoder_config(model.config)[0].vocab_size
    batches = [case_batch(ModelCase(batch=case.batch, seq=case.seq, seed=i), vocab)
               for i in range(case.dp)]
    floor = model_floor(model, [*batches, case_batch(ModelCase(batch="packed", seq=17), vocab)])
    refs = [reference_grads(model, b, loss_scale=case.sp) for b in batches]
    ref_loss = refs[d][0]
    ref = {n: _mean([r[1][n] for r in refs]) for n in refs[0][1]}
    sp_model, ep_model = copy.deepcopy(model), copy.deepcopy(model)
    sp_loss, sp_grads, _, sp_record = _run(sp_model, batches[d], mesh, case, None)
    unparallelize(sp_model)
    ep_loss, ep_grads, seen, record = _run(ep_model, batches[d], mesh, case, group)
    shards = {f"{path}.{p}": (f.owned, f.layout.rank) for path, _, f in expert_parallel_modules(ep_model)
              for p in f.params}
    worst: dict[str, tuple[float, float, float]] = {}  # name -> (vs reference, the reference's size, vs sp)
    for n, p in ep_model.named_parameters():
        r, s = ref[n], sp_grads[n]
        if n in shards:
            owned, rank = shards[n]
            start, count = expert_range(sum(owned), len(owned), rank)
            r = r[start:start + count] if r is not None else None
            s = s[start:start + count] if s is not None else None
        worst[n] = (*_diffs(ep_grads[n], r, p), _diffs(ep_grads[n], s, p)[0])
    unparallelize(ep_model)  # the experts come back whole, gradients too
    full = [_diffs(q.grad, ref[n], q) for n, q in ep_model.named_parameters() if n in shards]
    values = max((float((q - model.get_parameter(n)).detach().abs().max()) for n, q in ep_model.named_parameters()
                  if n in shards), default=0.0)
    row = {"label": case.label(), "rank": me, "loss_ref": ref_loss, "loss_diff": abs(ep_loss - ref_loss),
           "loss_diff_sp": abs(ep_loss - sp_loss), "grad_max": max(v[0] for v in worst.values()),
           "grad_rel": max(v[0] / max(v[1], 1e-30) for v in worst.values()),
           "grad_max_sp": max(v[2] for v in worst.values()),
           "worst": max(worst, key=lambda n: worst[n][0]), "full_grad_max": max((f[0] for f in full), default=0.0),
           "full_values_max": values, "f32": bool(floor), "floor": sorted(floor.params), "sharded": sorted(shards),
           "loads": record["loads"], "dense_tokens": seen, "local_tokens": record["local_tokens"],
           "aux_loss": record["aux_loss"], "norm": record["norm"], "norm_sp": sp_record["norm"],
           "local_norm": record["local_norm"],
           "norm_ref": float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in ref.values()
                                                                  if g is not None])))}
    row["dense_tokens_ok"] = bool(seen) and all(t == record["local_tokens"] for v in seen.values() for t in v)
    checks = {"loss vs sp": row["loss_diff_sp"] <= LOSS_TOL, "grads vs sp": row["grad_max_sp"] <= GRAD_TOL,
              "experts gathered back": values == 0.0, "dense layers keep SP": row["dense_tokens_ok"],
              "loss vs reference": _within(row["loss_diff"], abs(ref_loss), LOSS_TOL, floor),
              "grads vs reference": all(_within(d, size, GRAD_TOL, floor) for d, size, _ in worst.values()),
              "whole experts' grads vs reference": all(_within(d, size, GRAD_TOL, floor) for d, size in full),
              "grad norm vs sp": abs(row["norm"] - row["norm_sp"]) <= GRAD_TOL,
              "grad norm vs reference": _within(abs(row["norm"] - row["norm_ref"]), row["norm_ref"], GRAD_TOL, floor)}
    row["failed"] = [name for name, ok in checks.items() if not ok]
    row["ok"] = not row["failed"]
    return row


def _diffs(mine: Tensor | None, theirs: Tensor | None, like: Tensor) -> tuple[float, float]:
    """``(max |mine - theirs|, max |theirs|)``; None counts as zeros."""
    a = mine if mine is not None else torch.zeros_like(like)
    b = theirs if theirs is not None else torch.zeros_like(like)
    if not a.numel():
        return 0.0, 0.0
    return float((a - b).abs().max()), float(b.abs().max())


def _within(diff: float, scale: float, tol: float, floor: Floor) -> bool:
    """Within the strict tolerance, or -- for a model float32-exact by its own code -- within
    float32 precision of ``scale`` (the compared value's magnitude), as model_parity compares."""
    return diff <= tol or (bool(floor) and diff <= F32_RTOL * scale)


def _mean(grads: list[Tensor | None]) -> Tensor | None:
    present = [g for g in grads if g is not None]
    if not present:
        return None
    return sum(present) / len(grads)


def run_ep_parity(rank: int, world: int, cases: list[EPCase]) -> list[dict[str, Any]]:
    """Every case on this rank (``world`` must be each case's dp x sp); returns this rank's rows."""
    rows = []
    for case in cases:
        assert case.dp * case.sp == world, (case.label(), world)
        rows.append(compare_ep(case))
    return rows


def ep_case(family: str, **changes: Any) -> EPCase:
    """An :class:`EPCase` of ``family`` with ``changes``."""
    return replace(EPCase(family=family), **changes)
