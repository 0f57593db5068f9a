"""Run the real workbench for browser tests and screenshots: `streamlit run app.py` as a subprocess on a free
127.0.0.1 port, and Debian's headless Chromium driven by Playwright (never a downloaded browser)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support import REPO

CHROMIUM_PATH = os.environ.get("CLEF_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_workbench(env: dict[str, str] | None = None, *, log_path: Path | None = None,
                      timeout: float = 180.0) -> Iterator[str]:
    """Start the workbench with extra environment `env`; yield its URL once /_stcore/health answers; stop it."""
    port = free_port()
    command = [sys.executable, "-m", "streamlit", "run", str(REPO / "app.py"), "--server.headless", "true",
               "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false",
               "--server.fileWatcherType", "none"]
    log_path = log_path or Path(os.devnull)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})}, stdout=log,
                                   stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if process.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-3000:] if log_path.is_file() else ""
                    raise RuntimeError(f"streamlit exited with {process.returncode} before serving:\n{tail}")
                try:
                    with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as reply:
                        if reply.read().strip() == b"ok":
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"streamlit did not answer on {url} within {timeout:.0f} s")
                time.sleep(0.3)
            yield url
        finally:
            stop_process(process, timeout=15)



def stop_process(process: subprocess.Popen, *, timeout: float) -> None:
    """Ask a child process to stop; kill it if it has not within `timeout` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def launch_chromium(playwright: Any):
    """Debian's chromium through Playwright. Raises FileNotFoundError saying how to install it if absent."""
    if not Path(CHROMIUM_PATH).is_file():
        raise FileNotFoundError(f"{CHROMIUM_PATH} not found: install Debian's chromium "
                                "(apt-get install -y chromium) or set CLEF_CHROMIUM to its path")
    return playwright.chromium.launch(executable_path=CHROMIUM_PATH, args=CHROMIUM_ARGS, headless=True)


@contextmanager
def workbench_page(env: dict[str, str], folder: Path, *, width: int = 1440,
                   height: int = 900) -> Iterator[tuple[Any, str]]:
    """A workbench process on `env` and one Chromium page of `width` × `height` (actions wait up to 60 s): (page,
    the workbench's URL). The page's last state is kept in `folder/last.png` for a failure."""
    import playwright.sync_api as playwright_api

    with running_workbench(env, log_path=folder / "streamlit.log") as url, \
            playwright_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport={"width": width, "height": height})
        page.set_default_timeout(60_000)
        try:
            yield page, url
        finally:
            page.screenshot(path=str(folder / "last.png"), full_page=True)
            browser.close()
