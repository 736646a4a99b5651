"""``seqpar plan --gpus N --gpu-memory 80GB``: the planner at scale (:mod:`seqpar.planner.nd`) --
dp_replicate / dp_shard / tp / sp / ep and the memory switches, the memory per GPU, the bytes per
layer per dimension, and why."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def moe_shape(name_or_path: str | None) -> dict[str, int]:
    """``{experts, top_k, expert_intermediate}`` from a local MoE config (``--moe``). Raises
    ValueError when there is no config or it names no experts."""
    from seqpar.integrations.models import BUILTIN_MODELS, builtin_config, decoder_config
    from seqpar.planner.nd import MOE_KEYS, moe_fields

    if name_or_path is None:
        raise ValueError("--moe reads the experts from --model's config: give --model CONFIG")
    path = Path(name_or_path)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file() and name_or_path not in BUILTIN_MODELS:
        raise ValueError(f"--model {name_or_path}: not a local directory or config.json, nor a built-in name")
    cfg = json.loads(path.read_text()) if path.is_file() else builtin_config(name_or_path).to_dict()
    if "text_config" in cfg:
        cfg = decoder_config(cfg)[0]
    out = moe_fields(cfg)
    if not out["experts"] or not out["top_k"]:
        raise ValueError(f"--moe: {name_or_path}'s config names no experts ({', '.join(MOE_KEYS['experts'])}) or "
                         f"experts per token ({', '.join(MOE_KEYS['top_k'])})")
    return out


def run_nd(args: argparse.Namespace, kw: dict[str, Any]) -> int:
    """Plan and print (``kw``: the model's shape as :func:`seqpar.cli.plan._resolve` reads it)."""
    from seqpar.planner import format_bytes
    from seqpar.planner.nd import ModelShape, plan_nd

    if args.gpu_memory is None:
        raise ValueError("--gpus plans against the memory of one GPU: give --gpu-memory (e.g. 80GB)")
    moe = moe_shape(args.model) if args.moe else {}
    width = kw["intermediate_size"] or 4 * kw["hidden_size"]
    shape = ModelShape(hidden_size=kw["hidden_size"], intermediate_size=width, layers=kw["layers"],
                       heads=kw["heads"], kv_heads=kw["kv_heads"], head_dim=kw["head_dim"],
                       vocab_size=kw["vocab_size"], tied=args.tied, **moe)
    print(f"model: {shape.heads} heads / {shape.kv_heads} KV heads x {shape.head_dim}, hidden {shape.hidden_size}, "
          f"MLP {shape.intermediate_size}, {shape.layers} layers, vocabulary {shape.vocab_size}"
          + (f", {shape.experts} experts (top {shape.top_k}, width {shape.expert_intermediate})" if moe else "")
          + f"{f' ({args.model})' if args.model else ''}; {args.dtype}")
    print(f"cluster: {args.gpus} GPUs, {args.gpus_per_node} per node, {format_bytes(args.gpu_memory)} each; "
          f"sequence {kw['seq_len']} tokens")
    p = plan_nd(shape, gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_memory=args.gpu_memory,
                seq_len=kw["seq_len"], dtype_bytes=kw["dtype_bytes"], causal=args.causal)
    c, m = p.chosen, p.chosen.memory
    print(f"\nchosen: {c.label} ({c.strategy}); memory switches: {c.switches.label}")
    print(f"reason: {p.reason}")
    mesh = ", ".join(f"{k}={v}" for k, v in c.mesh_kwargs().items())
    switches = ", ".join(f"{k}={v!r}" for k, v in c.switches.kwargs().items())
    print(f"use:    mesh = seqpar.init_mesh({mesh}); seqpar.parallelize(model, mesh, strategy={c.strategy!r})"
          + (f"; seqpar.reduce_memory(model, mesh, {switches})" if c.switches.any else "")
          + "; seqpar.apply_fsdp(model, mesh)")
    print(f"\nmemory per GPU ({format_bytes(m.phase_peak())}): weights {format_bytes(m.weights)}, gradients "
          f"{format_bytes(m.gradients)}, AdamW {format_bytes(m.optimizer)} (FSDP2 over dp_shard x sp, float32 master), "
          f"logits {format_bytes(m.logits)}, MLP {format_bytes(m.mlp)}, layers {format_bytes(m.layers)}, other "
          f"{format_bytes(m.other)}" + (f"; host {format_bytes(m.offloaded)}" if m.offloaded else ""))
    print("bytes per layer per GPU, forward (inter-node part):  "
          + ", ".join(f"{k} {format_bytes(v)} ({format_bytes(c.inter_node[k])})" for k, v in c.bytes_per_layer.items()))
    print("\n" + format_layouts(p.candidates, c))
    return 0


def format_layouts(cands: tuple[Any, ...], chosen: Any, top: int = 12) -> str:
    """The fitting layouts, fastest first (``*``: the chosen one), and how many do not fit."""
    from seqpar.planner import format_bytes

    ok = sorted((c for c in cands if c.feasible), key=lambda c: c.seconds_per_layer)
    head = f"  {'dp_rep':>6} {'dp_shard':>8} {'ulysses':>7} {'ring':>4} {'tp':>3} {'ep':>3} {'switches':>18} " \
           f"{'memory/GPU':>11} {'ms/layer':>9}"
    lines = [f"layouts that fit ({len(ok)} of {len(cands)}; the {min(top, len(ok))} fastest):", head]
    for c in ok[:top]:
        mark = "*" if c is chosen else " "
        lines.append(f"{mark} {c.dp_replicate:>6} {c.dp_shard:>8} {c.ulysses:>7} {c.ring:>4} {c.tp:>3} {c.ep:>3} "
                     f"{c.switches.label:>18} {format_bytes(c.memory.phase_peak()):>11} "
                     f"{c.seconds_per_layer * 1e3:>9.3f}")
    return "\n".join(lines)
