"""The layout of the tests and benchmarks (CONTRIBUTING.md): every test module sits in the folder of its layer, a test
module imports nothing from another test module (what tests share lives in tests/support, so each module can run,
move or go on its own), and a benchmark imports no other benchmark."""

from __future__ import annotations

import ast
from pathlib import Path

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
