"""``seqpar plan``: choose dp x ulysses x ring for a model, a cluster and a sequence length, and show
the estimated communication bytes and activation memory of every candidate (no GPUs needed).

With ``--gpus N --gpu-memory 80GB`` it plans at scale instead (:mod:`seqpar.cli.plan_nd`): dp_replicate /
dp_shard / tp / sp / ep (``--moe``) and the memory switches, so that the whole step fits each GPU.

The model's shape comes from flags, or from ``--model`` (a local transformers checkpoint directory or
config.json, or a built-in tiny name); flags given explicitly override the model's values."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seqpar.integrations.models import BUILTIN_MODELS, builtin_config, decoder_config

if TYPE_CHECKING:
    from seqpar.planner.cost import Candidate

# With no flags: 32 heads of 128 (hidden 4096), 32 layers, a 32k vocabulary, on one node of 8 ranks, 128k tokens.
DEFAULTS = dict(heads=32, kv_heads=None, head_dim=None, hidden_size=None, layers=32, intermediate_size=None,
                vocab_size=32000, world_size=8, devices_per_node=8, seq_len=131072)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# transformers config keys for each planner argument (first match wins)
_CONFIG_KEYS = {"heads": ("num_attention_heads", "n_head"), "kv_heads": ("num_key_value_heads",),
                "head_dim": ("head_dim",), "hidden_size": ("hidden_size", "n_embd"),
                "layers": ("num_hidden_layers", "n_layer"), "intermediate_size": ("intermediate_size", "n_inner"),
                "vocab_size": ("vocab_size",)}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose dp x ulysses x ring and estimate bytes and memory per rank",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="local checkpoint dir / config.json, or a built-in tiny name")
    p.add_argument("--heads", type=int, help=f"query heads (default {DEFAULTS['heads']})")
    p.add_argument("--kv-heads", type=int, help="KV heads (default: = heads)")
    p.add_argument("--head-dim", type=int, help="head dim (default: hidden_size / heads, else 128)")
    p.add_argument("--hidden-size", type=int, help="model width (default: heads * head_dim)")
    p.add_argument("--intermediate-size", type=int, help="MLP width for the memory estimate (default 4 * hidden)")
    p.add_argument("--layers", type=int, help=f"decoder layers (default {DEFAULTS['layers']})")
    p.add_argument("--vocab-size", type=int, help=f"vocabulary, for the logits (default {DEFAULTS['vocab_size']})")
    p.add_argument("--tied", action="store_true", help="input and output embeddings share one weight")
    p.add_argument("--fsdp", action="store_true", help="weights, gradients and AdamW states sharded over all ranks")
    p.add_argument("--loss-tile", type=int, default=1024, help="tokens per loss tile of the tiled-loss estimate")
    p.add_argument("--mlp-tile", type=int, default=None, help="tokens per MLP tile of the tiled-MLP estimate "
                   "(default: reduce_memory's, a tile that follows the shard)")
    p.add_argument("--world-size", type=int, help=f"total ranks (default {DEFAULTS['world_size']})")
    p.add_argument("--devices-per-node", type=int, help=f"ranks per node (default {DEFAULTS['devices_per_node']})")
    p.add_argument("--seq-len", type=parse_size, help=f"tokens per sequence, e.g. 1M or 131072 "
                                                 f"(default {DEFAULTS['seq_len']})")
    p.add_argument("--batch", type=int, default=1, help="sequences per sp group per step (default 1)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="activation dtype (default bf16)")
    p.add_argument("--memory-budget", type=parse_size, default=None,
                   help="activation memory per rank, e.g. 40GiB (what is left after weights and optimizer);"
                        " without it all ranks split the sequence")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--max-ulysses", type=int, default=None, help="cap on the ulysses degree")
    p.add_argument("--no-causal", dest="causal", action="store_false",
                   help="bidirectional attention (no zigzag chunks needed by ring)")
    n = p.add_argument_group("at scale: dp_replicate x dp_shard x sp x tp (x ep) and the memory switches")
    n.add_argument("--gpus", type=int, default=None, help="plan N GPUs at scale (with --gpu-memory)")
    n.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8): tp stays inside one")
    n.add_argument("--gpu-memory", type=parse_size, default=None, help="memory of one GPU, e.g. 80GB or 96GiB")
    n.add_argument("--moe", action="store_true", help="an MoE model: experts from --model's config, split by ep")
    d = p.add_argument_group("dynamic SP prediction (the cost model's, not a measurement; "
                             "run at the chosen split's sp over dp x sp)")
    d.add_argument("--length-mean", type=parse_size, default=None,
                   help="predict the dynamic schedule's gain on rows of lognormal lengths with this mean, e.g. 4k")
    d.add_argument("--length-sigma", type=float, default=1.2, help="the lognormal's sigma (default 1.2)")
    d.add_argument("--lengths-file", default=None,
                   help="predict it on these row lengths instead: a text file of integers (spaces, commas, lines)")
    d.add_argument("--token-budget", type=parse_size, default=None,
                   help="tokens per rank per bin (default: --seq-len / sp, what the static job gives a rank)")
    d.add_argument("--tokens-per-step", type=parse_size, default=None,
                   help="tokens per optimizer step (default: world size x token budget)")
    d.add_argument("--steps", type=int, default=16, help="steps drawn from the lognormal (default 16)")
    d.add_argument("--seed", type=int, default=0, help="seed of the lognormal draws (default 0)")
    p.set_defaults(func=run)


def parse_size(text: str) -> int:
    """``"80GiB"`` -> bytes, ``"1M"`` -> 1048576 (:func:`seqpar.planner.parse_size`), as argparse wants its error."""
    from seqpar.planner import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def model_shape(name_or_path: str) -> dict[str, int]:
    """Planner arguments read from a transformers config: a local directory with config.json, a
    config.json path, or a built-in name (``seqpar.integrations.models.BUILTIN_MODELS``)."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--model {name_or_path}: cannot read {path}: {e}") from e
    else:
        cfg = _builtin_config(name_or_path)
    if "text_config" in cfg:  # a multimodal config: the decoder's shape is in text_config
        cfg = decoder_config(cfg)[0]
    shape = {}
    for arg, keys in _CONFIG_KEYS.items():
        value = next((cfg[k] for k in keys if cfg.get(k) is not None), None)
        if value is not None:
            shape[arg] = int(value)
    if "heads" not in shape or "hidden_size" not in shape:
        raise ValueError(f"--model {name_or_path}: the config has no num_attention_heads / hidden_size;"
                         f" give --heads, --kv-heads, --head-dim and --hidden-size instead")
    return shape


def _builtin_config(name: str) -> dict[str, Any]:
    """The config of a built-in model name as a dict."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"--model {name}: not a local directory or config.json, nor a built-in name"
                         f" ({', '.join(BUILTIN_MODELS)})")
    return builtin_config(name).to_dict()


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Explicit flags > --model config > defaults; head_dim and hidden_size default from each other."""
    shape = model_shape(args.model) if args.model else {}
    out = {}
    for key, default in DEFAULTS.items():
        flag = getattr(args, key)
        out[key] = flag if flag is not None else shape.get(key, default)
    out["kv_heads"] = out["kv_heads"] or out["heads"]
    if out["head_dim"] is None:
        out["head_dim"] = out["hidden_size"] // out["heads"] if out["hidden_size"] else 128
    out["hidden_size"] = out["hidden_size"] or out["heads"] * out["head_dim"]
    return out


def run(args: argparse.Namespace) -> int:
    from seqpar.planner import InfeasiblePlanError, format_bytes, format_table, plan

    if args.length_mean is not None and args.lengths_file is not None:
        raise ValueError("give --length-mean (a lognormal) or --lengths-file, not both")
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    kw = _resolve(args)
    if args.gpus is not None:
        from seqpar.cli.plan_nd import run_nd

        return run_nd(args, {**kw, "dtype_bytes": DTYPE_BYTES[args.dtype]})
    kw.update(dtype_bytes=DTYPE_BYTES[args.dtype], batch=args.batch, memory_budget_bytes=args.memory_budget,
              max_ulysses=args.max_ulysses, causal=args.causal, checkpointing=args.checkpointing)
    budget = "none" if args.memory_budget is None else format_bytes(args.memory_budget)
    print(f"model: {kw['heads']} heads / {kw['kv_heads']} KV heads x {kw['head_dim']}, hidden {kw['hidden_size']},"
          f" {kw['layers']} layers{f' ({args.model})' if args.model else ''}; {args.dtype},"
          f" {'causal' if args.causal else 'bidirectional'}{', checkpointing' if args.checkpointing else ''}")
    print(f"cluster: {kw['world_size']} ranks, {kw['devices_per_node']} per node; sequence {kw['seq_len']} tokens"
          f" x batch {args.batch}; activation budget per rank: {budget}")
    print("bytes: per rank per layer, forward; memory: activations per rank, all layers\n")
    try:
        p = plan(**{k: v for k, v in kw.items() if k != "vocab_size"})
    except InfeasiblePlanError as e:
        print(format_table(e.candidates))
        raise
    print(p.table())
    print(f"\nchosen: {p.chosen.label} ({p.strategy})")
    print(f"reason: {p.reason}")
    mesh = ", ".join(f"{k}={v}" for k, v in p.mesh_kwargs().items())
    print(f"use:    mesh = seqpar.init_mesh({mesh}); strategy={p.strategy!r}")
    dynamic = args.length_mean is not None or args.lengths_file is not None
    print("\n" + step_memory_table(p.chosen, kw, vocab_size=kw["vocab_size"], tied=args.tied, fsdp=args.fsdp,
                                   loss_tile=args.loss_tile, mlp_tile=args.mlp_tile, dynamic=dynamic))
    if dynamic:
        print("\n" + dynamic_prediction(args, kw, p.chosen))
    return 0


def dynamic_prediction(args: argparse.Namespace, kw: dict[str, Any], chosen: Candidate) -> str:
    """The dynamic SP schedule's predicted gain over static sp on the chosen split, for the lengths
    ``--length-mean`` / ``--lengths-file`` describe: H100 constants (guesses), not a measurement."""
    from seqpar.planner.gain import lognormal_lengths, predict_gain
    from seqpar.planner.work import H100, Shapes, bin_seconds

    if chosen.ulysses > 1 and chosen.ring > 1:
        return (f"dynamic SP: not predicted for {chosen.label}: a dynamic schedule runs over dp x sp with one"
                f" strategy; cap --max-ulysses at 1 for ring, or choose a split with ring=1")
    sp, world, max_len = chosen.sp, kw["world_size"], kw["seq_len"]
    budget = args.token_budget or -(-max_len // sp)
    per_step = args.tokens_per_step or world * budget
    if args.lengths_file is not None:
        lengths, source = read_lengths(args.lengths_file), f"{args.lengths_file}"
    else:
        n = max(1, round(args.steps * per_step / args.length_mean))
        lengths = lognormal_lengths(n, mean=args.length_mean, sigma=args.length_sigma, cap=max_len, seed=args.seed)
        source = f"lognormal, mean {args.length_mean}, sigma {args.length_sigma}, max {max_len}, seed {args.seed}"
    shapes = Shapes(heads=kw["heads"], kv_heads=kw["kv_heads"], head_dim=kw["head_dim"],
                    hidden_size=kw["hidden_size"], intermediate_size=kw["intermediate_size"] or 4 * kw["hidden_size"],
                    layers=kw["layers"], vocab_size=kw["vocab_size"], dtype_bytes=kw["dtype_bytes"],
                    causal=kw["causal"])
    cost = functools.partial(bin_seconds, shapes=shapes, machine=H100, devices_per_node=kw["devices_per_node"],
                             strategy="ring" if chosen.ring > 1 else "ulysses")
    try:
        g = predict_gain(lengths, world=world, sp=sp, token_budget=budget, tokens_per_step=per_step, cost=cost)
    except ValueError as e:
        raise ValueError(f"{e} (seqpar plan: --token-budget, or --seq-len for the longest row)") from e
    hist = ", ".join(f"sp={k}: {n} ({n / g.rows:.0%})" for k, n in g.rows_at_degree.items())
    return "\n".join([
        f"dynamic SP schedule vs static sp={sp} on {chosen.label}: a PREDICTION of the cost model with H100"
        f" guesses (seqpar.planner.work.H100; fit_machine / fit_degrees refit them from measurements), not a"
        f" measurement",
        f"  lengths: {source}: {g.rows} rows, {g.tokens} tokens, mean {g.tokens / max(g.rows, 1):.0f}",
        f"  {g.steps} steps of <= {per_step} tokens; token budget {budget} per rank per bin",
        f"  rows at degree (dynamic): {hist}",
        f"  predicted step time: static {g.static_s / g.steps:.3g} s, dynamic {g.dynamic_s / g.steps:.3g} s"
        f" -> predicted {g.ratio:.3f}x of static"])


def read_lengths(path: str) -> list[int]:
    """Row lengths from a text file: positive integers separated by spaces, commas or lines."""
    try:
        words = Path(path).read_text().replace(",", " ").split()
    except OSError as e:
        raise ValueError(f"--lengths-file {path}: cannot read it: {e}") from e
    if not words or not all(w.isdigit() and int(w) > 0 for w in words):
        bad = next((w for w in words if not (w.isdigit() and int(w) > 0)), "nothing")
        raise ValueError(f"--lengths-file {path}: expected positive integers (row lengths), found {bad!r}")
    return [int(w) for w in words]


# the switch sets the step-memory table compares (seqpar.reduce_memory's switches)
_SWITCH_ROWS = (("off", {}), ("tiled loss", dict(tiled_loss=True)), ("tiled MLP", dict(tiled_mlp=True)),
                ("checkpoint layers", dict(checkpoint="layers")),
                ("all (loss+mlp+layers)", dict(tiled_loss=True, tiled_mlp=True, checkpoint="layers")),
                ("all, offload", dict(tiled_loss=True, tiled_mlp=True, checkpoint="offload")))


def step_memory_table(chosen: Any, kw: dict[str, Any], *, vocab_size: int, tied: bool, fsdp: bool, loss_tile: int,
                      mlp_tile: int | None, dynamic: bool = False) -> str:
    """Memory per rank of one training step on the chosen split, for each set of memory switches
    (:mod:`seqpar.planner.memory`): weights, gradients, AdamW states, activations, host offload.
    ``dynamic`` with ``fsdp``: a line more, the dynamic schedule's (parameters gathered for the step)."""
    from seqpar.planner import format_bytes
    from seqpar.planner.cost import largest_shard
    from seqpar.planner.memory import MemorySwitches, step_memory

    tokens = kw["batch"] * largest_shard(kw["seq_len"], chosen.ulysses, chosen.ring,
                                         zigzag=kw["causal"] and chosen.ring > 1)
    shape = dict(tokens=tokens, hidden_size=kw["hidden_size"], intermediate_size=kw["intermediate_size"]
                 or 4 * kw["hidden_size"], layers=kw["layers"], heads=kw["heads"], kv_heads=kw["kv_heads"],
                 head_dim=kw["head_dim"], vocab_size=vocab_size, dtype_bytes=kw["dtype_bytes"], tied=tied,
                 fsdp_shards=kw["world_size"] if fsdp else 1, loss_tile=loss_tile, mlp_tile=mlp_tile)
    rows = [(name, step_memory(**shape, switches=MemorySwitches(**sw))) for name, sw in _SWITCH_ROWS]
    first = rows[0][1]
    lines = [f"memory per rank, one training step on {chosen.label} ({tokens} tokens on the largest shard; vocabulary "
             f"{vocab_size}; AdamW; {'FSDP over all ranks' if fsdp else 'weights replicated'}):",
             f"  weights {format_bytes(first.weights)}, gradients {format_bytes(first.gradients)}, AdamW states "
             f"{format_bytes(first.optimizer)}; activations by memory switch (seqpar.reduce_memory):",
             f"  {'switches':<22} {'logits':>10} {'MLP':>10} {'layers':>10} {'other':>10} {'host':>10} {'total':>10}"]
    for name, m in rows:
        lines.append(f"  {name:<22} {format_bytes(m.logits):>10} {format_bytes(m.mlp):>10} {format_bytes(m.layers):>10}"
                     f" {format_bytes(m.other):>10} {format_bytes(m.offloaded):>10} {format_bytes(m.total):>10}")
    if dynamic and fsdp:
        off, on = (step_memory(**shape, switches=MemorySwitches(**dict(_SWITCH_ROWS)[name]), sp_schedule="dynamic")
                   for name in ("off", "all (loss+mlp+layers)"))
        lines.append(f"  --sp-schedule dynamic under FSDP2: + {format_bytes(off.gathered)} per rank (total "
                     f"{format_bytes(off.total)} off, {format_bytes(on.total)} all): every parameter gathered\n"
                     f"  and its gradient whole for the step")
    return "\n".join(lines)


if __name__ == "__main__":
    from seqpar.cli.main import main

    sys.exit(main(["plan", *sys.argv[1:]]))
