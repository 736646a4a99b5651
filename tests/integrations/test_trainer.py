"""seqpar inside transformers' Trainer and TRL's SFTTrainer (``seqpar.integrations.trainer.mixin``).

Each case trains the same script twice: in this process without seqpar (the reference), and on
gloo workers with ``parallelize_trainer(trainer, mesh)`` -- sp=2 on 2 processes, dp=2 x sp=2 on 4
(``-m heavy``). The Trainer runs Ulysses on padded rows, SFTTrainer padded rows on Ulysses and
packed (padding-free) rows on ring attention with the doc-zigzag layout. The padded SFT run comes
through the mixin (``class ...(SeqParTrainerMixin, SFTTrainer)``, the mesh given to the
constructor), the others through ``parallelize_trainer`` on the trainer as built.
Every logged loss and the final weights must agree to 1e-6 in float32, with gradient accumulation
2 and micro-batches of different token counts. Resuming from a Trainer checkpoint must reproduce
the uninterrupted run's losses; bad input must raise the same ValueError on every rank before any
step. The workers start once per process count and run every case in one go.

The MoE runs at dp > 1 take as reference the same script under DDP over dp processes without
seqpar, not one process reading the dp ranks' rows as one batch: the router aux loss is a product
of one forward's means, so under DDP it is each dp rank's own, and transformers' Trainer scales
it by num_processes with the rest of the loss (the dp ranks' terms are summed; SFTTrainer averages
them). One process over the joint rows computes another loss (0.46 apart in the logged loss for
Trainer, 0.006 for SFTTrainer at dp=2), which is why this case was once refused.
"""

from __future__ import annotations

import os

import pytest
import torch
from trainer_rows import VOCAB, rows

from seqpar.comm.launch import run_distributed

TOL = 1e-6
STEPS = 3
MICRO = 2  # per-device micro-batch (rows) of one dp rank
ACCUM = 2


# ---------------------------------------------------------------------------------------------
# the "script": data, model, trainer -- the same with and without seqpar
# ---------------------------------------------------------------------------------------------


class PadCollator:
    """Right-pads a list of rows to the longest (plus ``extra`` on a given rank: the bad-input case)."""

    def __init__(self, extra_on_rank: int | None = None) -> None:
        self.extra_on_rank = extra_on_rank

    def __call__(self, rows):
        width = max(len(r["input_ids"]) for r in rows)
        if self.extra_on_rank is not None and int(os.environ.get("RANK", 0)) == self.extra_on_rank:
            width += 3
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r["input_ids"]), torch.tensor(r["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _model(kind: str = "tiny-llama"):
    from seqpar.integrations.models import build_model

    torch.manual_seed(0)
    if kind == "roberta":  # a model seqpar refuses (positions numbered from the padding index)
        from seqpar.testing.zoo import build_tiny

        return build_tiny("roberta", is_decoder=True)
    if kind == "moe":  # issue 36: router logits on, the aux loss weighted 0.1 (the zoo's tiny Qwen3-MoE)
        from seqpar.testing.zoo import build_tiny

        return build_tiny("qwen3_moe").float()
    model, _ = build_model(kind, dtype=torch.float32, vocab_size=VOCAB)
    return model


def _tokenizer():
    """A word-level tokenizer over the ids (TRL needs one for pad / eos)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _args(out: str, batch: int, *, trl: bool = False, packing: bool = False, steps: int = STEPS, save: int = 0):
    """The same TrainingArguments / SFTConfig with and without seqpar (only the batch differs: see train)."""
    common = dict(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=MICRO,
                  gradient_accumulation_steps=ACCUM, max_steps=steps, learning_rate=3e-3, logging_steps=1,
                  save_strategy="steps" if save else "no", save_steps=save or 500, report_to=[], use_cpu=True,
                  seed=0, disable_tqdm=True, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.01)
    if trl:
        from trl import SFTConfig

        # float32 (SFTConfig turns bf16 autocast on by default); its default activation checkpointing stays on
        return SFTConfig(max_length=64 if packing else None, packing=packing, padding_free=packing, bf16=False,
                         **common)
    from transformers import TrainingArguments

    return TrainingArguments(**common)


def train(kind: str, out: str, *, mesh=None, dp: int = 1, resume: str | None = None) -> dict:
    """The user's script: ``kind`` is "trainer" (4 steps, a checkpoint at step 2, then evaluate and
    predict), "sft-padded" or "sft-packed" (3 steps). With ``mesh`` it adds the one seqpar line
    (packed rows on ring attention and the doc-zigzag layout); without, one process reads the dp
    ranks' rows as one batch of ``dp`` x MICRO."""
    from seqpar.integrations.trainer.mixin import SeqParTrainerMixin, parallelize_trainer

    net = _model(_model_kind(kind))
    batch = MICRO if mesh is not None else MICRO * dp
    if kind == "trainer":
        from transformers import Trainer

        trainer = Trainer(model=net, args=_args(out, batch, steps=STEPS + 1, save=2), train_dataset=rows(48, 1),
                          eval_dataset=rows(6, 2), data_collator=PadCollator())
    elif kind == "trainer-moe":
        from transformers import Trainer

        trainer = Trainer(model=net, args=_args(out, batch), train_dataset=rows(48, 1), data_collator=PadCollator())
    else:
        from datasets import Dataset
        from trl import SFTTrainer

        packing = kind == "sft-packed"  # "sft-moe": padded rows, TRL's own aux-loss weighting
        cls, extra = SFTTrainer, {}
        if mesh is not None and kind == "sft-padded":  # the user's own class, sequence-parallel from birth

            class MySFTTrainer(SeqParTrainerMixin, SFTTrainer):
                pass

            cls, extra = MySFTTrainer, {"mesh": mesh}
        trainer = cls(model=net, args=_args(out, batch, trl=True, packing=packing),
                      train_dataset=Dataset.from_list(rows(160 if packing else 48, 1)),
                      processing_class=_tokenizer(), **extra)
    if mesh is not None and not isinstance(trainer, SeqParTrainerMixin):
        ring = kind == "sft-packed"
        parallelize_trainer(trainer, mesh, strategy="ring" if ring else "ulysses",
                            layout="doc-zigzag" if ring else "contiguous")  # the line a user adds
    trainer.train(resume_from_checkpoint=resume)
    result = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "weights": {n: p.detach().clone() for n, p in net.named_parameters()}}
    if kind == "trainer" and not resume:
        result["eval"] = trainer.evaluate()["eval_loss"]
        pred = trainer.predict(rows(3, 3))
        result["predict"] = (torch.as_tensor(pred.predictions), torch.as_tensor(pred.label_ids))
    return result


KINDS = ["trainer", "sft-padded", "sft-packed", "trainer-moe", "sft-moe"]


def _model_kind(kind: str) -> str:
    return "moe" if kind.endswith("-moe") else "tiny-llama"
BAD = ["collator", "model", "sp", "own-loss"]


def _bad(case: str, out: str):
    """Bad input: returns this rank's ValueError text (None if nothing raised) and the step reached."""
    from transformers import Trainer

    import seqpar
    from seqpar.integrations.trainer.mixin import parallelize_trainer

    class OwnLossTrainer(Trainer):  # a user's trainer with its own loss: seqpar's must not replace it silently
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(**inputs).logits.square().mean()

    trainer = (OwnLossTrainer if case == "own-loss" else Trainer)(
        model=_model("roberta" if case == "model" else "tiny-llama"), args=_args(out, MICRO),
        train_dataset=rows(48, 1), data_collator=PadCollator(extra_on_rank=1 if case == "collator" else None))
    try:
        if case == "sp":
            parallelize_trainer(trainer, sp=3)
        else:
            parallelize_trainer(trainer, seqpar.init_mesh(sp=2, device_type="cpu"))
            trainer.train()
    except ValueError as e:
        return str(e), trainer.state.global_step
    return None, trainer.state.global_step


def _worker(rank: int, world: int, out: str, kinds: list[str], bad: list[str]) -> dict:
    import seqpar

    mesh = seqpar.init_mesh(sp=2, device_type="cpu")
    res: dict = {}
    for kind in kinds:
        res[kind] = train(kind, os.path.join(out, kind), mesh=mesh)
    if "trainer" in kinds:  # the same 4-step run again, resumed from its checkpoint of step 2
        path = os.path.join(out, "trainer")
        res["resumed"] = train("trainer", path, mesh=mesh, resume=os.path.join(path, "checkpoint-2"))
    for case in bad:
        res[f"bad-{case}"] = _bad(case, os.path.join(out, f"bad-{case}"))
    return res


def _ddp_worker(rank: int, world: int, out: str, kinds: list[str]) -> dict:
    """The script without seqpar under the Trainer's own DDP over ``world`` processes (gloo)."""
    return {kind: train(kind, os.path.join(out, f"ddp-{kind}")) for kind in kinds}


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------

# P=4 (dp=2 x sp=2) is heavy: each worker imports transformers' Trainer, accelerate and TRL (~10 s of
# CPU each, measured), which four processes on this 2-core machine cannot fit in the default budget
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.heavy)], ids=["sp2", "dp2xsp2"])
def runs(request, tmp_path_factory):
    """(P, every rank's results, the references: single-process, DDP for MoE at dp > 1)."""
    world = request.param
    out = str(tmp_path_factory.mktemp(f"trainer{world}"))
    results = run_distributed(_worker, world, out, KINDS, BAD, timeout=600.0)
    dp = world // 2
    moe = [kind for kind in KINDS if kind.endswith("-moe")] if dp > 1 else []
    refs = {kind: train(kind, os.path.join(out, f"ref-{kind}"), dp=dp) for kind in KINDS if kind not in moe}
    if moe:  # the router aux loss is each dp rank's own: the reference is DDP without seqpar (module doc)
        ddp = run_distributed(_ddp_worker, dp, out, moe, timeout=600.0)
        for kind in moe:
            _close(ddp[1][kind]["losses"], ddp[0][kind]["losses"], f"DDP reference {kind}: the ranks' logged losses")
            refs[kind] = ddp[0][kind]
    return world, results, refs


def _close(a, b, what):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    err = float((a - b).abs().max()) if a.numel() else 0.0
    assert err <= TOL, f"{what}: max difference {err:.3g} > {TOL}"


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_parity(runs, kind):
    world, results, refs = runs
    ref = refs[kind]
    assert len(ref["losses"]) == STEPS + (kind == "trainer")
    for rank, res in enumerate(results):
        _close(res[kind]["losses"], ref["losses"], f"P={world} rank {rank} {kind} logged losses")
    for name, w in ref["weights"].items():
        for rank, res in enumerate(results):
            _close(res[kind]["weights"][name], w, f"P={world} rank {rank} {kind} weight {name}")
    start = _model(_model_kind(kind)).state_dict()
    assert any(float((w - start[n]).abs().max()) > 1e-3 for n, w in ref["weights"].items())


@pytest.mark.distributed
def test_eval_and_predict(runs):
    world, results, refs = runs
    ref = refs["trainer"]
    for rank, res in enumerate(results):
        _close(res["trainer"]["eval"], ref["eval"], f"P={world} rank {rank} eval loss")
        for got, want, what in zip(res["trainer"]["predict"], ref["predict"], ("logits", "labels"), strict=True):
            _close(got, want, f"P={world} rank {rank} predict {what}")


@pytest.mark.distributed
def test_resume(runs):
    world, results, refs = runs
    for rank, res in enumerate(results):
        _close(res["resumed"]["losses"], refs["trainer"]["losses"], f"P={world} rank {rank} resumed losses")
    for name, w in refs["trainer"]["weights"].items():
        for rank, res in enumerate(results):
            _close(res["resumed"]["weights"][name], w, f"P={world} rank {rank} resumed weight {name}")


@pytest.mark.distributed
@pytest.mark.parametrize("case,expect", [("collator", "sequence length"),
                                         ("model", "cannot parallelize RobertaForCausalLM"),
                                         ("sp", "sp=3 must divide the world size"),
                                         ("own-loss", "OwnLossTrainer defines its own compute_loss")])
def test_bad_input(runs, case, expect):
    world, results, _ = runs
    messages = [res[f"bad-{case}"] for res in results]
    for rank, (msg, step) in enumerate(messages):
        assert msg is not None, f"P={world} rank {rank}: {case} did not raise"
        assert expect in msg, f"P={world} rank {rank}: {msg}"
        assert step == 0, f"P={world} rank {rank}: {case} raised after {step} steps"
    assert len({m for m, _ in messages}) == 1, f"the ranks raised different errors: {messages}"


@pytest.mark.parametrize("option,value", [("compute_loss_func", lambda *a, **k: 0), ("label_smoothing_factor", 0.1),
                                          ("loss_type", "dft")])
def test_refuses_losses_it_would_ignore(option, value):
    """Options whose loss seqpar's compute_loss would not compute are refused, not ignored."""
    from types import SimpleNamespace

    from seqpar.integrations.trainer.mixin import check_loss_options

    args = SimpleNamespace(label_smoothing_factor=0.0, loss_type="nll")
    check_loss_options(SimpleNamespace(args=args, compute_loss_func=None))  # the defaults pass
    trainer = SimpleNamespace(args=args, compute_loss_func=None)
    setattr(trainer if option == "compute_loss_func" else args, option, value)
    with pytest.raises(ValueError, match=option):
        check_loss_options(trainer)


def test_trainers_with_their_own_loss_are_refused_by_name():
    """Every TRL trainer class whose loss the generic integration would replace is refused by name;
    Trainer, SFTTrainer and subclasses that keep their loss pass."""
    import trl
    from transformers import Trainer

    from seqpar.errors import Refused
    from seqpar.integrations.trainer.mixin import check_own_loss

    class Mine(trl.SFTTrainer):
        pass

    for cls in (Trainer, trl.SFTTrainer, Mine):
        check_own_loss(cls)
    # TRL's other trainers run with their own mixins or are refused by name (test_trl_registry); the
    # generic integration alone would replace their loss
    others = [n for n in dir(trl) if n.endswith("Trainer") and n != "SFTTrainer"]
    assert "KTOTrainer" in others and "DistillationTrainer" in others, others
    for name in others:
        with pytest.raises(Refused, match=f"{name} defines its own compute_loss"):
            check_own_loss(getattr(trl, name))


def test_router_aux_at_dp_above_1_is_refused_for_trl_trainers_other_than_sft():
    """dp > 1 with a router aux loss is held against DDP for Trainer and SFTTrainer (test_parity,
    dp2 x sp2); another TRL trainer adding one is refused by name until its run is."""
    from types import SimpleNamespace

    from seqpar.integrations.trainer.mixin import _router_aux_unverified

    def trainer(module: str, name: str, aux: bool):
        cls = type(name, (), {"__module__": module})
        made = cls()
        made.model = SimpleNamespace(config=SimpleNamespace(output_router_logits=aux))
        return made

    assert _router_aux_unverified(trainer("transformers.trainer", "Trainer", True)) is None
    assert _router_aux_unverified(trainer("trl.trainer.sft_trainer", "SFTTrainer", True)) is None
    assert _router_aux_unverified(trainer("trl.trainer.dpo_trainer", "DPOTrainer", True)) == "DPOTrainer"
    assert _router_aux_unverified(trainer("trl.trainer.dpo_trainer", "DPOTrainer", False)) is None


def test_mixin_overrides_public_trainer_methods_only():
    """The mixin changes a step through the Trainer's public hooks, no private method."""
    from transformers import Trainer

    from seqpar import SeqParTrainerMixin

    overridden = [n for n, v in vars(SeqParTrainerMixin).items() if callable(v) and hasattr(Trainer, n)]
    assert "compute_loss" in overridden and "get_train_dataloader" in overridden
    assert [n for n in overridden if n.startswith("_") and n != "__init__"] == []


def test_mixin_needs_mesh_or_sp_and_parallelize_trainer_refuses_it_twice():
    import seqpar

    class Base:
        def __init__(self, **kwargs):
            raise AssertionError("the trainer must not be built when the seqpar arguments are wrong")

    class MyTrainer(seqpar.SeqParTrainerMixin, Base):
        pass

    with pytest.raises(ValueError, match="give MyTrainer either mesh=seqpar.init_mesh"):
        MyTrainer(model=None)
    with pytest.raises(ValueError, match="already sequence-parallel"):
        seqpar.parallelize_trainer(object.__new__(MyTrainer), sp=2)
