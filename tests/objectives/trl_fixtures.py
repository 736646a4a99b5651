"""Tiny offline assets for holding seqpar's objectives and readers against TRL's own code: a word-level
tokenizer (ids t3..t63), a byte-level BPE tokenizer with a chat template, a tiny Llama, and TRL's
GRPO / RLOO trainers built around them in this process (no downloads, no workers)."""

from __future__ import annotations

import os

import torch

VOCAB = 64
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A ChatML-like template (the prompt with its generation prompt is a prefix of prompt + completion)."""
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = ("what is two plus two four the quick brown fox jumps over a lazy dog hello how are you fine thanks "
         "tell me a story once upon a time there was a cat which color is the sky blue").split()


def word_tokenizer():
    """``t3`` .. ``t63`` one id each (``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2), whitespace-split."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def chat_tokenizer(vocab_size: int = 200):
    """A byte-level BPE tokenizer trained on :data:`WORDS`, with :data:`TEMPLATE`."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS[i:i + 7]) for i in range(len(WORDS))] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def tiny_lm(seed: int = 0, dtype: torch.dtype = torch.float32, vocab: int = VOCAB):
    from seqpar.integrations.models import build_model

    torch.manual_seed(seed)
    model, _ = build_model("tiny-llama", dtype=dtype, vocab_size=vocab)
    return model


def prompts(n: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (int(torch.randint(3, 7, (1,), generator=g)),),
                                                          generator=g)) for _ in range(n)]


def generation_trainer(kind: str, out: str, reward_funcs: list, model=None, **config):
    """TRL's ``GRPOTrainer`` (``kind="grpo"``) or ``RLOOTrainer`` on a tiny float32 Llama, in this
    process (one process: TRL's generation batch is every completion), 4 completions per prompt."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset

    if kind == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer
    args = Config(output_dir=out, per_device_train_batch_size=8, num_generations=4, max_completion_length=7,
                  report_to=[], use_cpu=True, bf16=False, seed=0, disable_tqdm=True, save_strategy="no",
                  shuffle_dataset=False, **config)
    data = Dataset.from_list([{"prompt": p} for p in prompts(2)])
    trainer = Trainer(model=model if model is not None else tiny_lm(), reward_funcs=reward_funcs, args=args,
                      train_dataset=data, processing_class=word_tokenizer())
    trainer.model.train()
    return trainer
