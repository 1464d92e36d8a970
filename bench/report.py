"""Replay results into the results page: `python -m bench.report`.

For each results directory (`deploy.jobs.replay --out`): its tables (`bench.tables.replay_markdown`)
and its plot in the style of LLMS Fig. 9 (`bench.plots.plot_switch_latency`). With `--write FILE`,
the tables replace what lies between `<!-- replay:begin -->` and `<!-- replay:end -->` in FILE (the
pair is appended under a "Trace replay" heading when missing).

With `--grid OUT` it renders the experiment sets `bench.grid` ran into OUT, each from its manifest
(`OUT/set-<name>.json`) and the runs' summaries, each between its own markers (`<!-- grid:begin -->`
... `<!-- chunks:end -->`): the grid (LLMS Fig. 9, with a plot), capacity (Fig. 10, with a plot), the
ablation (Fig. 13) and the chunk sizes (Fig. 14). A run not done yet is a blank cell, and the section
says how many are missing.

    python -m bench.report [RESULTS_DIR ...] [--grid OUT] [--write docs/benchmarks.md] [--img-dir docs/img]

This module knows the markers and headings of its sections, the plots' file names and the command
line; what the tables say and how the plots look are `bench.tables`' and `bench.plots`'. Text outside
its markers is never touched.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench import grid as G
from bench.markdown import replace_block
from bench.plots import plot_capacity, plot_grid, plot_switch_latency
from bench.results import ResultsError, SetResults, load_results, load_set
from bench.tables import ablation_markdown, capacity_markdown, chunks_markdown, grid_markdown, replay_markdown

BEGIN, END = "<!-- replay:begin -->", "<!-- replay:end -->"
SECTION = "## Trace replay"
SET_MARKERS = {name: (f"<!-- {name}:begin -->", f"<!-- {name}:end -->") for name in G.SETS}
SET_SECTIONS = {
    "grid": "## Switch latency by active contexts (LLMS Fig. 9)",
    "capacity": "## Most active contexts within a switch latency bound (LLMS Fig. 10)",
    "ablation": "## Ablation (LLMS Fig. 13)",
    "chunks": "## Chunk size (LLMS Fig. 14)",
}


def replace_section(doc: str, text: str, begin: str = BEGIN, end: str = END, section: str = SECTION) -> str:
    """`doc` with the text between the markers `begin` and `end` (default: the replay's) replaced by
    `text`; the first time, the block goes at the end of `section` (`bench.markdown.replace_block`)."""
    try:
        return replace_block(doc, text, begin, end, section)
    except ValueError as e:
        raise ResultsError(str(e)) from None


def _link(png: Path, md_dir: str | Path) -> str:
    """`png` as a link from a markdown file in `md_dir`."""
    return Path(os.path.relpath(png, md_dir)).as_posix()


def report(dirs: list[str | Path], img_dir: str | Path, md_dir: str | Path) -> str:
    """Tables of every results directory, each with its plot saved in `img_dir` and linked relative
    to `md_dir` (where the markdown will live)."""
    parts = []
    for d in dirs:
        res = load_results(d)
        png = plot_switch_latency(res, Path(img_dir) / f"{res.name}.png")
        parts.append(replay_markdown(res, _link(png, md_dir)))
    return "\n\n".join(parts)


def report_set(sr: SetResults, img_dir: str | Path, md_dir: str | Path) -> str:
    """One set's markdown, its plot (grid, capacity) saved in `img_dir` and linked relative to `md_dir`."""
    def plotted(plot, name: str) -> str | None:  # no plot before the first run
        return _link(plot(sr, Path(img_dir) / name), md_dir) if sr.summaries else None

    if sr.name == "grid":
        return grid_markdown(sr, plotted(plot_grid, "grid-switch-vs-contexts.png"))
    if sr.name == "capacity":
        return capacity_markdown(sr, plotted(plot_capacity, "capacity-max-contexts.png"))
    if sr.name == "ablation":
        return ablation_markdown(sr)
    return chunks_markdown(sr)


def report_sets(out: str | Path, img_dir: str | Path, md_dir: str | Path) -> dict[str, str]:
    """Markdown of every set with a manifest under `out`, by set name (ResultsError when there is none)."""
    texts = {name: report_set(load_set(out, name), img_dir, md_dir)
             for name in G.SETS if G.manifest_path(out, name).exists()}
    if not texts:
        raise ResultsError(f"{out}: no grid set manifest (set-<name>.json); run python -m bench.grid first")
    return texts


def main(argv: list[str] | None = None, prog: str = "python -m bench.report") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Replay results as markdown tables and PNG plots "
                                 "(LLMS Fig. 9 and 10 style); the markdown goes to stdout, or into a file with --write.")
    ap.add_argument("dirs", nargs="*", metavar="RESULTS_DIR", help="written by deploy.jobs.replay --out")
    ap.add_argument("--grid", type=Path, metavar="OUT",
                    help="render the experiment sets bench.grid ran into OUT, each between its own markers")
    ap.add_argument("--write", type=Path, metavar="FILE",
                    help=f"replace the text between {BEGIN} and {END} (and the sets' markers) in this markdown file")
    ap.add_argument("--img-dir", type=Path, default=None, metavar="DIR",
                    help="where the PNGs go (default: img/ next to --write's file, else docs/img)")
    args = ap.parse_args(argv)
    if not args.dirs and args.grid is None:
        ap.error("give RESULTS_DIRs, --grid OUT, or both")
    img_dir = args.img_dir or (args.write.parent / "img" if args.write else Path("docs/img"))
    md_dir = args.write.parent if args.write else Path.cwd()
    try:
        sections = [(BEGIN, END, SECTION, report(args.dirs, img_dir, md_dir))] if args.dirs else []
        if args.grid is not None:
            sections += [(*SET_MARKERS[name], SET_SECTIONS[name], text)
                         for name, text in report_sets(args.grid, img_dir, md_dir).items()]
        if args.write:
            doc = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
            for begin, end, section, text in sections:
                doc = replace_section(doc, text, begin, end, section)
            args.write.write_text(doc)
    except ResultsError as e:
        ap.error(str(e))
    print("\n\n".join(f"{section}\n\n{text}" if args.grid is not None else text
                      for _, _, section, text in sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
