"""The docs point at things that exist, and nothing in the repository points outside it.

- Every `path/file.py:name` or `path/file.py:Class.method` reference in the docs names a file of the
  repository that defines it (read with `ast`, nothing imported); `path/file.c:name`, a C function.
- Every path of the repository named in backticks, and every relative Markdown link, exists.
- No tracked or new text file refers to the team's documents outside the repository (a clone does
  not have them): their file names and the folder beside the checkout.

No Ray, no model, no network.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/design.md", "docs/papers.md")

# `engine/model.py:Transformer.forward`, `deploy/serve_app.py:build`, `engine/attention.c:attn_forward`
REF = re.compile(r"`([A-Za-z0-9_./-]+\.(?:py|c)):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)`")
# `engine/model.py`, `dashboards/llmaas.json`, `deploy/jobs/`: a path inside the repository
PATH = re.compile(r"`((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]*)`")
# [text](target): relative links only
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")

# built from parts, so that this file does not contain what it looks for
OUTSIDE = [
    re.compile(re.escape(".." + "/shared")),
    re.compile(r"\b" + "DESIGN" + r"\.md\b"),
    re.compile(r"\b" + "STYLE" + r"\.md\b"),
    re.compile(re.escape("shared" + "/papers")),
    re.compile("papers" + r"/[A-Za-z0-9_-]+\.txt"),
]


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci"}


@cache
def _python_names(path: Path) -> dict[str, set[str]]:
    """Top-level functions, classes (each with its methods) and constants of a Python file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update((t.id, set()) for t in targets if isinstance(t, ast.Name) and t.id.isupper())
    return names


def _defines(path: Path, name: str) -> bool:
    if path.suffix == ".c":
        # a definition: the name and its parameter list start a line that is not a declaration
        return re.search(rf"^[A-Za-z_][\w \t*]*\b{re.escape(name)}\s*\([^;]*$", path.read_text(encoding="utf-8"),
                         re.M) is not None
    outer, _, inner = name.partition(".")
    names = _python_names(path)
    return outer in names and (not inner or inner in names[outer])


def _docs() -> list[tuple[str, str]]:
    return [(d, (ROOT / d).read_text(encoding="utf-8")) for d in DOCS if (ROOT / d).exists()]


def test_the_docs_exist():
    for d in DOCS:
        assert (ROOT / d).is_file(), d


def test_code_references_name_what_the_file_defines():
    bad, seen = [], 0
    for doc, text in _docs():
        for m in REF.finditer(text):
            seen += 1
            rel, name = m.groups()
            path = ROOT / rel
            line = text.count("\n", 0, m.start()) + 1
            if not path.is_file():
                bad.append(f"{doc}:{line}: {rel} does not exist")
            elif not _defines(path, name):
                bad.append(f"{doc}:{line}: {rel} defines no {name}")
    assert seen > 0, "no `file.py:name` references found: has the reference syntax changed?"
    assert not bad, "\n".join(bad)


def test_paths_and_links_in_the_docs_exist():
    top = _top_level()
    bad = []
    for doc, text in _docs():
        for m in PATH.finditer(text):
            rel = m.group(1)
            if rel.split("/", 1)[0] in top and not (ROOT / rel).exists():
                bad.append(f"{doc}:{text.count(chr(10), 0, m.start()) + 1}: no {rel}")
        for m in LINK.finditer(text):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):  # same page, or a URL
                continue
            if not ((ROOT / doc).parent / target).exists():
                bad.append(f"{doc}:{text.count(chr(10), 0, m.start()) + 1}: broken link {m.group(1)}")
    assert not bad, "\n".join(bad)


def _repository_files() -> list[Path]:
    """Tracked files and new files git does not ignore, as they are in the working tree."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    names = sorted({n for n in out.decode("utf-8", "surrogateescape").split("\0") if n})
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def test_nothing_refers_outside_the_repository():
    bad = []
    for path in _repository_files():
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (images)
            continue
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if any(p.search(line) for p in OUTSIDE):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not bad, ("these lines point at documents outside the repository; cite docs/design.md, "
                     "or a paper by name (docs/papers.md):\n" + "\n".join(bad))
