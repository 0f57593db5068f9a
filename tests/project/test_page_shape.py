"""Pages only render: each page function fits on a screen, and no page reaches past the view-models into the
statistics, the case-set services or the store (their calls, and the errors they raise, are the view-models')."""

from __future__ import annotations

import ast

import pytest

from tests.support import REPO

PAGES = sorted((REPO / "pages").glob("*.py"))
MAX_FUNCTION_LINES = 60
SERVICES_FOR_VIEW_MODELS = ("clef_workbench.stats", "clef_workbench.casesets", "clef_workbench.store")


def imported_modules(tree: ast.Module) -> set[str]:
    """Every module an import statement names, `from a import b` as both `a` and `a.b` (b may be a module)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_there_are_pages_to_check():
    assert {p.stem for p in PAGES} >= {"runs", "cases", "review", "decide", "schemas", "compare"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_function_is_over_60_lines(page):
    tree = ast.parse(page.read_text(encoding="utf-8"))
    too_long = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert too_long == {}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_imports_the_statistics_the_case_set_services_or_the_store(page):
    imported = imported_modules(ast.parse(page.read_text(encoding="utf-8")))
    reached = sorted(name for name in imported
                     if any(name == service or name.startswith(service + ".") for service in SERVICES_FOR_VIEW_MODELS))
    assert reached == []
