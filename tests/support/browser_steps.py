"""What a person does in the workbench, as Playwright steps the browser tests share: wait for a rerun to end, go to a
page by its sidebar link, choose in a selectbox, commit a text field, press a button's keyboard shortcut, delete a
data editor's row, and create a case set from a CSV file through the Case sets page."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from pathlib import Path

import playwright.sync_api as playwright_api

from tests.support.browser import LONG

expect = playwright_api.expect


# No script run the page asked for is pending (browser.COUNT_RERUNS) and Streamlit has dropped the elements it marked
# stale; true also on a page that has not loaded the workbench yet.
SETTLED = """() => (!window.__reruns || window.__reruns.asked === window.__reruns.answered)
                 && !document.querySelector('[data-stale="true"]')"""
TWO_FRAMES = "() => new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)))"


def settle(page, *, timeout: float | None = None) -> None:
    """Wait until the script runs the page asked for have ended and their elements are drawn, still so two frames
    later: an upload or a table's edit asks for its run a moment after the interaction that made it."""
    while True:
        page.wait_for_function(SETTLED, timeout=timeout)
        page.evaluate(TWO_FRAMES)
        if page.evaluate(SETTLED):
            return


ASKED = "(() => window.__reruns ? window.__reruns.asked : 0)"


def settle_grid_change(page, change: Callable[[], object], *, patience_ms: int = 5_000) -> None:
    """Make `change` on a data grid (a click on a cell, a row deleted) and settle. A grid sends its selection or edit
    150 ms after the change (Streamlit debounces them), after any two frames: wait for it to be sent first, for up
    to `patience_ms` (a click that changed nothing sends nothing)."""
    asked = page.evaluate(ASKED)
    change()
    with contextlib.suppress(playwright_api.TimeoutError):
        page.wait_for_function(f"() => {ASKED}() > {asked}", timeout=patience_ms)
    settle(page)


def model_loaded(page) -> None:
    """Wait until the sidebar shows the loaded model: while it loads, the sidebar's status reruns every second or
    so, and a file chosen while one lands can be dropped."""
    playwright_api.expect(page.get_by_text("GPU memory loaded")).to_be_visible(timeout=LONG)
    settle(page)


def commit(locator) -> None:
    """Streamlit text widgets send their value on blur."""
    locator.press("Tab")
    settle(locator.page)


def go_to(page, title: str, *, timeout: float | None = None) -> None:
    """Navigate as a person does: the page's link in the sidebar."""
    page.get_by_test_id("stSidebar").get_by_test_id("stPageLink-NavLink").filter(has_text=title).click()
    expect(page).to_have_title(f"{title} · Clef Workbench", timeout=timeout)
    settle(page, timeout=timeout)


def press_shortcut(page, key: str, happened: Callable[[], bool], *, patience_ms: int = 20_000) -> None:
    """Press a button's shortcut with the focus outside any input (on the page's title), as a reviewer does, and
    press it once more if nothing `happened()` within `patience_ms` and after the page settled. A key pressed while
    the page redraws can reach no button (under two CPU burners a Review shortcut saved nothing in 30 s); a person
    presses it again. Waiting for the page to settle first means a press that did arrive, only slowly, is never
    doubled. The caller then expects the outcome."""
    for _ in range(2):
        page.locator("h1").first.click()
        page.keyboard.press(key)
        for _ in range(patience_ms // 500):
            if happened():
                return
            page.wait_for_timeout(500)
        settle(page)
        if happened():
            return


def pick(page, label: str, option: str, *, exact: bool = False, scope=None) -> None:
    """Choose in a Streamlit selectbox as a person does: open its list, click the option whose label starts with
    `option` (typed first, to filter a long list), or with `exact` the option that is `option` (not typed: text typed
    into the box of a page that reruns as the option is chosen can land in what the page shows next). The list
    sometimes closes when the page reruns as it opens or before the click lands: open it again until the option is
    clicked."""
    box = (scope or page).get_by_role("combobox", name=label)
    name = re.compile(rf"^{re.escape(option)}{'$' if exact else ''}")
    wanted = page.get_by_role("option", name=name).first
    for _ in range(6):
        settle(page)
        box.click()
        if not exact:
            page.keyboard.type(option)
        try:
            wanted.wait_for(state="visible", timeout=5000)
            wanted.click(timeout=10_000)  # the list can also close between showing the option and the click
        except playwright_api.TimeoutError:
            box.press("Escape")
            continue
        break
    else:
        raise AssertionError(f"{label}: the option {option!r} never showed")
    expect(box).to_have_value(name)
    settle(page)


def delete_row(page, grid, index: int) -> None:
    """Delete row `index` (from 0) of a data editor: select it by its selection box (the table is drawn on a canvas;
    header and rows are 35 px high), then press the button the table's toolbar shows for a selection. Under CPU load
    a click can land before the canvas takes clicks: a person would see no selection and click again."""
    box = grid.bounding_box()
    delete_rows = page.get_by_role("button", name="Delete row(s)")
    for _ in range(3):
        page.mouse.click(box["x"] + 16, box["y"] + 35 * (index + 1) + 17)
        try:
            expect(delete_rows).to_be_visible(timeout=5_000)
            break
        except AssertionError:
            continue
    settle_grid_change(page, delete_rows.click)


def new_case_set_from_csv(page, name: str, schema: str, csv_path: Path, cases: int) -> None:
    """On the Case sets page: a new case set `name` for the library schema `schema`, then the CSV imported with its
    answer columns mapped to their questions by name and the other columns as the state (`cases` rows)."""
    page.get_by_role("button", name="New case set").click()
    page.get_by_label("Name").fill(name)
    page.get_by_role("combobox", name="Schema it is meant for").click()
    page.get_by_role("option", name=schema, exact=True).click()
    page.get_by_role("button", name="Create").click()
    settle(page)
    expect(page.get_by_text(re.compile(rf"Schema: \*?\*?{re.escape(schema)}"))).to_be_visible()
    page.get_by_role("tab", name="Import").click()
    settle(page)  # the tab click reruns the page; a file chosen during that rerun could be dropped
    page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(csv_path))
    settle(page)
    page.get_by_role("button", name=re.compile(r"^Use the \d+ column\(s\) that are not mapped or labels")).click()
    settle(page)
    expect(page.get_by_text(f"Preview — {cases} case(s)")).to_be_visible(timeout=30_000)
    page.get_by_role("button", name=f"Import {cases} cases").click()
    settle(page)
    expect(page.get_by_text(f"Imported {cases} cases into “{name}”.")).to_be_visible()
