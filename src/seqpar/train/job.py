"""Everything about a ``seqpar train`` job that can be decided before any worker starts.

:func:`prepare_job` is run by the parent (or every torchrun rank) first: it checks the options,
the model (name, or a checkpoint: weights present, a config transformers builds a causal LM
from), the tokenizer, the data (read and tokenized: its token ids against the model's embedding
size), the save dir (an earlier run's checkpoints are not silently deleted) and the sequence
length against the SP split, and resolves the strategy into mesh sizes and a layout -- all
without a process group, so a bad option is one clear error instead of a traceback from every rank.
The job is prepared once -- by the parent of local workers, or by each torchrun rank -- and handed to
the run whole: its data already read and tokenized, its tokenizer loaded.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from seqpar.attention.layout import min_seq_len
from seqpar.integrations.models import BUILTIN_MODELS, build_model, builtin_config, decoder_config
from seqpar.planner import hybrid_split, plan

from .checks import check_config
from .config import FIELDS, RESUME_AUTO, TrainConfig, builtin_fields, model_overrides
from .dit_setup import prepare_dit
from .layout import auto_layout, check_model_layout, check_plan_options, check_tiled_mlp, mesh_kwargs
from .objectives import DATA_KINDS, objective_of
from .report import HF_DIR
from .safe_load import check_plain
from .sources import DataSource
from .tokenizer import load_hf_tokenizer

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")

# what must match for --resume to continue the same loss curve (--steps may grow: the schedule
# then follows the new total; --sp, --tp, --ep and the strategy may change: checkpoints reshard; dp, --micro-batch
# and --grad-accum may change as long as a step reads the same rows: see check_resumable; --mlp-tile
# may change: the MLP is per token, its tiles change no value -- and by default they follow the shard,
# so they change with --sp anyway)
RESUME_KEYS = ("model", "model_config", "data", "text_field", "seq_len", "packing", "seed", "lr", "warmup",
               "min_lr_ratio", "weight_decay", "adam_eps", "dtype", "tiled_loss", "tiled_mlp", "loss_tile", "tokenizer",
               "train_on", "chat_template", "overflow", "lora_r", "lora_alpha", "lora_targets", "token_budget",
               "objective", "beta", "dpo_loss", "rl_loss", "kl_coef", "clip_epsilon", "clip_epsilon_high",
               "max_completion_length", "advantages", "scale_rewards", "kto_loss", "flow_weighting", "logit_mean",
               "logit_std")


@dataclass(frozen=True)
class Job:
    cfg: TrainConfig
    world: int
    sp: int
    dp: int
    strategy: str  # "ulysses", "ring" or "hybrid" ("auto" resolved)
    mesh_kwargs: dict[str, int]  # for seqpar.init_mesh
    layout: str  # for seqpar.shard_batch
    heads: int
    kv_heads: int
    reason: str = ""  # why "auto" chose what it chose
    resume_from: str | None = None  # --resume: the checkpoint the run continues from (checked)
    resume_step: int = 0  # its step
    resume_notes: tuple[str, ...] = ()  # what the resume changed or skipped, in words (printed at the start)
    replaces: tuple[int, ...] = ()  # --overwrite: the steps of the earlier run's checkpoints it deletes
    data: DataSource | None = field(default=None, compare=False, repr=False)  # read and tokenized, once
    tokenizer: Any = field(default=None, compare=False, repr=False)  # the run's transformers tokenizer (None: bytes)
    tp: int = 1  # tensor-parallel ranks (innermost): a batch is held by sp x tp ranks
    ep: int = 1  # expert-parallel ranks, folded over dp x sp
    plan_reason: str = ""  # --plan auto: what it chose and why, in words (printed at the start)

    @property
    def batch_ranks(self) -> int:
        """The ranks that hold one batch (its sp x tp ranks): each counts it once among them."""
        return self.sp * self.tp


def make_data(cfg: TrainConfig, hf_tokenizer: Any | None) -> DataSource:
    """The run's data: its objective's kind of data (:data:`seqpar.train.objectives.DATA_KINDS`), the
    embedded demo without --data, else --data read, tokenized and cut into units."""
    kind = DATA_KINDS[objective_of(cfg.objective).data]
    return kind.load(cfg, hf_tokenizer) if cfg.data else kind.demo(cfg)


def _model_config(cfg: TrainConfig) -> Any:
    """The transformers config the job will build (no weights are loaded)."""
    if cfg.model in BUILTIN_MODELS:
        return builtin_config(cfg.model, **model_overrides(cfg))
    if not os.path.isdir(cfg.model):
        raise ValueError(f"--model {cfg.model!r} is neither a built-in name ({', '.join(BUILTIN_MODELS)}) nor an "
                         "existing checkpoint directory")
    if cfg.model_config:
        raise ValueError("--model-config applies to built-in models only; a checkpoint brings its own config")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model)
    except Exception as e:  # transformers raises OSError / ValueError / KeyError depending on what is wrong
        raise ValueError(f"--model {cfg.model!r} is not a loadable transformers checkpoint: "
                         f"{str(e).splitlines()[0]}") from None


def _check_checkpoint(cfg: TrainConfig, config: Any) -> Any:
    """A ``--model`` directory must hold weights and a config transformers builds a causal LM from.
    Returns that model, built on the meta device (no weights read)."""
    if not any(os.path.isfile(os.path.join(cfg.model, f)) for f in WEIGHT_FILES):
        raise ValueError(f"--model {cfg.model!r} holds no weights ({' or '.join(WEIGHT_FILES[::2])}): give a "
                         "checkpoint written by save_pretrained, or a built-in name to start from random weights")
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # transformers raises ValueError / KeyError / ImportError by what is wrong
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--model {cfg.model!r}: transformers cannot build a causal LM from its config.json "
                         f"({type(config).__name__}): {why}") from None
    return model


def _check_vocab(cfg: TrainConfig, data: DataSource, embeddings: int) -> None:
    """The token ids the data uses (padding included) must all have an embedding: compared with the
    ids used, not with the tokenizer's length (which counts added tokens the data may never use)."""
    need = data.max_token_id + 1
    if need > embeddings:
        raise ValueError(f"the data uses token ids up to {data.max_token_id} ({need} embeddings needed) but --model "
                         f"{cfg.model!r} embeds {embeddings}: give the checkpoint its own tokenizer (or --tokenizer "
                         "DIR with its vocabulary), or use a built-in model")


def _check_builtin_fields(cfg: TrainConfig, data: DataSource) -> None:
    """``--model-config`` may set any field of a built-in; the two the data and the length need
    must still fit them (the defaults are the data's vocabulary and ``--seq-len``)."""
    fields = model_overrides(cfg)
    need = data.max_token_id + 1
    if "vocab_size" in fields and int(fields["vocab_size"]) < need:
        raise ValueError(f"--model-config vocab_size {fields['vocab_size']} is smaller than the {need} token ids the "
                         f"data uses: use vocab_size >= {need} or leave it out")
    pos = fields.get("max_position_embeddings")
    if pos is not None and int(pos) < cfg.seq_len:
        raise ValueError(f"--model-config max_position_embeddings {pos} is below --seq-len {cfg.seq_len}: raise it or "
                         "leave it out")


def prepare_job(cfg: TrainConfig, world: int | None = None) -> Job:
    """Validate ``cfg`` for a job of ``world`` ranks (default: from --nproc / --sp / --tp / --dp),
    resolve the strategy (and with --plan auto the whole layout, :mod:`.layout`), read the data and
    load the tokenizer. Raises ValueError with the option to change. A DiT's job (data the model splits
    itself: --objective flow-matching) is prepared by :func:`seqpar.train.dit_setup.prepare_dit`."""
    if DATA_KINDS[objective_of(cfg.objective).data].model_splits:
        d = prepare_dit(cfg, world)
        return check_save_dir(Job(d.cfg, d.world, d.sp, d.dp, d.strategy, d.mesh_kwargs, "contiguous", d.heads,
                                  d.heads, d.reason, data=d.data))
    check_plan_options(cfg, world)
    if cfg.plan == "auto":  # everything but the layout now; the layout once the model's shape is known
        world = world if world is not None else cfg.nproc
        check_config(cfg.replace(sp=1, tp=1, ep=1, dp=None), world)
    else:
        world, sp, dp = check_config(cfg, world)
    config_full = _model_config(cfg)
    config = decoder_config(config_full)[0]
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    max_pos = getattr(config, "max_position_embeddings", None)
    if cfg.model not in BUILTIN_MODELS and max_pos is not None and cfg.seq_len > max_pos:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds the model's max_position_embeddings {max_pos}: "
                         f"use --seq-len <= {max_pos}")
    if cfg.plan == "none":
        strategy, reason, mesh_kwargs, layout = _layout(cfg, sp, dp, config)
    meta = _check_checkpoint(cfg, config_full) if cfg.model not in BUILTIN_MODELS else None
    tokenizer = load_hf_tokenizer(cfg.model, cfg.tokenizer, cfg.chat_template)
    data = make_data(cfg, tokenizer)
    if meta is not None:
        _check_vocab(cfg, data, int(meta.get_input_embeddings().num_embeddings))
    plan_reason = ""
    if cfg.plan == "auto":
        built = builtin_config(cfg.model, **builtin_fields(cfg, data.vocab_size)) if meta is None else config_full
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        device_type = "cuda" if torch.cuda.is_available() and "LOCAL_RANK" in os.environ else "cpu"
        cfg, planned, plan_reason, _ = auto_layout(cfg, world, built, device_type=device_type, local_ranks=local)
        world, sp, dp = check_config(cfg, world)
        strategy, reason, mesh_kwargs, layout = _layout(cfg, sp, dp, config, planned)
    check_tiled_mlp(cfg, config)
    if cfg.lora_r or cfg.tp > 1 or cfg.ep > 1:  # the model on the meta device, for the checks that need it
        if meta is None:
            with torch.device("meta"):
                meta, _ = build_model(cfg.model, **builtin_fields(cfg, data.vocab_size))
        check_model_layout(cfg, meta, tp=cfg.tp, ep=cfg.ep)
    if cfg.lora_r:  # --lora-targets must name modules of the model (peft says which it did not find)
        from .lora import add_lora

        add_lora(meta, cfg)
    if cfg.model in BUILTIN_MODELS:
        _check_builtin_fields(cfg, data)
    job = Job(cfg, world, sp, dp, strategy, mesh_kwargs, layout, heads, kv_heads, reason, data=data,
              tokenizer=tokenizer, tp=cfg.tp, ep=cfg.ep, plan_reason=plan_reason)
    return check_save_dir(job)


def _layout(cfg: TrainConfig, sp: int, dp: int, config: Any, planned: dict[str, int] | None = None
            ) -> tuple[str, str, dict[str, int], str]:
    """``(strategy, why auto chose it, init_mesh's keywords, shard_batch's layout)`` of the options
    (``planned``: --plan auto's mesh keywords, its strategy in ``cfg``); ValueError naming the option."""
    heads = int(config.num_attention_heads) // cfg.tp  # a tp rank's heads: what sp splits
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // cfg.tp
    strategy, reason, split = cfg.strategy, "", {}
    if strategy == "auto":
        hidden = int(config.hidden_size)
        head_dim = int(getattr(config, "head_dim", None) or hidden // int(config.num_attention_heads))
        p = plan(heads=heads, kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden, world_size=sp,
                 devices_per_node=sp, seq_len=cfg.seq_len, layers=int(config.num_hidden_layers),
                 batch=cfg.micro_batch)
        strategy, reason = p.strategy, p.reason
        if strategy == "hybrid":
            split = {"ulysses": p.ulysses, "ring": p.ring}
    elif strategy == "hybrid" and planned is None:
        try:
            u, r = hybrid_split(sp, heads)
        except ValueError:
            raise ValueError(f"--strategy hybrid cannot split --sp {sp} into ulysses x ring (each >= 2, ulysses <= "
                             f"{heads} heads{' per tp rank' if cfg.tp > 1 else ''}): use --strategy ulysses or "
                             "ring") from None
        split = {"ulysses": u, "ring": r}
    kwargs = planned if planned is not None else mesh_kwargs(dp=dp, sp=sp, tp=cfg.tp, ep=cfg.ep, **split)
    # ring work balanced per packed document and padding run (plain rows: the same as zigzag)
    layout = "contiguous" if strategy == "ulysses" or sp == 1 else "doc-zigzag"
    if cfg.dtype == "bfloat16" and cfg.fsdp == "off":
        raise ValueError("--dtype bfloat16 trains through FSDP2's mixed precision (bf16 compute, fp32 master "
                         "weights): use --fsdp auto or on")
    ulysses = kwargs.get("ulysses", sp if strategy == "ulysses" else 1)
    shortest = min_seq_len(sp, layout, ulysses)
    if cfg.seq_len < shortest:
        raise ValueError(f"--seq-len {cfg.seq_len} is too short for --sp {sp} with {strategy} ({layout} layout): "
                         f"use --seq-len >= {shortest} or a smaller --sp")
    return strategy, reason, kwargs, layout


def check_save_dir(job: Job) -> Job:
    """--resume: the checkpoint to continue from, checked; a fresh run: refused where an earlier
    run's checkpoints would be deleted, unless --overwrite (then they are listed in the job)."""
    from . import checkpoint as ckpt

    cfg = job.cfg
    found = ckpt.complete_checkpoints(cfg.save_dir)
    if cfg.resume and (found or cfg.resume != RESUME_AUTO):  # --resume auto without a checkpoint: afresh
        if not found:
            raise ValueError(f"--resume: no complete checkpoint in {ckpt.checkpoint_root(cfg.save_dir)!r}; "
                             "run without --resume to start fresh (or --resume auto: continue if there is one)")
        (step, path), notes = intact_checkpoint(found, cfg.resume_fallback)
        state = ckpt.read_trainer_state(path)
        notes += check_resumable(job, state, path)
        return dataclasses.replace(job, resume_from=path, resume_step=step, resume_notes=tuple(notes))
    if found and not cfg.overwrite:
        n, them = (f"{len(found)} checkpoints", "them") if len(found) > 1 else ("1 checkpoint", "it")
        raise ValueError(f"--save-dir {cfg.save_dir!r} holds {n} of an earlier run (the latest at step "
                         f"{found[-1][0]}): --resume continues it, --overwrite deletes {them} and starts afresh, or "
                         "choose another --save-dir")
    export = os.path.join(cfg.save_dir, HF_DIR)
    if os.path.isdir(export) and os.listdir(export) and not cfg.overwrite:
        raise ValueError(f"--save-dir {cfg.save_dir!r} holds an earlier run's export ({export}): move it, or "
                         "--overwrite deletes it and starts afresh, or choose another --save-dir")
    return dataclasses.replace(job, replaces=tuple(step for step, _ in found))


def intact_checkpoint(found: list[tuple[int, str]], fallback: bool) -> tuple[tuple[int, str], list[str]]:
    """The checkpoint to resume from: the latest of ``found`` (``(step, path)``, oldest first) if no
    file of it is damaged (:func:`seqpar.train.checkpoint.damaged`); with ``fallback`` the newest
    intact one (the notes say which were skipped and why). Raises ValueError naming the damaged files,
    or a file that holds a pickled object (:func:`seqpar.train.safe_load.check_plain`: that is no
    accident to fall back from)."""
    from . import checkpoint as ckpt

    notes: list[str] = []
    for step, path in reversed(found):
        check_plain(path)  # a pickled object in it: ValueError naming the file, never a fallback
        bad = ckpt.damaged(path)
        if not bad:
            return (step, path), notes
        what = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        if not fallback:
            older = [s for s, _ in found if s < step]
            hint = (f"--resume-fallback continues from the newest intact one before it (step {older[-1]} is the "
                    "next to try)" if older else "no older checkpoint is left to fall back to")
            raise ValueError(f"--resume: the checkpoint {path} is damaged ({what}): {hint}, or delete it")
        notes.append(f"skipped the damaged checkpoint {path} ({what})")
    raise ValueError(f"--resume: every checkpoint in {ckpt.checkpoint_root(os.path.dirname(os.path.dirname(path)))!r} "
                     f"is damaged ({'; '.join(notes)}); start afresh with --overwrite")


def check_resumable(job: Job, state: dict[str, Any], path: str) -> list[str]:
    """Raise ValueError unless the checkpoint at ``path`` was written by the same run's options,
    or by options that read the same rows per step (see below); returns what changed, in words.

    The rows of step s are rows ``[s * G, (s + 1) * G)`` of the run, G = dp x grad_accum x micro_batch
    (:func:`seqpar.train.sources.row_index`), and its loss is the token mean over all of them: so dp,
    --grad-accum and --micro-batch may change together as long as G stays (the same rows, the same
    mean, summed in another order: equal to rounding), and sp, tp, ep and the strategy may change
    freely (DCP reshards the model and the optimizer state: the checkpoint holds whole tensors'
    layouts, expert shards and tensor-parallel DTensors included)."""
    # an option the checkpoint's seqpar did not have yet ran at its default
    old = {k: FIELDS[k].default for k in RESUME_KEYS} | state.get("config", {})
    diff = [k for k in RESUME_KEYS if old.get(k) != getattr(job.cfg, k)]
    if diff:
        what = ", ".join(f"--{k.replace('_', '-')} {old.get(k)!r} -> {getattr(job.cfg, k)!r}" for k in diff)
        raise ValueError(f"--resume: {path} was written with other options ({what}); use the same ones to "
                         "continue the same run")
    config = state.get("config", {})
    old_dp = int(state.get("dp", job.dp))
    old_ga = int(config.get("grad_accum", FIELDS["grad_accum"].default))
    old_mb = int(config.get("micro_batch", FIELDS["micro_batch"].default))
    rows, new_rows = old_dp * old_ga * old_mb, job.dp * job.cfg.grad_accum * job.cfg.micro_batch
    if rows != new_rows:
        fit = rows // (job.dp * job.cfg.micro_batch) if rows % (job.dp * job.cfg.micro_batch) == 0 else None
        fix = f"use --grad-accum {fit}" if fit else f"use --dp {old_dp} --grad-accum {old_ga} --micro-batch {old_mb}"
        raise ValueError(f"--resume: {path} was written with dp={old_dp} x --grad-accum {old_ga} x --micro-batch "
                         f"{old_mb} = {rows} rows per step; this run reads dp={job.dp} x {job.cfg.grad_accum} x "
                         f"{job.cfg.micro_batch} = {new_rows}, so its steps would read other rows and average over "
                         f"another count: {fix} (the rows per step must stay {rows})")
    if int(state["step"]) > job.cfg.steps:
        raise ValueError(f"--resume: {path} is at step {state['step']}, past --steps {job.cfg.steps}")
    notes = []
    changed = [f"{name} {a} -> {b}" for name, a, b in (
        ("dp", old_dp, job.dp), ("--grad-accum", old_ga, job.cfg.grad_accum),
        ("--micro-batch", old_mb, job.cfg.micro_batch), ("sp", state.get("sp", job.sp), job.sp),
        ("tp", state.get("tp", 1), job.tp), ("ep", state.get("ep", 1), job.ep),
        ("strategy", state.get("strategy", job.strategy), job.strategy),
        ("--mlp-tile", *(t or "following the shard" for t in (config.get("mlp_tile", job.cfg.mlp_tile),
                                                                job.cfg.mlp_tile))))
        if a != b]
    if changed:
        notes.append(f"resuming with {', '.join(changed)}: DCP reshards the model and optimizer; step s still reads "
                     f"rows {rows}*s .. {rows}*s+{rows - 1} of the data (dp rank d, micro-batch m, row b: row "
                     f"{rows}*s + (m*dp + d)*{job.cfg.micro_batch} + b), the same loss up to summation order")
    return notes
