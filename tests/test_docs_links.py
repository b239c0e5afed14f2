"""Every relative link in README.md and docs/*.md names a file or folder of the repository,
and none leaves it: a reader following one lands on what it names, in this checkout.
Web links (http, https, mailto) are not followed; ``#anchor`` links within a page are checked
against its headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
WEB = ("http://", "https://", "mailto:")


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", FENCE.sub("", text), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def _links(doc: Path) -> list[str]:
    text = FENCE.sub("", doc.read_text())
    return [m[1] or m[2] for m in LINK.finditer(text)]


def test_the_documents_have_relative_links():
    assert sum(1 for d in DOCS for t in _links(d) if not t.startswith(WEB)) >= 10


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_relative_links_resolve_inside_the_repository(doc):
    broken = []
    for target in _links(doc):
        if target.startswith(WEB):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        inside = dest.is_relative_to(ROOT) and dest.exists()
        anchored = (not anchor or dest.suffix != ".md" or not inside
                    or anchor in _anchors(dest.read_text()))
        if not (inside and anchored):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links that do not resolve: {broken}"
