"""Benchmark sections of a markdown file (docs/benchmarks.md): each script owns the text between its
markers `<!-- NAME:begin -->` and `<!-- NAME:end -->` and replaces it on every run."""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_block(doc: str, text: str, begin: str, end: str, heading: str) -> str:
    """`doc` with the text between `begin` and `end` replaced by `text` (markers kept). When the
    markers are missing, the block goes at the end of the `heading` section (the heading is added at
    the end of the document when missing). Unbalanced markers raise ValueError."""
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc[doc.index(begin):]:
        i = doc.index(begin)
        j = doc.index(end, i) + len(end)
        return doc[:i] + block + doc[j:]
    if begin in doc or end in doc:
        raise ValueError(f"unbalanced markers: want {begin} then {end}")
    lines = doc.splitlines()
    if heading not in lines:
        return doc.rstrip("\n") + f"\n\n{heading}\n\n{block}\n"
    # the heading's section ends at the next heading of the same or a higher level
    level = len(heading) - len(heading.lstrip("#"))
    at = lines.index(heading) + 1
    while at < len(lines) and not (lines[at].startswith("#")
                                  and len(lines[at]) - len(lines[at].lstrip("#")) <= level):
        at += 1
    head = "\n".join(lines[:at]).rstrip("\n")
    tail = "\n".join(lines[at:])
    return head + "\n\n" + block + "\n" + ("\n" + tail + "\n" if tail else "")


def write_section(path: Path, name: str, heading: str, text: str) -> None:
    """Replace the `name` section of the markdown file `path` (see `replace_block`)."""
    doc = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = markers(name)
    try:
        path.write_text(replace_block(doc, text, begin, end, heading))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def publish(text: str, path: Path | None, name: str, heading: str) -> int:
    """A benchmark's ending: print its section, write it into `path` when given; exit status 0."""
    print(text)
    if path:
        write_section(path, name, heading, text)
    return 0
