"""A deep link on a fresh server (/review before anyone opened /) shows the workbench, not a bare page, with the
sidebar status even though the page stops early."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.browser_harness import launch_chromium, running_workbench

pytestmark = pytest.mark.browser


def test_deep_link_on_a_fresh_server_uses_the_app_navigation(tmp_path):
    with running_workbench({"CLEF_DB": str(tmp_path / "workbench.sqlite3")}) as url, sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page()
            page.goto(f"{url}/review")
            expect(page.get_by_role("heading", name="Review")).to_be_visible(timeout=120_000)
            navigation = page.get_by_test_id("stSidebarNav")
            expect(navigation.get_by_text("Case sets", exact=True)).to_be_visible(timeout=30_000)
            expect(navigation.get_by_text("app", exact=True)).to_have_count(0)
            # The Review page stops early when no run has results; the sidebar's model status is still there.
            expect(page.get_by_test_id("stSidebar").get_by_text("queue depth")).to_be_visible(timeout=30_000)
        finally:
            browser.close()
