"""Why and How sure in a real browser: `streamlit run app.py` as a subprocess on the demo model, Debian's headless
Chromium through Playwright.

* Decide's Why view for a text state, a JSON state, an image and a video (the screenshot in docs/why-view.png is
  taken here: `CLEF_WRITE_DOCS=1` rewrites it).
* The calibration journey: import labelled cases → run them on the demo model from the Runs page → fit a calibration
  → the reliability curves before and after → Decide shows calibrated probabilities → Review routes by them.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import playwright.sync_api as playwright_api  # noqa: E402
import pytest
from PIL import Image

from clef_workbench import calibration, review
from clef_workbench.store import Store
from tests.support import REPO
from tests.support.browser import chromium_page, running_workbench
from tests.support.browser_steps import commit, go_to, new_case_set_from_csv, pick, settle
from tests.support.media import mp4_bytes

expect = playwright_api.expect
expect.set_options(timeout=30_000)  # two CPU cores shared with the model: reruns can take seconds

pytestmark = [pytest.mark.browser, pytest.mark.slow]

LONG = 180_000  # ms: the first load builds the demo model
RUN = 1_800_000  # ms: a 36-case batch run on the demo model on a busy CPU
SCREENSHOT = REPO / "docs" / "why-view.png"
TEXT_STATE = ("My parcel arrived with the box crushed. I have asked for a refund twice!\n"
              "Nobody answered my emails. It was a birthday present for my mother.")


def serve(tmp_path: Path, *, library: bool):
    """The workbench on the demo model with a database of its own, and the shipped schemas or none (Decide then
    starts with no questions)."""
    if library:
        shutil.copytree(REPO / "schemas", tmp_path / "schemas")
    else:
        (tmp_path / "schemas").mkdir()
    db = tmp_path / "workbench.sqlite3"
    env = {"CLEF_DB": str(db), "CLEF_SCHEMAS_DIR": str(tmp_path / "schemas"), "CLEF_MODEL": "demo"}
    with running_workbench(env, log_path=tmp_path / "streamlit.log") as url:
        yield url, db


@pytest.fixture
def empty_workbench(tmp_path: Path):
    yield from serve(tmp_path, library=False)


@pytest.fixture
def workbench(tmp_path: Path):
    yield from serve(tmp_path, library=True)


@pytest.fixture
def page(tmp_path: Path):
    with chromium_page(width=1280, height=900, screenshot=tmp_path / "last.png") as page:  # kept for a failure
        yield page


def run_and_wait(page) -> None:
    """Run the record and wait for the answer cards and the Why view drawn from the new answer."""
    run = page.get_by_role("button", name=re.compile(r"^Run\b"))
    run.click()
    settle(page)
    expect(page.get_by_text(re.compile(r"^Each part of the evidence was removed in turn"))).to_be_visible(timeout=LONG)
    settle(page)


def test_why_view_for_text_json_image_and_video(empty_workbench, page, tmp_path: Path):
    url, _ = empty_workbench
    page.goto(url)
    expect(page.get_by_text("clef-demo has random weights: its answers mean nothing")).to_be_visible(timeout=LONG)
    expect(page.get_by_text("No questions yet")).to_be_visible()
    state = page.locator('textarea[aria-label="State"]')
    state.fill(TEXT_STATE)
    commit(state)
    pick(page, "New question type", "noul", exact=True)
    page.get_by_role("button", name="Add question").click()
    settle(page)
    instructions = page.locator('textarea[aria-label="Instructions"]').first
    instructions.fill("Is the customer angry?")
    commit(instructions)
    page.get_by_role("button", name=re.compile(r"^Run\b")).click()
    expect(page.get_by_text("Is the customer angry?")).to_have_count(1)
    expect(page.locator('[data-testid="stMetricLabel"]', has_text="Answer")).to_have_count(1, timeout=LONG)
    settle(page)
    expect(page.locator(".why-text")).to_have_count(0)  # nothing explained until asked
    page.get_by_text("Why", exact=True).click()
    settle(page)

    # text: every sentence a coloured span, green or red by its effect, its effect on hover
    sentences = page.locator(".why-text span")
    expect(sentences).to_have_count(4, timeout=LONG)
    texts = [text.strip() for text in sentences.all_inner_texts()]
    assert texts == ["My parcel arrived with the box crushed.", "I have asked for a refund twice!",
                     "Nobody answered my emails.", "It was a birthday present for my mother."]
    classes = [sentences.nth(i).get_attribute("class") for i in range(4)]
    assert set(classes) <= {"why-towards", "why-against", "why-none"} and set(classes) != {"why-none"}
    assert re.search(r"(supports|works against) the answer: without it P\(answer\) (falls|rises) by [0-9.]+ pp$",
                     sentences.first.get_attribute("title"))
    # readable as numbers: each sentence's value next to it, a key of the one fixed scale, the largest as a table
    values = page.locator(".why-text .why-value").all_inner_texts()
    assert len(values) == 4 and all(re.fullmatch(r"\([+-]\d+\.\d pp\)", v) for v in values)
    expect(page.locator(".why-key")).to_contain_text("+10.0 pp or more")
    top = page.locator("table.why-top tbody tr")
    expect(top).to_have_count(4)
    assert [re.fullmatch(r"[+-]\d+\.\d pp", cell) is not None for cell in
            page.locator("table.why-top tbody td:nth-child(2)").all_inner_texts()] == [True] * 4

    # an image: its regions tinted, beside the sentences; this is the screenshot of the docs
    photo = tmp_path / "parcel.png"
    rng = np.random.default_rng(3)
    pixels = np.zeros((96, 128, 3), dtype=np.uint8)
    pixels[:, :64] = (150, 110, 70)  # a cardboard box on the left, a noisy background on the right
    pixels[:, 64:] = rng.integers(0, 255, (96, 64, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(photo)
    page.locator('[data-testid="stFileUploader"]').filter(has_text="Images").locator(
        'input[type="file"]').set_input_files(str(photo))
    expect(page.get_by_text(re.compile(r"parcel\.png · 128×96"))).to_be_visible()
    run_and_wait(page)
    heatmap = page.locator('[data-testid="stImage"]', has_text="Image 1: each region outlined and labelled")
    expect(heatmap).to_be_visible(timeout=LONG)
    expect(page.locator(".why-text span")).to_have_count(4)
    # the screenshot: from the Why toggle to the bottom of the labelled image, in a window tall enough for both
    # (Streamlit scrolls its own container, so a full-page screenshot holds only what the window shows)
    page.set_viewport_size({"width": 1280, "height": 1800})
    toggle = page.get_by_text("Why", exact=True)
    toggle.scroll_into_view_if_needed()
    settle(page)
    page.wait_for_function("img => img.complete && img.getBoundingClientRect().height > 200",
                           arg=heatmap.locator("img").element_handle())
    top, bottom = toggle.bounding_box(), heatmap.locator("img").bounding_box()
    left = min(top["x"], bottom["x"]) - 12
    clip = {"x": left, "y": top["y"] - 12, "width": max(bottom["x"] + bottom["width"], 640 + left) - left + 12,
            "height": bottom["y"] + bottom["height"] - top["y"] + 24}
    shot = tmp_path / "why-view.png"
    page.screenshot(path=str(shot), clip=clip, full_page=True)
    if os.environ.get("CLEF_WRITE_DOCS") or not SCREENSHOT.exists():
        small = Image.open(shot).convert("RGB")
        small.thumbnail((1000, 1000))
        small.quantize(colors=96).save(SCREENSHOT, optimize=True)
    assert SCREENSHOT.stat().st_size < 200_000
    page.set_viewport_size({"width": 1280, "height": 900})

    # a video: the frames it read, ranked by effect
    page.locator('[data-testid="stFileUploader"]').filter(has_text="Images").get_by_role(
        "button", name=re.compile("Remove|Delete|Clear", re.I)).first.click()
    settle(page)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(mp4_bytes(frames=30, fps=15))
    page.locator('[data-testid="stFileUploader"]').filter(has_text="Videos").locator(
        'input[type="file"]').set_input_files(str(clip))
    expect(page.get_by_text("clip.mp4: the model reads these 4 of 30 frames (15.0 fps source).")
           ).to_be_visible(timeout=LONG)
    run_and_wait(page)
    expect(page.locator('[data-testid="stImage"]', has_text="each region outlined")).to_have_count(0)
    frames = page.locator('[data-testid="stDataFrame"]').filter(has=page.locator("canvas")).last
    expect(frames).to_be_visible()

    # JSON: its fields ranked, each by its path
    state.fill('{"customer": {"name": "Ada", "tier": "gold"}, "message": "Refund me now!"}')
    commit(state)
    run_and_wait(page)
    fields = page.locator("table.why-fields tbody tr")
    expect(fields).to_have_count(3, timeout=LONG)
    paths = page.locator("table.why-fields tbody code").all_inner_texts()
    assert sorted(paths) == ["customer.name", "customer.tier", "message"]
    expect(page.locator(".why-text")).to_have_count(0)


def test_why_on_the_vehicle_example_with_a_photo_and_a_video_fits_itself_to_the_budget(workbench, page,
                                                                                         tmp_path: Path):
    """The shipped vehicle example with one photo and a 3-second video: everything at once is over the budget of one
    explanation; Why explains the image regions instead and says so, each region labelled in percentage points, and
    "Explain by" offers the other units."""
    url, _ = workbench
    page.goto(url)
    expect(page.get_by_text("fast kernels:")).to_be_visible(timeout=LONG)  # the sidebar lists a loaded model's kernels
    pick(page, "Library", "Vehicle damage claim (photo)")
    page.get_by_role("button", name="Load", exact=True).click()
    settle(page)
    expect(page.get_by_role("combobox", name="Example states of the loaded schema")).to_be_visible()
    page.get_by_role("button", name="Use this example", exact=True).click()
    settle(page)
    expect(page.locator('textarea[aria-label="State"]')).to_contain_text("claim_id")
    photo = tmp_path / "car.png"
    pixels = np.zeros((480, 640, 3), dtype=np.uint8)
    pixels[:] = (200, 30, 40)  # a red car filling the photo: a red tint would not show on it
    pixels[300:, :] = (60, 60, 60)
    Image.fromarray(pixels).save(photo)
    page.locator('[data-testid="stFileUploader"]').filter(has_text="Images").locator(
        'input[type="file"]').set_input_files(str(photo))
    expect(page.get_by_text(re.compile(r"car\.png · 640×480"))).to_be_visible()
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(mp4_bytes(frames=45, fps=15))  # 3 seconds
    page.locator('[data-testid="stFileUploader"]').filter(has_text="Videos").locator(
        'input[type="file"]').set_input_files(str(clip))
    expect(page.get_by_text(re.compile(r"clip\.mp4: the model reads these \d+ of 45 frames"))).to_be_visible(
        timeout=LONG)
    page.get_by_role("button", name=re.compile(r"^Run\b")).click()
    expect(page.locator('[data-testid="stMetricLabel"]', has_text="Answer").first).to_be_visible(timeout=LONG)
    settle(page)
    page.get_by_text("Why", exact=True).click()
    settle(page)
    expect(page.get_by_text(re.compile(r"^Explaining by everything .* over the 65,536-token budget of one "
                                       r"explanation, so this explains the 16 image regions"))).to_be_visible(
        timeout=LONG)
    expect(page.get_by_text("Why could not be computed")).to_have_count(0)
    expect(page.locator('[data-testid="stImage"]', has_text="Image 1: each region outlined and labelled")
           ).to_be_visible()
    rows = page.locator("table.why-top tbody tr")
    expect(rows).to_have_count(5)
    assert all(re.fullmatch(r"image 1, region row \d, column \d", cell) for cell in
               page.locator("table.why-top tbody td:nth-child(1)").all_inner_texts())
    expect(page.locator(".why-key")).to_be_visible()

    # the unit the refusal advised is a control on the page: the fields alone fit, and nothing is said about a budget
    pick(page, "Explain by", "fields", exact=True)
    expect(page.locator("table.why-fields tbody tr").first).to_be_visible(timeout=LONG)
    expect(page.get_by_text(re.compile(r"^Explaining by everything"))).to_have_count(0)
    values = page.locator("table.why-fields tbody td:nth-child(3)").all_inner_texts()
    assert values and all(re.fullmatch(r"[+-]\d+\.\d pp", v) for v in values)


def labelled_csv(path: Path, cases: int) -> None:
    """Tickets labelled with a team drawn at random: the demo model's sharp random answers are over-confident."""
    rng = np.random.default_rng(11)
    teams = ["billing", "technical_support", "account_security", "sales"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["subject", "body", "team"])
        for i in range(cases):
            writer.writerow([f"Ticket {i}", f"Order {1000 + 37 * i}: parcel {i} late, invoice {i} charged twice.",
                             teams[int(rng.integers(len(teams)))]])


def test_calibration_journey_import_run_calibrate_decide_and_review(workbench, page, tmp_path: Path):
    url, db = workbench
    store = Store(db)
    csv_path = tmp_path / "labelled.csv"
    labelled_csv(csv_path, 36)

    # -- import labelled cases ------------------------------------------------------------------------------------
    page.goto(url)
    expect(page.get_by_text("clef-demo has random weights: its answers mean nothing")).to_be_visible(timeout=LONG)
    go_to(page, "Case sets")
    expect(page.get_by_text("No case sets yet")).to_be_visible(timeout=LONG)
    new_case_set_from_csv(page, "Labelled tickets", "support-ticket-routing", csv_path, 36)

    # -- its run: the case set run on the demo model from the Runs page, as a person starts one -------------------
    go_to(page, "Runs")
    pick(page, "Case set", "Labelled tickets (36 cases)", exact=True)
    page.get_by_role("button", name="Start run").click()
    expect(page.get_by_text("Finished: all 36 cases have answers.")).to_be_visible(timeout=RUN)
    [run] = store.list_runs()
    run_id = run["id"]
    assert run["model_id"] == "clef-demo" and len(store.list_results(run_id)) == 36
    expect(page.get_by_role("button", name="Fit a calibration on these labelled cases")).to_be_visible(timeout=LONG)

    # -- calibrate: the table and the reliability curves before and after ----------------------------------------
    # the page's last section: the script has drawn every chart before it
    expect(page.get_by_text("Compare with another run of the same case set")).to_be_visible(timeout=LONG)
    settle(page)
    charts = page.locator('[data-testid="stVegaLiteChart"]')
    before = charts.count()
    assert before > 0  # the run's own reliability diagram among them
    page.get_by_role("button", name="Fit a calibration on these labelled cases").click()
    expect(page.get_by_text(re.compile(r"^Kept as calibration “"))).to_be_visible(timeout=LONG)
    [kept] = store.list_calibrations()
    assert kept["run_id"] == run_id and set(kept["payload"]["questions"]) == {"team"}
    expect(charts).to_have_count(before + 1)  # team's curve raw vs calibrated (the only labelled question)
    settle(page)
    charts.last.scroll_into_view_if_needed()
    expect(charts.last.locator("canvas, svg.marks")).to_have_count(1)

    # -- Decide: a case of the run, its probabilities calibrated and labelled so ---------------------------------
    case_id = store.list_results(run_id)[0]["case_id"]
    page.goto(f"{url}/?run={run_id}&case={case_id}")
    expect(page.get_by_text(f"Case #{case_id} of run #{run_id}", exact=False)).to_be_visible(timeout=LONG)
    page.get_by_role("button", name=re.compile(r"^Run\b")).click()
    expect(page.get_by_role("combobox", name="Probabilities")).to_be_visible(timeout=LONG)
    pick(page, "Probabilities", kept["name"], exact=True)
    # whether the fit helps is said next to the choice, with its held-out interval, before anything is applied
    judged = calibration.verdicts(kept["payload"])["team"]
    print(f"team's calibration: {judged}")
    expect(page.get_by_text(judged.reason, exact=False).first).to_be_visible()
    if not judged.applied:
        expect(page.get_by_text("team · choice · answered by", exact=False).filter(has_text="calibrated")
               ).to_have_count(0)
        page.get_by_role("checkbox", name="Apply it also where it did not help").check(force=True)
        settle(page)
    expect(page.get_by_text(f"Calibrated with “{kept['name']}”", exact=False).first).to_be_visible()
    expect(page.get_by_text("team · choice · answered by", exact=False).filter(has_text="calibrated")).to_be_visible()

    # -- Review: the thresholds read calibrated confidence ----------------------------------------------------------
    go_to(page, "Review")
    expect(page.get_by_label("Your name (recorded with every action)")).to_be_visible(timeout=LONG)
    for label in ("Margin (top-1 − top-2) below", "An unknown-type option was chosen",
                  "Disagrees with the expected answer"):
        box = page.get_by_role("checkbox", name=label, exact=True)
        if box.is_checked():
            box.uncheck(force=True)
            settle(page)
    page.get_by_role("checkbox", name="Confidence (top-1 probability) below", exact=True).check(force=True)
    settle(page)
    # the counts the page previews are those of the confidence rule on raw, then on calibrated, probabilities
    rules = review.ReviewRules(confidence_below=0.5, margin_below=None, unknown_option=False,
                               disagree_with_expected=False)
    raw_count = review.preview(store, run_id, rules)["items"]
    calibrated_count = review.preview(store, run_id, replace(rules, calibration=kept["name"]))["items"]
    expect(page.get_by_text(f"These rules select {raw_count} item(s)")).to_be_visible()
    pick(page, "Confidence and margin read from", kept["name"], exact=True)
    expect(page.get_by_text(f"These rules select {calibrated_count} item(s)")).to_be_visible()
    expect(page.get_by_text(judged.reason, exact=False).first).to_be_visible()
    if not judged.applied:  # a map that does not help leaves the thresholds on the raw numbers
        assert calibrated_count == raw_count
        return
    assert calibrated_count > 0
    page.get_by_role("button", name=re.compile(r"^Add \d+ item\(s\) to the queue$")).click()
    settle(page)
    expect(page.get_by_text(re.compile(r"Why queued:.*calibrated confidence"))).to_be_visible()
    expect(page.get_by_text(f"Calibrated distribution · “{kept['name']}”", exact=False)).to_be_visible()
    items = store.list_review_items(run_id)
    assert items and all(i["reason"].startswith("calibrated confidence") for i in items)
