"""Tokenizer and chat template, turned into the token ids a context grows by.

This module deliberately knows nothing about the model, KV caches or sampling.

A context is a conversation whose token ids are the source of truth (docs/design.md §3): the ids the model
generated are kept as they are, never replaced by a re-tokenization of their text. The template is
rendered with a private-use sentinel in place of each assistant reply, so the ids of a turn are found
by rendering the conversation before and after it and tokenizing only the new text. For ChatML-style
templates (SmolLM2, Qwen2) that equals tokenizing each segment between replies and splicing the
generated ids in; `conversation_ids` is that reference.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

SENTINEL = "\ue000"  # stands for an assistant reply whose ids are kept as generated


@dataclass(slots=True)
class Turn:
    role: str
    """`system`, `user` or `assistant`."""
    text: str
    """Decoded text of the turn."""
    ids: list[int] | None = None
    """Generated ids of an assistant turn (the source of truth), else None."""


@dataclass(slots=True)
class Conversation:
    turns: list[Turn] = field(default_factory=list)

    def messages(self, sentinel: bool = True) -> list[dict]:
        return [
            {"role": t.role, "content": SENTINEL if (sentinel and t.role == "assistant") else t.text}
            for t in self.turns
        ]


class ChatTokenizer:
    """The model's tokenizer and chat template, loaded from a local directory: `RustTokenizer` where it
    mirrors the configuration, else transformers' `AutoTokenizer`."""

    def __init__(self, directory: str | Path) -> None:
        self.tok = RustTokenizer.load(Path(directory))
        if self.tok is None:  # a tokenizer that needs transformers' code
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(directory))
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(f"{directory}: tokenizer has no chat template")
        self.eos_token_id: int | None = self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    # ---- plain text ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode_document(self, text: str) -> list[int]:
        """Ids of plain text as the model expects a document to start (BOS if the tokenizer adds one)."""
        return self.tok.encode(text, add_special_tokens=True)

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def decode_reply(self, ids) -> str:
        """Text of generated ids as shown to a user: special tokens (EOS) left out."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    # ---- templates -----------------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _suffix_ids(self, before: str, after: str) -> list[int]:
        if not after.startswith(before):
            raise ValueError("chat template output is not incremental over turns; cannot extend a context")
        new = after[len(before) :]
        if SENTINEL in new:
            raise RuntimeError("an assistant reply would be re-tokenized")
        return self.encode(new)

    def system_ids(self, system_prompt: str | None) -> list[int]:
        """Ids a new context starts with: the rendered system turn, or nothing (the template may add a
        default system turn with the first user turn)."""
        if system_prompt is None:
            return []
        return self.encode(self.render([{"role": "system", "content": system_prompt}], False))

    def user_turn_ids(self, conv: Conversation, prompt: str) -> list[int]:
        """Ids appended by a user turn, up to and including the assistant header."""
        msgs = conv.messages()
        before = self.render(msgs, False)
        after = self.render(msgs + [{"role": "user", "content": prompt}], True)
        return self._suffix_ids(before, after)

    def reply_closing_ids(self, conv: Conversation) -> list[int]:
        """Ids the template puts after an assistant reply (e.g. `<|im_end|>\\n`)."""
        msgs = conv.messages() + [{"role": "assistant", "content": SENTINEL}]
        text = self.render(msgs, False)
        return self.encode(text[text.rindex(SENTINEL) + len(SENTINEL) :])

    def conversation_ids(self, conv: Conversation, add_generation_prompt: bool = False) -> list[int]:
        """Reference: tokenize the rendered conversation segment by segment with each assistant reply's
        generated ids in place (without its EOS, which the template writes)."""
        text = self.render(conv.messages(), add_generation_prompt)
        parts = text.split(SENTINEL)
        replies = [t for t in conv.turns if t.role == "assistant"]
        ids: list[int] = []
        for i, part in enumerate(parts):
            ids += self.encode(part)
            if i < len(replies):
                r = list(replies[i].ids or [])
                if r and r[-1] == self.eos_token_id:
                    r = r[:-1]
                ids += r
        return ids


# tokenizer_config.json keys whose meaning RustTokenizer carries; another key may change what transformers
# does with the tokenizer, so a directory with one is left to transformers
_PLAIN_CONFIG = {"backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token", "is_local",
                 "local_files_only", "model_max_length", "clean_up_tokenization_spaces", "chat_template"}
_PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


class RustTokenizer:
    """A tokenizer.json tokenizer and a Jinja chat template without transformers, whose import and
    tokenizer set-up take about 3 s of a process's start (a service start pays it in two actors, the CLI
    at every command); ~0.4 s this way. It does what transformers' fast tokenizer does for a plain
    configuration (the `tokenizers` library's encode and decode, the template rendered in Jinja's
    immutable sandbox with `trim_blocks` and `lstrip_blocks`, as transformers renders it), and
    `load` returns None for any other, which transformers then loads (tests/engine/test_chat.py
    checks the two agree on the default model)."""

    def __init__(self, backend, source: str, template, special: dict[str, str | None]) -> None:
        self._backend = backend
        self._template = template
        self._special = special
        self.chat_template = source
        ids = {k: (backend.token_to_id(v) if v is not None else None) for k, v in special.items()}
        self.bos_token_id: int | None = ids.get("bos_token")
        self.eos_token_id: int | None = ids.get("eos_token")
        self.pad_token_id: int | None = ids.get("pad_token")

    @classmethod
    def load(cls, directory: Path) -> "RustTokenizer | None":
        """The tokenizer of `directory`, or None where it needs transformers: no tokenizer.json, a
        configuration key or class this does not mirror, or a template that uses transformers' own
        Jinja extensions."""
        try:
            cfg = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
            tokenizer_json = directory / "tokenizer.json"
            template_file = directory / "chat_template.jinja"
            source = cfg.get("chat_template")
            if source is None and template_file.is_file():
                source = template_file.read_text(encoding="utf-8")
        except (OSError, ValueError):
            return None
        if (not tokenizer_json.is_file() or not isinstance(source, str) or set(cfg) - _PLAIN_CONFIG
                or cfg.get("tokenizer_class") not in _PLAIN_CLASSES or cfg.get("clean_up_tokenization_spaces")):
            return None
        special = {k: cfg.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        if not all(v is None or isinstance(v, str) for v in special.values()):
            return None  # an AddedToken written as a dict
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        try:
            template = env.from_string(source)
        except jinja2.TemplateSyntaxError:  # e.g. transformers' {% generation %} tag
            return None
        return cls(Tokenizer.from_file(str(tokenizer_json)), source, template, special)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        if tokenize:
            raise ValueError("RustTokenizer renders text only; encode the rendered text")
        return self._template.render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._special)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # as transformers' filter: plain JSON, without Jinja's HTML escaping
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)
