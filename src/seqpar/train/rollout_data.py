"""RL rollouts for ``seqpar train --objective grpo|ppo``: the rows of ``--data`` (the format of
:mod:`seqpar.objectives.rollouts`: prompt and completion as text or token ids, a reward or an
advantage, optional group, old and reference log-probs) read, tokenized with the run's tokenizer,
their advantages computed per prompt group from the rewards (``--advantages grpo``: the group's mean
and std, ``--scale-rewards``; ``rloo``: leave-one-out), and cut into units as sft's rows are, each
token's objective inputs carried as columns of the unit::

    input_ids, labels (the completion tokens), attention_mask, position_ids   [S]
    advantages   [S]  each completion token its completion's advantage (or its own: PPO's GAE)
    old_logps    [S]  the sampling policy's log-probs on the completion tokens (0 elsewhere), if given
    ref_logps    [S]  the reference's, if given (else a reference model runs, with --kl-coef)

One rollout per row (padded), or ``--packing``: rollouts one after the other, none crossing a row
edge. A rollout longer than ``--seq-len`` is refused, naming the row: cutting a completion would
change its loss. Text is tokenized as TRL tokenizes a prompt and its completion (the prompt, then the
completion with the tokenizer's EOS; a chat through the template with its generation prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from seqpar.objectives.rollouts import PER_TOKEN, Rollout, parse_rollouts, with_advantages

from .data import TextData, row_tensors
from .formats import read_rows
from .tokenizer import ByteTokenizer, HFTokenizer, prompt_completion_tokenizer

ADVANTAGE_ESTIMATORS = ("grpo", "rloo")
INPUT_COLUMNS = ("advantages", *PER_TOKEN)
"""The per-token columns a rollout unit carries for the objective (beside the model's inputs)."""


def rollout_unit(rollouts: Sequence[Rollout], seq_len: int, pad_id: int) -> dict[str, Tensor]:
    """One row of ``seq_len`` tokens holding ``rollouts`` one after the other (positions restart at
    each), with the :data:`INPUT_COLUMNS` they give (see the module doc)."""
    ids = [t for r in rollouts for t in r.ids]
    targets = [t for r in rollouts for t in r.targets]
    positions = [p for r in rollouts for p in range(len(r.ids))]
    assert len(ids) <= seq_len, (len(ids), seq_len)
    unit = row_tensors(ids, targets, positions, seq_len, pad_id)
    start = 0
    columns = {"advantages": torch.zeros(seq_len, dtype=torch.float64)}
    columns.update({f: torch.zeros(seq_len, dtype=torch.float64) for f in PER_TOKEN
                    if getattr(rollouts[0], f) is not None})
    for r in rollouts:
        where = start + torch.tensor(r.targets).nonzero().squeeze(1)  # the completion's positions in the row
        columns["advantages"][where] = torch.tensor(r.advantage, dtype=torch.float64)
        for f in PER_TOKEN:
            if f in columns:
                columns[f][where] = torch.tensor(getattr(r, f), dtype=torch.float64)
        start += len(r.ids)
    return {**unit, **columns}


def rollout_units(rollouts: Sequence[Rollout], seq_len: int, *, packing: bool, pad_id: int) -> list[dict[str, Tensor]]:
    """The units of ``rollouts`` (see the module doc); ValueError naming a rollout longer than ``seq_len``."""
    long = next((r for r in rollouts if len(r.ids) > seq_len), None)
    if long is not None:
        raise ValueError(f"{long.where}: the rollout holds {len(long.ids)} tokens, more than --seq-len {seq_len}; "
                         "cutting its completion would change its loss: raise --seq-len (or leave the row out)")
    if not packing:
        return [rollout_unit([r], seq_len, pad_id) for r in rollouts]
    units, row, used = [], [], 0
    for r in rollouts:
        if used + len(r.ids) > seq_len:
            units.append(rollout_unit(row, seq_len, pad_id))
            row, used = [], 0
        row.append(r)
        used += len(r.ids)
    return units + [rollout_unit(row, seq_len, pad_id)]


def load_rollouts(paths: Sequence[str], tok: ByteTokenizer | HFTokenizer, *, seq_len: int, packing: bool, seed: int,
                  eval_rows: int, estimator: str, scale_rewards: str, per_token_advantages: bool = False) -> TextData:
    """Read, tokenize and cut rollouts (see the module doc) into a run's units; advantages computed
    per group over the whole file. ``per_token_advantages``: require an advantage per completion token
    (PPO's GAE), not rewards. ValueError naming the row and the field at fault."""
    rollouts = parse_rollouts(read_rows(paths), prompt_completion_tokenizer(tok), vocab_size=tok.vocab_size)
    if per_token_advantages:
        bad = next((r for r in rollouts if not isinstance(r.advantage, tuple)), None)
        if bad is not None:
            raise ValueError(f"{bad.where}: --objective ppo takes an 'advantage' per completion token (GAE from a "
                             "value model); rewards per completion train with --objective grpo")
    rollouts = with_advantages(rollouts, estimator=estimator, scale_rewards=scale_rewards)
    units = rollout_units(rollouts, seq_len, packing=packing, pad_id=tok.pad_id)
    given = "rewards" if rollouts[0].reward is not None else "advantages"
    how = f" ({estimator} advantages per group, --scale-rewards {scale_rewards})" if given == "rewards" else ""
    extra = [f for f in PER_TOKEN if getattr(rollouts[0], f) is not None]
    what = (f"{len(rollouts)} rollouts with {given}{how} in {len(units)} {'packed ' if packing else ''}rows, "
            f"{sum(r.n_targets for r in rollouts)} completion tokens ({getattr(tok, 'name', 'tokenizer')})"
            f"{'; ' + ' and '.join(extra) + ' given' if extra else ''}")
    return TextData(units, seed=seed, eval_rows=eval_rows, vocab_size=tok.vocab_size, describe=what)

