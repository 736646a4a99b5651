"""``seqpar train``: train a transformer on long sequences with sequence parallelism.

Without arguments: 2 local CPU workers (gloo) train a tiny Llama-style model at sp=2 on an embedded
long-range copy task (4096-token rows, every answer 2048 tokens back) and report the loss, the
held-out answer accuracy against chance, and peak memory per rank. On GPUs:
``torchrun --nproc-per-node 8 -m seqpar.cli.main train --model PATH --data FILE ... --dtype bfloat16``.
Options may also come from a YAML / TOML file (--config); the command line wins.

Diffusion: ``--objective flow-matching`` trains a diffusers video transformer with rectified flow on
precomputed latents (--data *.safetensors / *.npz / *.parquet); without --data a tiny Wan learns
moving squares at sp=2 and draws samples.png.

Fine-tuning: chat (assistant-only loss), prompt/completion, text, parquet / arrow / save_to_disk
data (--data), LoRA (--lora-r), evaluation every N steps (--eval-every), tensorboard / wandb
(--report-to), a transformers checkpoint at the end (--export-hf; later: seqpar export).
A --save-dir that already holds checkpoints is continued with --resume or replaced with
--overwrite; without either the run refuses to start.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from seqpar.train.config import (
    FIELDS,
    OPTIONAL_KINDS,
    RESUME_AUTO,
    TrainConfig,
    describe_memory,
    load_config_file,
)
from seqpar.train.dynamic import describe_degrees
from seqpar.train.job import Job
from seqpar.train.loop import RunSummary
from seqpar.train.objectives import OBJECTIVES


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model with sequence parallelism (no arguments: a CPU demo)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE",
                   help="YAML or TOML file with any of the options below (names as here, - or _)")
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        meta = f.metadata
        default = f.default
        shown = meta.get("shown", "off" if default is False else "on" if default is True else default)
        text = f"{meta['help']} (default: {shown})".replace("%", "%%")  # argparse %-formats help texts
        kw: dict[str, Any] = {"default": argparse.SUPPRESS, "help": text}
        if meta.get("negatable"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            continue
        if name == "resume":  # --resume, or --resume auto
            p.add_argument(flag, nargs="?", const=True, choices=[RESUME_AUTO], metavar=RESUME_AUTO, **kw)
            continue
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", **kw)
            continue
        kind = OPTIONAL_KINDS.get(name, type(default))
        kind = str if kind is list else kind  # nargs="+" gives the list
        for extra in ("choices", "nargs", "metavar"):
            if extra in meta:
                kw[extra] = meta[extra]
        p.add_argument(flag, type=kind, **kw)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the objective's own (its ``defaults`` in :data:`seqpar.train.objectives.OBJECTIVES`),
    then the --config file, then the options given on the command line."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_config_file(args.config))
    values.update({k: v for k, v in vars(args).items() if k in FIELDS})
    spec = OBJECTIVES.get(values.get("objective", FIELDS["objective"].default))
    own = dict(spec.defaults) if spec is not None else {}  # an unknown name: refused by the checks
    return TrainConfig(**{**own, **values})


def layout_words(sp: int, dp: int, tp: int | None = 1, ep: int | None = 1) -> str:
    """``"sp=2 x dp=2"``, ``"tp=2 x sp=2 x dp=1"``, ``"sp=2 x dp=2, ep=2"``: the ranks' layout in words
    (tp, ep None or 1: not said)."""
    return (f"tp={tp} x " if (tp or 1) > 1 else "") + f"sp={sp} x dp={dp}" + (f", ep={ep}" if (ep or 1) > 1 else "")


def _duration(s: float) -> str:
    return f"{int(s // 60)}m{s % 60:04.1f}s" if s >= 60 else f"{s:.1f}s"


def format_summary(s: RunSummary) -> str:
    """The closing report of a run (rank 0's summary)."""
    this_run = f" ({len(s.losses)} in this run)" if s.resumed_from else ""
    lines = [f"seqpar train: {s.steps} steps{this_run} in {_duration(s.train_time_s)} "
             f"(+{s.setup_s:.0f}s setup, {s.eval_s:.0f}s eval) -- {layout_words(s.sp, s.dp, s.tp, s.ep)} "
             f"({s.strategy}, {s.world} ranks on {s.device.split(':')[0]}{', FSDP2' if s.fsdp else ''}, {s.dtype}), "
             f"{s.tokens_per_step:,} tokens per step, {s.params:,} parameters"
             f"{f' ({s.trainable:,} trained: {s.lora})' if s.lora else ''}"]
    lines.append(f"  data        {s.data}")
    lines.append(f"  attention   {s.attention}; layout {s.layout}")
    lines.append(f"  memory      {s.memory}")
    if s.sp_degrees:  # --sp-schedule dynamic
        lines.append(f"  schedule    dynamic: {describe_degrees(s.sp_degrees, s.sp_unit)} over the run; cost model "
                     f"{s.sp_cost}")
    if s.losses:
        (s0, l0), (s1, l1) = s.losses[0], s.losses[-1]
        lines.append(f"  loss        {l0:.4f} (step {s0}) -> {l1:.4f} (step {s1})")
    ev, first = s.final_eval, s.first_eval
    if ev and ev.accuracy is not None:
        acc = f"{100 * ev.accuracy:.1f}%"
        answers = s.accuracy_of == "answers"  # the task's answers, else the preference accuracy: the chosen won
        if s.chance:
            acc += f" vs chance {100 * s.chance:.1f}%" + (f" ({ev.accuracy / s.chance:.0f}x)" if answers else "")
        if first and first.accuracy is not None:
            acc += f"; before training {100 * first.accuracy:.1f}%"
        lines.append(f"  held-out    accuracy {acc} over {ev.targets:,} {s.accuracy_of}; loss {ev.loss:.4f}")
    elif ev:
        before = f"; before training {first.loss:.4f}" if first else ""
        lines.append(f"  held-out    loss {ev.loss:.4f} over {ev.targets:,} units{before}")
    if s.evals and len(s.evals) > 1:
        losses = ", ".join(f"step {step}: {e.loss:.4f}" for step, e in s.evals)
        lines.append(f"  evaluations {losses} (held-out loss)")
    if s.peak_mem_mib and s.device.startswith("cuda"):
        mem = ", ".join(f"rank {r}: {a:,.0f} / {b:,.0f} MiB" for r, (a, b) in
                        enumerate(zip(s.peak_mem_mib, s.peak_reserved_mib, strict=True)))
        lines.append(f"  peak memory {mem} (CUDA allocated / reserved, steps only: reset after setup)")
    elif s.peak_mem_mib:
        mem = ", ".join(f"rank {r}: {m:,.0f} MiB" for r, m in enumerate(s.peak_mem_mib))
        lines.append(f"  peak memory {mem} (peak RSS of the process, setup included)")
    lines.append(f"  metrics     {s.metrics} (one JSON line per step and per evaluation)"
                 f"{'; summary.json' if s.summary_file else ''}{'; loss.png' if s.plot else ''}")
    if s.samples:
        lines.append(f"  samples     {s.samples} (held-out clips, each above the clip the model samples from its text)")
    if s.checkpoint:
        lines.append(f"  checkpoint  {s.checkpoint} (torch.distributed.checkpoint; --resume continues; seqpar export "
                     "writes it for transformers)")
    if s.export and s.export_lora == "adapter":
        lines.append(f"  exported    {s.export} (peft's LoRA adapter: peft.AutoPeftModelForCausalLM.from_pretrained "
                     "loads it)")
    elif s.export:
        auto = {"reward": "AutoModelForSequenceClassification", "flow-matching": "the diffusers class's"}.get(
            s.objective, "AutoModelForCausalLM")
        lines.append(f"  exported    {s.export} (save_pretrained{', LoRA merged' if s.export_lora else ''}: "
                     f"{auto}.from_pretrained loads it)")
    if s.resumed_from:
        lines.append(f"  resumed     from step {s.resumed_step} ({s.resumed_from})")
    if s.replaced_steps:
        lines.append(f"  replaced    an earlier run's checkpoints (steps {', '.join(map(str, s.replaced_steps))}; "
                     "--overwrite)")
    return "\n".join(lines)


def describe_start(job: Job) -> str:
    """The run's first line: where it runs, what it continues or replaces."""
    cfg = job.cfg
    line = (f"seqpar train: {job.world} local workers on the CPU (gloo, 1 thread each), "
            f"{layout_words(job.sp, job.dp, job.tp, job.ep)}, "
            f"{job.strategy}{' (auto: ' + job.reason + ')' if job.reason else ''}, --seq-len {cfg.seq_len}, "
            f"{cfg.steps} steps -> {os.path.abspath(cfg.save_dir)}; memory: {describe_memory(cfg)}")
    if job.plan_reason:
        line += f"\nseqpar train: {job.plan_reason}"
    if job.resume_from:
        line += f"\nseqpar train: resuming from step {job.resume_step} ({os.path.abspath(job.resume_from)})"
        line += "".join(f"\nseqpar train: {note}" for note in job.resume_notes)
    elif cfg.resume:
        line += "\nseqpar train: --resume auto: no checkpoint yet, starting afresh"
    if job.replaces:
        line += (f"\nseqpar train: --overwrite: deleting the earlier run's checkpoints (steps "
                 f"{', '.join(map(str, job.replaces))}) in {os.path.abspath(cfg.save_dir)}")
    if job.data is not None:
        line += f"\nseqpar train: data: {job.data.describe()}"
    return line


def _say(text: str) -> None:
    print(f"seqpar train: {text}", file=sys.stderr, flush=True)


def _say_rank_failed(error: Exception, cfg: TrainConfig) -> None:
    """A rank of a torchrun job stops because another failed or was lost: once per agent."""
    from seqpar.train.checkpoint import latest_checkpoint

    last = latest_checkpoint(cfg.save_dir)
    where = (f"last complete checkpoint: {os.path.abspath(last)} (--resume auto continues from it)" if last
             else "no checkpoint was completed")
    _say(f"error: {error}\n  {where}")


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from seqpar.train.launcher import JobFailed, run_local, run_torchrun, under_torchrun

    cfg = config_from_args(args)
    if under_torchrun():
        from seqpar.errors import RankFailed

        rank = int(os.environ.get("RANK", 0))
        try:
            summary = run_torchrun(cfg, say=_say, report=lambda e: _say_rank_failed(e, cfg))
        except ValueError as e:  # the same on every rank: say it once
            if rank == 0:
                print(f"seqpar train: error: {e}", file=sys.stderr, flush=True)
            else:  # torchrun stops every rank when the first one exits: let rank 0 say it first
                import time

                time.sleep(5)
            from seqpar.comm import faults

            if faults.stopped():  # a collective left pending: the interpreter's teardown would wait for it
                sys.stdout.flush()
                os._exit(2)
            return 2
        except RankFailed:  # said once per agent by run_torchrun; the collectives it left pending
            sys.stdout.flush()  # would make the interpreter's teardown wait for them
            sys.stderr.flush()
            os._exit(1)
        if summary is not None:
            print(format_summary(summary), flush=True)
        return 0

    from seqpar.train.checkpoint import latest_checkpoint
    from seqpar.train.job import prepare_job

    job = prepare_job(cfg)  # ValueError -> one line from seqpar.cli.main, before any worker starts
    import torch

    if torch.cuda.is_available():  # said, not silent: local workers are gloo processes on the CPU
        print(f"seqpar train: this host has {torch.cuda.device_count()} CUDA device(s), but without torchrun the "
              "workers run on the CPU (gloo); for the GPUs: torchrun --nproc-per-node N -m seqpar.cli.main train "
              "...", file=sys.stderr, flush=True)
    print(describe_start(job), flush=True)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # terminate like Ctrl-C: stop the workers
    try:
        summary = run_local(job)
    except (JobFailed, KeyboardInterrupt) as e:
        last = latest_checkpoint(cfg.save_dir)
        where = f"last complete checkpoint: {os.path.abspath(last)}" if last else "no checkpoint was completed"
        if isinstance(e, KeyboardInterrupt):
            print(f"\nseqpar train: interrupted; every worker stopped; {where}", file=sys.stderr)
            return 130
        print(f"seqpar train: error: the job failed and every worker was stopped: {e}\n  {where}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_summary(summary), flush=True)
    return 0
