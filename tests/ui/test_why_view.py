"""Decide's "Why" toggle: the view-model (workbench_ui/why_view.py) and the page through AppTest on the demo model."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from PIL import Image

from clef_engine import TokenBudgetError
from clef_engine.explain import explaining, segment_counts, unit_that_fits
from clef_engine.protocol import data_url
from tests.support.apptest import button, engine, no_exceptions, start
from tests.support.bodies import QUESTIONS, TEXT_STATE
from tests.support.media import png_bytes
from workbench_ui import why_view as why


def segment(start: int, end: int, delta: float, state: str) -> dict:
    return {"kind": "sentence", "start": start, "end": end, "text": state[start:end], "delta": delta}


def test_text_html_colours_each_sentence_on_one_fixed_scale_and_shows_its_value():
    state = "  Refund <now>! It was late.\nThanks."
    segments = [segment(2, 16, -0.2, state), segment(16, 29, 0.05, state), segment(29, 36, 0.0, state)]
    page = why.text_html(state, segments)
    spans = re.findall(r'<span class="why-(\w+)" style="background:rgba\((\d+),(\d+),(\d+),([0-9.]+)\)', page)
    assert [s[0] for s in spans] == ["towards", "against", "none"]
    assert tuple(map(int, spans[0][1:4])) == why.TOWARDS and tuple(map(int, spans[1][1:4])) == why.AGAINST
    assert float(spans[0][4]) == why.LARGEST_ALPHA and float(spans[2][4]) == 0  # beyond the scale, and none
    assert float(spans[1][4]) == round(why.SMALLEST_ALPHA + (why.LARGEST_ALPHA - why.SMALLEST_ALPHA) / 2, 2)
    # the same effect has the same colour whatever else is in view: no scale relative to the largest
    alone = why.text_html(state, [segment(16, 29, 0.05, state)])
    assert re.search(r'why-against" style="(background:[^;]+)', alone)[1] == \
        re.search(r'why-against" style="(background:[^;]+)', page)[1]
    # each value next to its sentence, in percentage points
    values = re.findall(r'<small class="why-value"[^>]*>\(([^)]*)\)</small>', page)
    assert values == ["-20.0 pp", "+5.0 pp", "+0.0 pp"]
    assert "&lt;now&gt;" in page and "<now>" not in page  # the state is text, never markup
    without_values = re.sub(r'<small class="why-value".*?</small>', "", page)
    assert re.sub(r"<[^>]+>", "", without_values).replace("&lt;", "<").replace("&gt;", ">") == state
    assert why.describe(-0.0116) == "supports the answer: without it P(answer) falls by 1.2 pp"


def test_the_key_shows_the_fixed_scale_in_percentage_points():
    key = why.key_html()
    labels = re.findall(r'class="why-key-step"[^>]*>([^<]*)<', key)
    assert labels == ["-10.0 pp or more", "-5.0 pp", "-1.0 pp", "+0.0 pp", "+1.0 pp", "+5.0 pp", "+10.0 pp or more"]
    assert f"rgba(26,127,55,{why.LARGEST_ALPHA:.2f})" in key and f"rgba(207,34,46,{why.LARGEST_ALPHA:.2f})" in key


def test_fields_frames_and_the_top_table_read_in_percentage_points():
    assert why.path_text(["customer", "name"]) == "customer.name"
    assert why.path_text(["items", 2, "price"]) == "items[2].price"
    fields = [{"kind": "field", "path": ["b"], "text": "<x>", "delta": -0.3},
              {"kind": "field", "path": ["a", 0], "text": "1", "delta": 0.0116}]
    table = why.fields_html(fields)
    assert table.index("&lt;x&gt;") < table.index("a[0]") and "+1.2 pp" in table and "-30.0 pp" in table
    assert "0.0116" not in table
    rows = why.frame_rows([{"kind": "frame", "video": 0, "frame": 12, "seconds": 1.5, "delta": -0.0123}])
    assert rows == [{"video": 1, "frame": 12, "seconds": 1.5, "P(answer) without it, pp": -1.2, "effect": "towards"}]
    ranked = [{"kind": "region", "image": 0, "box": [32, 0, 64, 24], "delta": -0.08},
              {"kind": "sentence", "start": 0, "end": 9, "text": "Refund it. ", "delta": 0.02},
              {"kind": "frame", "video": 0, "frame": 12, "seconds": 1.5, "delta": -0.01},
              {"kind": "region", "image": 0, "box": [0, 0, 32, 24], "delta": 0.0}]
    top = why.top_html(ranked, count=3)
    cells = re.findall(r"<tr class=\"why-\w+\"><td>([^<]*)</td><td[^>]*>([^<]*)</td>", top)
    assert cells == [("image 1, region row 1, column 2", "-8.0 pp"), ("“Refund it.”", "+2.0 pp"),
                     ("video 1, frame 12 (1.5 s)", "-1.0 pp")]
    assert why.answered_option({"type": "noul", "noul": 0.3}) == "false"
    assert why.answered_option({"type": "score", "probabilities": {"0": 0.2, "1": 0.8}}) == "level 1"


def test_region_values_and_outlines_read_on_an_image_of_the_answers_own_colour():
    image = Image.new("RGB", (40, 20), why.AGAINST)  # a red car: a red tint would not show
    regions = [{"kind": "region", "image": 0, "box": [0, 0, 20, 20], "delta": 0.04},
               {"kind": "region", "image": 0, "box": [20, 0, 40, 20], "delta": 0.0},
               {"kind": "region", "image": 1, "box": [0, 0, 40, 20], "delta": 0.9}]  # another image's
    drawn = why.region_overlay(image, regions, 0)
    assert drawn.width == why.DISPLAY_WIDTH and drawn.height == why.DISPLAY_WIDTH // 2
    pixels = np.asarray(drawn).astype(int)
    half = why.DISPLAY_WIDTH // 2
    for left in (0, half):  # each region: a white label patch with black text, whatever the picture
        region = pixels[:, left:left + half].reshape(-1, 3)
        assert (region == 255).all(axis=1).any() and (region.sum(axis=1) < 60).any()
    # the region with an effect is outlined in white around its colour; the one without is not outlined
    assert (pixels[half // 2, 0] == 255).all() and (pixels[half // 2, half - 1] == 255).all()
    assert (pixels[half // 2, half + 2] == why.AGAINST).all()
    assert (pixels[half // 2, half // 2] == why.AGAINST).all()  # inside, the picture as it was


def test_a_request_offers_the_units_its_segments_come_in():
    assert why.units_for({"state": "a. b."}) == ["everything", "sentence", "line"]
    assert why.units_for({"state": {"a": 1}, "images": ["x"], "videos": ["y"]}) == [
        "everything", "field", "region", "frame"]
    image = data_url("image/png", png_bytes(64, 96, seed=1))
    counts = segment_counts({"state": {"a": 1, "b": [2, 3]}, "images": [image]}, [4, 8])
    assert counts == {"field": 3, "region": 16, "frame": 12}
    # the unit with the most segments whose variants surely fit: every variant as long as the record
    assert unit_that_fits(counts, record_tokens=100, budget=100 * 17) == "region"
    assert unit_that_fits(counts, record_tokens=100, budget=100 * 17 - 1) == "frame"
    assert unit_that_fits(counts, record_tokens=100, budget=100 * 4 - 1) is None


def test_why_over_the_budget_explains_by_a_coarser_unit_that_fits_and_says_so(tiny_engine, monkeypatch):
    image = data_url("image/png", png_bytes(64, 96, seed=11))
    request = {"state": TEXT_STATE, "questions": QUESTIONS, "images": [image]}
    record_tokens = tiny_engine.count_tokens(request)["total"]
    # room for the record and its 16 region variants, not for those and the 6 sentence variants too
    monkeypatch.setattr(tiny_engine, "token_budget", -(-record_tokens * 17 // 4))
    with pytest.raises(TokenBudgetError):
        tiny_engine.explain(request)  # what the page showed: a refusal advising a control it did not have
    explained = why.explain(tiny_engine, request)
    regions = explained["x_explanations"]["angry"]
    assert len(regions) == 16 and {s["kind"] for s in regions} == {"region"}
    assert explained["x_why_fallback"] == {"asked": "everything", "used": "region", "segments": 16,
                                           "asked_tokens": explained["x_why_fallback"]["asked_tokens"],
                                           "budget": 4 * tiny_engine.token_budget}
    note = why.fallback_note(explained)
    assert note.startswith("Explaining by everything") and "so this explains the 16 image regions" in note
    assert "“Explain by”" in note
    # a unit asked for that fits is used as it is
    assert "x_why_fallback" not in why.explain(tiny_engine, request, "sentence")
    # nothing fits: said so, without advising a unit
    monkeypatch.setattr(tiny_engine, "token_budget", record_tokens // 2)  # the record and one variant: over
    with pytest.raises(TokenBudgetError, match="no single kind of segment fits either") as caught:
        why.explain(tiny_engine, request)
    assert "another unit" not in str(caught.value)


def test_decide_why_toggle_highlights_the_sentences_and_fields(workbench):
    at = start()
    button(at, "Run").click()
    at.run()
    no_exceptions(at)
    assert not [m for m in at.markdown if "why-text" in m.value], "nothing is explained until asked"
    records_before = engine().info()["scheduler"]["records"]
    at.toggle(key="decide.why").set_value(True).run()
    no_exceptions(at)
    question = at.selectbox(key="decide.why_result.question").value
    explained = at.session_state["decide.why_result"][1]
    segments = explained["x_explanations"][question]
    highlighted = next(m.value for m in at.markdown if "why-text" in m.value)
    classes = re.findall(r'<span class="why-(\w+)"', highlighted)
    by_start = sorted(segments, key=lambda s: s["start"])
    assert classes == [why.effect(s["delta"]) for s in by_start] and len(classes) > 3
    assert engine().info()["scheduler"]["records"] == records_before + 1 + len(segments)  # one batched job
    # another question: its own explanation, from the same run (nothing decided again)
    other = [q for q in explained["answers"] if q != question][0]
    at.selectbox(key="decide.why_result.question").set_value(other).run()
    no_exceptions(at)
    assert engine().info()["scheduler"]["records"] == records_before + 1 + len(segments)
    highlighted = next(m.value for m in at.markdown if "why-text" in m.value)
    by_start = sorted(explained["x_explanations"][other], key=lambda s: s["start"])
    assert re.findall(r'<span class="why-(\w+)"', highlighted) == [why.effect(s["delta"]) for s in by_start]

    # another unit: the lines, explained afresh
    assert at.selectbox(key="decide.why_unit").options == ["everything", "sentences", "lines"]
    at.selectbox(key="decide.why_unit").set_value("line").run()
    no_exceptions(at)
    lines = at.session_state["decide.why_result"][1]["x_explanations"][other]
    assert {s["kind"] for s in lines} == {"line"} and len(lines) < len(segments)
    assert not [i for i in at.info if "budget of one explanation" in i.value]  # it fitted: nothing to say

    # a JSON state: its fields
    at.text_area(key="decide.state_text").input('{"vendor": "ACME", "total": 12, "lines": [{"sku": "A1"}]}').run()
    button(at, "Run").click()
    at.run()
    no_exceptions(at)
    table = next(m.value for m in at.markdown if "why-fields" in m.value)
    assert [p for p in ("vendor", "total", "lines[0].sku") if f"<code>{p}</code>" in table] == [
        "vendor", "total", "lines[0].sku"]


def test_why_on_the_decide_page_goes_before_a_batch_run_and_http_explanations_behind_it(tiny_engine, monkeypatch):
    """One person waits at the screen for Why: its variants are interactive work, ahead of a batch run's bulk work
    queued before it; an HTTP `x_explain`, which any client may send back to back, stays bulk, behind both."""
    scheduler = tiny_engine.scheduler
    finished: list[str] = []
    labels = iter(["batch run", "Why on Decide", "HTTP x_explain"])
    submit = scheduler.submit

    def labelled_submit(records, **options):
        label = next(labels)
        future = submit(records, **options)
        future.add_done_callback(lambda _: finished.append(label))  # on the worker, in the order jobs finish
        return future

    holding, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=scheduler.call, args=(lambda: holding.set() or release.wait(),))
    worker.start()
    try:
        assert holding.wait(60)  # the worker is busy: what follows queues, in this order
        monkeypatch.setattr(scheduler, "submit", labelled_submit)
        tiny_engine.submit([{"state": TEXT_STATE, "questions": QUESTIONS}] * 3, priority="bulk")
        why_thread = threading.Thread(target=why.explain, args=(tiny_engine, {"state": TEXT_STATE,
                                                                              "questions": QUESTIONS}))
        why_thread.start()
        while scheduler.queue_depth() < 2:
            assert why_thread.is_alive()
            time.sleep(0.005)
        http = explaining(tiny_engine, True).submit([{"state": TEXT_STATE, "questions": QUESTIONS}])
    finally:
        release.set()
    worker.join()
    why_thread.join()
    assert http.result(timeout=120)[0]["x_explanations"]
    assert finished == ["Why on Decide", "batch run", "HTTP x_explain"]
