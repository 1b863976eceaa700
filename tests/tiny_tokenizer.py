"""A 96-token character-level tokenizer with a ChatML chat template, matching the tiny targets' vocabulary."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """96 tokens: 3 specials and 93 characters (the tiny targets' vocabulary size), with a chat template."""
    from tokenizers import Tokenizer, decoders, models

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(32, 127) if chr(c) not in "`~^"] + ["\n"]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(specials)
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
