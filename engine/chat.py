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
    """A Hugging Face tokenizer with the model's chat template, loaded from a local directory."""

    def __init__(self, directory: str | Path) -> None:
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
