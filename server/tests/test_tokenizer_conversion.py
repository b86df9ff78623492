"""The tokenizer.json written by the .gguf conversion is the tokenizer the
model was trained with: it encodes like the tokenizer transformers builds
from the .gguf itself (the reference), through the plain `tokenizers`
library the Rust router also uses, and the converted folder loads in
transformers with its chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing   \n\n\ttabs and newlines\r\n",
    "Café crème brûlée, naïve façade, Ångström, Straße",
    "Emoji: 🤗🚀👩‍👩‍👧 and flags 🇫🇷",
    "日本語のテキストと中文",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'fn main() { println!("{}", 2026 * 12345); } // 0x1F',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nBe brief.<|im_end|><|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path):
    """transformers' tokenizer built straight from the .gguf metadata."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def converted(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_converted_tokenizer_encodes_like_the_gguf(reference, converted, add_special_tokens):
    for text in TEXTS:
        expected = reference(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert converted.encode(text, add_special_tokens=add_special_tokens).ids == expected, text


def test_chat_markup_becomes_single_special_tokens(converted):
    ids = converted.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == converted.token_to_id("<|im_start|>") == 1
    assert ids[-1] == converted.token_to_id("<|im_end|>") == 2


def test_decoding_gives_the_text_back(converted):
    # Byte-level BPE is lossless; the router detokenizes with this file.
    for text in TEXTS:
        assert converted.decode(converted.encode(text).ids, skip_special_tokens=False) == text


def test_converted_folder_loads_in_transformers_with_its_chat_template(smollm2_dir, reference):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert tokenizer.eos_token == "<|im_end|>"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
