"""The fixtures every test module can take (tests/conftest.py loads this module): one tiny Clef-format release, one
CPU engine and one default server process per test session, an HTTP client of it per module, a server of a test's
own, and per test the environment of one workbench."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO
from tests.support.servers import ServerProcess, serving

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Under pytest-xdist (scripts/test.sh) every worker and the servers it starts share the machine's cores: torch's
    # threads are split between the workers, so they never spin-wait for cores the other worker holds. Set before
    # any test module imports torch; child processes inherit it.
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


@pytest.fixture(scope="module", autouse=True)
def _local_ray_cluster_stopped_after_its_module():
    """A Ray cluster a test module started (tests/support/ray_cluster.py) stops with the module: test workers take
    turns."""
    yield
    from tests.support.ray_cluster import shutdown_local_cluster

    shutdown_local_cluster()


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory) -> Path:
    """A tiny release written by `build_tiny_release` (the same code as `python -m clef_engine tiny`)."""
    from clef_engine.tiny import build_tiny_release

    return build_tiny_release(tmp_path_factory.mktemp("tiny-release"), seed=0)


@pytest.fixture(scope="session")
def tiny_engine(tiny_release):
    """The tiny release loaded through the real loading path, on the CPU in float32."""
    import clef_engine

    engine = clef_engine.load(tiny_release, device="cpu", dtype="float32")
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def server(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real `python -m clef_engine serve` process on the tiny release with the default settings, shared by the
    tests that need no other (one per pytest-xdist worker). A module that needs other settings, or a server whose
    state no other test sees, starts its own with `tests.support.servers.serving`."""
    yield from serving(tiny_release, tmp_path_factory, "server.log")


@pytest.fixture
def fresh_server(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server process of one test's own, whose memory no earlier request has touched: memory another test's
    request freed stays in a process and would hide a growth, so a test that bounds the server's growth takes this."""
    yield from serving(tiny_release, tmp_path_factory, "fresh-server.log")


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    """An HTTP client of the `server` fixture (the session's, or the module's own where it defines one)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


@pytest.fixture
def workbench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Env for one workbench app: a copy of the shipped schemas, an empty database. The engine is shared by every
    test, as by every session of a real server (cache_resource); the store is per test (its path is CLEF_DB)."""
    from workbench_ui import shell

    schemas_dir = tmp_path / "schemas"
    shutil.copytree(REPO / "schemas", schemas_dir)
    monkeypatch.setenv("CLEF_SCHEMAS_DIR", str(schemas_dir))
    monkeypatch.setenv("CLEF_DB", str(tmp_path / "workbench.sqlite3"))
    monkeypatch.delenv("CLEF_MODEL", raising=False)
    monkeypatch.chdir(REPO)
    shell.get_store.clear()
    yield tmp_path
    shell.get_store.clear()


@pytest.fixture
def store(tmp_path: Path):
    """An empty workbench database in the test's folder (a module may define its own `store`)."""
    from clef_workbench.store import Store

    return Store(tmp_path / "w.db")


@pytest.fixture
def library(tmp_path: Path, store):
    """A copy of the shipped schema library whose versions `store` keeps (a module may define its own `library`)."""
    from clef_workbench.schema_library import SchemaLibrary

    shutil.copytree(REPO / "schemas", tmp_path / "schemas")
    return SchemaLibrary(tmp_path / "schemas", history=store)
