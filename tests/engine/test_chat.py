"""The tokenizer without transformers (engine.chat.RustTokenizer) against transformers' own on the default
model: the same ids, texts and rendered templates; directories it does not mirror go to transformers."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from engine.chat import SENTINEL, ChatTokenizer, RustTokenizer

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "Tabs\tand\nnew\n\nlines\r\n",
    "Unicode: naïve café, 東京, Ünïcödé, emoji 🙂🚀, Ελληνικά",
    "Special tokens in text: <|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    f"A reply sentinel {SENTINEL} in the middle",
    "def f(x):\n    return x ** 2  # code, with    runs of spaces",
    "1234567890 3.14159 -42 1e-9",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three metals."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": SENTINEL}, {"role": "user", "content": "And again?"}],
    [{"role": "user", "content": "  spaces\n\nand lines  "}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def pair(resolved_model):
    from transformers import AutoTokenizer

    light = RustTokenizer.load(resolved_model.directory)
    assert light is not None, "the default model's tokenizer should load without transformers"
    return light, AutoTokenizer.from_pretrained(str(resolved_model.directory))


def test_ids_texts_and_special_tokens_equal_transformers(pair):
    light, hf = pair
    assert len(light) == len(hf)
    assert (light.bos_token_id, light.eos_token_id, light.pad_token_id) == (
        hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    for text in TEXTS:
        for special in (False, True):
            ids = light.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (False, True):
                assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(50):  # ids no text gives: partial UTF-8, special tokens anywhere
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))]
        for skip in (False, True):
            assert light.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_rendered_templates_equal_transformers(pair):
    light, hf = pair
    assert light.chat_template == hf.chat_template
    for messages in CONVERSATIONS:
        for gen in (False, True):
            assert light.apply_chat_template(messages, add_generation_prompt=gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)


def test_a_configuration_it_does_not_mirror_goes_to_transformers(resolved_model, tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(resolved_model.directory, d, ignore=shutil.ignore_patterns("*.safetensors"))
    assert isinstance(ChatTokenizer(d).tok, RustTokenizer)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    assert RustTokenizer.load(d) is None
    tok = ChatTokenizer(d)
    assert not isinstance(tok.tok, RustTokenizer)
    assert tok.encode("Hi") == RustTokenizer.load(resolved_model.directory).encode("Hi", False)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}")
    assert RustTokenizer.load(d) is None
