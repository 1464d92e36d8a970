"""The results page and its writers: every script that rewrites a section of docs/benchmarks.md finds
its markers there, once each, under the heading it would add them to; and `bench.report` renders the
stored results (docs/results/) into exactly the page's text. No model, no Ray, no benchmark run."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from bench import (accuracy, bf16_prefill, decode_overhead, decode_switches, engine_speed, lookup_decode,
                   predictor_yield, quantized, rag, rag_blend, report, restore_speed, served_decode, switching,
                   tuning)
from bench.markdown import markers

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
SWITCHING_BLOCKS = ("bound", "one process:no read throttle", "one process:50 MB/s read throttle",
                    "Ray actors:no read throttle")
TUNING_BLOCKS = ("Ray actors", "Ray actors, back to back")
HOST_BLOCKS = ("Xeon-AMX", "EPYC-AVX512")  # bench.quantized and bench.bf16_prefill: a block per host kind


def _writers() -> list[tuple[str, str, str]]:
    """(begin, end, heading) of every section a script writes into the page."""
    out = [(engine_speed.BEGIN, engine_speed.END, "## Engine speed"),
           (report.BEGIN, report.END, report.SECTION)]
    out += [(*report.SET_MARKERS[name], heading) for name, heading in report.SET_SECTIONS.items()]
    out += [(*markers(m.NAME), m.HEADING) for m in (accuracy, restore_speed, decode_overhead,
                                                    rag, rag_blend, predictor_yield, decode_switches,
                                                    lookup_decode, served_decode)]
    # bench.switching names each block by what it ran: BEGIN with "begin" turned into "begin:<tail>"
    out += [(switching.BEGIN.replace("begin", f"begin:{tail}"), switching.END.replace("end", f"end:{tail}"),
             "## Context switching") for tail in SWITCHING_BLOCKS]
    out += [(*markers(f"{tuning.NAME}:{tail}"), tuning.HEADING) for tail in TUNING_BLOCKS]
    out += [(*markers(f"{m.NAME}:{host}"), m.HEADING) for m in (quantized, bf16_prefill) for host in HOST_BLOCKS]
    return out


@pytest.mark.parametrize("begin,end,heading", _writers(), ids=[b.strip("<!-> ") for b, _, _ in _writers()])
def test_each_writer_finds_its_markers_once_under_its_heading(begin, end, heading):
    doc = PAGE.read_text()
    assert doc.count(begin) == 1 and doc.count(end) == 1
    i, j = doc.index(begin), doc.index(end)
    assert i < j and "<!--" not in doc[i + len(begin):j]  # no other block inside
    assert re.findall(r"^## .*$", doc[:i], re.M)[-1] == heading


def test_the_page_has_no_markers_without_a_writer():
    known = {m for begin, end, _ in _writers() for m in (begin, end)}
    assert set(re.findall(r"<!--.*?-->", PAGE.read_text())) == known


def test_report_renders_the_stored_results_into_the_page_unchanged(tmp_path, monkeypatch, capsys):
    # the Makefile's two commands, run from the repository root (the grid's tables name its path)
    # against a copy of the page; the PNGs go next to the copy
    page = tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    shutil.copy(PAGE, page)
    monkeypatch.chdir(ROOT)
    assert report.main(["docs/results/replay-markov-8ctx", "--write", str(page)]) == 0
    assert report.main(["--grid", "docs/results/grid", "--write", str(page)]) == 0
    capsys.readouterr()
    assert page.read_text() == PAGE.read_text()
    drawn = {p.name for p in (page.parent / "img").iterdir()}
    assert drawn == {"replay-markov-8ctx.png", "grid-switch-vs-contexts.png", "capacity-max-contexts.png"}
    assert drawn <= {p.name for p in (ROOT / "docs" / "img").iterdir()}
