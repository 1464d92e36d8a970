"""Prompt text for benchmark traces: passages of the Python reference manual in task prompts.

The passages are real prose written by others and available offline: the topic texts of the Python
reference manual that the standard library ships as ``pydoc_data.topics.topics`` (what ``help()``
shows). Each topic is split into paragraphs; headings, grammar rules, code examples and fragments
are dropped; whitespace is collapsed. Topics are grouped into *families* (syntax, data model, ...)
so that one benchmark context can read a coherent stream of passages call after call, the way an
app's conversation stays on one subject. Only the short instruction templates in :data:`TASKS` are
ours.

Lengths are in tokens as counted by a ``count_tokens`` callable; :func:`approx_tokens` (about four
characters per token) is the default. This module deliberately knows nothing about the model, its
tokenizer or chat template, the service, or the trace's timing: it only turns a token budget into
text, and a budget can only be approximated to within one word.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

CountTokens = Callable[[str], int]

CHARS_PER_TOKEN = 4  # rule of thumb for English text under BPE tokenizers (characters per token)

# Families of reference-manual topics (pydoc_data topic keys). A context reads one family. Topic
# keys missing from the running Python's pydoc_data are skipped; topics listed nowhere are not used.
FAMILIES: dict[str, tuple[str, ...]] = {
    "syntax": (
        "identifiers", "id-classes", "atom-identifiers", "atom-literals", "strings",
        "formatstrings", "numbers", "integers", "floating", "imaginary",
    ),
    "data model": (
        "objects", "types", "specialnames", "customization", "attribute-access", "callable-types",
        "sequence-types", "numeric-types", "context-managers", "specialattrs",
    ),
    "execution model": (
        "execmodel", "naming", "exceptions", "dynamic-features", "global", "nonlocal", "debugger",
    ),
    "statements": (
        "compound", "assignment", "augassign", "assert", "pass", "del", "return", "yield", "raise",
        "break", "continue", "import", "if", "while", "for", "try", "with", "function", "class",
        "async",
    ),
    "expressions": (
        "conversions", "attribute-references", "subscriptions", "slicings", "calls", "await",
        "power", "unary", "binary", "shifting", "bitwise", "comparisons", "in", "booleans",
        "lambda", "exprlists", "lists", "dict", "operator-summary",
    ),
    "built-in types": (
        "truth", "typesseq", "typesseq-mutable", "string-methods", "typesmapping", "typesmodules",
        "typesfunctions", "typesmethods", "bltin-code-objects", "bltin-type-objects",
        "bltin-null-object", "bltin-ellipsis-object",
    ),
}

# Instruction templates, one per task (the tasks of LLMS Table 3's datasets). Placeholders:
# {passage} the reference-manual text, {title} its topic's heading, {labels} the family names.
TASKS: dict[str, str] = {
    "classify": (
        "Classify the following passage as one of: {labels}. Answer with the label only.\n\n"
        "Passage: {passage}"
    ),
    "summarise": "Summarise the following passage in one sentence.\n\nPassage: {passage}",
    "summarise_notes": "Summarise these notes in a few words.\n\nNotes: {passage}",
    "answer": (
        "Read the passage, then answer: what does it say about {title}?\n\nPassage: {passage}"
    ),
    "translate": "Translate the following passage into German.\n\nPassage: {passage}",
    "sentiment": "Is the tone of this text positive, negative or neutral?\n\nText: {passage}",
}

MIN_WORDS = 6  # a paragraph with fewer words is a fragment ("Note:"), not a passage (words)
_HEADING_UNDERLINE = re.compile(r"^[*=\-~^]{3,}$")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_CODE_MARKERS = ("::=", ">>>", "...:")


class UnknownTaskError(ValueError):
    """A task name is not in :data:`TASKS`; the message lists the valid names."""

    def __init__(self, name: object) -> None:
        super().__init__(f"unknown task {name!r}; valid: {', '.join(sorted(TASKS))}")


@dataclass(frozen=True, slots=True)
class Passage:
    """One cleaned paragraph of a reference-manual topic."""

    topic: str  # pydoc_data topic key, e.g. "assignment"
    title: str  # the topic's heading, e.g. "Assignment statements"
    family: str  # key of FAMILIES the topic belongs to
    text: str  # the paragraph, whitespace collapsed to single spaces


def approx_tokens(text: str) -> int:
    """Approximate token count of ``text``: ceil(characters / 4)."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _is_prose(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    if len(lines) >= 2 and _HEADING_UNDERLINE.match(lines[1].strip()):
        return False  # a heading
    if any(m in paragraph for m in _CODE_MARKERS):
        return False  # grammar rule or interactive example
    text = " ".join(paragraph.split())
    if len(text.split()) < MIN_WORDS:
        return False
    visible = text.replace(" ", "")
    letters = sum(c.isalpha() for c in visible)
    # Code blocks are punctuation-heavy and rarely end a sentence; prose does both the other way.
    return letters >= 0.6 * len(visible) and text[-1] in ".:?)"


def split_passages(text: str) -> list[str]:
    """The prose paragraphs of one topic's text, each with whitespace collapsed to single spaces."""
    return [" ".join(p.split()) for p in _PARAGRAPH_BREAK.split(text) if _is_prose(p)]


def topic_title(text: str) -> str:
    """The heading of a topic text (its first line), without the manual's quote marks."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first.replace('"', "").strip()


def load_passages(topics: Mapping[str, str] | None = None) -> dict[str, tuple[Passage, ...]]:
    """Passages per family, in manual order (family topic order, then paragraph order).

    ``topics`` maps topic key -> text; the default is ``pydoc_data.topics.topics``. A paragraph that
    appears under several topics (the manual repeats some) is kept once, under its first topic.
    Families with no passage are left out.
    """
    if topics is None:
        from pydoc_data.topics import topics as manual

        topics = manual
    seen: set[str] = set()
    out: dict[str, tuple[Passage, ...]] = {}
    for family, keys in FAMILIES.items():
        passages = []
        for key in keys:
            if key not in topics:
                continue
            title = topic_title(topics[key])
            for paragraph in split_passages(topics[key]):
                if paragraph not in seen:
                    seen.add(paragraph)
                    passages.append(Passage(key, title, family, paragraph))
        if passages:
            out[family] = tuple(passages)
    return out


def render(task: str, passage: str, *, title: str = "", labels: Sequence[str] = ()) -> str:
    """The prompt of ``task`` around ``passage`` (raises :class:`UnknownTaskError`)."""
    try:
        template = TASKS[task]
    except KeyError as e:
        raise UnknownTaskError(task) from e
    return template.format(passage=passage, title=title or "it", labels=", ".join(labels))


def _longest_prefix(
    head: str, words: list[str], budget: int, count_tokens: CountTokens, min_words: int
) -> str:
    """``head`` joined to the longest prefix of ``words`` (at least ``min_words``) whose count stays
    within ``budget`` tokens; counting the whole text keeps the tokenizer's merges honest."""
    sep = "\n\n" if head else ""
    lo, hi = min_words, len(words)  # invariant: the answer has between lo and hi words
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(head + sep + " ".join(words[:mid])) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return head + sep + " ".join(words[:lo]) if lo else head


class PassageStream:
    """A cursor over one family's passages: each :meth:`take` continues where the last one stopped.

    Passages are taken whole while they fit the budget; the last one is cut at a word boundary, and
    the next take starts at the passage after it. At the end of the family the stream wraps around.
    A take returns at least one word, so a budget below one word is exceeded.
    """

    __slots__ = ("_passages", "_cursor", "_count")

    def __init__(self, passages: Sequence[Passage], start: int, count_tokens: CountTokens) -> None:
        if not passages:
            raise ValueError("a passage stream needs at least one passage")
        self._passages = tuple(passages)  # one family's passages in manual order
        self._cursor = start % len(passages)  # index of the next passage to take
        self._count = count_tokens  # tokens of a text

    def peek(self) -> Passage:
        """The passage the next :meth:`take` starts with."""
        return self._passages[self._cursor]

    def take(self, budget_tokens: int) -> tuple[str, Passage]:
        """(text of about ``budget_tokens`` tokens, the first passage it comes from)."""
        first = self._passages[self._cursor]
        text = ""
        for _ in range(len(self._passages)):
            p = self._passages[self._cursor]
            self._cursor = (self._cursor + 1) % len(self._passages)
            longer = f"{text}\n\n{p.text}" if text else p.text
            n = self._count(longer)
            if n <= budget_tokens:
                text = longer
                if n == budget_tokens:
                    break
                continue
            min_words = 0 if text else 1  # never return nothing
            text = _longest_prefix(text, p.text.split(), budget_tokens, self._count, min_words)
            break
        return text, first


def build_prompt(
    task: str,
    stream: PassageStream,
    target_tokens: int,
    count_tokens: CountTokens,
    labels: Sequence[str] = (),
) -> str:
    """A ``task`` prompt of about ``target_tokens`` tokens, its passage text taken from ``stream``.

    The instruction's own tokens come out of the budget; if the instruction alone reaches it, the
    passage is a single word and the prompt exceeds the target.
    """
    title = stream.peek().title
    overhead = count_tokens(render(task, "", title=title, labels=labels))
    text, _ = stream.take(max(target_tokens - overhead, 0))
    return render(task, text, title=title, labels=labels)
