"""Tiny chat assets for the tests, built on the fly (no downloads): a BPE tokenizer trained on a few
sentences, with a chat template whose ``{% generation %}`` markers give transformers' assistant
masks, a checkpoint of a tiny Llama with that tokenizer, and chat / prompt-completion data."""

import json

TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}"
            "{{ m['content'] }}<|end|>{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""A ChatML-like template: the assistant's text and its end marker are its targets."""

PLAIN_TEMPLATE = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
"""The same without generation markers: transformers cannot tell the assistant tokens."""

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = ("what is two plus two four the quick brown fox jumps over a lazy dog hello how are you fine thanks "
         "tell me a story once upon a time there was a cat which color is the sky blue name three fruits apple "
         "pear plum be brief").split()

CHATS = [
    [{"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello how are you"},
     {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "tell me a story"},
     {"role": "assistant", "content": "once upon a time there was a cat"}],
    [{"role": "user", "content": "which color is the sky"}, {"role": "assistant", "content": "blue"}],
    [{"role": "user", "content": "name three fruits"}, {"role": "assistant", "content": "apple pear plum"},
     {"role": "user", "content": "what is two plus two"}, {"role": "assistant", "content": "four"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"},
     {"role": "assistant", "content": "jumps over a lazy dog"}],
]


def chats(n: int) -> list[list[dict[str, str]]]:
    """``n`` conversations, cycling through :data:`CHATS` with a varying number of extra turns."""
    out = []
    for i in range(n):
        base = CHATS[i % len(CHATS)]
        extra = CHATS[(i + 1) % len(CHATS)][: 2 * (i % 3)]  # 0, 2 or 4 more messages
        out.append(base + [m for m in extra if m["role"] != "system"])
    return out


def chat_tokenizer(template: str | None = TEMPLATE, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on :data:`WORDS` (``vocab_size`` ids, specials first)."""
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
    if template is not None:
        fast.chat_template = template
    return fast


def chat_checkpoint(path, *, template: str | None = TEMPLATE, max_position_embeddings: int = 256, seed: int = 0,
                    **config):
    """A tiny Llama (the training size of seqpar train) with :func:`chat_tokenizer`, saved to ``path``."""
    import torch

    from seqpar.integrations.models import build_model
    from seqpar.train.config import TRAIN_SIZE

    tok = chat_tokenizer(template)
    torch.manual_seed(seed)
    fields = {**TRAIN_SIZE, "hidden_size": 32, "head_dim": 8, "intermediate_size": 64, **config}
    model, _ = build_model("tiny-llama", vocab_size=len(tok), max_position_embeddings=max_position_embeddings,
                           **fields)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def write_jsonl(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)
