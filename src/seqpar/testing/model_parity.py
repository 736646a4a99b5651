"""Whole-model parity: the same batches with and without seqpar, loss and every gradient compared.

The engine behind ``seqpar verify --model`` and the tests. Every rank builds the same model (seeded,
float64, weights re-drawn large enough that masks and windows change the result) and the same full
batch; the reference is the unmodified transformers model on the whole batch (its own masks:
padding mask, or packed rows via position_ids); the parallel run is ``parallelize`` +
``shard_batch`` + ``sync_gradients``. Labels carry the ignore index at padding and at document
starts, so the reference's plain shift and seqpar's target rules agree. Printing is the CLI's
(``seqpar verify --model``); this module only computes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch.loss import sync_gradients
from ..batch.sharding import shard_batch
from ..batch.targets import IGNORE_INDEX
from ..comm.mesh import Axis, axis_group, init_mesh
from ..errors import Refused
from ..integrations.hf.parallelize import parallelize, unparallelize
from ..integrations.mixers import chosen_modes, set_mixer_mode
from ..integrations.models import BUILTIN_MODELS, build_model, builtin_config, decoder_config
from ..planner import hybrid_split
from .eager64 import EAGER_FLOAT64, register_eager_float64
from .router64 import collect, router_term

LOSS_TOL = 1e-9
GRAD_TOL = 1e-8
FLOAT64_NOISE = 1e-12  # float64 sums of a few hundred terms regrouped move by ~1e-15 relative
F32_RTOL = 1e-5
"""Relative tolerance for what a float64 model itself computes in float32 (see :func:`precision_floor`)."""


@dataclass(frozen=True)
class Floor:
    """Where a float64 model is only float32-exact by its own code, measured on the reference alone
    (:func:`precision_floor`): parameters whose gradient is a float32 sum over tokens (Gemma's
    ``1 + weight.float()`` norms, routers in float32), whether the loss itself is float32 (logits
    cast to float32), whether the model's own attention is float32 (transformers' eager softmax).
    Any of these makes the model's gradients float32-accurate throughout (the rounding flows back
    through every layer), so a model with a non-empty floor is compared within :data:`F32_RTOL`
    (relative) or the absolute tolerances; every other model absolutely to :data:`LOSS_TOL` /
    :data:`GRAD_TOL`."""

    params: frozenset[str] = frozenset()
    loss: bool = False
    attention: bool = False

    def __or__(self, other: Floor) -> Floor:
        return Floor(self.params | other.params, self.loss or other.loss, self.attention or other.attention)

    def __bool__(self) -> bool:
        return bool(self.params) or self.loss or self.attention


def _regrouped(batch: dict[str, Tensor]) -> list[dict[str, Tensor]]:
    """The same token losses as ``batch``, computed in other shapes: a padded batch one row at a
    time; a packed one with all its documents in one right-padded batch (the reference runs them
    one at a time)."""
    if "position_ids" not in batch:
        return [{k: v[r:r + 1] for k, v in batch.items()} for r in range(batch["input_ids"].shape[0])]
    docs = []
    for row, pos in enumerate(batch["position_ids"].expand(batch["input_ids"].shape[0], -1)):
        starts = [*(pos == 0).nonzero().flatten().tolist(), pos.numel()]
        docs += [(batch["input_ids"][row, a:b], batch["labels"][row, a:b]) for a, b in zip(starts[:-1], starts[1:],
                                                                                             strict=True)]
    n = max(len(ids) for ids, _ in docs)
    out = {"input_ids": torch.zeros(len(docs), n, dtype=torch.long),
           "labels": torch.full((len(docs), n), IGNORE_INDEX, dtype=torch.long),
           "attention_mask": torch.zeros(len(docs), n, dtype=torch.long)}
    for i, (ids, labels) in enumerate(docs):
        n_i = len(ids)
        out["input_ids"][i, :n_i], out["labels"][i, :n_i], out["attention_mask"][i, :n_i] = ids, labels, 1
    return [out]


def precision_floor(model: nn.Module, batch: dict[str, Tensor],
                    whole: tuple[float, dict[str, Tensor | None]] | None = None) -> Floor:
    """Run the reference on ``batch`` and on the same token losses in other shapes
    (:func:`_regrouped`): in float64 the two agree to rounding (~1e-16) unless the model computes
    something in float32 itself (a norm weight, a router, the logits), whose sums then depend on
    how the tokens are grouped -- as they do across SP ranks. A parameter or loss that moves by
    more than :data:`FLOAT64_NOISE` (relative) is such a float32 computation. ``whole``: the
    reference of ``batch`` when already computed (:func:`reference_grads`)."""
    loss_whole, whole = whole or reference_grads(model, batch)
    n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    parts, runs = [], []
    for part in _regrouped(batch):
        total, _ = reference_token_loss(model, part, runs)
        parts.append(total / n)
    regrouped = sum(parts) + router_term(model, runs)  # the aux loss is over the union of the parts' tokens
    regrouped.backward()
    loss_parts = float(regrouped.detach())
    params = frozenset(name for name, q in model.named_parameters() if whole[name] is not None and q.grad is not None
                       and _moved(whole[name], q.grad))
    model.zero_grad(set_to_none=True)
    return Floor(params, abs(loss_whole - loss_parts) > FLOAT64_NOISE * abs(loss_whole))


def model_floor(model: nn.Module, batches: Iterable[dict[str, Tensor]]) -> Floor:
    """The union of :func:`precision_floor` over ``batches``: the floor of the model rather than of
    one batch. A model's float32 step moves a sum only where its float32 kernels round the regrouped
    tokens differently, which depends on the shapes and on the machine's kernels (measured: Bailing
    hybrid's float32 router moved its loss under padded and plain rows but not packed ones, on an
    AMD EPYC), so one batch shape can miss a float32 step that the sharded runs of another show."""
    floor = Floor()
    for batch in batches:
        floor |= precision_floor(model, batch)
    return floor


def grid_floor(model: nn.Module, vocab: int, shapes: Iterable[tuple[str, int]]) -> Floor:
    """:func:`model_floor` over packed 17-token rows and every ``(batch kind, length)`` of a grid."""
    return model_floor(model, [case_batch(ModelCase(batch=kind, seq=seq), vocab)
                               for kind, seq in dict.fromkeys([("packed", 17), *shapes])])


def _moved(a: Tensor, b: Tensor) -> bool:
    """More than float64 rounding apart (relative to the larger entry)."""
    return float((a - b).abs().max()) > max(FLOAT64_NOISE * float(a.abs().max()), 1e-14)


@dataclass(frozen=True)
class ModelCase:
    """One parity case. ``batch``: "padded" (2 rows, the second shorter and right-padded),
    "packed" (documents restarting position_ids, no padding) or "plain" (no padding, one document)."""

    model: str = "tiny-llama"
    batch: str = "padded"
    seq: int = 16
    heads: int | None = None  # config overrides (None: the model's own)
    kv_heads: int | None = None
    strategy: str = "ulysses"
    layout: str = "contiguous"
    attn: str | None = None  # attn_implementation (None: the built-in default)
    seed: int = 0
    checkpointing: str | None = None  # "reentrant" / "non-reentrant": the SP model recomputes its layers
    mixer_mode: str | None = None  # hybrid token mixers' run mode (set_mixer_mode); None: seqpar chooses
    config: tuple[tuple[str, Any], ...] = ()  # more config overrides, e.g. (("tie_word_embeddings", True),)

    def label(self) -> str:
        heads = "" if self.heads is None else f" H={self.heads}/{self.kv_heads}"
        heads += "".join(f" {k}={v}" for k, v in self.config)
        attn = "" if self.attn is None else f" attn={self.attn}"
        ckpt = "" if self.checkpointing is None else f" ckpt={self.checkpointing}"
        mixers = "" if self.mixer_mode is None else f" mixers={self.mixer_mode}"
        return f"{self.model} {self.batch} S={self.seq}{heads} {self.strategy}/{self.layout}{attn}{ckpt}{mixers}"


def case_batch(case: ModelCase, vocab: int) -> dict[str, Tensor]:
    """The full batch of a case, identical on every rank."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    s = case.seq
    ids = torch.randint(0, vocab, (2, s), generator=g)
    labels = ids.clone()
    if case.batch == "padded":
        short = s - max(1, s // 3)
        mask = torch.ones(2, s, dtype=torch.long)
        mask[1, short:] = 0
        labels[mask == 0] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if case.batch == "packed":
        docs = [[s // 3, s // 2], [s // 2]]  # document lengths per row; the rest is the last document
        pos = torch.empty(2, s, dtype=torch.long)
        for row, lens in enumerate(docs):
            lens = [n for n in lens if n > 0]
            lens.append(s - sum(lens))
            pos[row] = torch.cat([torch.arange(n) for n in lens])
        labels[pos == 0] = IGNORE_INDEX  # a document's first token is not predicted from the previous document
        return {"input_ids": ids, "labels": labels, "position_ids": pos}
    if case.batch == "plain":
        return {"input_ids": ids, "labels": labels}
    raise ValueError(f"unknown batch kind {case.batch!r}: choose padded, packed or plain")


def make_model(case: ModelCase) -> nn.Module:
    """The case's model in float64, with weights drawn large enough that attention is peaked."""
    overrides: dict[str, Any] = {}
    if case.heads is not None:
        overrides["num_attention_heads"] = case.heads
        overrides["hidden_size"] = 8 * case.heads  # transformers wants hidden % heads == 0
    if case.kv_heads is not None:
        overrides["num_key_value_heads"] = case.kv_heads
    overrides.update(dict(case.config))
    if case.attn == EAGER_FLOAT64:
        register_eager_float64()
    torch.manual_seed(case.seed)
    model, _ = build_model(case.model, dtype=torch.float64, attn_implementation=case.attn, **overrides)
    if case.model not in BUILTIN_MODELS:
        model.train()
        return model  # a user's checkpoint keeps its own weights
    g = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (1.5 / p.shape[-1] ** 0.5))
    model.train()  # dropout is 0 in the built-in configs; train mode is what training runs in
    return model


def reference_token_loss(model: nn.Module, batch: dict[str, Tensor], routers: list[Any] | None = None
                         ) -> tuple[Tensor, int]:
    """The non-parallel model on the whole batch: ``(sum of the float64 token losses, number of
    targets)``. Padded rows run with the model's own padding mask; a packed row (``position_ids``
    restarting at 0) runs as what packing means, each document on its own, so the check does not
    depend on whether the model's own masks understand packing. ``routers``: each forward's router
    logits are appended to it, for the MoE aux loss of the whole batch (:mod:`.router64`)."""
    if "position_ids" in batch:
        total, n = batch["input_ids"].new_zeros((), dtype=torch.float64), 0
        for row, pos in enumerate(batch["position_ids"].expand(batch["input_ids"].shape[0], -1)):
            starts = [*(pos == 0).nonzero().flatten().tolist(), pos.numel()]
            for a, b in zip(starts[:-1], starts[1:], strict=True):
                doc = {k: batch[k][row:row + 1, a:b] for k in ("input_ids", "labels")}
                ce, m = reference_token_loss(model, doc, routers)
                total, n = total + ce, n + m
        return total, n
    kw: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False}
    if "attention_mask" in batch:
        kw["attention_mask"] = batch["attention_mask"]
    out = model(**kw)
    collect(out, kw.get("attention_mask"), routers)
    logits = out.logits  # [B, S, V]
    targets = batch["labels"][:, 1:]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="sum")
    return ce, int((targets != IGNORE_INDEX).sum())


def reference_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The non-parallel token-mean loss of the whole batch (see :func:`reference_token_loss`), plus
    ``coef * aux`` of the whole batch for an MoE model with router logits on (:mod:`.router64`)."""
    runs: list[Any] = []
    total, n = reference_token_loss(model, batch, runs)
    return total / n + router_term(model, runs)


def param_group(name: str) -> str:
    for key, group in (("embed", "embed"), ("lm_head", "lm_head"), ("attn", "attention"), ("mlp", "mlp")):
        if key in name:
            return group
    return "norm"


def reference_grads(model: nn.Module, batch: dict[str, Tensor], *, loss_scale: float = 1.0
                    ) -> tuple[float, dict[str, Tensor | None]]:
    """The non-parallel loss of ``batch`` and every parameter's gradient (``model``'s grads are reset).

    ``loss_scale``: back-propagate ``loss_scale * loss`` and divide the gradients by it -- the same
    gradient, computed at the scale at which the seqpar loss back-propagates for an average over
    that many ranks (:func:`sp_loss_scale`). It matters for models that cast to float32 inside
    (Llama's RMSNorm runs in float32 whatever the model's dtype): they round each token's gradient
    relative to its scale, so at a scale with an odd factor (3 ranks) only an oracle at the same
    scale agrees to float64 rounding; at a power of two the scaling commutes with the rounding."""
    model.zero_grad(set_to_none=True)
    ref = reference_loss(model, batch)
    (ref * loss_scale if loss_scale != 1.0 else ref).backward()
    grads = {n: (q.grad / loss_scale if loss_scale != 1.0 else q.grad) if q.grad is not None else None
             for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(ref.detach()), grads


def sp_loss_scale(mesh: DeviceMesh) -> int:
    """The factor by which the seqpar loss scales each rank's gradient for a batch sharded over
    ``mesh`` without ``num_items_in_batch`` (the SP size: the gradients are then averaged over it,
    see :mod:`seqpar.batch.loss`): the ``loss_scale`` of the matching :func:`reference_grads`."""
    return dist.get_world_size(axis_group(mesh, Axis.SP.value))


def compare_models(sp_model: nn.Module, batch: dict[str, Tensor], mesh: DeviceMesh, *, strategy: str,
                   reference: tuple[float, dict[str, Tensor | None]], floor: Floor = Floor(),
                   layout: str = "contiguous", mixer_mode: str | None = None,
                   num_items: float | None = None) -> dict[str, Any]:
    """Run ``sp_model`` (a copy of the reference model, parallelized here and restored after) on
    its shard of ``batch``; compare its loss and synced gradients with ``reference``
    (:func:`reference_grads`), where the model is float32-exact only by its own code
    (``floor``, :func:`precision_floor`) relative to :data:`F32_RTOL`. ``mixer_mode``: the run
    mode of hybrid token mixers (:func:`seqpar.integrations.mixers.set_mixer_mode`; None: seqpar
    chooses). Returns ``{loss_ref, loss_diff, loss_tol, grad_diff: {group: max}, grad_max,
    worst_param, f32_params, f32_rel, ok, mixer_modes}`` (``mixer_modes``: token-mixer class -> the
    mode it ran in). ``num_items``: shard_batch's ``num_items_in_batch`` (None: the batch's targets)."""
    ref_loss, ref_grads = reference
    parallelize(sp_model, mesh, strategy=strategy)
    try:
        if mixer_mode is not None:
            set_mixer_mode(sp_model, mixer_mode)
        local = shard_batch(batch, mesh, layout=layout, num_items_in_batch=num_items)
        loss = sp_model(**local).loss
        loss.backward()
        sync_gradients(sp_model, mesh)
        modes = chosen_modes(sp_model)
    finally:
        unparallelize(sp_model)
    groups: dict[str, float] = {}
    worst, worst_name, f32_worst = 0.0, "", 0.0
    # a model that computes anything in float32 has float32-accurate gradients throughout (its
    # rounding flows back through every layer): all of them are compared at float32 precision
    f32 = {n for n, _ in sp_model.named_parameters()} if floor else set()
    for n, q in sp_model.named_parameters():
        if q.grad is None and ref_grads[n] is None:
            continue  # a parameter this batch does not reach (an unrouted expert) on both sides
        mine = q.grad if q.grad is not None else torch.zeros_like(q)
        theirs = ref_grads[n] if ref_grads[n] is not None else torch.zeros_like(q)
        d = float((mine - theirs).abs().max())
        if n in f32 and d > GRAD_TOL:  # relative to float32 precision, reported apart
            f32_worst = max(f32_worst, d / max(float(theirs.abs().max()), 1e-30))
            continue
        grp = param_group(n)
        groups[grp] = max(groups.get(grp, 0.0), d)
        if d > worst or not worst_name:
            worst, worst_name = d, n
    loss_tol = max(LOSS_TOL, F32_RTOL * abs(ref_loss)) if floor else LOSS_TOL
    row = {"loss_ref": ref_loss, "loss_diff": abs(float(loss.detach()) - ref_loss), "loss_tol": loss_tol,
           "grad_diff": groups,
           "grad_max": worst, "worst_param": worst_name, "f32_params": len(f32), "f32_rel": f32_worst,
           "mixer_modes": modes}
    row["ok"] = row_ok(row)
    return row


def compare(case: ModelCase, mesh: DeviceMesh, p: int) -> dict[str, Any]:
    """One case on this rank: ``{label, P, loss_ref, loss_diff, grad_diff: {group: max}, worst_param}``."""
    model = make_model(case)
    vocab = decoder_config(model.config)[0].vocab_size
    batch = case_batch(case, vocab)
    # the model's own float32 sums show when its tokens are regrouped: packed rows do most, and the
    # case's own shape shows what its kernels' rounding of that shape moves
    packed = batch if case.batch == "packed" else case_batch(replace(case, batch="packed"), vocab)
    floor = model_floor(model, [packed] if packed is batch else [packed, batch])
    head = {"label": case.label(), "case": asdict(case), "P": p}
    try:  # a model seqpar refuses is an outcome to report; any other error (a ValueError too) propagates
        parallelize(model, mesh, strategy=case.strategy)
        unparallelize(model)
    except Refused as e:
        return {**head, "refused": str(e)}
    sp_model = copy.deepcopy(model)
    if case.checkpointing is not None:
        sp_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": case.checkpointing == "reentrant"})
        sp_model.train()
    reference = reference_grads(model, batch, loss_scale=sp_loss_scale(mesh))
    row = compare_models(sp_model, batch, mesh, strategy=case.strategy, reference=reference, floor=floor,
                         layout=case.layout, mixer_mode=case.mixer_mode)
    return {**head, **row}


def sp_meshes(world: int, sizes: tuple[int, ...], strategy: str = "ulysses") -> dict[int, DeviceMesh | None]:
    """For each SP size: a ``dp x sp`` mesh when it divides the world (the dp replicas run the
    same batch; ``dp x ring x ulysses`` for the hybrid strategy, split by
    :func:`seqpar.planner.hybrid_split`), else a 1-D ``sp`` mesh over the first ``P`` ranks (None on
    the others, which sit that size out). Every rank must call this together."""
    out: dict[int, DeviceMesh | None] = {}
    for p in sizes:
        if world % p == 0:
            split = dict(zip(("ulysses", "ring"), hybrid_split(p), strict=True)) if strategy == "hybrid" else {}
            out[p] = init_mesh(sp=p, device_type="cpu", **split)
        elif strategy == "hybrid":
            raise ValueError(f"the hybrid strategy needs a mesh: sp={p} must divide the world size {world}")
        else:
            mesh = DeviceMesh("cpu", torch.arange(p), mesh_dim_names=("sp",))
            out[p] = mesh if dist.get_rank() < p else None
    return out


def run_model_parity(rank: int, world: int, cases: list[ModelCase], sizes: tuple[int, ...] | None = None
                     ) -> list[dict[str, Any]]:
    """Run every case at every SP size (default: the world); returns this rank's rows. Cases are
    grouped by strategy, each on meshes of its kind (see :func:`sp_meshes`)."""
    torch.set_num_threads(1)
    rows = []
    for strategy in dict.fromkeys(c.strategy for c in cases):
        for p, mesh in sp_meshes(world, sizes or (world,), strategy).items():
            if mesh is None:
                continue
            for case in cases:
                if case.strategy == strategy:
                    rows.append(compare(case, mesh, p))
    return rows


def parity_attention(model: str) -> str | None:
    """The attention implementation parity runs use: the model's own, except that models with
    an attention softcap (transformers' sdpa refuses it, its eager is float32-exact only) run on
    :func:`eager_float64_attention` -- on both sides, so the comparison stays like for like."""
    if model in BUILTIN_MODELS:
        config = builtin_config(model)
    else:
        from transformers import AutoConfig

        config = decoder_config(AutoConfig.from_pretrained(model))[0]
    return EAGER_FLOAT64 if getattr(config, "attn_logit_softcapping", None) else None


def model_cases(model: str, strategy: str = "ulysses") -> list[ModelCase]:
    """The cases ``seqpar verify --model`` runs: padded, packed and plain rows at odd and even
    lengths; GQA with fewer KV heads than ranks and head counts no P divides come with the
    built-in configs (4 query / 2 KV heads) and an override (6 / 2) for built-in models."""
    attn = parity_attention(model)
    cases = [ModelCase(model=model, batch=b, seq=s, strategy=strategy, attn=attn)
             for b, s in (("padded", 16), ("packed", 17), ("plain", 13))]
    if model in BUILTIN_MODELS:
        cases.append(ModelCase(model=model, batch="padded", seq=15, heads=6, kv_heads=2, strategy=strategy,
                               attn=attn))
    return cases


def row_ok(row: dict[str, Any]) -> bool:
    if "refused" in row:
        return False
    return row["loss_diff"] <= row["loss_tol"] and row["grad_max"] <= GRAD_TOL and row["f32_rel"] <= F32_RTOL
