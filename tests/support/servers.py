"""Real server processes on free 127.0.0.1 ports: `python -m clef_engine serve` (`ServerProcess`, `serving`) and
`streamlit run serve_workbench.py` (`serving_workbench`), each waited for until its health route answers 200 and
stopped when its test or fixture is done. bench/hostile_load.py starts its server with these too."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tests.support import REPO

if TYPE_CHECKING:  # bench/hostile_load.py imports this module where the test requirements may not be installed
    import pytest

STARTUP_SECONDS = 180  # a bound for a failure only: a busy two-core machine can take minutes to load a model


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process: subprocess.Popen, *, timeout: float) -> None:
    """Ask a child process to stop; kill it if it has not within `timeout` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_until_healthy(process: subprocess.Popen, health_url: str, log_path: Path | None = None, *,
                       timeout: float = STARTUP_SECONDS,
                       while_starting: Callable[[httpx.Response], None] | None = None) -> None:
    """Return once `health_url` answers 200; raise RuntimeError with the log's tail if `process` exits first or
    `timeout` seconds pass. Each other answer before then is handed to `while_starting` (to check it)."""
    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-5000:] if log_path and log_path.is_file() else ""

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode} before serving:\n{log_tail()}")
        try:
            response = httpx.get(health_url, timeout=2)
            if response.status_code == 200:
                return
            if while_starting is not None:
                while_starting(response)
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{health_url} did not answer 200 within {timeout:.0f} s:\n{log_tail()}")
        time.sleep(0.3)


class ServerProcess:
    """`python -m clef_engine serve --model RELEASE --device cpu EXTRA...`, healthy once constructed (or `python -m
    LAUNCHER serve ...`, a module that changes something first and then runs clef_engine's command line)."""

    def __init__(self, release: Path, log_path: Path, *extra: str, env: dict[str, str] | None = None,
                 launcher: str = "clef_engine"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        command = [sys.executable, "-m", launcher, "serve", "--model", str(release), "--device", "cpu",
                   "--port", str(self.port), *extra]
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        try:
            wait_until_healthy(self.process, f"{self.url}/health", log_path)
        except RuntimeError:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        stop_process(self.process, timeout=20)
        self._log.close()


def serving(tiny_release: Path, tmp_path_factory: pytest.TempPathFactory, log_name: str, *extra: str,
            env: dict[str, str] | None = None, launcher: str = "clef_engine") -> Iterator[ServerProcess]:
    """A real server process on the tiny release for a fixture (`yield from`); stopped when the fixture ends."""
    process = ServerProcess(tiny_release, tmp_path_factory.mktemp("logs") / log_name, *extra, env=env,
                            launcher=launcher)
    try:
        yield process
    finally:
        process.stop()


@contextmanager
def serving_workbench(release: Path, folder: Path, env: dict[str, str] | None = None, *,
                      while_starting: Callable[[httpx.Response], None] | None = None
                      ) -> Iterator[tuple[subprocess.Popen, str]]:
    """`streamlit run serve_workbench.py` (the workbench and the API on one port) on `release`, its database in
    `folder`, once /health answers 200 (its model loaded): (process, URL)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = folder / "workbench.log"
    env = {**os.environ, "CLEF_MODEL": str(release), "CLEF_DB": str(folder / "wb.sqlite3"), **(env or {})}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "serve_workbench.py",
                                    "--server.headless", "true", "--server.address", "127.0.0.1",
                                    "--server.port", str(port), "--browser.gatherUsageStats", "false"],
                                   cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(process, f"{url}/health", log_path, while_starting=while_starting)
        yield process, url
    finally:
        stop_process(process, timeout=20)
