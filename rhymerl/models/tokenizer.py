"""An offline tokenizer for the tiny test model: byte-level BPE trained deterministically on a fixed corpus."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the template SmolLM2 and Qwen2 use, so prompts render the same way.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    lines = []
    for a in range(0, 50):
        for b in range(0, 50, 7):
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
            lines.append(f"Calculate {a} - {b} * 2 = {a - b * 2}")
    words = ("user assistant system Answer: answer the following question step by step "
             "Let me think. First, then, so the result is Therefore Sum add subtract multiply divide").split()
    lines.append(" ".join(words) * 4)
    return lines


def build_tokenizer(vocab_size: int = 384) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def save_tokenizer(folder: Path, vocab_size: int = 384) -> int:
    """Write tokenizer.json + tokenizer_config.json; return the vocabulary size."""
    tok = build_tokenizer(vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    eos = "<|im_end|>"
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": eos, "pad_token": "<|endoftext|>",
        "unk_token": None, "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False}
            for t in SPECIAL_TOKENS
        },
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": eos, "pad_token": "<|endoftext|>"}, indent=2))
    return tok.get_vocab_size()
