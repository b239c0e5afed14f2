"""The README's result tables are the committed runs' ``results.json``, rendered.

Each block between ``<!-- results: PATH -->`` and ``<!-- /results -->`` must equal
``python -m deltaserve.bench.tables PATH``; ``--update README.md`` rewrites them.
"""

from pathlib import Path

import pytest

from deltaserve.bench.tables import blocks

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_results_blocks_match_their_committed_results():
    found = blocks(README)  # a block naming a missing file fails here (FileNotFoundError)
    if not found:
        pytest.skip("README.md has no '<!-- results: PATH -->' block yet: nothing to check "
                    "(commit a run's results.json and add its block)")
    for b in found:
        assert b.matches, (f"README block for {b.path} differs from its results.json; run "
                           f"python -m deltaserve.bench.tables --update README.md")
