"""Take docs/screenshot-decide.png: the Decide page after a run of the support-ticket example on the demo model.

Usage: .venv/bin/python scripts/screenshot.py [OUTPUT]   (needs Debian's chromium at /usr/bin/chromium)
Starts `streamlit run app.py` on a free port with a throw-away database, drives headless Chromium with Playwright.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright.sync_api import expect  # noqa: E402

from tests.support import REPO  # noqa: E402
from tests.support.browser import workbench_page  # noqa: E402


def main(output: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = {"CLEF_DB": str(Path(tmp) / "workbench.sqlite3"), "CLEF_SCHEMAS_DIR": str(REPO / "schemas")}
        with workbench_page(env, Path(tmp), height=1500) as (page, url):
            page.goto(url)
            run = page.get_by_role("button", name=re.compile(r"^Run\b"))  # the name also carries its key, Ctrl+Enter
            expect(run).to_be_enabled(timeout=180_000)
            run.click()
            answers = page.locator('[data-testid="stMetricLabel"]', has_text="Answer")
            expect(answers).to_have_count(5, timeout=180_000)
            charts = page.locator('[data-testid="stVegaLiteChart"] canvas, [data-testid="stVegaLiteChart"] svg.marks')
            expect(charts).to_have_count(6)
            # The inputs (left) and Run with the answers (right) share the top of the page: show it from the top.
            page.evaluate("document.querySelector('[data-testid=\"stMain\"]').scrollTo(0, 0)")
            page.wait_for_timeout(1000)  # let vega finish drawing
            output.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(output))
    print(f"wrote {output}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "screenshot-decide.png")
