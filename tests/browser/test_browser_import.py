"""Importing exported files in a real browser (issue 23, point 2): Excel's "Unicode text" (tab-separated UTF-16)
and a semicolon-separated CSV, each read as it was written and imported with its text intact, no traceback."""

from __future__ import annotations

import re

import playwright.sync_api as playwright_api
import pytest

from clef_workbench.store import Store
from tests.support.browser import LONG, chromium_page, demo_workbench
from tests.support.browser_steps import model_loaded, settle
from tests.support.import_files import KINDS, delimited, expected_cases, stored

expect = playwright_api.expect
pytestmark = pytest.mark.browser

SEMICOLON_ROWS = [
    ["Facture erronée", "Le montant, TVA comprise, est faux : 1 234,50 € au lieu de 1 034,50 €.", "billing", "1"],
    ["Colis abîmé", "Carton écrasé, deux verres cassés; je veux un échange.", "shipping", "2"],
]


@pytest.fixture(scope="module")
def workbench(tmp_path_factory):
    yield from demo_workbench(tmp_path_factory, "import")


def import_file(page, path, described: str, count: int) -> None:
    page.get_by_role("tab", name="Import").click()
    settle(page)  # the tab click reruns the page; a file chosen during that rerun could be dropped
    chip = page.locator('[data-testid="stFileChipName"]')
    for _ in range(3):  # a file chosen while a rerun of the page (the sidebar's model status) lands can be dropped
        page.locator('[data-testid="stFileUploaderDropzoneInput"]').set_input_files(str(path))
        settle(page)
        if chip.count():
            break
    expect(chip).to_have_text(re.compile(re.escape(path.name)))
    expect(page.get_by_text(described)).to_be_visible()
    page.get_by_role("button", name=re.compile(r"^Use the 2 column\(s\)")).click()
    settle(page)
    expect(page.get_by_text(f"Preview — {count} case(s)")).to_be_visible()
    page.get_by_role("button", name=f"Import {count} cases").click()
    settle(page)
    expect(page.get_by_text(re.compile(rf"^Imported {count} cases into"))).to_be_visible()
    expect(page.get_by_test_id("stException")).to_have_count(0)


def test_excel_unicode_text_and_a_semicolon_csv_import_with_their_text_intact(workbench):
    url, db, root = workbench
    store = Store(db)
    unicode_set = store.create_case_set("Unicode text", schema_name="support-ticket-routing")
    semicolon_set = store.create_case_set("Semicolons", schema_name="support-ticket-routing")
    unicode_text = KINDS["excel unicode text"]
    (root / unicode_text.file_name).write_bytes(unicode_text.data)
    (root / "factures.csv").write_text(delimited(SEMICOLON_ROWS, ";"), encoding="utf-8", newline="")
    with chromium_page(screenshot=root / "import.png") as page:  # the last screen kept for a failure
        page.goto(f"{url}/cases?set={unicode_set}")
        expect(page.get_by_role("heading", name="Case sets")).to_be_visible(timeout=LONG)
        model_loaded(page)
        import_file(page, root / unicode_text.file_name, "UTF-16 with BOM, tab-separated, 5 rows", 5)
        page.goto(f"{url}/cases?set={semicolon_set}")
        expect(page.get_by_role("heading", name="Case sets")).to_be_visible(timeout=LONG)
        settle(page)
        import_file(page, root / "factures.csv", "UTF-8, semicolon-separated, 2 rows", 2)
    assert stored(store, unicode_set) == expected_cases(unicode_text.rows)
    assert stored(store, semicolon_set) == expected_cases(SEMICOLON_ROWS)
