"""The Decide page in a real browser: `streamlit run app.py` as a subprocess, Debian's headless Chromium through
Playwright. Writes a JSON state, builds a schema with one question of each type, runs it on the demo model, sees
the charts, attaches an image and runs again. (A video upload: test_browser_six_journeys.py.)"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import playwright.sync_api as playwright_api  # noqa: E402
import pytest
from PIL import Image

from tests.support.browser import chromium_page, running_workbench
from tests.support.browser_steps import commit, pick, settle

expect = playwright_api.expect
expect.set_options(timeout=60_000)  # two CPU cores shared with the model and other work: reruns can take seconds

# No skip when chromium is missing: launch_chromium fails with how to install it (scripts/setup.sh --test does).
pytestmark = pytest.mark.browser

LONG = 300_000  # ms, a safety limit: the first page load builds/loads the demo model


@pytest.fixture(scope="module")
def workbench_url(tmp_path_factory):
    """One workbench for the module: each test opens it in a Chromium of its own, a session that starts empty (an
    empty schema library: Decide starts with no questions; nothing here saves a schema)."""
    folder = tmp_path_factory.mktemp("decide")
    env = {"CLEF_DB": str(folder / "workbench.sqlite3"), "CLEF_SCHEMAS_DIR": str(folder / "schemas")}
    with running_workbench(env, log_path=folder / "streamlit.log") as url:
        yield url


@pytest.fixture
def page(workbench_url):
    with chromium_page(width=1400, height=1000) as page:
        page.goto(workbench_url)
        yield page


def test_decide_in_a_real_browser(page, tmp_path: Path):
    try:
        decide_scenario(page, tmp_path)
    except Exception:
        # What the user would have seen: the page's messages and a screenshot next to the test's temp files.
        page.screenshot(path=str(tmp_path / "failure.png"), full_page=True)
        alerts = page.locator('[data-testid="stAlert"]').all_inner_texts()
        print(f"messages on the page: {alerts}\nscreenshot: {tmp_path / 'failure.png'}")
        raise


def decide_scenario(page, tmp_path: Path) -> None:
    expect(page.get_by_text("clef-demo has random weights: its answers mean nothing")).to_be_visible(timeout=LONG)
    expect(page.get_by_text("No questions yet")).to_be_visible()

    # A JSON state with a syntax error shows line and column; fixed, it is read as a JSON object.
    state = page.locator('textarea[aria-label="State"]')
    state.fill('{\n  "subject": "Refund please",\n  "body": }')
    commit(state)
    expect(page.get_by_text("The state is not valid JSON: Expecting value. (line 3, column 11)")).to_be_visible()
    state.fill(json.dumps({"subject": "Charged twice", "body": "You billed my card twice, refund one now!",
                           "plan": "Business"}, indent=2))
    commit(state)
    expect(page.get_by_text("Read as JSON object · 3 keys")).to_be_visible()

    # One question of each type.
    for qtype in ("noul", "choice", "score"):
        pick(page, "New question type", qtype, exact=True)
        page.get_by_role("button", name="Add question").click()
        settle(page)
        expect(page.get_by_label(re.compile(r"^Question \d id$"))).to_have_count(("noul", "choice", "score")
                                                                                 .index(qtype) + 1)
    instructions = ["Does the customer ask for a refund?", "Which team should handle it?", "How angry are they?"]
    for i, text in enumerate(instructions):
        box = page.locator('textarea[aria-label="Instructions"]').nth(i)
        box.fill(text)
        commit(box)
    options = page.locator('textarea[aria-label="Options — one per line: id: description"]')
    options.fill("billing: Charges, refunds, invoices\ntech: Something is broken\nunknown: None of these")
    commit(options)
    levels = page.locator('textarea[aria-label="Levels — one per line, lowest first"]')
    levels.fill("calm\nannoyed\nfurious")
    commit(levels)
    expect(page.get_by_text("tokens used.")).to_be_visible()

    run = page.get_by_role("button", name=re.compile(r"^Run\b"))  # the name also carries its key, Ctrl+Enter
    expect(run).to_be_enabled()
    run.click()
    expect(page.locator('[data-testid="stMetricLabel"]', has_text="Answer")).to_have_count(3, timeout=LONG)
    settle(page)
    # Budget bar + one chart per question, each drawn by vega-embed.
    expect(page.locator('[data-testid="stVegaLiteChart"]')).to_have_count(4)
    expect(page.locator('[data-testid="stVegaLiteChart"] canvas, [data-testid="stVegaLiteChart"] svg.marks')
           ).to_have_count(4)
    expect(page.get_by_text(re.compile(r"^Legend: 0 calm · 1 annoyed · 2 furious$"))).to_be_visible()
    expect(response_code(page)).to_contain_text('"q3"')
    response = json.loads(response_code(page).inner_text())
    assert list(response["answers"]) == ["q1", "q2", "q3"]
    assert list(response["answers"]["q2"]["probabilities"]) == ["billing", "tech", "unknown"]
    assert response["x_token_counts"]["media"] == 0
    page.screenshot(path=str(tmp_path / "after-first-run.png"), full_page=True)

    # Attach an image: preview, then a second run whose request carries it.
    photo = tmp_path / "photo.png"
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 40)).save(buffer, format="PNG")
    photo.write_bytes(buffer.getvalue())
    uploader = page.locator('[data-testid="stFileUploader"]').filter(has_text="Images")
    uploader.locator('input[type="file"]').set_input_files(str(photo))
    expect(page.get_by_text(re.compile(r"photo\.png · 64×48"))).to_be_visible()
    run.click()
    expect(page.get_by_text(re.compile(r"^Tokens: prefix \d+ · media [1-9]\d*"))).to_be_visible(timeout=LONG)
    # The caption renders before the JSON further down: wait for the new response there too.
    expect(response_code(page)).to_contain_text(re.compile(r'"media": [1-9]'))
    settle(page)
    response = json.loads(response_code(page).inner_text())
    assert response["x_token_counts"]["media"] > 0
    assert list(response["answers"]) == ["q1", "q2", "q3"]
    page.get_by_role("tab", name="Request JSON").click()
    request_code = page.locator('[data-testid="stCode"]').nth(1)
    expect(request_code).to_contain_text('"data:image/png;base64,')
    expect(request_code).to_contain_text("[photo.png, ")
    expect(page.locator('[data-testid="stVegaLiteChart"] canvas, [data-testid="stVegaLiteChart"] svg.marks')
           ).to_have_count(4)


def response_code(page):
    """The Response JSON tab's code block, found by its content: under two CPU burners the page's first code block
    once read as the request (which names the questions too) while the answers were on screen."""
    return page.locator('[data-testid="stCode"]').filter(has_text='"answers"').first


def test_an_uploaded_image_and_the_answers_survive_a_reload(page, tmp_path: Path):
    """Point 10: upload an image, run, reload: the image is still attached and shown, the answers are still there,
    not marked outdated, and the run's request still carries the image."""
    expect(page.get_by_text("clef-demo has random weights: its answers mean nothing")).to_be_visible(timeout=LONG)
    state = page.locator('textarea[aria-label="State"]')
    state.fill("A photo of the damaged parcel.")
    commit(state)
    pick(page, "New question type", "noul", exact=True)
    page.get_by_role("button", name="Add question").click()
    settle(page)
    photo = tmp_path / "parcel.png"
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (30, 120, 200)).save(buffer, format="PNG")
    photo.write_bytes(buffer.getvalue())
    page.locator('[data-testid="stFileUploader"]').filter(has_text="Images").locator('input[type="file"]') \
        .set_input_files(str(photo))
    expect(page.get_by_text(re.compile(r"parcel\.png · 64×48"))).to_be_visible()
    page.get_by_role("button", name=re.compile(r"^Run\b")).click()
    tokens = page.get_by_text(re.compile(r"^Tokens: prefix \d+ · media [1-9]\d*"))
    expect(tokens).to_be_visible(timeout=LONG)
    settle(page)
    answered = json.loads(response_code(page).inner_text())
    expect(page).to_have_url(re.compile(r"[?&]draft="))

    page.reload()
    expect(page.get_by_text(re.compile(r"parcel\.png · 64×48"))).to_be_visible(timeout=LONG)
    expect(page.get_by_text("Kept from this draft", exact=False)).to_be_visible()
    expect(page.locator('[data-testid="stImage"] img').first).to_be_visible()
    expect(tokens).to_be_visible()
    expect(page.locator('[data-testid="stMetricLabel"]', has_text="Answer")).to_have_count(1)
    settle(page)
    assert json.loads(response_code(page).inner_text()) == answered
    expect(page.get_by_text("Outdated:", exact=False)).to_have_count(0)
    expect(page.get_by_text("clef-demo has random weights: its answers mean nothing").first).to_be_visible()
    page.get_by_role("tab", name="Request JSON").click()
    expect(page.locator('[data-testid="stCode"]').nth(1)).to_contain_text("[parcel.png, ")
