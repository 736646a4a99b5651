"""RL rollouts made elsewhere (vLLM, SGLang, another trainer's generation), read for the training side:
one row per completion, checked, tokenized, and turned into a batch and the per-row / per-token inputs
:class:`~seqpar.objectives.rl.PolicyGradient` takes. Pure: no processes; text goes through the
caller's ``tokenize`` (``seqpar train``'s tokenizer), token ids need none.

A row (a JSONL object, or a parquet / arrow row) -- ``docs/guides/trl.md``, "Rollouts"::

    prompt, completion           strings (or lists of chat messages): tokenized by ``tokenize``
    prompt_ids, completion_ids   or the token ids the generation engine used (they win over the
                                 text when both are given: they are what was sampled)
    reward                       a number per completion (null: unscorable, advantage 0), or
    advantage                    a number, or one number per completion token (PPO's GAE)
    group        (optional)      the completions of one prompt share it; default: the prompt itself
    old_logps    (optional)      the sampling policy's log-probs, one per completion token
    ref_logps    (optional)      the reference's log-probs, one per completion token

Every row gives the same kind: all rewards or all advantages, and an optional column in every row or
none. Anything else is a ValueError naming the row (``where``: ``file:line``) and the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..batch.targets import IGNORE_INDEX
from .advantages import group_advantages, rloo_advantages

Tokenize = Callable[[Any, Any], tuple[Sequence[int], Sequence[bool]]]
"""``tokenize(prompt, completion) -> (ids, completion_mask)``: the tokens of the prompt followed by
the completion, and which of them are completion tokens (the targets), as the trainer tokenizes
them (TRL: the prompt with its generation prompt, then the completion)."""

PER_TOKEN = ("old_logps", "ref_logps")
FIELDS = ("prompt", "completion", "prompt_ids", "completion_ids", "reward", "advantage", "group", *PER_TOKEN)


@dataclass(frozen=True)
class Rollout:
    """One completion, tokenized. ``ids``: prompt then completion; ``targets``: per token, a
    completion token (trained on); ``advantage``: a number or one per target (None until
    :func:`with_advantages`); ``reward``: NaN when unscorable; ``old_logps`` / ``ref_logps``: one
    per target, or None; ``group``: its prompt group; ``where``: for error messages."""

    where: str
    ids: tuple[int, ...]
    targets: tuple[bool, ...]
    group: Hashable
    reward: float | None = None
    advantage: float | tuple[float, ...] | None = None
    old_logps: tuple[float, ...] | None = None
    ref_logps: tuple[float, ...] | None = None

    @property
    def n_targets(self) -> int:
        return sum(self.targets)


def _ids(value: Any, where: str, field: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in value):
        raise ValueError(f"{where}: {field!r} must be a list of token ids (integers >= 0), got {value!r:.80}")
    return list(value)


def _number(value: Any, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {field!r} must be a finite number, got {value!r:.80}")
    return float(value)


def _per_target(value: Any, n: int, where: str, field: str) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: {field!r} must be a list with one number per completion token ({n}), got "
                         f"{type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{where}: {field!r} has {len(value)} values for {n} completion tokens: give one per "
                         "completion token, in order (the generation engine's tokens: completion_ids)")
    out = tuple(_number(v, where, f"{field}[{i}]") for i, v in enumerate(value))
    if field in PER_TOKEN:
        bad = next((i for i, v in enumerate(out) if v > 0), None)
        if bad is not None:
            raise ValueError(f"{where}: {field}[{bad}] = {out[bad]} is > 0: log-probabilities are <= 0 (give log p, "
                             "not p)")
    return out


def _tokens(row: Mapping[str, Any], where: str, tokenize: Tokenize | None) -> tuple[list[int], list[bool], Any]:
    """``(ids, targets, group key of the prompt)`` of one row."""
    if "prompt_ids" in row or "completion_ids" in row:
        missing = [f for f in ("prompt_ids", "completion_ids") if f not in row]
        if missing:
            raise ValueError(f"{where}: token ids need both 'prompt_ids' and 'completion_ids' (missing {missing})")
        prompt, completion = _ids(row["prompt_ids"], where, "prompt_ids"), _ids(row["completion_ids"], where,
                                                                                "completion_ids")
        return prompt + completion, [False] * len(prompt) + [True] * len(completion), tuple(prompt)
    if "prompt" not in row or "completion" not in row:
        raise ValueError(f"{where}: a rollout needs 'prompt' and 'completion' (text or chat messages) or "
                         f"'prompt_ids' and 'completion_ids'; found {sorted(row)}")
    if tokenize is None:
        raise ValueError(f"{where}: the row gives text; reading text needs a tokenizer (or give prompt_ids and "
                         "completion_ids)")
    ids, mask = tokenize(row["prompt"], row["completion"])
    ids, mask = list(ids), [bool(m) for m in mask]
    if len(ids) != len(mask):
        raise ValueError(f"{where}: the tokenizer returned {len(ids)} ids and {len(mask)} mask entries")
    return ids, mask, repr(row["prompt"])


def parse_rollout(row: Mapping[str, Any], where: str, tokenize: Tokenize | None = None,
                  vocab_size: int | None = None) -> Rollout:
    """One row as a :class:`Rollout` (see the module doc); ValueError naming ``where`` and the field."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected an object with the rollout fields, got {type(row).__name__}")
    ids, targets, prompt_key = _tokens(row, where, tokenize)
    n = sum(targets)
    if n == 0:
        raise ValueError(f"{where}: the completion has no tokens: nothing to train on (leave the row out)")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise ValueError(f"{where}: token id {max(ids)} is outside the vocabulary ({vocab_size} ids)")
    has = [f for f in ("reward", "advantage") if f in row]
    if len(has) != 1:
        raise ValueError(f"{where}: give 'reward' (advantages computed per prompt group) or 'advantage', exactly one"
                         f" (found {has or 'neither'})")
    reward = advantage = None
    if "reward" in has:
        reward = math.nan if row["reward"] is None else _number(row["reward"], where, "reward")
    elif isinstance(row["advantage"], (list, tuple)):
        advantage = _per_target(row["advantage"], n, where, "advantage")
    else:
        advantage = _number(row["advantage"], where, "advantage")
    group = row.get("group", prompt_key)
    if not isinstance(group, Hashable) or isinstance(group, (float, bool)) or group is None:
        raise ValueError(f"{where}: 'group' must be a string or an integer, got {group!r:.80}")
    per_token = {f: _per_target(row[f], n, where, f) if row.get(f) is not None else None for f in PER_TOKEN}
    return Rollout(where, tuple(ids), tuple(targets), group, reward, advantage, **per_token)


def parse_rollouts(rows: Iterable[tuple[str, Mapping[str, Any]]], tokenize: Tokenize | None = None,
                   vocab_size: int | None = None) -> list[Rollout]:
    """Every ``(where, row)`` as a :class:`Rollout`, checked to give the same kind of row (rewards or
    advantages; the optional per-token columns in every row or none). ValueError naming the row."""
    out = [parse_rollout(row, where, tokenize, vocab_size) for where, row in rows]
    if not out:
        raise ValueError("no rollouts: the data holds no rows")
    first = out[0]
    for r in out[1:]:
        if (r.reward is None) != (first.reward is None):
            kind = "a reward" if first.reward is not None else "an advantage"
            raise ValueError(f"{r.where}: every row must give {kind}, as {first.where} does")
        for f in PER_TOKEN:
            if (getattr(r, f) is None) != (getattr(first, f) is None):
                has, lacks = (r, first) if getattr(r, f) is not None else (first, r)
                raise ValueError(f"{lacks.where}: no {f!r} while {has.where} has it: give it in every row or none")
    return out


def with_advantages(rollouts: Sequence[Rollout], *, estimator: str = "grpo", scale_rewards: str = "group",
                    normalize: bool = False) -> list[Rollout]:
    """The rollouts with their advantages: given ones kept; from the rewards per group otherwise
    (``estimator`` "grpo": :func:`~seqpar.objectives.advantages.group_advantages` with
    ``scale_rewards``; "rloo": :func:`~seqpar.objectives.advantages.rloo_advantages` with
    ``normalize``), over the rollouts given (TRL: one generation batch)."""
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"estimator={estimator!r}: choose 'grpo' (group mean / std) or 'rloo' (leave-one-out)")
    if not rollouts or rollouts[0].reward is None:
        return list(rollouts)
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
    groups = [r.group for r in rollouts]
    adv = (group_advantages(rewards, groups, scale_rewards=scale_rewards) if estimator == "grpo"
           else rloo_advantages(rewards, groups, normalize=normalize))
    return [replace(r, advantage=float(a)) for r, a in zip(rollouts, adv.tolist(), strict=True)]


def rollout_batch(rollouts: Sequence[Rollout], pad_id: int, *, dtype: torch.dtype = torch.float64
                  ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """``(batch, inputs)``: one rollout per row, right-padded to the longest. ``batch``: ``input_ids``,
    ``labels`` (the completion tokens; ``-100`` elsewhere), ``attention_mask``, ``position_ids``
    ``[B, S]`` for :func:`seqpar.shard_batch`; ``inputs`` for the objective: ``advantages`` ``[B]``
    (or ``[B, S]`` per token), ``old_logps`` / ``ref_logps`` ``[B, S]`` when given -- per-token
    values aligned with the labels (entry i belongs to token i), 0 elsewhere, in ``dtype`` (the
    objective casts them to the model's, as TRL's float32 columns are). ValueError for a rollout
    without an advantage (call :func:`with_advantages`)."""
    if not rollouts:
        raise ValueError("rollout_batch needs at least one rollout")
    missing = next((r for r in rollouts if r.advantage is None), None)
    if missing is not None:
        raise ValueError(f"{missing.where}: no advantage yet: compute them from the rewards (with_advantages)")
    b, s = len(rollouts), max(len(r.ids) for r in rollouts)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.long)
    per_token = any(isinstance(r.advantage, tuple) for r in rollouts)
    cols = {f: torch.zeros(b, s, dtype=dtype) for f in PER_TOKEN if getattr(rollouts[0], f) is not None}
    adv = torch.zeros(b, s, dtype=dtype) if per_token else torch.zeros(b, dtype=dtype)
    for i, r in enumerate(rollouts):
        n = len(r.ids)
        ids[i, :n] = torch.tensor(r.ids)
        mask[i, :n] = 1
        where = torch.tensor(r.targets).nonzero().squeeze(1)  # the completion tokens' positions
        labels[i, where] = ids[i, where]
        for f, col in cols.items():
            col[i, where] = torch.tensor(getattr(r, f), dtype=dtype)
        if per_token:
            adv[i, where] = torch.tensor(r.advantage, dtype=dtype) if isinstance(r.advantage, tuple) else \
                float(r.advantage)
        else:
            adv[i] = float(r.advantage)
    positions = torch.arange(s).expand(b, s).clone()
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": positions}
    return batch, {"advantages": adv, **cols}
