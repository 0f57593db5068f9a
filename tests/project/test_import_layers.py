"""The contract and the UI-free services load without the engine: a client, the store, the schema library and the
case-set services never pay for torch (seconds to import) or need it installed. Each check runs in a fresh
interpreter, as a user's process starts, because this test session has long since imported torch."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

TORCH_FREE = [
    "clef_engine",
    "clef_engine.protocol",
    "clef_engine.errors",
    "clef_engine.interface",
    "clef_engine.remote",
    "clef_engine.remote_http",
    "clef_workbench.store",
    "clef_workbench.schemas",
    "clef_workbench.schema_diff",
    "clef_workbench.schema_library",
    "clef_workbench.casesets",
    "clef_workbench.case_table",
    "clef_workbench.stats",
    "clef_workbench.compare",
    "clef_workbench.review",
    "workbench_ui.state_input",
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


@functools.cache
def product_modules() -> dict[str, ast.Module]:
    """Repository-relative path → parsed source of every product module (parsed once: four tests read them)."""
    paths: list[Path] = []
    for entry in PRODUCT:
        path = REPO / entry
        paths.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return {path.relative_to(REPO).as_posix(): ast.parse(path.read_text(encoding="utf-8")) for path in paths}


def import_statements(path: str, tree: ast.Module, *, runtime_only: bool = False) -> list[tuple[str, list[str]]]:
    """(module, the names imported from it; [] for `import module`) of every import in `tree`, module-level and
    function-local, relative imports resolved against its package (`path`); `runtime_only` leaves out the imports
    under `if TYPE_CHECKING:`, which never run."""
    package = path.removesuffix(".py").split("/")[:-1]  # a module's package; an __init__'s is its own folder
    type_only = {id(inner) for block in ast.walk(tree) if runtime_only and isinstance(block, ast.If)
                 and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                 for statement in block.body for inner in ast.walk(statement)}
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and id(node) not in type_only:
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and id(node) not in type_only:
            base = package[: len(package) - node.level + 1] if node.level else []
            found.append((".".join([*base, *([node.module] if node.module else [])]), [a.name for a in node.names]))
    return found


def imported_modules(path: str, tree: ast.Module) -> set[str]:
    """Every module `tree` imports, and `module.name` for every name it imports from one (a submodule or not)."""
    return {imported for module, names in import_statements(path, tree)
            for imported in (module, *(f"{module}.{name}" for name in names))}


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
    assert "clef_engine" in checked or "clef_engine/interface.py" in checked
    source = (REPO / "clef_engine" / "interface.py").read_text(encoding="utf-8")
    assert "engine: DecisionEngine = local" in source and "engine = remote" in source


# --- no import cycle, and every layer imports only downwards ------------------------------------------------------
# Layers: contract -> model -> fast path -> engine -> serving and the workbench (docs/architecture.md). serve/'s own
# rule is test_nothing_below_the_server_imports_serve above.
LAYER_RULES = [  # (importers: path prefixes, what they must not import: module prefixes)
    (("clef_engine/model/",), ("clef_engine.fast",)),  # the model is the exact path the fast one is checked against
    # the services are UI-free: Streamlit and its charts live in workbench_ui/ and pages/
    (("clef_workbench/",), ("streamlit", "altair", "workbench_ui", "pages")),
    # fronts reach the engine through clef_engine.interface, never its kernels
    (("clef_engine/serve/", "clef_workbench/", "workbench_ui/", "pages/", "app.py", "serve_workbench.py"),
     ("clef_engine.fast",)),
    # the scheduler knows nothing of tensors, the model runner nothing of requests (nano-vllm's split)
    (("clef_engine/scheduler.py",), ("torch", "clef_engine.runner", "clef_engine.engine")),
    (("clef_engine/runner.py",), ("clef_engine.engine", "clef_engine.explain", "clef_engine.interface",
                                  "clef_engine.protocol", "clef_engine.serve")),
]


def module_name(path: str) -> str:
    """clef_engine/fast/packed.py -> clef_engine.fast.packed; a package's __init__.py -> the package."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module path -> the paths of the modules among `modules` it imports at run time (`from package import name`
    imports the submodule `package.name` where there is one, else the package)."""
    paths = {module_name(path): path for path in modules}
    graph = {}
    for path, tree in modules.items():
        targets = {f"{module}.{name}" if f"{module}.{name}" in paths else module
                   for module, names in import_statements(path, tree, runtime_only=True)
                   for name in names or [""]}  # `import module` names nothing: the module itself
        graph[path] = {paths[target] for target in targets if target in paths} - {path}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` reaches by one import or more."""
    seen: set[str] = set()
    waiting = list(graph[start])
    while waiting:
        node = waiting.pop()
        if node not in seen:
            seen.add(node)
            waiting.extend(graph[node])
    return seen


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Each set of modules that import one another, directly or around a loop (a strongly connected component)."""
    reach = {node: reachable(graph, node) for node in graph}
    return {frozenset({node} | {other for other in reach[node] if node in reach[other]})
            for node in graph if node in reach[node]}


def layer_breaks(modules: dict[str, ast.Module]) -> set[tuple[str, str]]:
    """(module path, forbidden module prefix) for every import against LAYER_RULES (TYPE_CHECKING imports too)."""
    return {(path, forbidden) for path, tree in modules.items() for importers, forbiddens in LAYER_RULES
            if path.startswith(importers) for imported in imported_modules(path, tree) for forbidden in forbiddens
            if imported == forbidden or imported.startswith(forbidden + ".")}


def test_the_import_graph_sees_function_local_imports_and_skips_type_checking_ones():
    modules = {path: ast.parse(source) for path, source in {
        "pkg/__init__.py": "",
        "pkg/a.py": "def late():\n    from . import b\n",
        "pkg/b.py": "from .a import late\nimport pkg.c\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\nimport altair\n",
    }.items()}
    graph = import_graph(modules)
    assert graph == {"pkg/__init__.py": set(), "pkg/a.py": {"pkg/b.py"}, "pkg/b.py": {"pkg/a.py", "pkg/c.py"},
                     "pkg/c.py": set()}
    assert import_cycles(graph) == {frozenset({"pkg/a.py", "pkg/b.py"})}
    assert import_cycles({**graph, "pkg/c.py": {"pkg/__init__.py"}, "pkg/__init__.py": {"pkg/b.py"}}) == {
        frozenset(modules)}
    assert layer_breaks({"clef_workbench/" + path.removeprefix("pkg/"): tree for path, tree in modules.items()}) == {
        ("clef_workbench/c.py", "altair")}


def test_no_product_module_imports_another_that_imports_it_back():
    """No runtime import cycle among product modules, function-local imports included (a late import hides a
    cycle from Python, not from a reader): a module can be read, tested and moved with what it imports."""
    assert import_cycles(import_graph(product_modules())) == set()


def test_every_layer_imports_only_the_layers_below_it():
    assert layer_breaks(product_modules()) == set()
