"""The README's results are the committed runs' ``results.json``, rendered, and its prose
around them states no figure the files do not hold.

Each block between ``<!-- results: PATH -->`` and ``<!-- /results -->`` (a table) or
``<!-- results-summary: PATH -->`` and ``<!-- /results-summary -->`` (the run's figures as
prose) must equal what ``python -m deltaserve.bench.tables`` renders from PATH;
``--update README.md`` rewrites them. Outside the blocks, in the sections on measured runs,
every percentage, millisecond and tokens/s figure must be one the results the paragraph names
(or, naming none, one of the README's runs) hold, to the written precision.
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltaserve.bench.tables import BLOCK, blocks

README = Path(__file__).resolve().parents[2] / "README.md"
SECTIONS = ("## Results on this machine", "### Measured on SGLang")
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?) ?(%|ms\b|tokens/s)")
FOLDER = re.compile(r"results/([\w.-]+)/")


def test_readme_results_blocks_match_their_committed_results():
    found = blocks(README)  # a block naming a missing file fails here (FileNotFoundError)
    if not found:
        pytest.skip("README.md has no '<!-- results: PATH -->' block yet: nothing to check "
                    "(commit a run's results.json and add its block)")
    for b in found:
        assert b.matches, (f"README block for {b.path} differs from its results.json; run "
                           f"python -m deltaserve.bench.tables --update README.md")


def test_every_run_with_a_table_has_its_figures_generated_as_prose():
    kinds: dict[str, set[str]] = {}
    for m in BLOCK.finditer(README.read_text()):
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


def _held(value: float, unit: str, numbers: list[float]) -> bool:
    """Whether ``value`` (as written, with ``unit``) is one of ``numbers`` at its precision:
    a percentage is a fraction × 100 to one decimal or none, ms to the unit, tokens/s to one
    decimal or none."""
    scale = 100.0 if unit == "%" else 1.0
    return any(round(scale * x, 1) == value or round(scale * x) == value for x in numbers)


def _section(text: str, head: str) -> str:
    start = text.index(head)
    end = text.find("\n## ", start + len(head))
    return text[start:end if end >= 0 else None]


def test_prose_figures_outside_the_blocks_are_in_the_results_they_name():
    text = README.read_text()
    runs = sorted({m["path"] for m in BLOCK.finditer(text)})
    unheld = []
    for head in SECTIONS:
        for para in BLOCK.sub("", _section(text, head)).split("\n\n"):
            paths = [f"results/{f}/results.json" for f in FOLDER.findall(para)] or runs
            numbers = [x for p in paths if (README.parent / p).is_file()
                       for x in _leaves(json.loads((README.parent / p).read_text()))]
            unheld += [(m[0], para[:60]) for m in FIGURE.finditer(para)
                       if not _held(float(m[1].replace(",", "")), m[2], numbers)]
    assert not unheld, f"figures no named results.json holds: {unheld}"
