"""Rules over the product code itself, read as syntax trees: it writes to no private Streamlit class (the app's
navigation is Streamlit's public pages-directory mode), and the environment is read in one module per side — the
workbench's `clef_workbench/settings.py` and the engine's `clef_engine/config.py`."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

PRODUCT_PACKAGES = ["pages", "clef_engine", "clef_workbench", "workbench_ui"]
PRODUCT_SCRIPTS = ["app.py", "serve_workbench.py"]
# Streamlit's documented modules; everything else under streamlit (streamlit.runtime, ...) is its internals.
PUBLIC_STREAMLIT = {"streamlit", "streamlit.components.v1", "streamlit.column_config"}
ENVIRONMENT_READERS = {
    "clef_workbench/settings.py",  # WorkbenchSettings: the workbench, the app and the workbench CLI
    "clef_engine/config.py",  # EngineConfig: the engine's knobs
    # what the engine's library entry points fall back on (a remote key, the demo's cache folder, --api-key-env),
    # torch-free so that a remote client reads its key without torch
    "clef_engine/environment.py",
}


def product_files() -> list[Path]:
    files = [REPO / name for name in PRODUCT_SCRIPTS]
    for package in PRODUCT_PACKAGES:
        files += sorted((REPO / package).rglob("*.py"))
    return files


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_the_product_code_is_found():
    names = {str(path.relative_to(REPO)) for path in product_files()}
    assert {"app.py", "pages/runs.py", "workbench_ui/shell.py", "clef_workbench/jobs.py"} <= names


def test_no_product_module_touches_streamlit_internals():
    """The old shell imported streamlit.runtime.pages_manager and set PagesManager.uses_pages_directory, because a
    `pages/` folder made Streamlit run a deep link's page without app.py's navigation."""
    found = []
    for path in product_files():
        where = path.relative_to(REPO)
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            else:
                modules = []
            found += [f"{where}:{node.lineno} imports {module}" for module in modules
                      if module.split(".")[0] == "streamlit" and module not in PUBLIC_STREAMLIT]
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in ("PagesManager", "uses_pages_directory"):
                found.append(f"{where}:{node.lineno} uses {name}")
    assert not found, found
def reads_environment(node: ast.AST) -> bool:
    """os.environ / os.getenv / environ / getenv (from os import …), as an expression."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
        return node.attr in ("environ", "getenv", "environb", "getenvb")
    if isinstance(node, ast.ImportFrom) and node.module == "os":
        return any(alias.name in ("environ", "getenv", "environb", "getenvb") for alias in node.names)
    return False


def test_only_the_settings_modules_read_the_environment():
    readers = {}
    for path in product_files():
        where = str(path.relative_to(REPO))
        lines = [node.lineno for node in ast.walk(parsed(path)) if reads_environment(node)]
        if lines:
            readers[where] = lines
    strays = {where: lines for where, lines in readers.items() if where not in ENVIRONMENT_READERS}
    assert not strays, f"read the environment outside the settings modules: {strays}"
    assert {"clef_workbench/settings.py", "clef_engine/config.py"} <= set(readers)
