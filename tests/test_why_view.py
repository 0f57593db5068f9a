"""Decide's "Why" toggle: the view-model (workbench_ui/why_view.py) and the page through AppTest on the demo model."""

from __future__ import annotations

import re

import numpy as np
from PIL import Image

from tests.test_app_pages import button, engine, no_exceptions, start
from workbench_ui import why_view as why


def segment(start: int, end: int, delta: float, state: str) -> dict:
    return {"kind": "sentence", "start": start, "end": end, "text": state[start:end], "delta": delta}


def test_text_html_colours_each_sentence_by_its_effect_and_keeps_the_text():
    state = "  Refund <now>! It was late.\nThanks."
    segments = [segment(2, 16, -0.2, state), segment(16, 29, 0.05, state), segment(29, 36, 0.0, state)]
    page = why.text_html(state, segments)
    spans = re.findall(r'<span class="why-(\w+)" style="background:rgba\((\d+),(\d+),(\d+),([0-9.]+)\)', page)
    assert [s[0] for s in spans] == ["towards", "against", "none"]
    assert tuple(map(int, spans[0][1:4])) == why.TOWARDS and tuple(map(int, spans[1][1:4])) == why.AGAINST
    assert float(spans[0][4]) == why.LARGEST_ALPHA and float(spans[2][4]) == 0  # the strongest, and none
    assert why.SMALLEST_ALPHA < float(spans[1][4]) < why.LARGEST_ALPHA
    assert "&lt;now&gt;" in page and "<now>" not in page  # the state is text, never markup
    assert re.sub(r"<[^>]+>", "", page).replace("&lt;", "<").replace("&gt;", ">") == state


def test_fields_paths_and_frames_read_as_a_person_writes_them():
    assert why.path_text(["customer", "name"]) == "customer.name"
    assert why.path_text(["items", 2, "price"]) == "items[2].price"
    fields = [{"kind": "field", "path": ["a", 0], "text": "1", "delta": 0.1},
              {"kind": "field", "path": ["b"], "text": "<x>", "delta": -0.3}]
    table = why.fields_html(fields)
    assert table.index("a[0]") < table.index("&lt;x&gt;") and "+0.1000" in table and "-0.3000" in table
    rows = why.frame_rows([{"kind": "frame", "video": 0, "frame": 12, "seconds": 1.5, "delta": -0.01}])
    assert rows == [{"video": 1, "frame": 12, "seconds": 1.5, "Δ P(answer)": -0.01, "effect": "towards"}]
    assert why.answered_option({"type": "noul", "noul": 0.3}) == "false"
    assert why.answered_option({"type": "score", "probabilities": {"0": 0.2, "1": 0.8}}) == "level 1"


def test_region_heatmap_tints_only_the_regions_by_their_effect():
    image = Image.new("RGB", (40, 20), (128, 128, 128))
    regions = [{"kind": "region", "image": 0, "box": [0, 0, 20, 20], "delta": -0.4},
               {"kind": "region", "image": 0, "box": [20, 0, 40, 20], "delta": 0.0},
               {"kind": "region", "image": 1, "box": [0, 0, 40, 20], "delta": 0.9}]  # another image's
    pixels = np.asarray(why.region_heatmap(image, regions, 0)).astype(int)
    left, right = pixels[10, 5], pixels[10, 30]
    assert left[1] > left[0] and left[1] > left[2]  # towards the answer: green
    assert (right == 128).all()  # no effect, and the other image's region is not drawn here


def test_decide_why_toggle_highlights_the_sentences_and_fields(workbench):
    at = start()
    button(at, "Run").click()
    at.run()
    no_exceptions(at)
    assert not [m for m in at.markdown if "why-text" in m.value], "nothing is explained until asked"
    records_before = engine().info()["scheduler"]["records"]
    at.toggle(key="decide.why").set_value(True).run()
    no_exceptions(at)
    question = at.selectbox(key="decide.why_question").value
    explained = at.session_state["decide.why_result"][1]
    segments = explained["x_explanations"][question]
    highlighted = next(m.value for m in at.markdown if "why-text" in m.value)
    classes = re.findall(r'<span class="why-(\w+)"', highlighted)
    by_start = sorted(segments, key=lambda s: s["start"])
    assert classes == [why.effect(s["delta"]) for s in by_start] and len(classes) > 3
    assert engine().info()["scheduler"]["records"] == records_before + 1 + len(segments)  # one batched job
    # another question: its own explanation, from the same run (nothing decided again)
    other = [q for q in explained["answers"] if q != question][0]
    at.selectbox(key="decide.why_question").set_value(other).run()
    no_exceptions(at)
    assert engine().info()["scheduler"]["records"] == records_before + 1 + len(segments)
    highlighted = next(m.value for m in at.markdown if "why-text" in m.value)
    by_start = sorted(explained["x_explanations"][other], key=lambda s: s["start"])
    assert re.findall(r'<span class="why-(\w+)"', highlighted) == [why.effect(s["delta"]) for s in by_start]

    # a JSON state: its fields
    at.text_area(key="decide.state_text").input('{"vendor": "ACME", "total": 12, "lines": [{"sku": "A1"}]}').run()
    button(at, "Run").click()
    at.run()
    no_exceptions(at)
    table = next(m.value for m in at.markdown if "why-fields" in m.value)
    assert [p for p in ("vendor", "total", "lines[0].sku") if f"<code>{p}</code>" in table] == [
        "vendor", "total", "lines[0].sku"]
