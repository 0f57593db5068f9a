"""Take screenshots of the Runs page after a run of the support-ticket example case set on the demo model: the whole
page, and the "One case's answers" charts opened (the per-case probability charts).

Usage: .venv/bin/python scripts/screenshot_runs.py [OUTPUT_DIR]   (needs Debian's chromium at /usr/bin/chromium)
Starts `streamlit run app.py` on a free port with a throw-away database, drives headless Chromium with Playwright.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright.sync_api import expect, sync_playwright  # noqa: E402

from clef_workbench import casesets  # noqa: E402
from clef_workbench.store import Store  # noqa: E402
from tests.support import REPO  # noqa: E402
from tests.support.browser import launch_chromium, running_workbench  # noqa: E402


def main(output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "workbench.sqlite3"
        casesets.load_example_case_sets(Store(db), REPO / "schemas")
        env = {"CLEF_DB": str(db), "CLEF_SCHEMAS_DIR": str(REPO / "schemas"), "CLEF_MODEL": "demo"}
        with running_workbench(env, log_path=Path(tmp) / "streamlit.log") as url, sync_playwright() as playwright:
            browser = launch_chromium(playwright)
            page = browser.new_page(viewport={"width": 1440, "height": 1200}, device_scale_factor=1)
            page.goto(f"{url}/runs")
            page.get_by_role("combobox", name="Case set").click()
            page.get_by_role("option", name=re.compile(r"^Example: Support ticket routing")).click()
            page.get_by_role("button", name="Start run").click()
            expect(page.locator('[data-testid="stMetric"]', has_text="samples")).to_contain_text("12",
                                                                                                  timeout=300_000)
            page.wait_for_timeout(1500)
            page.screenshot(path=str(output_dir / "runs.png"), full_page=True)
            page.get_by_text("One case's answers").click()
            charts = page.locator('[data-testid="stExpander"]', has_text="One case's answers") \
                .locator('[data-testid="stVegaLiteChart"]')
            expect(charts).to_have_count(5, timeout=60_000)
            page.wait_for_timeout(1500)  # let vega finish drawing
            charts.first.scroll_into_view_if_needed()
            page.locator('[data-testid="stExpander"]', has_text="One case's answers").screenshot(
                path=str(output_dir / "runs-one-case.png"))
            browser.close()
    print(f"wrote {output_dir / 'runs.png'} and {output_dir / 'runs-one-case.png'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir()) / "clef-runs-screenshots")
