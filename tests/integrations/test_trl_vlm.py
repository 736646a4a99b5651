"""TRL's ``SFTTrainer`` on a vision dataset under ``seqpar.parallelize_trainer`` (issue 24 item 7).

The script a user writes: a ``datasets.Dataset`` of ``images`` (PIL) and ``messages`` (chats; TRL
puts the images in the first user turn), a Qwen2-VL processor (its own image processor and chat
template code; a tokenizer and template made here, offline), TRL's own VLM collator (what
SFTTrainer picks for a processor: ``input_ids``, ``labels``, ``attention_mask``, ``pixel_values``,
``image_grid_thw``, ``mm_token_type_ids``), assistant-only loss, a tiny random Qwen2-VL in float64,
plain SGD, gradient accumulation 2 over micro-batches of different lengths and image counts, an
evaluation at the end (3 rows: an uneven last batch). The workers run it with the one added line
``parallelize_trainer(trainer, mesh)`` -- sp=2 on Ulysses here; sp=3 (uneven shards, an odd
number of ranks) on Ulysses and ring under ``-m heavy`` -- and this process runs two references
without seqpar:

    the script   as is. TRL 1.16 computes its loss with a fused LM head whose log-softmax
                 accumulates in float32 whatever the model's dtype, so it agrees to float32
                 precision (F32_RTOL, relative to each loss and each gradient's size)
    the oracle   the script with transformers' own Trainer.compute_loss and the model's loss in
                 float64: the step losses, the eval loss, every parameter's gradient at every step
                 (vision tower included) and the final weights agree to 1e-12 at sp=2. At sp=3 the
                 first loss does; the gradients, and the losses after them, hold to float32
                 precision: Qwen2-VL's RMSNorm runs in float32 on gradients scaled by 3

Some image's placeholder tokens cross a shard boundary (features encoded on one rank, its tokens on
two). Bad input raises the same ValueError on every rank before any step: images that differ across
the ranks of an SP group, and a multimodal key seqpar does not run (``image_position_ids``, which
TRL's collator returns for a Gemma 4 processor) as a :class:`seqpar.errors.Refused`.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from seqpar.comm.launch import run_distributed
from seqpar.testing.model_parity import F32_RTOL

LOSS_TOL = 1e-12  # float64: step losses ~6, sums of a few hundred token losses regrouped over the ranks
GRAD_TOL = 1e-12  # float64, absolute: the gradients are clipped to norm 1 (the Trainer's max_grad_norm)
LR = 0.5
STEPS = 2
MICRO = 2  # rows per micro-batch
ACCUM = 2
SPECIALS = ["<pad>", "<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>"]
WORDS = ("what is in this picture a red square and blue circle describe the image it shows green lines dots "
         "on white how many shapes are there two three none count them").split()
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}{% generation %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
            "<|im_end|>{% endgeneration %}\n"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
            "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen2-VL's ChatML shape; the assistant's text and its end marker are its targets."""


# ---------------------------------------------------------------------------------------------
# the "script": processor, data, model, trainer -- the same with and without seqpar
# ---------------------------------------------------------------------------------------------

def _tokenizer():
    """A byte-level BPE tokenizer trained on :data:`WORDS`, with Qwen2-VL's special tokens."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS[i:i + 6]) for i in range(len(WORDS))] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>")


def _processor():
    """Qwen2-VL's processor over its PIL image processor at a tiny patch size (4 px, 2 x 2 merged:
    a 16 x 16 image is 16 patches, 4 placeholder tokens)."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class ImageQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor without its video processor: transformers builds video processors only
        with torchvision, which this environment lacks; images and text run Qwen2VLProcessor's code."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=1600)
    return ImageQwen2VLProcessor(image_processor=images, tokenizer=_tokenizer(), chat_template=TEMPLATE)


def _image(h: int, w: int, seed: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def _dataset(n: int, seed: int):
    """``n`` rows of 1-2 images (8..32 px a side: 1 to 16 placeholder tokens) and a chat of one or
    two exchanges, every length different."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)

    def text(lo: int, hi: int) -> str:
        k = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))

    rows = []
    for i in range(n):
        sides = torch.randint(2, 6, (1 + i % 2, 2), generator=g) * 8
        chat = [{"role": "user", "content": text(2, 6)}, {"role": "assistant", "content": text(2, 8)}]
        if i % 3 == 1:
            chat += [{"role": "user", "content": text(2, 5)}, {"role": "assistant", "content": text(1, 5)}]
        rows.append({"images": [_image(int(h), int(w), 100 * seed + 10 * i + k) for k, (h, w) in enumerate(sides)],
                     "messages": chat})
    return Dataset.from_list(rows)


def _model(tok):
    """A tiny random Qwen2-VL (seqpar's VLM zoo config: a two-layer vision tower of 4 px patches),
    float64, its special token ids and vocabulary those of ``tok``."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from seqpar.testing.vlm_zoo import tiny_vlm_dict

    d = tiny_vlm_dict("qwen2_vl")
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    ids = dict(zip(names, tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                     "<|vision_end|>"]), strict=True))
    d.update(ids)
    d["text_config"].update(vocab_size=len(tok), **ids)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(Qwen2VLConfig.from_dict(d)).to(torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # unit-gain matrices: gradients of one size everywhere
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (1.5 / p[0].numel() ** 0.5))
    return model


def _loss64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss without its cast of the logits to float32: the reference's loss
    in float64 (seqpar's own loss keeps float64 logits in float64; PLATFORM.md)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    total = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
                            ignore_index=ignore_index, reduction="sum" if num_items_in_batch is not None else "mean")
    return total / num_items_in_batch if num_items_in_batch is not None else total


def _oracle_class():
    """SFTTrainer with transformers' own ``Trainer.compute_loss`` (the model's loss, float64 by
    :func:`_loss64`) instead of TRL's: TRL 1.16 scores tokens with its fused LM head, whose
    log-softmax accumulators are float32 whatever the model's dtype (trl/kernels/chunked_logprob.py)."""
    from transformers import Trainer
    from trl import SFTTrainer

    class Float64LossSFTTrainer(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    return Float64LossSFTTrainer


def _recorder(trainer):
    """A callback recording each optimizer step's loss (float64: the sum of its micro-batches'
    training_step values) and every parameter's gradient (after the Trainer's clipping, before
    the optimizer); of each micro-batch: its input_ids, keys, and (targets, tokens)."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.losses, self.grads, self.ids, self.micro, self.targets = [], [], [], [], []
            self.keys: set[str] = set()

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.losses.append(float(sum(self.micro)))
            self.micro.clear()
            self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    record = Record()
    step = trainer.training_step  # bound after parallelize_trainer: the sequence-parallel one

    def recorded(model, inputs, *args, **kwargs):
        record.ids.append(inputs["input_ids"].clone())
        record.keys.update(inputs)
        record.targets.append((int((inputs["labels"] != -100).sum()), int(inputs["attention_mask"].sum())))
        loss = step(model, inputs, *args, **kwargs)
        record.micro.append(loss.detach().to(torch.float64))
        return loss

    trainer.training_step = recorded
    trainer.add_callback(record)
    return record


def _trainer(out: str, *, mesh=None, strategy: str = "ulysses", collator=None, oracle: bool = False):
    """The user's trainer (with ``mesh``: plus the seqpar line); ``collator`` wraps TRL's VLM
    collator (the bad-input cases); ``oracle``: the float64 reference (:func:`_oracle_class`)."""
    from trl import SFTConfig, SFTTrainer

    from seqpar.integrations.trainer.mixin import parallelize_trainer

    processor = _processor()
    net = _model(processor.tokenizer)
    cls = SFTTrainer
    if oracle:
        cls, net.loss_function = _oracle_class(), _loss64
    args = SFTConfig(output_dir=out, per_device_train_batch_size=MICRO, per_device_eval_batch_size=MICRO,
                     gradient_accumulation_steps=ACCUM, max_steps=STEPS, optim="sgd", learning_rate=LR,
                     lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                     seed=0, disable_tqdm=True, bf16=False, assistant_only_loss=True)
    trainer = cls(model=net, args=args, train_dataset=_dataset(4 * STEPS, 1), eval_dataset=_dataset(3, 2),
                  processing_class=processor)
    if collator is not None:
        trainer.data_collator = collator(trainer.data_collator)
    if mesh is not None:
        parallelize_trainer(trainer, mesh, strategy=strategy)  # the line a user adds
    return trainer


def train(out: str, *, mesh=None, strategy: str = "ulysses", oracle: bool = False) -> dict:
    """The user's script: train, then evaluate; what :func:`_recorder` saw, and the weights."""
    trainer = _trainer(out, mesh=mesh, strategy=strategy, oracle=oracle)
    record = _recorder(trainer)
    trainer.train()
    return {"losses": record.losses, "grads": record.grads, "ids": record.ids, "keys": record.keys,
            "targets": record.targets,
            "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "eval": trainer.evaluate()["eval_loss"], "collator": type(trainer.data_collator).__name__,
            "image_token": trainer.model.config.image_token_id}


class ImagesDifferOnRank1:
    """TRL's collator with pixels changed on rank 1: the SP group's batches differ."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, rows):
        batch = self.inner(rows)
        if int(os.environ.get("RANK", 0)) == 1:
            batch["pixel_values"] = batch["pixel_values"] + 1.0
        return batch


class GemmaFourKeys:
    """TRL's collator plus ``image_position_ids``, which it returns for a Gemma 4 processor."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, rows):
        batch = self.inner(rows)
        batch["image_position_ids"] = torch.zeros(batch["pixel_values"].shape[0], 2, dtype=torch.long)
        return batch


BAD = {"images": ImagesDifferOnRank1, "refused": GemmaFourKeys}


def _bad(case: str, out: str, mesh):
    """Bad input: ``(exception type, message, optimizer steps reached)`` on this rank."""
    trainer = _trainer(out, mesh=mesh, collator=BAD[case])
    try:
        trainer.train()
    except ValueError as e:
        return type(e).__name__, str(e), trainer.state.global_step
    return None, None, trainer.state.global_step


def _worker(rank: int, world: int, out: str, strategies: list[str], bad: list[str]) -> dict:
    import seqpar

    mesh = seqpar.init_mesh(sp=world, device_type="cpu")
    res: dict = {s: train(os.path.join(out, s), mesh=mesh, strategy=s) for s in strategies}
    for case in bad:
        res[f"bad-{case}"] = _bad(case, os.path.join(out, f"bad-{case}"), mesh)
    return res


# ---------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------

# make test: sp=2 on Ulysses (the Trainer integration does not depend on the strategy; ring with images runs
# in test_vlm.py's P=2 grid); -m heavy: sp=3 on both
GRID = {2: ["ulysses"], 3: ["ulysses", "ring"]}


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.heavy)], ids=["sp2", "sp3"])
def runs(request, tmp_path_factory):
    """(P, every rank's results, the single-process references: the script as is, and the oracle)."""
    world = request.param
    out = str(tmp_path_factory.mktemp(f"trl_vlm{world}"))
    results = run_distributed(_worker, world, out, GRID[world], list(BAD), timeout=600.0)
    refs = {"script": train(os.path.join(out, "script")), "oracle": train(os.path.join(out, "oracle"), oracle=True)}
    return world, results, refs


def _diff(a, b, what: str) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    return float((a - b).abs().max()) if a.numel() else 0.0


def _scale(t) -> float:
    return float(torch.as_tensor(t).abs().max())


def _compare(got: dict, ref: dict, where: str, *, loss_tol, grad_tol) -> None:
    """Step losses, eval loss, every gradient of every step and the final weights;
    ``loss_tol(value, steps before it)`` and ``grad_tol(name, reference gradient)`` give each one's
    tolerance. Plain SGD at a constant rate: the weights moved by ``lr`` x the sum of the steps'
    gradients, so their tolerance is that multiple of the gradients'."""
    assert got["collator"] == ref["collator"] == "DataCollatorForVisionLanguageModeling"
    assert len(ref["losses"]) == len(got["losses"]) == STEPS, (got["losses"], ref["losses"])
    for step, (mine, theirs) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(mine - theirs) <= loss_tol(theirs, step), f"{where} step {step} loss {mine!r} vs {theirs!r}"
    assert abs(got["eval"] - ref["eval"]) <= loss_tol(ref["eval"], STEPS), \
        f"{where} eval loss {got['eval']} vs {ref['eval']}"
    moved: dict[str, float] = {}
    for step, (mine, theirs) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        assert mine.keys() == theirs.keys(), f"{where} step {step}: the parameters with gradients differ"
        for name, g in theirs.items():
            d, tol = _diff(mine[name], g, f"{where} step {step} grad {name}"), grad_tol(name, g)
            assert d <= tol, f"{where} step {step} grad {name}: max difference {d:.3g} > {tol:.3g}"
            moved[name] = moved.get(name, 0.0) + LR * tol
    for name, w in ref["weights"].items():
        d = _diff(got["weights"][name], w, f"{where} weight {name}")
        assert d <= moved[name], f"{where} weight {name}: max difference {d:.3g} > {moved[name]:.3g}"


@pytest.mark.distributed
def test_equals_the_float64_oracle(runs):
    """Against the oracle (the script, its loss in float64): float64 precision. At P=3 the
    gradients hold to the model's own float32 precision, and so do the losses after the first
    step (the weights they see moved by those gradients): Qwen2-VL's RMSNorm computes in float32,
    and the gradients it passes on carry seqpar's loss scale of 3 (exact at powers of two), which
    float32 rounds differently from the unscaled ones (seqpar.batch.loss)."""
    world, results, refs = runs
    ref = refs["oracle"]
    vision = [n for n in ref["grads"][0] if ".visual." in f".{n}"]
    assert vision and all(_scale(ref["grads"][0][n]) > 0 for n in vision), "the vision tower trains"
    exact = world & (world - 1) == 0

    def loss_tol(value, steps_before):
        return LOSS_TOL if exact or steps_before == 0 else F32_RTOL * abs(value)

    def grad_tol(name, g):
        return GRAD_TOL if exact else max(GRAD_TOL, F32_RTOL * _scale(g))

    for strategy in GRID[world]:
        for rank, res in enumerate(results):
            _compare(res[strategy], ref, f"P={world} {strategy} rank {rank} vs the oracle", loss_tol=loss_tol,
                     grad_tol=grad_tol)


@pytest.mark.distributed
def test_equals_the_script_to_its_float32_loss(runs):
    """Against the script as is: to float32 precision, what TRL's loss carries (its fused LM head
    accumulates the log-softmax in float32, and every gradient flows from it); seqpar's loss is
    float64 on a float64 model."""
    world, results, refs = runs
    for strategy in GRID[world]:
        for rank, res in enumerate(results):
            _compare(res[strategy], refs["script"], f"P={world} {strategy} rank {rank} vs the script",
                     loss_tol=lambda v, steps_before: F32_RTOL * abs(v),
                     grad_tol=lambda name, g: F32_RTOL * _scale(g))


@pytest.mark.distributed
def test_the_batches_are_the_collators_with_images_across_shards(runs):
    """What ran: TRL's VLM collator's keys, assistant-only targets, and some image's placeholder
    tokens on two ranks (contiguous layout) -- its features encoded on one, routed to both."""
    from seqpar.comm.collectives import split_sizes

    world, results, refs = runs
    ref = refs["oracle"]
    assert ref["keys"] == {"input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw",
                           "mm_token_type_ids"}, ref["keys"]
    assert all(0 < targets < tokens / 2 for targets, tokens in ref["targets"]), ref["targets"]  # replies only
    crossing = 0
    for ids in ref["ids"]:
        bounds = torch.tensor(split_sizes(ids.shape[1], world)).cumsum(0)[:-1].tolist()
        is_image = (ids == ref["image_token"]).tolist()
        crossing += sum(row[b - 1] and row[b] for row in is_image for b in bounds)
    assert crossing > 0, "no image straddles a shard boundary: the batches do not test the routing"
    for res in results:
        assert all(torch.equal(a, b) for a, b in zip(res["ulysses"]["ids"], ref["ids"], strict=True))


@pytest.mark.distributed
@pytest.mark.parametrize("case,kind,expect", [("images", "ValueError", "images"),
                                              ("refused", "Refused", "image_position_ids")])
def test_bad_input_raises_on_every_rank(runs, case, kind, expect):
    world, results, _ = runs
    messages = [res[f"bad-{case}"] for res in results]
    for rank, (name, msg, step) in enumerate(messages):
        assert msg is not None, f"P={world} rank {rank}: {case} did not raise"
        assert name == kind and expect in msg, f"P={world} rank {rank}: {name}: {msg}"
        assert step == 0, f"P={world} rank {rank}: {case} raised after {step} steps"
    assert len({m for _, m, _ in messages}) == 1, f"the ranks raised different errors: {messages}"
