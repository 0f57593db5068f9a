"""The contract and the UI-free services load without the engine: a client, the store, the schema library and the
case-set services never pay for torch (seconds to import) or need it installed. Each check runs in a fresh
interpreter, as a user's process starts, because this test session has long since imported torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

TORCH_FREE = [
    "clef_engine",
    "clef_engine.protocol",
    "clef_engine.errors",
    "clef_engine.interface",
    "clef_engine.remote",
    "clef_engine.remote_http",
    "clef_engine.fp8_fidelity",
    "clef_workbench.store",
    "clef_workbench.schemas",
    "clef_workbench.schema_diff",
    "clef_workbench.schema_library",
    "clef_workbench.casesets",
    "clef_workbench.case_table",
    "clef_workbench.stats",
    "clef_workbench.compare",
    "clef_workbench.review",
    "clef_workbench.state_input",
]


def modules_loaded_by(statement: str) -> set[str]:
    """The module names `sys.modules` holds after running `statement` in a fresh interpreter."""
    probe = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_the_contract_and_the_store_import_without_torch():
    loaded = modules_loaded_by("import clef_engine.protocol, clef_workbench.store")
    assert "clef_engine.protocol" in loaded and "clef_workbench.store" in loaded
    assert "torch" not in loaded


def test_no_ui_free_module_imports_torch():
    # One interpreter for all: each module is imported in turn, and the first that brings torch in is named.
    probe = ("import importlib, sys\n"
             f"for name in {TORCH_FREE!r}:\n"
             "    importlib.import_module(name)\n"
             "    if 'torch' in sys.modules:\n"
             "        print('torch-came-with:' + name)\n"
             "        break")
    loaded = modules_loaded_by(probe)
    assert set(TORCH_FREE) <= loaded
    assert "torch" not in loaded, sorted(name for name in loaded if name.startswith("torch-came-with:"))


def test_the_engine_still_loads_on_first_use_through_the_package():
    loaded = modules_loaded_by("import clef_engine\nclef_engine.Engine, clef_engine.demo_release")
    assert {"torch", "clef_engine.engine", "clef_engine.tiny"} <= loaded


def test_contract_defaults_are_the_ones_the_engine_uses():
    from clef_engine import DEFAULT_MAX_LENGTH, protocol
    from clef_engine.model import encoding, media

    assert DEFAULT_MAX_LENGTH == protocol.DEFAULT_MAX_LENGTH == encoding.DEFAULT_MAX_LENGTH
    assert media.sniff_content_type is protocol.sniff_content_type
    assert media.MAX_MEDIA_BYTES == protocol.MAX_MEDIA_BYTES


# --- the engine's layers: serve/ is a front above the engine, and callers use the engine's interface ------------

PRODUCT = ["clef_engine", "clef_workbench", "workbench_ui", "pages", "app.py", "serve_workbench.py"]
# Fronts over serve/: the command line's dispatch, and the workbench process that mounts the HTTP API's routes
# beside Streamlit (a launcher, which nothing but serve_workbench.py imports).
SERVE_FRONTS = {"clef_engine/__main__.py", "workbench_ui/server.py"}
# The engine's own modules may use its parts; everyone else goes through clef_engine.interface.DecisionEngine.
ENGINE_INSIDE = {"clef_engine/engine.py", "clef_engine/explain.py", "clef_engine/model/reference.py"}
ENGINE_PARTS = {"encoder", "scheduler", "release"}


def product_modules() -> dict[str, ast.Module]:
    """Repository-relative path → parsed source of every product module."""
    paths: list[Path] = []
    for entry in PRODUCT:
        path = REPO / entry
        paths.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return {path.relative_to(REPO).as_posix(): ast.parse(path.read_text(encoding="utf-8")) for path in paths}


def imported_modules(path: str, tree: ast.Module) -> set[str]:
    """Every module `tree` imports, relative imports resolved against its package (`path`)."""
    package = path.removesuffix(".py").split("/")[:-1]  # a module's package; an __init__'s is its own folder
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_imported_modules_resolves_relative_imports():
    tree = ast.parse("from ..scheduler import Scheduler\nfrom . import openapi\nimport clef_engine.serve.cli")
    assert imported_modules("clef_engine/serve/server.py", tree) >= {
        "clef_engine.scheduler", "clef_engine.serve.openapi", "clef_engine.serve.cli"}
    assert "clef_engine.serve.scheduler" in imported_modules("clef_engine/engine.py",
                                                             ast.parse("from .serve.scheduler import Scheduler"))


def test_nothing_below_the_server_imports_serve():
    """serve/ is a front above the engine (nano-vllm's split): the engine, the workbench's services and the UI
    never import it, so the engine runs, and is tested, without its HTTP front."""
    offenders = {path: sorted(m for m in imported_modules(path, tree) if m.startswith("clef_engine.serve"))
                 for path, tree in product_modules().items()
                 if not path.startswith("clef_engine/serve/") and path not in SERVE_FRONTS}
    assert {path: modules for path, modules in offenders.items() if modules} == {}


def engine_probes(tree: ast.Module) -> list[str]:
    """`hasattr(<an engine>, …)` calls and `<an engine>.encoder / .scheduler / .release` reaches in `tree`: an
    engine is any name or attribute whose name ends in "engine"."""

    def is_engine(node: ast.AST) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        return name.lower().endswith("engine")

    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"
                and node.args and is_engine(node.args[0])):
            found.append(f"line {node.lineno}: hasattr({ast.unparse(node.args[0])}, …)")
        elif isinstance(node, ast.Attribute) and node.attr in ENGINE_PARTS and is_engine(node.value):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_engine_probes_are_found():
    tree = ast.parse("hasattr(engine, 'scheduler')\nself.engine.encoder.pad_token_id\nx = job.release")
    assert engine_probes(tree) == ["line 1: hasattr(engine, …)", "line 2: self.engine.encoder"]


def test_callers_use_the_engine_interface_and_nothing_else():
    """Outside the engine's own modules nobody probes an engine for attributes or reaches into its encoder,
    scheduler or release: they call clef_engine.interface.DecisionEngine, which both engines implement."""
    found = {path: engine_probes(tree) for path, tree in product_modules().items() if path not in ENGINE_INSIDE}
    assert {path: probes for path, probes in found.items() if probes} == {}


def test_both_engines_implement_the_decision_engine_protocol(tiny_engine):
    from clef_engine.interface import DecisionEngine, ExplainingEngine
    from clef_engine.remote import RemoteEngine

    remote = RemoteEngine("http://127.0.0.1:9", check=False)
    try:
        assert isinstance(tiny_engine, DecisionEngine) and isinstance(tiny_engine, ExplainingEngine)
        assert isinstance(remote, DecisionEngine) and not isinstance(remote, ExplainingEngine)
    finally:
        remote.close()


def test_mypy_checks_that_both_engines_implement_the_protocol():
    """interface.py assigns an Engine and a RemoteEngine to DecisionEngine variables for mypy (under TYPE_CHECKING);
    the module is on mypy's list, so a method either engine lacks or types differently fails the type check."""
    import tomllib

    checked = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]["files"]
    assert "clef_engine/interface.py" in checked
    source = (REPO / "clef_engine" / "interface.py").read_text(encoding="utf-8")
    assert "engine: DecisionEngine = local" in source and "engine = remote" in source
