"""``seqpar train --objective flow-matching``: what a job on a diffusers DiT needs beyond the shared
house -- its preparation (the model's config against the latents), its rank model and, at the end,
its samples. The steps, checkpoints, evaluation, resume and export are the house's
(:mod:`.loop`, :mod:`.objective_step`), with the DiT's loss from
:class:`seqpar.objectives.FlowMatching`::

    prepare   --model: a built-in DiT (tiny-wan) or a diffusers save_pretrained directory of a class the
              job can call (seqpar.integrations.diffusers.catalog); the latents' channels, frames and
              size against its patch, the text width against its text_dim; --seq-len becomes the tokens
              per sample; the strategy (auto: ulysses)
    rank      the model built whole on every rank (seeded: the same weights at any sp), LoRA by diffusers'
              add_adapter, seqpar.parallelize(output="sharded"), reduce_memory without the tiled loss
    samples   --plot: Euler samples of the first held-out clips' text, beside the clips, in samples.png
"""

from __future__ import annotations

import os
from typing import Any

import torch

import seqpar
from seqpar.integrations.diffusers.catalog import ConfigWriter, build_dit, dit_config
from seqpar.objectives.flow_matching import LATENTS, TEXT, sample_latents
from seqpar.planner import hybrid_split

from .checks import check_config
from .config import DTYPES, FIELDS, TrainConfig, memory_options, model_overrides
from .context import RunContext
from .job import Job, check_save_dir, make_data
from .layout import mesh_kwargs
from .lora import add_dit_lora, count_params, init_lora
from .model_setup import RankModel
from .sources import EVAL, TRAIN, DataSource, stack
from .video_demo import save_frame_grid

SAMPLES_FILE = "samples.png"
SAMPLE_CLIPS, SAMPLE_STEPS = 4, 30


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


def prepare_dit_job(cfg: TrainConfig, world: int | None = None) -> Job:
    """The :class:`~.job.Job` of a flow-matching run (see the module doc). ValueError naming the
    option, the file or the mismatch."""
    world, sp, dp = check_config(cfg, world)
    _, config = dit_config(cfg.model, **model_overrides(cfg))
    data = make_data(cfg, None)
    latents, text = data.shapes()  # type: ignore[attr-defined]  # a latents source
    tokens = latent_tokens(config, latents, text, cfg.model)
    if cfg.seq_len not in (FIELDS["seq_len"].default, tokens):
        raise ValueError(f"--seq-len {cfg.seq_len}: the latents set the sequence ({tokens} tokens per sample): "
                         "leave it out")
    if tokens < sp:
        raise ValueError(f"a sample of {tokens} tokens cannot be split over --sp {sp}: use --sp <= {tokens}")
    cfg = cfg.replace(seq_len=tokens)
    heads = int(config["num_attention_heads"])
    strategy, reason, split = cfg.strategy, "", {}
    if strategy == "auto":
        strategy, reason = "ulysses", "a DiT attends without a mask over whole samples: ulysses splits its heads"
    elif strategy == "hybrid":
        u, r = hybrid_split(sp, heads)
        split = {"ulysses": u, "ring": r}
    job = Job(cfg, world, sp, dp, strategy, mesh_kwargs(dp=dp, sp=sp, tp=1, ep=1, **split), "contiguous", heads,
              heads, reason, data=data, tokenizer=None)
    if cfg.lora_r:  # --lora-targets must name modules of the model (peft says which it did not find)
        with torch.device("meta"):
            add_dit_lora(build_dit(cfg.model, **model_overrides(cfg)), cfg)
    return check_save_dir(job)


def build_dit_rank_model(job: Job, mesh: Any, device: torch.device) -> RankModel:
    """This rank's DiT (see the module doc): whole on every rank, parallelized with a sharded output."""
    cfg = job.cfg
    dtype_name = cfg.dtype if cfg.dtype != "auto" else "float32"  # no FSDP2, so no bfloat16 mixed precision
    torch.manual_seed(cfg.seed)  # a built-in's weights: the same on every rank, at any sp
    model = build_dit(cfg.model, dtype=DTYPES[dtype_name], **model_overrides(cfg)).to(device)
    if cfg.lora_r:
        add_dit_lora(model, cfg)
        init_lora(model, cfg.seed)
    params, trainable = count_params(model)
    seqpar.parallelize(model, mesh, strategy=job.strategy, output="sharded")
    memory = memory_options(cfg, device.type)
    if memory is not None:
        seqpar.reduce_memory(model, mesh, **memory)
    return RankModel(model, None, params, trainable, dtype_name, False, seqpar.attention_kernel(model))


def config_writer(model: torch.nn.Module) -> ConfigWriter:
    """What a checkpoint writes as the DiT's config.json."""
    return ConfigWriter(model)


def save_samples(ctx: RunContext, data: DataSource) -> str:
    """The end of a flow-matching run (every rank): the model made a drop-in (``output="whole"``, every
    sp rank steps alike), ``SAMPLE_CLIPS`` clips sampled from the first held-out units' text (noise
    from --seed) in ``SAMPLE_STEPS`` Euler steps, and rank 0 writes them under the held-out clips in
    ``samples.png``. Returns its path (on every rank). The model is left parallelized for whole
    outputs: nothing trains after this."""
    cfg, model = ctx.job.cfg, ctx.model
    split, n = (EVAL, data.n_eval) if data.n_eval else (TRAIN, SAMPLE_CLIPS)
    units = [data.row(i, split) for i in range(min(n, SAMPLE_CLIPS))]
    batch = stack(units)
    seqpar.unparallelize(model)
    seqpar.parallelize(model, ctx.mesh, strategy=ctx.job.strategy, output="whole")
    noise = torch.randn(batch[LATENTS].shape, generator=torch.Generator().manual_seed(cfg.seed), dtype=torch.float32)
    model.eval()
    clips = sample_latents(model, batch[TEXT], noise, steps=SAMPLE_STEPS).float().cpu()
    model.train()
    path = os.path.abspath(os.path.join(cfg.save_dir, SAMPLES_FILE))
    if ctx.rank == 0:
        which = "held-out" if split == EVAL else "training"
        rows = []
        for i, clip in enumerate(clips):
            rows += [(f"{which} {i}", batch[LATENTS][i]), (f"sampled {i}", clip)]
        save_frame_grid(path, rows)
    return path
