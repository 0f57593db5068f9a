"""Run the real workbench for browser tests and screenshots: `streamlit run app.py` as a subprocess on a free
127.0.0.1 port, and Debian's headless Chromium driven by Playwright (never a downloaded browser)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support import REPO
from tests.support.servers import free_port, stop_process, wait_until_healthy

CHROMIUM_PATH = os.environ.get("CLEF_CHROMIUM", "/usr/bin/chromium")
LONG = 300_000  # ms, a safety limit for a page's first load, which loads the demo model
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@contextmanager
def running_workbench(env: dict[str, str] | None = None, *, log_path: Path | None = None,
                      timeout: float = 180.0) -> Iterator[str]:
    """Start the workbench with extra environment `env`; yield its URL once /_stcore/health answers; stop it."""
    port = free_port()
    command = [sys.executable, "-m", "streamlit", "run", str(REPO / "app.py"), "--server.headless", "true",
               "--server.address", "127.0.0.1", "--server.port", str(port), "--browser.gatherUsageStats", "false",
               "--server.fileWatcherType", "none"]
    with open(log_path or os.devnull, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})}, stdout=log,
                                   stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_healthy(process, f"{url}/_stcore/health", log_path, timeout=timeout)
            yield url
        finally:
            stop_process(process, timeout=15)


def demo_workbench(tmp_path_factory, name: str, **env: str) -> Iterator[tuple[str, Path, Path]]:
    """A workbench process on the demo model, with its own SQLite file and a copy of the schema library, for a
    fixture (`yield from`): (url, db, root)."""
    root = tmp_path_factory.mktemp(name)
    shutil.copytree(REPO / "schemas", root / "schemas")
    db = root / "workbench.sqlite3"
    env = {"CLEF_DB": str(db), "CLEF_SCHEMAS_DIR": str(root / "schemas"), "CLEF_MODEL": "demo", **env}
    with running_workbench(env, log_path=root / "streamlit.log") as url:
        yield url, db, root


def launch_chromium(playwright: Any):
    """Debian's chromium through Playwright. Raises FileNotFoundError saying how to install it if absent."""
    if not Path(CHROMIUM_PATH).is_file():
        raise FileNotFoundError(f"{CHROMIUM_PATH} not found: install Debian's chromium "
                                "(apt-get install -y chromium) or set CLEF_CHROMIUM to its path")
    return playwright.chromium.launch(executable_path=CHROMIUM_PATH, args=CHROMIUM_ARGS, headless=True)


# Counts, in the page, the script runs it asks its workbench for and the runs that ended, from the websocket's
# protobuf messages (field numbers of Streamlit's BackMsg and ForwardMsg). A widget's change, a button, a page link
# and an upload each send a rerun_script (11; an upload first a file_urls_request, 16), in the same event handler as
# the interaction; the server answers with script_finished (6), which also answers the requests that arrived while
# the script ran (Streamlit runs it once more for them). A run stopped for such a rerun (status 2,
# FINISHED_EARLY_FOR_RERUN) answers nothing: another run follows. A new connection (load, reload) drops what the old
# one asked.
COUNT_RERUNS = """(() => {
  const reruns = window.__reruns = {asked: 0, answered: 0};
  const fields = bytes => {  // the top-level fields of a protobuf message: {number: varint value or true}
    const found = {};
    let at = 0;
    const varint = () => { let value = 0, scale = 1, byte; do { byte = bytes[at++]; value += (byte & 127) * scale;
                                                                 scale *= 128; } while (byte & 128); return value; };
    while (at < bytes.length) {
      const tag = varint(), number = Math.floor(tag / 8), wire = tag % 8;
      if (wire === 0) found[number] = varint();
      else if (wire === 2) { const length = varint(); at += length; found[number] = true; }
      else if (wire === 1) at += 8;
      else if (wire === 5) at += 4;
      else break;
    }
    return found;
  };
  const asBytes = data => data instanceof ArrayBuffer ? new Uint8Array(data)
    : ArrayBuffer.isView(data) ? new Uint8Array(data.buffer, data.byteOffset, data.byteLength) : null;
  const send = WebSocket.prototype.send;
  WebSocket.prototype.send = function (data) {
    const bytes = asBytes(data);
    if (bytes && this.url.includes("/_stcore/stream")) {
      if (!this.__counted) {
        this.__counted = true;
        reruns.answered = reruns.asked;
        this.addEventListener("message", event => {
          const message = event.data instanceof ArrayBuffer ? fields(new Uint8Array(event.data)) : {};
          if (6 in message && message[6] !== 2) reruns.answered = reruns.asked;
        });
      }
      const message = fields(bytes);
      if (11 in message || 16 in message) reruns.asked += 1;
    }
    return send.call(this, data);
  };
})()"""


def new_page(browser: Any, **options: Any) -> Any:
    """A page of `browser` (actions wait up to 60 s) that counts its script runs, for browser_steps.settle."""
    page = browser.new_page(**options)
    page.set_default_timeout(60_000)
    page.add_init_script(COUNT_RERUNS)
    return page


@contextmanager
def chromium_page(*, width: int = 1440, height: int = 900, screenshot: Path | None = None,
                  **options: Any) -> Iterator[Any]:
    """One page of `width` × `height` in its own Chromium (actions wait up to 60 s; `options` go to `new_page`, e.g.
    accept_downloads). With `screenshot`, the page's last state is kept there, for a failure."""
    import playwright.sync_api as playwright_api

    with playwright_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = new_page(browser, viewport={"width": width, "height": height}, **options)
        try:
            yield page
        finally:
            if screenshot is not None:
                page.screenshot(path=str(screenshot), full_page=True)
            browser.close()


@contextmanager
def workbench_page(env: dict[str, str], folder: Path, *, width: int = 1440,
                   height: int = 900) -> Iterator[tuple[Any, str]]:
    """A workbench process on `env` and one Chromium page of `width` × `height`: (page, the workbench's URL). The
    page's last state is kept in `folder/last.png` for a failure."""
    with running_workbench(env, log_path=folder / "streamlit.log") as url, \
            chromium_page(width=width, height=height, screenshot=folder / "last.png") as page:
        yield page, url
