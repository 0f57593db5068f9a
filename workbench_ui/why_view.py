"""Decide's "Why" view: which part of the evidence moved each answer, drawn from an explained response.

`explain` asks the engine (clef_engine/explain.py) for a response with `x_explanations`; the rest turns one
question's segments into what the page shows: the text state with each sentence highlighted by its effect, the JSON
fields ranked, a heatmap over each image, the frames of each video. A segment whose removal lowers the answered
option's probability (delta < 0) supported the answer ("towards", green); one whose removal raises it worked
against the answer (red). The strength of a colour is the segment's |delta| over the largest of the question.

`render_why` draws it with Streamlit, and `render_case_why` explains a stored case of a run (Review's item, the Runs
page's case view) with the run's model when it is loaded; everything above them is plain and unit-tested.
"""

from __future__ import annotations

import html
import json
from collections.abc import MutableMapping
from typing import Any

import numpy as np
from PIL import Image

from clef_engine import ClefError
from clef_engine.interface import DecisionEngine, ExplainingEngine
from clef_engine.model import media
from clef_workbench.casesets import build_request

TOWARDS = (26, 127, 55)  # green: the segment supports the answer
AGAINST = (207, 34, 46)  # red: the segment works against it
SMALLEST_ALPHA, LARGEST_ALPHA = 0.12, 0.65  # background opacity of the weakest and the strongest segment


def explain(engine: DecisionEngine, request: dict, *, max_length: int | None = None, overflow: str = "refuse") -> dict:
    """The response to `request` with `x_explanations` (per question, segments ranked by effect). Raises
    RequestError / TokenBudgetError as the engine does, ValueError for a model that cannot explain here."""
    if not isinstance(engine, ExplainingEngine):
        raise ValueError("Why needs a model loaded in this workbench; a System One endpoint does not explain")
    return engine.explain(request, max_length=max_length, overflow=overflow)


def cached_explanation(state: MutableMapping, key: str, engine: DecisionEngine, request: dict, *,
                       max_length: int | None, overflow: str) -> dict:
    """The explanation of `request`, computed once per request, budget and model and kept in `state[key]` (the
    toggle reruns the page on every click; an explanation costs a batched run)."""
    identity = (json.dumps(request, sort_keys=True, default=str), max_length, overflow,
                engine.model_id, id(engine))
    kept = state.get(key)
    if kept is None or kept[0] != identity:
        kept = (identity, explain(engine, request, max_length=max_length, overflow=overflow))
        state[key] = kept
    return kept[1]


def model_for_run(models: list, model_id: str) -> Any | None:
    """Of the resident models (`ModelManager.loaded()`, the default first), the one that produced a run (its
    request name is the run's model id), else the default; None when none is loaded."""
    return next((m for m in models if m.name == model_id), models[0] if models else None)


def request_images(request: dict) -> list[Image.Image]:
    """The request's images as the model saw them (RGB), for the heatmaps."""
    return [media.load_image(item) for item in request.get("images") or []]


def effect(delta: float) -> str:
    return "towards" if delta < 0 else "against" if delta > 0 else "none"


def _largest(segments: list[dict]) -> float:
    return max((abs(s["delta"]) for s in segments), default=0.0)


def alpha(delta: float, largest: float) -> float:
    """Opacity of a segment's colour: 0 without an effect, else between the weakest and the strongest opacity."""
    if largest <= 0 or delta == 0:
        return 0.0
    return SMALLEST_ALPHA + (LARGEST_ALPHA - SMALLEST_ALPHA) * abs(delta) / largest


def colour(delta: float, largest: float) -> str:
    red, green, blue = TOWARDS if delta < 0 else AGAINST
    return f"rgba({red},{green},{blue},{alpha(delta, largest):.2f})"


def describe(delta: float) -> str:
    """A segment's effect in words: what removing it does to the answer's probability."""
    if delta == 0:
        return "no effect"
    side = "supports the answer" if delta < 0 else "works against the answer"
    return f"{side}: without it P(answer) {'falls' if delta < 0 else 'rises'} by {abs(delta):.2%}"


def text_html(state: str, segments: list[dict]) -> str:
    """The text state as HTML, each sentence or line in a span coloured by its effect (title: its delta), the rest
    as written; whitespace and line breaks kept."""
    spans = sorted((s for s in segments if "start" in s), key=lambda s: s["start"])
    largest = _largest(spans)
    parts, cursor = [], 0
    for segment in spans:
        parts.append(html.escape(state[cursor: segment["start"]]))
        parts.append(f'<span class="why-{effect(segment["delta"])}" '
                     f'style="background:{colour(segment["delta"], largest)};border-radius:3px" '
                     f'title="{html.escape(describe(segment["delta"]))}">'
                     f'{html.escape(state[segment["start"]: segment["end"]])}</span>')
        cursor = segment["end"]
    parts.append(html.escape(state[cursor:]))
    return f'<div class="why-text" style="white-space:pre-wrap;line-height:1.6">{"".join(parts)}</div>'


def path_text(path: list) -> str:
    """A JSON path as a reader writes it: customer.name, items[2].price."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "(state)"


def fields_html(segments: list[dict]) -> str:
    """The JSON state's fields, strongest effect first, each row coloured by its effect."""
    fields = [s for s in segments if s.get("kind") == "field"]
    largest = _largest(fields)
    rows = "".join(
        f'<tr class="why-{effect(s["delta"])}" style="background:{colour(s["delta"], largest)}">'
        f"<td><code>{html.escape(path_text(s['path']))}</code></td><td>{html.escape(s['text'])}</td>"
        f"<td style='text-align:right'>{s['delta']:+.4f}</td></tr>" for s in fields)
    return ('<table class="why-fields"><thead><tr><th>field</th><th>value</th><th>Δ P(answer) without it</th>'
            f"</tr></thead><tbody>{rows}</tbody></table>")


def region_heatmap(image: Image.Image, segments: list[dict], image_index: int) -> Image.Image:
    """The image with each region tinted by its effect (green towards the answer, red against)."""
    regions = [s for s in segments if s.get("kind") == "region" and s["image"] == image_index]
    largest = _largest(regions)
    base = np.asarray(image.convert("RGB"), dtype=np.float32)
    out = base.copy()
    for segment in regions:
        left, top, right, bottom = segment["box"]
        weight = alpha(segment["delta"], largest)
        tint = np.array(TOWARDS if segment["delta"] < 0 else AGAINST, dtype=np.float32)
        out[top:bottom, left:right] = (1 - weight) * base[top:bottom, left:right] + weight * tint
    return Image.fromarray(np.rint(out).astype(np.uint8))


def frame_rows(segments: list[dict]) -> list[dict]:
    """The videos' frames that were explained, strongest effect first."""
    return [{"video": s["video"] + 1, "frame": s["frame"], "seconds": s.get("seconds"), "Δ P(answer)": s["delta"],
             "effect": effect(s["delta"])} for s in segments if s.get("kind") == "frame"]


def answered_option(answer: dict) -> str:
    """The option whose probability the deltas measure: for noul the likelier of true/false."""
    if answer["type"] == "noul":
        return "true" if answer["noul"] >= 0.5 else "false"
    if answer["type"] == "choice":
        return answer["choice"]
    probabilities = answer["probabilities"]
    return f"level {max(probabilities, key=probabilities.get)}"


# ---- Streamlit ------------------------------------------------------------------------------------------------------


def render_why(explained: dict, question_id: str, state: Any, images: list[Image.Image]) -> None:
    """One question's explanation: the text or fields of the state, a heatmap per image, the frames."""
    import streamlit as st

    segments = explained["x_explanations"][question_id]
    answer = explained["answers"][question_id]
    st.caption(f"Each part of the evidence was removed in turn and the record decided again: green parts support "
               f"the answer “{answered_option(answer)}” (without them its probability falls), red parts work "
               "against it. Hover a sentence for its effect.")
    if isinstance(state, str) and any("start" in s for s in segments):
        st.markdown(text_html(state, segments), unsafe_allow_html=True)
    if any(s.get("kind") == "field" for s in segments):
        st.markdown(fields_html(segments), unsafe_allow_html=True)
    for index, image in enumerate(images):
        st.image(region_heatmap(image, segments, index), caption=f"Image {index + 1}: regions by effect")
    frames = frame_rows(segments)
    if frames:
        st.dataframe(frames, hide_index=True)


def render_case_why(key: str, models: list, run: dict, case: dict, *, question_id: str | None = None) -> None:
    """Explain a stored case (`Store.get_case`, with media) of `run` as its schema asks, with the run's model if it
    is resident (else the default, and said so), computed once and kept under `key`; then draw one question's
    explanation (`question_id`, or a choice of the questions)."""
    import streamlit as st

    model = model_for_run(models, run["model_id"])
    if model is None:
        st.info("Why needs a loaded model: load one in the sidebar.")
        return
    request = build_request(case, run["schema"], model=run["model_id"])
    settings = run.get("settings") or {}
    try:
        explained = cached_explanation(st.session_state, key, model.engine, request,
                                       max_length=settings.get("max_length"),
                                       overflow=settings.get("overflow") or "refuse")
    except (ClefError, ValueError) as exc:
        st.error(f"Why could not be computed: {exc}")
        return
    if model.name != run["model_id"]:
        st.caption(f"Explained by {model.label}: the run's model {run['model_id']} is not loaded here, so these "
                   "answers may differ from the run's.")
    if question_id is None:
        question_id = st.selectbox("Why this answer to", list(explained["answers"]), key=f"{key}.question")
    render_why(explained, question_id, request["state"], request_images(request))
