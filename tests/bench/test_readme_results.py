"""The documents' results are the committed runs' ``results.json``, rendered, and the prose
around them states no figure the files do not hold.

Each block between ``<!-- results: PATH -->`` and ``<!-- /results -->`` (a table) or
``<!-- results-summary: PATH -->`` and ``<!-- /results-summary -->`` (the run's figures as
prose), PATH relative to the document's folder, must equal what
``python -m deltaserve.bench.tables`` renders from PATH; ``--update FILE`` rewrites them.
Outside the blocks, in the sections on measured runs (README.md's headline, docs/results.md's
measured sections, docs/log.md's entries on measured runs), every percentage, millisecond and
tokens/s figure must be one the results the paragraph names hold, to the written precision
(a named folder's JSON files, and the figures its ``bench.log``, the bench's own output, printed);
a paragraph naming none is checked against the document's own blocks, or in a document
without blocks against every committed run.
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltaserve.bench.tables import BLOCK, blocks

ROOT = Path(__file__).resolve().parents[2]
WITH_BLOCKS = ("README.md", "docs/results.md")  # each must hold blocks: no vacuous pass
# document -> headings of its sections on measured runs (a section ends at the next "## ")
SECTIONS = {
    "README.md": ("## The headline run",),
    "docs/results.md": ("## Measured on this machine", "## Measured on SGLang"),
    "docs/log.md": ("## 2026-12-04: SGLang reads", "## 2026-12-04: why `--slo-scale`",
                    "## 2026-12-04: four fixes", "## 2026-12-03: the yields"),
}
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?) ?(%|ms\b|tokens/s)")
FOLDER = re.compile(r"results/([\w.-]+)/")


def test_every_markdown_file_with_blocks_is_checked():
    holding = {str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *ROOT.glob("docs/*.md")]
               if BLOCK.search(p.read_text())}
    assert holding == set(WITH_BLOCKS)


@pytest.mark.parametrize("name", WITH_BLOCKS)
def test_results_blocks_match_their_committed_results(name):
    found = blocks(ROOT / name)  # a block naming a missing file fails here (FileNotFoundError)
    assert found, f"{name} has no '<!-- results: PATH -->' block"
    for b in found:
        assert b.matches, (f"{name} block for {b.path} differs from its results.json; run "
                           f"python -m deltaserve.bench.tables --update {name}")


@pytest.mark.parametrize("name", WITH_BLOCKS)
def test_every_run_with_a_table_has_its_figures_generated_as_prose(name):
    kinds: dict[str, set[str]] = {}
    for m in BLOCK.finditer((ROOT / name).read_text()):
        kinds.setdefault(m["path"], set()).add(m["kind"])
    tables = {p for p, k in kinds.items() if "" in k}
    # the simulated runs' prose is the simulator's report (paper.md), not checked here
    measured = {p for p in tables if "-sim-" not in p}
    assert measured and all("-summary" in kinds[p] for p in measured), sorted(
        p for p in measured if "-summary" not in kinds[p])


def _leaves(doc: object) -> Iterator[float]:
    if isinstance(doc, dict):
        for v in doc.values():
            yield from _leaves(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _leaves(v)
    elif isinstance(doc, int | float) and not isinstance(doc, bool):
        yield float(doc)


def _log_numbers(path: Path) -> Iterator[float]:
    """The figures a bench printed, as the JSON files hold them (a percentage as a fraction)."""
    for m in FIGURE.finditer(path.read_text()):
        value = float(m[1].replace(",", ""))
        yield value / 100.0 if m[2] == "%" else value


def _named_numbers(folder: Path) -> list[float]:
    numbers = [x for p in sorted(folder.glob("*.json")) for x in _leaves(json.loads(p.read_text()))]
    log = folder / "bench.log"
    return numbers + (list(_log_numbers(log)) if log.is_file() else [])


def _held(value: float, unit: str, numbers: list[float]) -> bool:
    """Whether ``value`` (as written, with ``unit``) is one of ``numbers`` at its precision:
    a percentage is a fraction × 100 to one decimal or none, ms to the unit (held in ms, or in
    seconds as the step records and miss events hold them), tokens/s to one decimal or none."""
    scales = {"%": (100.0,), "ms": (1.0, 1e3)}.get(unit, (1.0,))
    return any(round(k * x, 1) == value or round(k * x) == value
               for k in scales for x in numbers)


def _section(text: str, head: str) -> str:
    start = text.index(head)  # a renamed heading fails here rather than skipping its checks
    end = text.find("\n## ", start + len(head))
    return text[start:end if end >= 0 else None]


def _figures(name: str) -> tuple[list[tuple[str, str]], int]:
    """The figures outside the blocks of ``name``'s measured sections that no results they
    name hold, and how many figures were read."""
    path = ROOT / name
    text = path.read_text()
    runs = sorted({(path.parent / m["path"]).resolve() for m in BLOCK.finditer(text)})
    runs = runs or sorted(ROOT.glob("results/*/results.json"))
    unheld, read = [], 0
    for head in SECTIONS[name]:
        for para in BLOCK.sub("", _section(text, head)).split("\n\n"):
            named = [ROOT / "results" / f for f in FOLDER.findall(para)]
            numbers = ([x for f in named for x in _named_numbers(f)] if named else
                       [x for p in runs if p.is_file() for x in _leaves(json.loads(p.read_text()))])
            figures = list(FIGURE.finditer(para))
            read += len(figures)
            unheld += [(m[0], para[:60]) for m in figures
                       if not _held(float(m[1].replace(",", "")), m[2], numbers)]
    return unheld, read


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_prose_figures_outside_the_blocks_are_in_the_results_they_name(name):
    unheld, _ = _figures(name)
    assert not unheld, f"{name}: figures no named results.json holds: {unheld}"


def test_the_prose_check_reads_figures():
    # the results' own prose leaves figures to the blocks; the log's history states many
    assert _figures("docs/log.md")[1] >= 10
