"""``seqpar train --objective flow-matching``: what a job on a diffusers DiT needs beyond the shared
house -- its preparation (the model's config against the latents: :func:`prepare_dit`, which
:func:`seqpar.train.job.prepare_job` makes a Job of) and its rank model (:func:`build_dit_model`, which
:func:`seqpar.train.model_setup.build_rank_model` wraps); its samples at the end are
:mod:`.dit_samples`. The steps, checkpoints, evaluation, resume and export are the house's
(:mod:`.loop`, :mod:`.objective_step`), with the DiT's loss from
:class:`seqpar.objectives.FlowMatching`::

    prepare   --model: a built-in DiT (tiny-wan) or a diffusers save_pretrained directory of a class the
              job can call (seqpar.integrations.diffusers.catalog); the latents' channels, frames and
              size against its patch, the text width against its text_dim; --seq-len becomes the tokens
              per sample; the strategy (auto: ulysses)
    rank      the model built whole on every rank (seeded: the same weights at any sp), LoRA by diffusers'
              add_adapter, seqpar.parallelize(output="sharded"), reduce_memory without the tiled loss
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import seqpar
from seqpar.integrations.diffusers.catalog import ConfigWriter, build_dit, dit_config
from seqpar.planner import hybrid_split

from .checks import check_config
from .config import DTYPES, FIELDS, TrainConfig, memory_options, model_overrides
from .layout import mesh_kwargs
from .lora import add_dit_lora, count_params, init_lora
from .objectives import DATA_KINDS, objective_of
from .sources import DataSource


def _patch(value: Any) -> tuple[int, int, int]:
    p = tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),) * 3
    return (1, *p) if len(p) == 2 else p  # type: ignore[return-value]


def latent_tokens(config: dict[str, Any], latents: tuple[int, ...], text: tuple[int, ...], model: str) -> int:
    """The tokens one sample of ``latents [C, F, H, W]`` makes through the DiT's patch, after checking
    the data fits ``config`` (channels, patch, text width). ValueError naming the mismatch."""
    c, *grid = latents
    if c != int(config["in_channels"]):
        raise ValueError(f"the latents have {c} channels but --model {model} takes in_channels="
                         f"{config['in_channels']}: give latents of its VAE, or another model")
    patch = _patch(config["patch_size"])
    bad = [f"{n} {v} (patch {p})" for n, v, p in zip(("frames", "height", "width"), grid, patch, strict=True) if v % p]
    if bad:
        raise ValueError(f"the latents' {', '.join(bad)} do not divide by --model {model}'s patch_size {list(patch)}")
    if text[-1] != int(config["text_dim"]):
        raise ValueError(f"the text embeddings are {text[-1]} wide but --model {model} takes text_dim="
                         f"{config['text_dim']}")
    return (grid[0] // patch[0]) * (grid[1] // patch[1]) * (grid[2] // patch[2])


@dataclass(frozen=True)
class DitPlan:
    """What :func:`prepare_dit` decided: the options (``seq_len``: the tokens of a sample), the layout
    and the data, read."""

    cfg: TrainConfig
    world: int
    sp: int
    dp: int
    strategy: str
    reason: str
    mesh_kwargs: dict[str, int]
    heads: int
    data: DataSource


def prepare_dit(cfg: TrainConfig, world: int | None = None) -> DitPlan:
    """A flow-matching run's options checked, its model's config against its data, its layout (see the
    module doc). ValueError naming the option, the file or the mismatch."""
    world, sp, dp = check_config(cfg, world)
    _, config = dit_config(cfg.model, **model_overrides(cfg))
    kind = DATA_KINDS[objective_of(cfg.objective).data]
    data = kind.load(cfg, None) if cfg.data else kind.demo(cfg)
    latents, text = data.shapes()  # type: ignore[attr-defined]  # a latents source
    tokens = latent_tokens(config, latents, text, cfg.model)
    if cfg.seq_len not in (FIELDS["seq_len"].default, tokens):
        raise ValueError(f"--seq-len {cfg.seq_len}: the latents set the sequence ({tokens} tokens per sample): "
                         "leave it out")
    if tokens < sp:
        raise ValueError(f"a sample of {tokens} tokens cannot be split over --sp {sp}: use --sp <= {tokens}")
    heads = int(config["num_attention_heads"])
    strategy, reason, split = cfg.strategy, "", {}
    if strategy == "auto":
        strategy, reason = "ulysses", "a DiT attends without a mask over whole samples: ulysses splits its heads"
    elif strategy == "hybrid":
        u, r = hybrid_split(sp, heads)
        split = {"ulysses": u, "ring": r}
    if cfg.lora_r:  # --lora-targets must name modules of the model (peft says which it did not find)
        with torch.device("meta"):
            add_dit_lora(build_dit(cfg.model, **model_overrides(cfg)), cfg)
    return DitPlan(cfg.replace(seq_len=tokens), world, sp, dp, strategy, reason,
                   mesh_kwargs(dp=dp, sp=sp, tp=1, ep=1, **split), heads, data)


def build_dit_model(cfg: TrainConfig, strategy: str, mesh: Any, device: torch.device
                    ) -> tuple[nn.Module, int, int, str]:
    """This rank's DiT (see the module doc): whole on every rank, parallelized with a sharded output.
    Returns ``(model, parameters, trainable ones, compute dtype's name)``."""
    dtype_name = cfg.dtype if cfg.dtype != "auto" else "float32"  # no FSDP2, so no bfloat16 mixed precision
    torch.manual_seed(cfg.seed)  # a built-in's weights: the same on every rank, at any sp
    model = build_dit(cfg.model, dtype=DTYPES[dtype_name], **model_overrides(cfg)).to(device)
    if cfg.lora_r:
        add_dit_lora(model, cfg)
        init_lora(model, cfg.seed)
    params, trainable = count_params(model)
    seqpar.parallelize(model, mesh, strategy=strategy, output="sharded")
    memory = memory_options(cfg, device.type)
    if memory is not None:
        seqpar.reduce_memory(model, mesh, **memory)
    return model, params, trainable, dtype_name


def config_writer(model: nn.Module) -> ConfigWriter:
    """What a checkpoint writes as the DiT's config.json."""
    return ConfigWriter(model)
