"""The tests' own layout (CONTRIBUTING.md, "Tests"): every test module sits in the folder of its layer, and a test
module imports nothing from another test module: what tests share lives in tests/support, so each module can run,
move or go on its own."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

TESTS = REPO / "tests"
LAYERS = {"engine", "api", "workbench", "ui", "browser", "project"}


def imported_test_modules(path: Path) -> list[str]:
    """The modules under tests/ that `path` imports, anywhere in it (function-local imports too), less tests.support:
    `from tests.api.test_server import x`, `from tests import test_x`, `from .test_x import y`."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) + 1 - node.level] if node.level else ()
            module = ".".join([*base, *filter(None, [node.module])])
            names = [f"{module}.{alias.name}" for alias in node.names] if module == "tests" else [module]
        else:
            continue
        found |= {name for name in names if name.startswith("tests.") and name.split(".")[1] != "support"}
    return sorted(found)


def test_no_test_module_imports_another():
    imports = {str(path.relative_to(REPO)): imported_test_modules(path) for path in sorted(TESTS.rglob("*.py"))}
    assert {path: names for path, names in imports.items() if names} == {}


def test_every_test_module_is_in_the_folder_of_its_layer():
    folders = {path.parent.relative_to(TESTS).as_posix() for path in TESTS.rglob("test_*.py")}
    assert folders <= LAYERS, f"test modules outside the layers' folders: {sorted(folders - LAYERS)}"
    assert all((TESTS / folder / "__init__.py").is_file() for folder in LAYERS | {"support"})
