"""The job's N-D layout: the mesh ``seqpar train`` builds from --sp, --tp, --ep and dp, what the model
must allow for it (checked on the meta-device model, before any worker starts), and ``--plan auto``
(the planner's layout, :func:`seqpar.planner.nd.plan_nd` -- what ``seqpar plan --gpus`` prints --
taken as the options)::

    --tp 1 --ep 1      seqpar.init_mesh(sp=, dp=)                     the 2-D dp x sp mesh, as before
    --tp T / --ep E    seqpar.init_mesh(dp_shard=dp, sp=, tp=T, ep=E)  the N-D mesh: tp innermost,
                       dp = world / (sp x tp), ep folded over dp x sp (seqpar.comm.mesh)

A tp group reads the same rows (its ranks share a dp rank); the loss and metrics count each batch
once per dp group, not once per tp or sp rank.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from seqpar.planner import format_bytes, parse_size
from seqpar.planner.memory import MemorySwitches
from seqpar.planner.nd import ModelShape, NdPlan, moe_fields, plan_nd

from .config import DTYPES, FIELDS, TrainConfig, resolve_dtype

PLANNED = ("sp", "tp", "ep", "dp", "strategy", "fsdp", "tiled_loss", "tiled_mlp", "checkpoint")
"""The options ``--plan auto`` sets: given away from their defaults too, they are refused by name."""


def mesh_kwargs(*, dp: int, sp: int, tp: int, ep: int, ulysses: int | None = None,
                ring: int | None = None) -> dict[str, int]:
    """:func:`seqpar.init_mesh`'s keywords: the 2-D ``dp x sp`` mesh at tp = ep = 1 (as before), else
    the N-D mesh with dp as dp_shard; ``ulysses`` / ``ring``: a hybrid split of sp."""
    kw = {"sp": sp, "dp": dp} if tp == 1 and ep == 1 else {"dp_shard": dp, "sp": sp, "tp": tp}
    if ep > 1:
        kw["ep"] = ep
    if ulysses is not None and ring is not None:
        kw.update(ulysses=ulysses, ring=ring)
    return kw


def experts_in(config: Any) -> int:
    """The expert count of a transformers (decoder) config, 0 for a dense model."""
    return moe_fields(config.to_dict() if hasattr(config, "to_dict") else dict(config))["experts"]


def check_model_layout(cfg: TrainConfig, model: nn.Module, *, tp: int, ep: int) -> None:
    """What --tp and --ep need from ``model`` (built on the meta device; pure, the same on every
    rank): its own tensor-parallel plan splitting whole heads and columns (tp), experts its plan
    declares as stacked tensors, no more ep ranks than experts, and a split of the experts that
    torch.distributed.checkpoint can save as one tensor (ep). Raises ValueError (or
    :class:`seqpar.Refused`) naming the option."""
    from seqpar.integrations.hf.parallelize import check_tp_model
    from seqpar.integrations.models import decoder_config

    if tp > 1:
        try:
            check_tp_model(model, decoder_config(model.config)[1], tp)
        except ValueError as e:
            raise type(e)(f"--tp {tp}: {e}") from None
    if ep > 1:
        from seqpar.integrations.moe.families import experts_of

        from .expert_state import checkpoint_split_problem

        try:
            found = experts_of(model)
        except ValueError as e:
            raise type(e)(f"--ep {ep}: {e}") from None
        for counts in sorted({e.num_experts for e in found}):
            if ep > counts:
                raise ValueError(f"--ep {ep} exceeds the {counts} experts of {type(model).__name__}'s MoE layers: "
                                 f"some ranks would own no expert; choose --ep <= {counts}")
            problem = checkpoint_split_problem(counts, ep)
            if problem:
                raise ValueError(f"--ep {ep}: {problem}")


def check_tiled_mlp(cfg: TrainConfig, config: Any) -> None:
    """--tiled-mlp tiles per-token MLPs; an MoE block's router sees every token of the shard, so a
    model with experts needs --no-tiled-mlp (ValueError)."""
    if cfg.tiled_mlp and experts_in(config):
        raise ValueError(f"--tiled-mlp tiles per-token MLPs, not the MoE blocks of --model {cfg.model} (their "
                         "routers see every token of the shard): use --no-tiled-mlp")


def check_plan_options(cfg: TrainConfig, world: int | None) -> None:
    """--plan and --gpu-memory against the other options (pure); ValueError naming them."""
    if cfg.plan not in ("none", "auto"):
        raise ValueError(f"unknown --plan {cfg.plan!r}: choose auto or none")
    if cfg.plan == "none":
        if cfg.gpu_memory is not None:
            raise ValueError("--gpu-memory is the memory --plan auto plans against: give --plan auto too")
        return
    given = [f"--{n.replace('_', '-')}" for n in PLANNED if getattr(cfg, n) != FIELDS[n].default]
    if given:
        raise ValueError(f"--plan auto chooses {', '.join(given)} itself (and the other layout options: "
                         f"{', '.join('--' + n.replace('_', '-') for n in PLANNED)}): leave them out, or use "
                         "--plan none")
    if world is None and cfg.nproc is None:
        raise ValueError("--plan auto plans for the ranks the job has: give --nproc N (or run it under torchrun)")
    if cfg.gpu_memory is not None:
        parse_size(cfg.gpu_memory)  # ValueError: not a size
    if cfg.sp_schedule == "dynamic":
        raise ValueError("--plan auto plans a static layout (the tp and ep it may choose do not run in a dynamic "
                         "schedule's bins): use --sp-schedule static")


def model_shape(config: Any) -> ModelShape:
    """The planner's shape of a transformers config, read as ``seqpar plan --model config.json [--moe]
    [--tied]`` reads it (intermediate 4 x hidden where absent, head_dim hidden / heads)."""
    from seqpar.integrations.models import decoder_config

    d = decoder_config(config.to_dict())[0]
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    moe = moe_fields(d) if moe_fields(d)["experts"] and moe_fields(d)["top_k"] else {}
    return ModelShape(hidden_size=hidden, intermediate_size=int(d.get("intermediate_size") or 4 * hidden),
                      layers=int(d["num_hidden_layers"]), heads=heads,
                      kv_heads=int(d.get("num_key_value_heads") or heads),
                      head_dim=int(d.get("head_dim") or hidden // heads), vocab_size=int(d["vocab_size"]),
                      tied=bool(getattr(config, "tie_word_embeddings", False)), **moe)


def device_memory(cfg: TrainConfig, device_type: str, local_ranks: int) -> int:
    """Bytes one rank's device has for --plan auto: --gpu-memory, else the CUDA device's total memory,
    else the host's memory shared by its ``local_ranks``."""
    if cfg.gpu_memory is not None:
        return parse_size(cfg.gpu_memory)
    if device_type == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local_ranks, 1)


def auto_layout(cfg: TrainConfig, world: int, config: Any, *, device_type: str, local_ranks: int
                ) -> tuple[TrainConfig, dict[str, int], str, NdPlan]:
    """``--plan auto``: ``(the options with the plan's layout, init_mesh's keywords, what it chose and
    why in words, the plan)`` for ``world`` ranks, ``local_ranks`` per host and the model ``config``
    the job builds. FSDP2 over dp_shard x sp as the plan's memory assumes, except with ep > 1 (FSDP2
    does not take expert shards: said in the words). Raises ValueError when no layout fits."""
    shape = model_shape(config)
    memory = device_memory(cfg, device_type, local_ranks)
    dtype_bytes = DTYPES[resolve_dtype(cfg, device_type)].itemsize
    p = plan_nd(shape, gpus=world, gpus_per_node=local_ranks, gpu_memory=memory, seq_len=cfg.seq_len,
                dtype_bytes=dtype_bytes)
    c = p.chosen
    sw: MemorySwitches = c.switches
    planned = cfg.replace(sp=c.sp, tp=c.tp, ep=c.ep, dp=c.dp_replicate * c.dp_shard, strategy=c.strategy,
                          tiled_loss=sw.tiled_loss, tiled_mlp=sw.tiled_mlp, checkpoint=sw.checkpoint,
                          fsdp="off" if c.ep > 1 else "on")
    if c.dp_replicate > 1 or c.tp > 1 or c.ep > 1:
        kwargs = c.mesh_kwargs()
    else:
        kwargs = mesh_kwargs(dp=c.dp_shard, sp=c.sp, tp=1, ep=1, **({"ulysses": c.ulysses, "ring": c.ring}
                                                                    if c.strategy == "hybrid" else {}))
    fsdp = ("FSDP2 off (it does not take expert shards; the plan's memory assumed it)" if c.ep > 1 else
            "FSDP2 over dp_shard x sp" + (f", HSDP over {c.dp_replicate} replicas" if c.dp_replicate > 1 else ""))
    words = (f"--plan auto: {c.label} ({c.strategy}), memory switches {sw.label}, {fsdp}; for {world} ranks "
             f"({local_ranks} per host) of {format_bytes(memory)}, {cfg.seq_len} tokens, "
             f"{dtype_bytes}-byte activations: {p.reason}")
    return planned, kwargs, words, p
