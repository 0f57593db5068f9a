"""Issue 23 in a real browser. Point 5: at 1024×768, 1280×720 and 1440×900 the Decide page's Run button is on screen
with its whole label, the library's and the save buttons' labels read whole, and the answers' numbers are not cut.
Point 13: an image over the size limit is refused in words under the uploader."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import playwright.sync_api as playwright_api
import pytest

from tests.browser_harness import REPO, launch_chromium, running_workbench
from tests.browser_steps import settle

pytestmark = pytest.mark.browser
LONG = 300_000  # ms, a safety limit: the first page load builds or loads the demo model
VIEWPORTS = [(1024, 768), (1280, 720), (1440, 900)]

# For an element: its box, and every part of it that hides text (content wider than its box: an ellipsis or a cut).
MEASURE = """(el) => {
  const box = el.getBoundingClientRect();
  const parts = [el, ...el.querySelectorAll('*')];
  const cut = parts.filter(p => p.scrollWidth > p.clientWidth + 1 && getComputedStyle(p).overflowX !== 'visible'
                                || getComputedStyle(p).textOverflow === 'ellipsis' && p.scrollWidth > p.clientWidth + 1)
                   .map(p => p.tagName + ':' + p.textContent.slice(0, 40));
  return {left: box.left, top: box.top, right: box.right, bottom: box.bottom, height: box.height,
          text: el.innerText, cut, overflowing: el.scrollWidth > el.clientWidth + 1};
}"""


def whole_label(page, name: str, width: int, height: int, *, on_screen: bool) -> dict:
    # by its accessible name as a whole word: "Load" is also inside the uploaders' "Upload"
    button = page.get_by_role("button", name=re.compile(rf"(^|\s){re.escape(name)}(\s|$)")).first
    button.scroll_into_view_if_needed() if not on_screen else None
    box = button.evaluate(MEASURE)
    where = f"{name!r} at {width}×{height}: {box}"
    assert name.split()[0] in box["text"], where
    assert not box["cut"] and not box["overflowing"], f"label cut: {where}"
    if on_screen:
        assert 0 <= box["left"] and box["right"] <= width and 0 <= box["top"] and box["bottom"] <= height, \
            f"not within the viewport: {where}"
    return box


@pytest.fixture
def page(tmp_path: Path):
    shutil.copytree(REPO / "schemas", tmp_path / "schemas")
    env = {"CLEF_DB": str(tmp_path / "workbench.sqlite3"), "CLEF_SCHEMAS_DIR": str(tmp_path / "schemas")}
    with running_workbench(env, log_path=tmp_path / "streamlit.log") as url, \
            playwright_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport={"width": VIEWPORTS[0][0], "height": VIEWPORTS[0][1]})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.get_by_role("button", name="Run").wait_for(timeout=LONG)
        yield page
        browser.close()


def test_run_and_the_numbers_are_whole_at_every_screen_size(page):
    for width, height in VIEWPORTS:
        page.set_viewport_size({"width": width, "height": height})
        # as the page first shows: Streamlit scrolls an inner element, not the window
        page.evaluate("for (const el of document.querySelectorAll('*')) if (el.scrollTop) el.scrollTop = 0")
        settle(page)
        run = whole_label(page, "Run", width, height, on_screen=True)
        assert "Run" in run["text"].split(), run
        for name in ("Load", "New schema"):
            box = whole_label(page, name, width, height, on_screen=False)
            assert box["height"] <= 2 * run["height"], f"{name!r} wraps a letter a line at {width}: {box}"
    page.get_by_role("button", name="Run").click()
    page.get_by_text("Latency").first.wait_for(timeout=LONG)
    settle(page)
    for width, height in VIEWPORTS:
        page.set_viewport_size({"width": width, "height": height})
        settle(page)
        values = page.locator('[data-testid="stMetricValue"]')
        assert values.count() >= 4
        for index in range(values.count()):
            box = values.nth(index).evaluate(MEASURE)
            assert not box["cut"] and not box["overflowing"], f"a number is cut at {width}×{height}: {box}"
        page.get_by_text("Save to the library").click()
        settle(page)
        whole_label(page, "Update “support-ticket-routing”", width, height, on_screen=False)
        page.get_by_text("Save to the library").click()


def test_an_image_over_the_limit_is_refused_in_words(page, tmp_path: Path):
    from clef_workbench import state_input

    big = tmp_path / "holiday.png"
    big.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(27 * 2**20))  # 27 MB: over the image limit, under the server's
    page.set_viewport_size({"width": 1440, "height": 900})
    page.locator('[data-testid="stFileUploaderDropzoneInput"]').first.set_input_files(str(big))
    limit = f"{state_input.MAX_IMAGE_BYTES // 2**20} MB image limit"
    refusal = page.get_by_text(re.compile(rf"^holiday\.png: 27\.0 MB is over the {limit}"))
    refusal.wait_for(timeout=LONG)
    assert refusal.is_visible()
    assert refusal.bounding_box()["height"] > 0, "in words on screen, not only for screen readers"
