"""The files a guide's commands name, made on the fly in the directory they run in (no downloads).

``chat``: ``my-model/`` (a tiny Llama saved with ``save_pretrained`` and a byte-level BPE tokenizer
whose chat template marks the assistant's text with ``{% generation %}``), ``chats.jsonl`` (chat
rows), ``pairs.jsonl`` (prompt / chosen / rejected rows): what a user brings, at a size a CPU trains.
"""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
            "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
QA = [("what is two plus two", "four"), ("which color is the sky", "blue"), ("name three fruits", "apple pear plum"),
      ("hello how are you", "fine thanks"), ("tell me a story", "once upon a time there was a cat")]


def _tokenizer():
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"{q} {a}" for q, a in QA] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def chat(where: Path) -> None:
    import torch

    from seqpar.integrations.models import build_model

    tok = _tokenizer()
    torch.manual_seed(0)
    model, _ = build_model("tiny-llama", vocab_size=len(tok), max_position_embeddings=4096)
    model.save_pretrained(where / "my-model")
    tok.save_pretrained(where / "my-model")
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in QA] * 40
    _jsonl(where / "chats.jsonl", [{"messages": m} for m in chats])
    pairs = [{"prompt": q, "chosen": a, "rejected": QA[(i + 1) % len(QA)][1]} for i, (q, a) in enumerate(QA)] * 8
    _jsonl(where / "pairs.jsonl", pairs)


FILES = {"chat": chat}
