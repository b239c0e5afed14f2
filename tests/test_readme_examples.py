"""The README's Python examples are what a user copies: each compiles, every name it imports
exists (in the venv that runs it: engine hosts are checked where their engine is installed), and
each one that starts co-serving does it under an ``if __name__ == "__main__":`` guard (the
backward is a process of its own, spawned by re-importing the main module)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
ENGINES = {"deltaserve.hosts.vllm": "vllm", "deltaserve.hosts.sglang": "sglang"}


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_example_imports_resolve_and_coserving_is_guarded(code):
    tree = ast.parse(code)  # a syntax error fails here
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            engine = next((e for m, e in ENGINES.items()
                           if node.module == m or node.module.startswith(m + ".")), None)
            if engine is not None and importlib.util.find_spec(engine) is None:
                continue  # that engine's venv checks it
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
    calls = {n.func.attr for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    if "attach" in calls:
        guards = [n for n in tree.body if isinstance(n, ast.If)
                  and ast.unparse(n.test) in ('__name__ == "__main__"', "__name__ == '__main__'")]
        assert guards, "an example that attaches must run under if __name__ == '__main__':"
        top_calls = {n.func.attr for stmt in tree.body if stmt not in guards
                     for n in ast.walk(stmt)
                     if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert "attach" not in top_calls
