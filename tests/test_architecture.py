"""The rules of the codebase, measured (issue #12): layered imports with no cycles (the
import-linter contracts in pyproject.toml), small files and functions, no function-local
imports, ``Any`` only where a third-party engine object has no type, and only
``train/backward/`` starts the backward process."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from importlinter.application.use_cases import lint_imports
from importlinter.configuration import configure

SRC = Path(__file__).resolve().parents[1] / "src" / "deltaserve"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

# Where an import inside a function is the point: the engine is imported only when chosen.
LOCAL_IMPORTS_ALLOWED = {
    "cli.py": "the chosen engine's server is imported only when `serve --engine` names it",
}
# Where `Any` stands for an object of a third-party library that has no type to name.
ANY_ALLOWED = {
    "hosts/vllm": "vLLM's internal objects (scheduler state, runner batches) are untyped",
    "hosts/sglang": "SGLang's internal objects (batches, server args) are untyped",
    "entrypoints/serve_sglang.py": "SGLang's server args, as in hosts/sglang",
    "core/tokenizer.py": "a Hugging Face tokenizer's keyword arguments and return values",
}


def modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def test_layers_and_no_import_cycles(capsys):
    configure()
    kept = lint_imports(config_filename=str(SRC.parents[1] / "pyproject.toml"), cache_dir=None,
                        no_logo=True)
    assert kept, capsys.readouterr().out


def test_files_and_functions_stay_small():
    too_long = []
    for path in modules():
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{rel(path)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel(path)}:{node.lineno} {node.name}: {n} lines")
    assert not too_long, "\n".join(too_long)


def test_no_function_local_imports():
    found = []
    for path in modules():
        if rel(path) in LOCAL_IMPORTS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Import | ast.ImportFrom):
                        found.append(f"{rel(path)}:{sub.lineno} in {node.name}: "
                                     f"{ast.unparse(sub)}")
    assert not found, "\n".join(found)


def test_any_only_for_untyped_engine_objects():
    found = []
    for path in modules():
        r = rel(path)
        if any(r == a or r.startswith(a + "/") for a in ANY_ALLOWED):
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"\bAny\b", code) and "import" not in code:
                found.append(f"{r}:{no}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("package", ["core"])
def test_the_policy_imports_no_torch(package):
    """The control plane is plain Python: unit-tested in milliseconds, anywhere."""
    for path in (SRC / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.split(".")[0] == "torch"], rel(path)


# The backward process is started in one place, the package the trainer owns: whoever else
# spawned it would bypass the grant, the outcome handling and the rollback of a half-published
# step that :mod:`deltaserve.train.backward` keeps together.
BACKWARD_PACKAGE = "train/backward"
# Modules that start a process of their own, which is not the backward, and why.
OTHER_PROCESSES_ALLOWED = {
    "bench/split_pool.py": "the split-pool baseline's standalone trainer process (its own "
                           "model and optimizer, no grant): a compared system, not the backward",
    "bench/replica_processes.py": "a data-parallel replica per process (vLLM's engines cannot "
                                  "share one): each a whole host, whose own backward its "
                                  "co-server starts through train/backward/",
}
PROCESS_MODULES = {"multiprocessing", "torch.multiprocessing"}
BACKWARD_NAMES = {"BackwardProcess", "worker_main"}


def process_starts(tree: ast.AST) -> list[tuple[int, str]]:
    """Where ``tree`` imports a multiprocessing module, calls ``get_context``/``Process``, or
    names the backward's process or entry point."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name in PROCESS_MODULES or a.name.startswith("multiprocessing.")]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            names = {a.name for a in node.names}
            if (mod in PROCESS_MODULES or mod.startswith("multiprocessing.")
                    or (mod == "torch" and "multiprocessing" in names)):
                found.append((node.lineno, f"from {mod} import ..."))
            elif names & BACKWARD_NAMES:
                found.append((node.lineno, f"from {mod} import {sorted(names & BACKWARD_NAMES)}"))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in {"Process", "get_context"} | BACKWARD_NAMES:
                found.append((node.lineno, f"{ast.unparse(f)}(...)"))
    return found


def test_only_the_backward_package_starts_the_backward_process():
    found = []
    for path in modules():
        r = rel(path)
        if r.startswith(BACKWARD_PACKAGE + "/") or r in OTHER_PROCESSES_ALLOWED:
            continue
        found += [f"{r}:{no}: {what}" for no, what in process_starts(ast.parse(path.read_text()))]
    assert not found, "only train/backward/ starts processes:\n" + "\n".join(found)


def test_the_process_rule_sees_a_backward_started_elsewhere():
    """The rule above can fail: each way of starting the backward outside its package is seen."""
    for source in ("import torch.multiprocessing as mp\n",
                   "from torch import multiprocessing\n",
                   "import multiprocessing\n",
                   "ctx.Process(target=f)\n",
                   "mp.get_context('spawn')\n",
                   "from deltaserve.train.backward.process import BackwardProcess\n",
                   "BackwardProcess(spec, shared)\n"):
        assert process_starts(ast.parse(source)), source
    assert not process_starts(ast.parse("from deltaserve.train.trainer import Trainer\n"))
