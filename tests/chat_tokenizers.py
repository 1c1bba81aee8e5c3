"""Tokenizer directories as transformers' own `save_pretrained` writes them (template in chat_template.jinja),
built here with no download: a byte-level BPE trained on a few sentences, with ChatML control tokens."""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
#: A template in the openai content format: it loops over each message's parts.
PARTS = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
         "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
         "{{ part['text'] }}{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONTROL = ["<|im_start|>", "<|im_end|>"]
CORPUS = ["You are terse.", "Summarise the cache design.", "Blocks are hashed and reused.", "Shorter.",
          "Caches reuse blocks of tokens.", "A prefix cache keeps the blocks of earlier prompts."] * 20


def save_tokenizer(directory: Path, template: str = CHATML, extra_tokens: tuple[str, ...] = ()) -> Path:
    """A tokenizer directory written by transformers' save_pretrained (chat_template.jinja beside tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=CONTROL + list(extra_tokens),
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 chat_template=template)
    hf.save_pretrained(str(directory))
    return directory


def encode(directory: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False).ids
