"""Sequence parallelism inside ``transformers.Trainer`` and ``trl.SFTTrainer``: a mixin, or one line.

::

    class MyTrainer(seqpar.SeqParTrainerMixin, SFTTrainer):          # your own trainer class
        ...
    trainer = MyTrainer(model=model, args=args, train_dataset=ds, sp=2)

    trainer = SFTTrainer(model=model, args=args, train_dataset=ds)   # or Trainer(...), unchanged
    seqpar.parallelize_trainer(trainer, sp=2)                        # the one added line
    trainer.train()                                                  # torchrun --nproc-per-node 4 ...

Both parallelize ``trainer.model`` over a ``dp x sp`` mesh; :func:`parallelize_trainer` makes a built
trainer's class ``SeqParTrainerMixin`` over its own. The mixin overrides public Trainer methods only
(``get_*_dataloader``, ``get_batch_samples``, ``training_step``, ``compute_loss``, ``prediction_step``,
``evaluation_loop``) and changes what a step does, nothing else (its loaders and batch checks:
:mod:`seqpar.integrations.trainer.data`)::

    data        train loader split over dp only (accelerate's batch sampler: num_processes = dp,
                through seqpar.compat), so the sp ranks of a dp group get the same batch; eval /
                predict loaders unsplit
    per step    get_batch_samples: the step's micro-batches; N = seqpar.count_target_tokens(over
                dp) -- the exact target count (transformers' own count sums the sp copies too);
                one all-gather over all ranks checks that each SP group holds the same batches,
                so a collator that differs across an SP group raises on every rank, before any step
    per micro   compute_loss: model(**shard_batch(batch, mesh, num_items_in_batch=N)).loss
                  value: this dp group's share of the step's global token mean     x dp
                  grad:  d(this rank's token losses) * dp * sp / N   (the seqpar loss's own)
                (in place of TRL's compute_loss: its fused LM head and the entropy / token
                accuracy it logs from it are not run)
    images      a VLM collator's (TRL's DataCollatorForVisionLanguageModeling: pixel_values,
                image_grid_thw, mm_token_type_ids) go to shard_batch whole with the text; the model
                divides them over the SP ranks (seqpar.integrations.vlm.encoder); the SP-group check
                compares them too, and a key of a mechanism seqpar does not run is a Refused there
    gradients   the Trainer's own DDP over all dp x sp ranks averages, i.e. divides by dp * sp:
                exactly the gradient of the global token mean (:mod:`seqpar.batch.loss`).
                accelerate's FSDP2 averages over all processes the same way (not exercised on
                CPU, where accelerate runs DDP even when FSDP is configured)
    logging     the Trainer logs the mean over all ranks of the values: x dp makes it the global
                token mean, the loss the same run without seqpar logs
    eval        every rank runs every eval batch (its SP group shards it), the loss is the batch
                token mean, logits are gathered back to [B, S, V]; no cross-rank gather after (an
                uneven last batch still weighs by its rows, as gather_for_metrics makes it)
    faults      an exception in a step (the forward, the loss, the backward, DDP's all-reduce) or
                in reading the step's batches is told to every rank (seqpar.comm.faults): the
                other ranks raise RankFailed naming it instead of waiting for the collective timeout

accelerate's own context / sequence parallelism (``ParallelismConfig(cp_size=...)``: torch
context_parallel, which drops the attention mask, so packed documents would attend across their
boundaries; ``sp_size``: DeepSpeed Ulysses) is refused: it would shard the batch a second time.
Its ``dp_replicate_size``, ``dp_shard_size`` and ``tp_size`` run with seqpar's sp on one N-D mesh:
seqpar's sp borrows its ranks from accelerate's dp_shard (:mod:`.parallelism`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from ...batch.local_batch import BATCH_KWARG
from ...batch.loss import sync_gradients
from ...batch.sharding import count_target_tokens, shard_batch
from ...comm import faults
from ...comm.mesh import Axis, as_mesh, dp_size, init_mesh, mesh_dims, tp_size
from ...errors import Refused
from ..hf.parallelize import parallelize
from ..hf.router_losses import model_setting
from .data import check_sp_groups, drop_remainder, model_batch, split_loader
from .parallelism import check_parallelism, full_logits, mark_tensor_parallel, trainer_mesh_kwargs


class _State:
    """The mesh and layout a trainer runs on, and its sizes: world = dp * sp * tp ranks. ``own_sync``:
    seqpar averages the gradients itself (tp > 1: accelerate wraps no DDP around a TP model)."""

    def __init__(self, mesh: DeviceMesh, layout: str, strategy: str = "ulysses") -> None:
        self.mesh, self.layout, self.strategy = mesh, layout, strategy
        self.world, self.dp = int(mesh.mesh.numel()), dp_size(mesh)
        self.sp = mesh_dims(mesh).sp
        self.own_sync = tp_size(mesh) > 1
        self.dp_rank = mesh.get_local_rank(Axis.DP.value) if self.dp > 1 else 0

    def over(self, mesh: DeviceMesh) -> _State:
        """The same layout and strategy over another mesh (a dynamic schedule's block of ranks)."""
        return _State(mesh, self.layout, self.strategy)


class SeqParTrainerMixin:
    """Sequence parallelism for a ``transformers.Trainer`` subclass (``Trainer``, TRL's
    ``SFTTrainer``, yours): put it first among the bases and give the constructor ``sp=N`` (or
    ``mesh=seqpar.init_mesh(...)``), and optionally ``strategy`` / ``layout`` as for
    :func:`parallelize_trainer`. The other arguments go to the trainer unchanged.

    Raises what :func:`parallelize_trainer` raises, from the constructor."""

    loss_is_scaled_for_ga = True  # the loss is normalised by N over the whole accumulation window
    seqpar_batch_keys: tuple[str, ...] = ()  # a TRL trainer's own batch columns (integrations/trl/mixins.py)
    _seqpar: _State

    def __init__(self, *args: Any, sp: int | None = None, mesh: DeviceMesh | None = None,
                 strategy: str = "ulysses", layout: str = "contiguous", **kwargs: Any) -> None:
        _check_mesh_or_sp(mesh, sp, type(self).__name__)  # before the trainer is built
        super().__init__(*args, **kwargs)
        self._seqpar = _setup(self, mesh, sp, strategy, layout, who=type(self).__name__)

    # ---- data ---------------------------------------------------------------------------

    def get_train_dataloader(self):
        """The Trainer's train loader, split over the dp ranks only."""
        return split_loader(super().get_train_dataloader(), self._seqpar.dp, self._seqpar.dp_rank)

    def get_eval_dataloader(self, eval_dataset=None):
        """The Trainer's eval loader, unsplit: every rank reads every batch (its SP group shards it)."""
        return split_loader(super().get_eval_dataloader(eval_dataset), 1, 0)

    def get_test_dataloader(self, test_dataset):
        """The Trainer's predict loader, unsplit like the eval loader."""
        return split_loader(super().get_test_dataloader(test_dataset), 1, 0)

    def evaluation_loop(self, *args: Any, **kwargs: Any):
        """The Trainer's, without its gather over the ranks."""
        # every rank already holds every batch's loss, logits and labels: gathering over the
        # ranks would repeat them. What gather_for_metrics does besides gathering stays: the Trainer
        # repeats each batch's loss by the *first* batch's size, and the last batch's copies past
        # the dataset's end are cut (without it an uneven last batch would weigh as a full one).
        # The Trainer resets gather_function itself at the end.
        self.gather_function = functools.partial(drop_remainder, self.accelerator.gradient_state)
        return super().evaluation_loop(*args, **kwargs)

    # ---- one optimizer step -------------------------------------------------------------

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device):
        """The step's micro-batches and N, their exact target count over the dp ranks; checks
        that every SP group holds the same batches (one all-gather over all ranks)."""
        with faults.publishing("the Trainer's batches"):
            batches = list(itertools.islice(epoch_iterator, num_batches))  # fewer at the epoch's end
            state = self._seqpar
            check_sp_groups(batches, num_batches, state.mesh, self.seqpar_batch_keys)
            if not batches or "labels" not in batches[0]:
                return batches, None
            return batches, count_target_tokens([model_batch(b) for b in batches], state.mesh)

    def training_step(self, *args: Any, **kwargs: Any):
        """The Trainer's step; an exception in it is told to every rank (:mod:`seqpar.comm.faults`)."""
        with faults.publishing("the Trainer's training step"):
            loss = super().training_step(*args, **kwargs)
            if self._seqpar.own_sync and self.accelerator.sync_gradients:  # the step's last micro-batch: before
                sync_gradients(self.model, self._seqpar.mesh)  # clipping and the optimizer, over dp x sp only
            return loss

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        """The seqpar loss of this rank's shard, its value scaled for the Trainer's logging."""
        state = self._seqpar
        if num_items_in_batch is not None and not isinstance(num_items_in_batch, (int, float)):
            num_items_in_batch = float(num_items_in_batch)
        local = shard_batch(model_batch(inputs), state.mesh, layout=state.layout,
                            num_items_in_batch=num_items_in_batch or None)
        outputs = model(**local)
        loss = outputs.loss
        if loss is None:
            raise ValueError("the batch has no labels: seqpar's Trainer integration trains a causal LM on labels")
        aux = _trl_aux_term(self, model, outputs, num_items_in_batch)
        if aux is not None:  # TRL's weighting of the router aux loss in place of the model's own
            loss = outputs.loss - _model_aux_term(self.model, outputs)
        if model.training and num_items_in_batch:
            # value x dp (the log's mean over all ranks becomes the global mean), gradient
            # unchanged (the seqpar loss already scales it for the DDP / FSDP average): the
            # second term is exactly zero in value and carries the gradient
            loss = loss.detach() * state.dp + (loss - loss.detach())
            if aux is not None:  # TRL averages it over dp: value as is, gradient / dp (the hook scaled it x dp)
                aux = aux.detach() + (aux - aux.detach()) / state.dp
        if aux is not None:
            loss = loss + aux
        if return_outputs:
            outputs.logits = full_logits(outputs.logits, local[BATCH_KWARG], state.mesh, _unwrap(model))
            return loss, outputs
        return loss

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None):
        """Loss (the batch's token mean), logits ``[B, S, V]`` and labels of a whole batch, on every rank."""
        inputs = {k: v.to(self.args.device) if isinstance(v, Tensor) else v for k, v in inputs.items()}
        labels = inputs.get("labels")
        with torch.no_grad():
            local = shard_batch(model_batch(inputs), self._seqpar.mesh, layout=self._seqpar.layout)
            outputs = model(**local)
        loss = outputs.loss.detach() if outputs.loss is not None else None
        if prediction_loss_only:
            return loss, None, None
        return loss, full_logits(outputs.logits.detach(), local[BATCH_KWARG], self._seqpar.mesh, _unwrap(model)), labels


def _model_aux_term(model: nn.Module, outputs: Any) -> Tensor:
    """``coef * aux_loss`` as the model added it to its loss (its own coefficient)."""
    coef = float(model_setting(_unwrap(model), ("router_aux_loss_coef", "aux_loss_coef"), 0.0))
    return coef * outputs.aux_loss.to(outputs.loss)


def _trl_aux_term(trainer: Any, model: nn.Module, outputs: Any, num_items_in_batch: Any) -> Tensor | None:
    """TRL SFTTrainer's router aux term (``aux_loss_enabled``): its ``router_aux_loss_coef`` times
    the exact aux loss, over the accumulation steps when ``num_items_in_batch`` is given (TRL's
    ``compute_loss``); None for other trainers, which keep the model's own term."""
    if not getattr(trainer, "aux_loss_enabled", False) or getattr(outputs, "aux_loss", None) is None:
        return None
    steps = trainer.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
    return trainer.router_aux_loss_coef * outputs.aux_loss.to(outputs.loss) / steps


_classes: dict[tuple[type, tuple[type, ...]], type] = {}

@dataclass(frozen=True)
class TrlEntry:
    """How :func:`parallelize_trainer` treats one TRL trainer class (``name``: its public import path).
    Exactly one of three: with TRL's own loss over a sharded stand-in model (``mixin`` and ``setup``;
    under a dynamic schedule the ``dynamic`` methods class, with the ``check_dynamic`` that refuses
    what it cannot make exact; None: no dynamic schedule), through the Trainer integration's causal-LM
    token mean (no mixin, not refused: ``SFTTrainer``), or ``refused``: why seqpar cannot make it exact."""

    name: str
    mixin: type[SeqParTrainerMixin] | None = None
    setup: Callable[[Any, _State], None] | None = None
    dynamic: type | None = None
    check_dynamic: Callable[[Any], None] | None = None
    refused: str | None = None

    @property
    def exact(self) -> bool:
        return self.refused is None


TRL_TRAINERS: dict[str, TrlEntry] = {}
"""Every TRL trainer class, exact or refused, keyed by where TRL defines it (:func:`trl_key`,
``"trl.trainer.dpo_trainer.DPOTrainer"``); filled by :mod:`seqpar.integrations.trl.registry` (which
``import seqpar`` imports; it subclasses the mixin above, so this module cannot import it). A TRL
trainer class that is not here (new in a TRL release) is refused until it is classified."""


def trl_key(cls: type) -> str:
    """The registry key of a class: its defining module and qualified name."""
    return f"{cls.__module__}.{cls.__qualname__}"


def trl_class(cls: type) -> type | None:
    """The first TRL class along ``cls``'s MRO (TRL's own trainer class, or the TRL class a user
    subclassed), or None for a trainer that is not TRL's. By module name: TRL is never imported here."""
    return next((k for k in cls.__mro__ if k.__module__.split(".")[0] == "trl"), None)


def trl_kind(cls: type) -> str | None:
    """The class name of :func:`trl_class` ("DPOTrainer", "GRPOTrainer"...), or None."""
    klass = trl_class(cls)
    return klass.__name__ if klass is not None else None


def trl_entry(cls: type) -> TrlEntry | None:
    """The :class:`TrlEntry` of a TRL trainer class (or of the user's subclass of one), None for a
    trainer that is not TRL's. Refused for a TRL class seqpar has not classified."""
    klass = trl_class(cls)
    if klass is None:
        return None
    if not TRL_TRAINERS:
        raise Refused("seqpar's TRL integration is not loaded: import seqpar (or "
                      "seqpar.integrations.trl.registry) before parallelize_trainer")
    entry = TRL_TRAINERS.get(trl_key(klass))
    if entry is None:
        raise Refused(f"TRL's {klass.__name__} ({trl_key(klass)}) is not classified by seqpar (a trainer new in "
                      "this TRL release): seqpar has not verified that it is exact; train it without seqpar, or "
                      "with the TRL release seqpar was tested with (seqpar/tested.txt)")
    return entry


def parallelize_trainer(trainer: Any, mesh: DeviceMesh | None = None, *, sp: int | None = None,
                        strategy: str = "ulysses", layout: str = "contiguous", schedule: Any = None) -> Any:
    """Make a constructed ``transformers.Trainer`` (or subclass: ``trl.SFTTrainer``) train, evaluate
    and predict with sequence parallelism over ``mesh`` (or ``seqpar.init_mesh(sp=sp)``), in place:
    its class becomes :class:`SeqParTrainerMixin` over its own.

    Call it after the trainer is built and before ``train()``; the processes come from ``torchrun``
    or ``accelerate launch`` (one per device). The dataset's rows are full sequences; each dp group
    of ``sp`` ranks reads the same batches and shards them along the sequence. ``strategy``: as for
    :func:`seqpar.parallelize`; ``layout``: as for :func:`seqpar.shard_batch` ("doc-zigzag"
    balances ring attention on packed rows). Eval and predict return the loss and the logits of
    whole sequences (``[B, S, V]``, gathered over sp) on every rank. Returns the trainer.

    Raises ValueError (the same on every rank, before any step) if ``sp`` does not divide the world
    size, if the model cannot be parallelized (:func:`seqpar.parallelize`), if the mesh does not
    span every process of the trainer, if accelerate's own context / sequence parallelism is on, or
    if the trainer computes a loss other than the causal-LM token mean (``compute_loss_func``,
    label smoothing, TRL's ``loss_type="dft"``). TRL's ``DPOTrainer``, ``RewardTrainer``, ``KTOTrainer``,
    ``GRPOTrainer`` and ``RLOOTrainer`` keep their own loss, exact (:mod:`seqpar.integrations.trl`);
    what of them seqpar cannot make exact is Refused by its option name; every other TRL trainer is
    Refused by name with the reason (:mod:`seqpar.integrations.trl.registry`). A MoE router aux loss
    is exact (the model's ``coef * aux_loss`` over the whole batch,
    :mod:`~seqpar.integrations.hf.router_losses`; with TRL's SFTTrainer weighted as TRL weights it: its
    ``router_aux_loss_coef``, over the accumulation steps, averaged over dp;
    at dp > 1 each dp rank's own, as under DDP without seqpar). Another TRL trainer adding a router
    aux loss at dp > 1 is Refused (not yet held against DDP).
    ``schedule``: a dynamic SP schedule over ``mesh`` (``seqpar.planner.bins.DynamicSP``): each
    micro-batch's rows binned, each bin at the degree it needs (:mod:`~seqpar.integrations.trainer.dynamic`; TRL's DPO
    and reward trainers: whole pairs per bin, :mod:`seqpar.integrations.trl.dynamic`; the others are refused).
    """
    dynamic: tuple[type, ...] = ()
    if schedule is not None:  # the dynamic schedule (issue 37): its methods live in their own module
        from .dynamic import DynamicTrainerMethods, check_dynamic

        layout, dynamic = check_dynamic(trainer, mesh, schedule, sp=sp, layout=layout), (DynamicTrainerMethods,)
    if isinstance(trainer, SeqParTrainerMixin):
        raise ValueError("this trainer is already sequence-parallel (seqpar.parallelize_trainer or "
                         "seqpar.SeqParTrainerMixin)")
    entry = _own_loss_entry(trainer)
    if entry is not None and schedule is not None:  # TRL's DPO / Reward: whole pairs per bin, TRL's loss
        if entry.check_dynamic is not None:
            entry.check_dynamic(trainer)  # refuses what it cannot make exact, by name
        if entry.dynamic is None:
            raise Refused(f"a dynamic SP schedule (schedule=) with TRL's {trl_kind(type(trainer))} is not supported: "
                          "leave schedule=None (the static schedule)")
        dynamic = (entry.dynamic,)
    mixin = entry.mixin if entry else SeqParTrainerMixin  # TRL's trainers with their own loss: their mixin
    state = _setup(trainer, mesh, sp, strategy, layout, who="parallelize_trainer")
    base = type(trainer)
    cls = _classes.get((base, dynamic))
    if cls is None:  # the base's own loss_is_scaled_for_ga where its compute_loss stays TRL's
        own = {} if mixin is SeqParTrainerMixin else {"loss_is_scaled_for_ga": base.loss_is_scaled_for_ga}
        cls = _classes[base, dynamic] = type(f"SeqPar{'Dynamic' * bool(dynamic)}{base.__name__}",
                                             (*dynamic, mixin, base), own)
    trainer.__class__ = cls  # the class a user would have written; its __init__ has already run
    trainer._seqpar = state
    if schedule is not None:
        trainer._dynamic, trainer.rows_at_degree = schedule, {}
    return trainer


def _setup(trainer: Any, mesh: DeviceMesh | None, sp: int | None, strategy: str, layout: str, *,
           who: str) -> _State:
    """Check the trainer and parallelize its model over ``mesh`` (or ``init_mesh(sp=sp)``)."""
    _check_mesh_or_sp(mesh, sp, who)
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    mesh = init_mesh(**trainer_mesh_kwargs(pc, sp)) if mesh is None else as_mesh(mesh, who)
    state = _State(mesh, layout, strategy)
    processes = int(trainer.accelerator.num_processes)
    if state.world != processes:
        raise ValueError(f"the mesh spans {state.world} ranks but the trainer runs {processes} processes: "
                         "build the mesh over every process (seqpar.init_mesh(sp=...))")
    check_parallelism(trainer, mesh)  # accelerate's cp / sp refused; its tp must be the mesh's
    entry = _own_loss_entry(trainer)
    if entry is not None and state.own_sync:
        raise Refused(f"TRL's {trl_kind(type(trainer))} with tensor parallelism (tp={tp_size(mesh)}) is not "
                      "supported: its loss reads whole-vocabulary logits; use tp=1")
    if entry is not None:  # TRL's trainers with their own loss (DPO, GRPO...): TRL's loss, sharded
        mixin, setup_trl = entry.mixin, entry.setup
        assert mixin is not None and setup_trl is not None, entry
        if who != "parallelize_trainer" and not isinstance(trainer, mixin):
            raise ValueError(f"{who} is over TRL's {mixin.__name__.removeprefix('SeqPar').removesuffix('Mixin')}"
                             f"Trainer, whose loss SeqParTrainerMixin does not compute: build it plainly and call "
                             "seqpar.parallelize_trainer(trainer, sp=...)")
        setup_trl(trainer, state)
        return state
    check_own_loss(type(trainer))
    check_loss_options(trainer)
    unverified = _router_aux_unverified(trainer) if state.dp > 1 else None
    if unverified is not None:
        raise Refused(f"the MoE router aux loss (output_router_logits) under {unverified} with dp > 1 is not yet "
                      f"verified exact (dp={state.dp}): train with sp only (dp=1), or set output_router_logits=False")
    parallelize(_unwrap(trainer.model), mesh, strategy=strategy)
    if state.own_sync:
        mark_tensor_parallel(_unwrap(trainer.model), tp_size(mesh))
    return state


def _own_loss_entry(trainer: Any) -> TrlEntry | None:
    """The trainer's :class:`TrlEntry` when seqpar runs it with TRL's own loss; None for the Trainer
    integration's token mean (``Trainer``, ``SFTTrainer``, a user's subclass); Refused, naming the
    trainer and the reason, for a TRL trainer seqpar cannot make exact."""
    entry = trl_entry(type(trainer))
    if entry is not None and entry.refused is not None:
        raise Refused(f"seqpar cannot make TRL's {entry.name} exact: {entry.refused}")
    return entry if entry is not None and entry.mixin is not None else None


def _router_aux_on(trainer: Any) -> bool:
    """The trainer adds a MoE router aux loss: TRL's ``aux_loss_enabled`` or the model's config."""
    config = getattr(_unwrap(trainer.model), "config", None)
    text = getattr(config, "text_config", None) or config
    return bool(getattr(trainer, "aux_loss_enabled", False) or getattr(text, "output_router_logits", False))


def _router_aux_unverified(trainer: Any) -> str | None:
    """The TRL trainer class whose router aux loss at dp > 1 has not been held against DDP without
    seqpar, or None: ``Trainer`` and ``SFTTrainer`` (and subclasses) have (test_trainer, dp2 x sp2)."""
    if not _router_aux_on(trainer):
        return None
    trl = [c for c in type(trainer).__mro__ if c.__module__.split(".")[0] == "trl"]
    return None if not trl or any(c.__name__ == "SFTTrainer" for c in trl) else trl[0].__name__


def _check_mesh_or_sp(mesh: DeviceMesh | None, sp: int | None, who: str) -> None:
    if (mesh is None) == (sp is None):
        raise ValueError(f"give {who} either mesh=seqpar.init_mesh(sp=...) or sp=N")


# the classes whose compute_loss seqpar's replaces knowingly: the token mean (and SFTTrainer's
# metrics and router aux term) is what they compute
_OWN_LOSS_KNOWN = {("transformers.trainer", "Trainer"), ("trl.trainer.sft_trainer", "SFTTrainer")}


def check_own_loss(cls: type) -> None:
    """Refuse a trainer class whose own ``compute_loss`` seqpar's would replace (a user's custom
    loss, TRL's ``KTOTrainer`` / ``RLOOTrainer`` / ``DistillationTrainer``...): the generic
    integration computes the causal-LM token mean, and silently dropping another loss is wrong."""
    for klass in cls.__mro__:
        if klass is SeqParTrainerMixin or issubclass(SeqParTrainerMixin, klass) or "compute_loss" not in vars(klass):
            continue
        if (klass.__module__, klass.__name__) in _OWN_LOSS_KNOWN:
            return  # reached the Trainer / SFTTrainer loss: every subclass above kept it
        raise Refused(f"{klass.__module__}.{klass.__name__} defines its own compute_loss, which seqpar's Trainer "
                      "integration would replace by the causal-LM token mean: train its objective through "
                      "seqpar.objectives (your own loop), use one of the trainers seqpar supports (Trainer, "
                      "SFTTrainer, TRL's DPO / Reward / KTO / GRPO / RLOO trainers), or keep the model's own loss")


def check_loss_options(trainer: Any) -> None:
    """Refuse the Trainer / TRL options whose loss seqpar's compute_loss would not compute (rather
    than ignore them): the loss here is the model's causal-LM token mean, nothing else."""
    args = trainer.args
    refused = {
        "compute_loss_func": getattr(trainer, "compute_loss_func", None) is not None,
        "label_smoothing_factor": bool(getattr(args, "label_smoothing_factor", 0.0)),
        f"loss_type={getattr(args, 'loss_type', None)!r}": getattr(args, "loss_type", "nll") not in ("nll", None),
    }
    named = [k for k, on in refused.items() if on]
    if named:
        raise Refused(f"seqpar's Trainer integration computes the causal-LM token mean only; it would ignore "
                      f"{', '.join(named)}: turn {'it' if len(named) == 1 else 'them'} off to train with seqpar")


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model
