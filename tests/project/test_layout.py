"""The layout of the tests and benchmarks (CONTRIBUTING.md): every test module sits in the folder of its layer, a test
module imports nothing from another test module (what tests share lives in tests/support, so each module can run,
move or go on its own), collecting them runs nothing of the project, and a benchmark imports no other benchmark."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

TESTS = REPO / "tests"
LAYERS = {"engine", "api", "workbench", "ui", "browser", "project"}


def imported_modules(path: Path) -> set[str]:
    """What `path` imports, anywhere in it (function-local imports too), as absolute names: `from a.b import c` is
    `a.b` and `a.b.c`, `from .x import y` is resolved against the file's package."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) + 1 - node.level] if node.level else ()
            module = ".".join([*base, *filter(None, [node.module])])
            found |= {module, *(f"{module}.{alias.name}" for alias in node.names)}
    return found


def imported_test_modules(path: Path) -> list[str]:
    """The modules under tests/ that `path` imports, less tests.support."""
    return sorted(name for name in imported_modules(path)
                  if name.startswith("tests.") and name.split(".")[1] != "support")


def test_no_test_module_imports_another():
    imports = {str(path.relative_to(REPO)): imported_test_modules(path) for path in sorted(TESTS.rglob("*.py"))}
    assert {path: names for path, names in imports.items() if names} == {}


def test_every_test_module_is_in_the_folder_of_its_layer():
    folders = {path.parent.relative_to(TESTS).as_posix() for path in TESTS.rglob("test_*.py")}
    assert folders <= LAYERS, f"test modules outside the layers' folders: {sorted(folders - LAYERS)}"
    assert all((TESTS / folder / "__init__.py").is_file() for folder in LAYERS | {"support"})


def test_a_benchmark_imports_no_other_benchmark():
    """bench/ keeps benchmarks that stand alone: each imports only the shared helpers of bench/build.py and the
    fidelity measure (bench/fidelity.py, a section of two benchmarks), never another benchmark."""
    shared = {"build", "fidelity"}
    imports = {path.name: sorted(name for name in imported_modules(path)
                                 if name.startswith("bench.") and name.split(".")[1] not in shared)
               for path in sorted((REPO / "bench").glob("*.py"))}
    assert {name: found for name, found in imports.items() if found} == {}


COLLECT_WATCHED = """
import json, os, subprocess, sys
import pytest

started = []
spawn = subprocess.Popen.__init__


def watched(self, args, *rest, **options):
    words = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    name = os.path.basename(words[0])
    if name.startswith("python") or name in ("bash", "sh") or any(os.getcwd() in w or ".venv" in w for w in words):
        started.append(words)
        raise RuntimeError(f"started at collection: {words}")
    return spawn(self, args, *rest, **options)


subprocess.Popen.__init__ = watched
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"])
print("STARTED", json.dumps(started))
sys.exit(code)
"""


@pytest.mark.slow  # collects the whole suite in a child interpreter
def test_collecting_the_suite_runs_nothing_of_the_project():
    """`pytest --collect-only` imports every test module and runs no process of the project (its Python, its
    `.venv`, a shell): so collecting works where the project's `.venv` is not, and costs only the imports. A library
    may still run its helpers as it is imported (ctypes asks ldconfig)."""
    done = subprocess.run([sys.executable, "-c", COLLECT_WATCHED], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    started = json.loads(done.stdout.rsplit("STARTED ", 1)[1])
    assert started == [] and done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
