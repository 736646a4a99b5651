"""The embedded tasks ``seqpar train`` learns when given no data, and their sources
(:class:`~seqpar.train.sources.DataSource`): the long-range copy task (``--objective sft``) and the
counting preference demo (the preference objectives).

The copy task copies across the sequence.

Each row is a random string followed by its copy::

    position   0     1 ... L      L+1    L+2 ... 2L+1
    token      BOS   x1 ... xL    SEP    x1  ...  xL       (L = (seq_len - 2) // 2)
    target     -     -  ...  -    x1     x2  ...  -        every copied symbol is a target

The symbol to predict always sits ``L + 1`` tokens back (2047 at ``--seq-len 4096``): no local
statistics help (symbols are uniform and independent), so the loss only falls once attention
learns to reach across the whole sequence. Under sequence parallelism that is across ranks: with
``sp = 2`` every answer lives in the other rank's shard. Chance accuracy is ``1 / SYMBOLS``.

Rows are a pure function of ``(seed, split, index)``: the data order never depends on how many
ranks run the job or where it was resumed, and held-out rows never coincide with training rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seqpar.batch.targets import IGNORE_INDEX
from seqpar.objectives.advantages import group_advantages
from seqpar.objectives.rollouts import Rollout

from .preference_data import kto_unit, pair_units
from .rollout_data import rollout_unit
from .sources import TRAIN, TaskSource
from .tokenizer import Document

PAD, BOS, SEP = 0, 1, 2
SPECIALS = 3


@dataclass(frozen=True)
class CopyTask:
    """Rows of ``seq_len`` tokens: ``[BOS] x [SEP] x`` with ``x`` uniform over ``symbols`` symbols."""

    seq_len: int
    seed: int = 0
    symbols: int = 64

    name = "copy"
    min_seq_len = 6  # BOS, 2 symbols, SEP, 2 symbols: at least one target that is not the first copy

    def __post_init__(self) -> None:
        if self.seq_len < self.min_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} is too short for the copy task: use --seq-len >= "
                             f"{self.min_seq_len} (thousands show what sequence parallelism is for)")

    @property
    def vocab_size(self) -> int:
        return SPECIALS + self.symbols

    @property
    def span(self) -> int:
        """L: symbols per copy; each target sits L + 1 tokens after its source."""
        return (self.seq_len - 2) // 2

    @property
    def chance(self) -> float:
        return 1.0 / self.symbols

    def _generator(self, split: int, index: int) -> torch.Generator:
        # one independent stream per (seed, split, row); plain ints, no salted str hashing
        return torch.Generator().manual_seed(((self.seed * 2 + split) * 2**31 + index) % 2**63)

    def row(self, index: int, split: int = TRAIN) -> dict[str, Tensor]:
        """Row ``index`` of ``split`` (TRAIN or EVAL): ``input_ids`` and ``labels``, each ``[seq_len]``."""
        n = self.span
        x = SPECIALS + torch.randint(0, self.symbols, (n,), generator=self._generator(split, index))
        ids = torch.full((self.seq_len,), SEP, dtype=torch.long)
        ids[0] = BOS
        ids[1:n + 1] = x
        ids[n + 2:2 * n + 2] = x
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[n + 2:2 * n + 2] = x  # unshifted: shard_batch makes labels[i + 1] the target of position i
        return {"input_ids": ids, "labels": labels}

    def describe(self) -> str:
        return (f"copy task: {self.span} random symbols (of {self.symbols}) then their copy; every answer sits "
                f"{self.span + 1} tokens back")


@dataclass(frozen=True)
class CountingPreference:
    """The preference demo (``--objective dpo|simpo|orpo|reward`` without ``--data``). Prompt
    ``[BOS] x [SEP]`` (``x``: half the row of random symbols); chosen: as many symbols counting up
    from ``x``'s last one (``x[-1] + 1, x[-1] + 2, ...`` modulo the alphabet); rejected: as many
    other symbols, each differing from the chosen one. A rule a tiny model finds from scratch
    in a few minutes of DPO (the long-range copy task does not: DPO's signal on a random model is
    too weak), so the held-out preference accuracy visibly rises."""

    seq_len: int
    seed: int = 0
    symbols: int = 64

    @property
    def span(self) -> int:
        """Symbols in the prompt, and in each answer: half the row each."""
        return (self.seq_len - 2) // 2

    @property
    def vocab_size(self) -> int:
        return SPECIALS + self.symbols

    def pair(self, index: int, split: int = TRAIN) -> tuple[list[int], list[int], list[int]]:
        """``(prompt, chosen, rejected)`` token ids of pair ``index`` of ``split``."""
        g = torch.Generator().manual_seed(((self.seed * 2 + split) * 2**31 + index + 7919) % 2**63)
        x = SPECIALS + torch.randint(0, self.symbols, (self.span,), generator=g)
        chosen = SPECIALS + (x[-1] - SPECIALS + torch.arange(1, self.span + 1)) % self.symbols
        shift = torch.randint(1, self.symbols, (self.span,), generator=g)  # never the chosen symbol
        other = SPECIALS + (chosen - SPECIALS + shift) % self.symbols
        return [BOS, *x.tolist(), SEP], chosen.tolist(), other.tolist()

    def describe(self) -> str:
        return (f"preference demo: a prompt of {self.span} random symbols (of {self.symbols}); chosen: {self.span} "
                f"symbols counting up from its last one; rejected: {self.span} other symbols")


@dataclass
class CopyTaskSource(TaskSource):
    """The copy task as a data source: row ``index`` of a split, drawn when read."""

    task: CopyTask
    rows_per_unit = 1

    @property
    def chance(self) -> float:
        return self.task.chance

    def row(self, index: int, split: int = TRAIN) -> dict[str, Tensor]:
        return self.task.row(index, split)


@dataclass
class PreferenceDemo(TaskSource):
    """The preference demo (:class:`CountingPreference`) as a data source: pair ``index`` of a split is
    one unit of two padded rows (chosen, rejected), drawn when read (like the copy task's rows)."""

    task: CountingPreference
    chance = 0.5
    rows_per_unit = 2

    def row(self, index: int, split: int = TRAIN) -> dict[str, Tensor]:
        p, c, r = self.task.pair(index, split)
        docs = [Document(p + x, [False] * len(p) + [True] * len(x)) for x in (c, r)]
        return pair_units([(docs[0], docs[1])], self.task.seq_len, packing=False, pad_id=PAD)[0][0]


def copy_task_source(seq_len: int, seed: int, eval_rows: int, *, packing: bool) -> CopyTaskSource:
    """The copy task's data; ValueError for options it cannot take (a row too short for the task)."""
    if packing:
        raise ValueError("the copy task fills each row with one sequence, so --packing has nothing to pack: leave "
                         "it out, or give --data")
    return CopyTaskSource(CopyTask(seq_len, seed), eval_rows)


def preference_demo(seq_len: int, seed: int, eval_rows: int, *, packing: bool) -> PreferenceDemo:
    """The preference demo's data; ValueError for options it cannot take."""
    if packing:
        raise ValueError("the preference demo fills each row with one sequence, so --packing has nothing to pack: "
                         "leave it out, or give --data")
    task = CountingPreference(seq_len, seed)
    if task.span < 2:  # span = (seq_len - 2) // 2: two symbols per answer need 6 tokens
        least = 2 * 2 + 2
        raise ValueError(f"--seq-len {seq_len} is too short for the preference demo: use --seq-len >= {least}")
    return PreferenceDemo(task, eval_rows)


@dataclass
class RolloutDemo(TaskSource):
    """The preference demo as RL rollouts (``--objective grpo|ppo`` without ``--data``): unit ``index``
    is one prompt's group of two completions, the counting-up one with reward 1 and the other with
    reward 0, their GRPO advantages (group mean / std; for ppo the same on every completion token), as
    two padded rows ``[2, S]``."""

    task: CountingPreference
    chance = None
    rows_per_unit = 2

    def row(self, index: int, split: int = TRAIN) -> dict[str, Tensor]:
        p, c, r = self.task.pair(index, split)
        adv = group_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), [0, 0]).tolist()
        rows = [rollout_unit([Rollout("demo", tuple(p + x), tuple([False] * len(p) + [True] * len(x)), 0,
                                      advantage=a)], self.task.seq_len, PAD) for x, a in ((c, adv[0]), (r, adv[1]))]
        return {k: torch.stack([row[k] for row in rows]) for k in rows[0]}


def rollout_demo(seq_len: int, seed: int, eval_rows: int, *, packing: bool) -> RolloutDemo:
    """The RL demo's data (the preference demo's task); ValueError for options it cannot take."""
    return RolloutDemo(preference_demo(seq_len, seed, eval_rows, packing=packing).task, eval_rows)


@dataclass
class UnpairedDemo(TaskSource):
    """The preference demo as KTO's unpaired rows (``--objective kto`` without ``--data``): unit
    ``index`` is pair ``index // 2``'s chosen completion (desirable) or rejected one (not), by parity,
    with its KL row: the prompt with the pair's other completion."""

    task: CountingPreference
    chance = None
    rows_per_unit = 2

    def row(self, index: int, split: int = TRAIN) -> dict[str, Tensor]:
        p, c, r = self.task.pair(index // 2, split)
        mine, other = (c, r) if index % 2 == 0 else (r, c)
        unit = kto_unit(p, mine, other, index % 2 == 0, self.task.seq_len, PAD)
        assert unit is not None  # the prompt is half the row
        return unit


def unpaired_demo(seq_len: int, seed: int, eval_rows: int, *, packing: bool) -> UnpairedDemo:
    """KTO's demo data (the preference demo's task); ValueError for options it cannot take."""
    return UnpairedDemo(preference_demo(seq_len, seed, eval_rows, packing=packing).task, eval_rows)
