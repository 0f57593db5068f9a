"""Decide's "Why" view: which part of the evidence moved each answer (green supports it, red works against it), in
percentage points on one fixed scale."""

from __future__ import annotations

import html
import json
from collections.abc import MutableMapping
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from clef_engine import ClefError
from clef_engine.errors import TokenBudgetError
from clef_engine.explain import segment_counts, unit_that_fits
from clef_engine.interface import DecisionEngine, ExplainingEngine
from clef_engine.model import media
from clef_workbench.casesets import build_request
from clef_workbench.store import Case, Run

TOWARDS = (26, 127, 55)  # green: the segment supports the answer
AGAINST = (207, 34, 46)  # red: the segment works against it
SMALLEST_ALPHA, LARGEST_ALPHA = 0.12, 0.65  # background opacity of the weakest and the strongest segment
# one scale everywhere: a colour is full from FULL_SCALE on, never relative to the largest effect in view
FULL_SCALE = 0.10
KEY_STEPS = (-0.10, -0.05, -0.01, 0.0, 0.01, 0.05, 0.10)  # the swatches of the key
TOP_SEGMENTS = 5  # the largest effects listed in a table under the view
DISPLAY_WIDTH = 768  # px: an image is drawn at this width with its regions labelled, whatever its own size

EVERYTHING = "everything"  # the state's sentences or fields with every image's regions and every video's frames
UNIT_LABELS = {EVERYTHING: "everything", "sentence": "sentences", "line": "lines", "field": "fields",
               "region": "image regions", "frame": "video frames"}


def units_for(request: dict) -> list[str]:
    """The segmentations a request can be explained by, everything at once first, for the "Explain by" choice."""
    units = [EVERYTHING, *(("sentence", "line") if isinstance(request["state"], str) else ("field",))]
    return units + ["region"] * bool(request.get("images")) + ["frame"] * bool(request.get("videos"))


def explain(engine: DecisionEngine, request: dict, unit: str = EVERYTHING, *, max_length: int | None = None,
            overflow: str = "refuse") -> dict:
    """The response with `x_explanations` by `unit`, or by the finest unit that fits the budget (`x_why_fallback`)."""
    if not isinstance(engine, ExplainingEngine):
        raise ValueError("Why needs a model loaded in this workbench; a System One endpoint does not explain")
    try:
        return engine.explain(request, None if unit == EVERYTHING else unit, max_length=max_length, overflow=overflow)
    except TokenBudgetError as exc:
        if exc.part != "explanation":
            raise
        sampled = [engine.sample_video_frames(media.video_bytes(video)) for video in request.get("videos") or []]
        counts = segment_counts(request, [len(video.frame_indices) for video in sampled if video is not None])
        used = unit_that_fits(counts, exc.token_counts["record"], exc.max_length)
        if used is None or used == unit:
            raise TokenBudgetError(
                f"explaining this record by {UNIT_LABELS[unit]} takes {exc.token_counts.get('explanation', 0):,} "
                f"tokens, over the {exc.max_length:,}-token budget of one explanation, and no single kind of segment "
                "fits either: shorten the state or attach fewer images or videos",
                over_by=exc.over_by, part=exc.part, token_counts=exc.token_counts, max_length=exc.max_length) from exc
        explained = engine.explain(request, used, max_length=max_length, overflow=overflow)
        return {**explained, "x_why_fallback": {"asked": unit, "used": used, "segments": counts[used],
                                                "asked_tokens": exc.token_counts.get("explanation"),
                                                "budget": exc.max_length}}


def fallback_note(explained: dict) -> str | None:
    """What the page says when Why explained by a coarser unit than asked: why, and what it used instead."""
    fallback = explained.get("x_why_fallback")
    if not fallback:
        return None
    cost = f"takes {fallback['asked_tokens']:,} tokens, " if fallback.get("asked_tokens") else "is "
    return (f"Explaining by {UNIT_LABELS[fallback['asked']]} {cost}over the {fallback['budget']:,}-token budget of "
            f"one explanation, so this explains the {fallback['segments']} {UNIT_LABELS[fallback['used']]} "
            f"({explained.get('x_explain_tokens', 0):,} tokens) instead. Choose another unit under “Explain by” for "
            "the other parts.")


def cached_explanation(state: MutableMapping, key: str, engine: DecisionEngine, request: dict, *,
                       unit: str = EVERYTHING, max_length: int | None, overflow: str) -> dict:
    """The explanation, computed once per request, unit, budget and model and kept in `state[key]`."""
    identity = (json.dumps(request, sort_keys=True, default=str), unit, max_length, overflow,
                engine.model_id, id(engine))
    kept = state.get(key)
    if kept is None or kept[0] != identity:
        kept = (identity, explain(engine, request, unit, max_length=max_length, overflow=overflow))
        state[key] = kept
    return kept[1]


def request_images(request: dict) -> list[Image.Image]:
    return [media.load_image(item) for item in request.get("images") or []]


def effect(delta: float) -> str:
    return "towards" if delta < 0 else "against" if delta > 0 else "none"


def points(delta: float) -> str:
    """A change of probability in percentage points, signed: -1.2 pp."""
    return f"{delta * 100:+.1f} pp"


def alpha(delta: float) -> float:
    """Opacity of a segment's colour on the fixed scale: 0 without an effect, full from FULL_SCALE on."""
    if delta == 0:
        return 0.0
    return SMALLEST_ALPHA + (LARGEST_ALPHA - SMALLEST_ALPHA) * min(1.0, abs(delta) / FULL_SCALE)


def colour(delta: float) -> str:
    red, green, blue = TOWARDS if delta < 0 else AGAINST
    return f"rgba({red},{green},{blue},{alpha(delta):.2f})"


def describe(delta: float) -> str:
    """A segment's effect in words: what removing it does to the answer's probability."""
    if delta == 0:
        return "no effect"
    side = "supports the answer" if delta < 0 else "works against the answer"
    return f"{side}: without it P(answer) {'falls' if delta < 0 else 'rises'} by {abs(delta) * 100:.1f} pp"


def key_html() -> str:
    swatches = "".join(
        f'<span class="why-key-step" style="background:{colour(step)};padding:0 6px;border-radius:3px;'
        f'margin-right:4px;white-space:nowrap">{points(step)}{" or more" if abs(step) == FULL_SCALE else ""}</span>'
        for step in KEY_STEPS)
    return (f'<div class="why-key" style="margin:4px 0 8px">Key — P(answer) without the part, in percentage points '
            f"(pp): {swatches}</div>")


def text_html(state: str, segments: list[dict]) -> str:
    """The text state as HTML, each sentence coloured by its effect and followed by its value, whitespace kept."""
    spans = sorted((s for s in segments if "start" in s), key=lambda s: s["start"])
    parts, cursor = [], 0
    for segment in spans:
        parts.append(html.escape(state[cursor: segment["start"]]))
        # the value goes before the segment's trailing whitespace, next to the words it belongs to
        text = state[segment["start"]: segment["end"]]
        words = text.rstrip()
        parts.append(f'<span class="why-{effect(segment["delta"])}" '
                     f'style="background:{colour(segment["delta"])};border-radius:3px" '
                     f'title="{html.escape(describe(segment["delta"]))}">{html.escape(words)}</span>'
                     f'<small class="why-value" style="margin:0 2px;color:#555">({points(segment["delta"])})</small>'
                     f"{html.escape(text[len(words):])}")
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
    rows = "".join(
        f'<tr class="why-{effect(s["delta"])}" style="background:{colour(s["delta"])}">'
        f"<td><code>{html.escape(path_text(s['path']))}</code></td><td>{html.escape(s['text'])}</td>"
        f"<td style='text-align:right'>{points(s['delta'])}</td></tr>" for s in segments if s.get("kind") == "field")
    return ('<table class="why-fields"><thead><tr><th>field</th><th>value</th><th>P(answer) without it</th>'
            f"</tr></thead><tbody>{rows}</tbody></table>")


def region_cells(segments: list[dict], image_index: int) -> list[tuple[dict, int, int]]:
    """(segment, row, column) of one image's regions, rows and columns counted from 1 at the top left."""
    regions = [s for s in segments if s.get("kind") == "region" and s["image"] == image_index]
    tops = sorted({s["box"][1] for s in regions})
    lefts = sorted({s["box"][0] for s in regions})
    return [(s, tops.index(s["box"][1]) + 1, lefts.index(s["box"][0]) + 1) for s in regions]


def segment_label(segment: dict, segments: list[dict]) -> str:
    """Where a segment is, as a reader finds it: the sentence, the field, the image region, the video frame."""
    kind = segment.get("kind")
    if kind == "field":
        return f"{path_text(segment['path'])} = {segment['text']}"
    if kind == "region":
        row, column = next((r, c) for s, r, c in region_cells(segments, segment["image"]) if s is segment)
        return f"image {segment['image'] + 1}, region row {row}, column {column}"
    if kind == "frame":
        seconds = f" ({segment['seconds']:.1f} s)" if segment.get("seconds") is not None else ""
        return f"video {segment['video'] + 1}, frame {segment['frame']}{seconds}"
    text = " ".join(segment.get("text", "").split())
    return f"“{text[:77]}…”" if len(text) > 80 else f"“{text}”"


def top_html(segments: list[dict], count: int = TOP_SEGMENTS) -> str:
    """The `count` segments with the largest effect (segments come ranked), as a table of numbers."""
    rows = "".join(
        f'<tr class="why-{effect(s["delta"])}"><td>{html.escape(segment_label(s, segments))}</td>'
        f'<td style="text-align:right;white-space:nowrap;background:{colour(s["delta"])}">{points(s["delta"])}</td>'
        f"<td>{html.escape(describe(s['delta']).split(':')[0])}</td></tr>" for s in segments[:count])
    return ('<table class="why-top"><thead><tr><th>largest effects</th><th>P(answer) without it</th><th>effect</th>'
            f"</tr></thead><tbody>{rows}</tbody></table>")


def region_overlay(image: Image.Image, segments: list[dict], image_index: int) -> Image.Image:
    """The image at DISPLAY_WIDTH with each region outlined in its effect's colour and labelled with its value."""
    scale = DISPLAY_WIDTH / image.width
    out = image.convert("RGB").resize((DISPLAY_WIDTH, max(1, round(image.height * scale))),
                                      Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.LANCZOS)
    draw = ImageDraw.Draw(out)
    font = ImageFont.load_default(size=16)
    for segment, _, _ in region_cells(segments, image_index):
        left, top, right, bottom = (round(v * scale) for v in segment["box"])
        if segment["delta"] != 0:
            tint = TOWARDS if segment["delta"] < 0 else AGAINST
            width = 2 + round(4 * min(1.0, abs(segment["delta"]) / FULL_SCALE))
            draw.rectangle((left, top, right - 1, bottom - 1), outline=(255, 255, 255), width=width + 2)
            draw.rectangle((left + 1, top + 1, right - 2, bottom - 2), outline=tint, width=width)
        label = points(segment["delta"])
        x0, y0, x1, y1 = draw.textbbox((left + 6, top + 6), label, font=font)
        draw.rectangle((x0 - 3, y0 - 3, x1 + 3, y1 + 3), fill=(255, 255, 255), outline=(0, 0, 0))
        draw.text((left + 6, top + 6), label, fill=(0, 0, 0), font=font)
    return out


def frame_rows(segments: list[dict]) -> list[dict]:
    return [{"video": s["video"] + 1, "frame": s["frame"], "seconds": s.get("seconds"),
             "P(answer) without it, pp": round(s["delta"] * 100, 1), "effect": effect(s["delta"])}
            for s in segments if s.get("kind") == "frame"]


def answered_option(answer: dict) -> str:
    """The option whose probability the deltas measure: for noul the likelier of true/false."""
    if answer["type"] == "noul":
        return "true" if answer["noul"] >= 0.5 else "false"
    if answer["type"] == "choice":
        return answer["choice"]
    probabilities = answer["probabilities"]
    return f"level {max(probabilities, key=probabilities.get)}"


def render_why(explained: dict, question_id: str, state: Any, images: list[Image.Image]) -> None:
    """One question's explanation: the key, the state, the images' regions, the frames and the largest effects."""
    import streamlit as st

    segments = explained["x_explanations"][question_id]
    answer = explained["answers"][question_id]
    if note := fallback_note(explained):
        st.info(note, icon=":material/grid_view:")
    st.caption(f"Each part of the evidence was removed in turn and the record decided again: green parts support "
               f"the answer “{answered_option(answer)}” (without them its probability falls), red parts work "
               "against it. Each part's value is the change of P(answer) without it, in percentage points.")
    st.markdown(key_html(), unsafe_allow_html=True)
    if isinstance(state, str) and any("start" in s for s in segments):
        st.markdown(text_html(state, segments), unsafe_allow_html=True)
    if any(s.get("kind") == "field" for s in segments):
        st.markdown(fields_html(segments), unsafe_allow_html=True)
    for index, image in enumerate(images):
        if any(s.get("kind") == "region" and s["image"] == index for s in segments):
            st.image(region_overlay(image, segments, index),
                     caption=f"Image {index + 1}: each region outlined and labelled with its effect")
    if frames := frame_rows(segments):
        st.dataframe(frames, hide_index=True)
    st.markdown(top_html(segments), unsafe_allow_html=True)


def render_explained(key: str, engine: DecisionEngine, request: dict, *, unit: str = EVERYTHING,
                     max_length: int | None, overflow: str, question_id: str | None = None, picker: Any = None,
                     note: str | None = None) -> None:
    """Explain `request` (kept under `key`) and show one question's explanation: `question_id`, else the one picked
    in `picker` (a column; the page by default); `note` goes above it."""
    import streamlit as st

    try:
        explained = cached_explanation(st.session_state, key, engine, request, unit=unit, max_length=max_length,
                                       overflow=overflow)
    except (ClefError, ValueError) as exc:
        st.error(f"Why could not be computed: {exc}")
        return
    if note:
        st.caption(note)
    if question_id is None:
        question_id = (picker or st).selectbox("Why this answer to", list(explained["answers"]),
                                               key=f"{key}.question")
    render_why(explained, question_id, request["state"], request_images(request))


def explained_by_note(used: str, answered: str, label: str, differ_from: str) -> str | None:
    """What Why says when the model that answered is not loaded and `used` explains instead; None when it is."""
    if used == answered:
        return None
    return (f"Explained by {label}: the model that answered, {answered}, is not loaded here, so these answers may "
            f"differ from {differ_from}.")


def render_case_why(key: str, models: list, run: Run, case: Case, *, question_id: str | None = None) -> None:
    """Explain a stored case with the run's model if resident (else the default, said so)."""
    import streamlit as st

    model = next((m for m in models if m.name == run["model_id"]), models[0] if models else None)
    if model is None:
        st.info("Why needs a loaded model: load one in the sidebar.")
        return
    note = explained_by_note(model.name, run["model_id"], model.label, "the run's")
    render_explained(key, model.engine, build_request(case, run["schema"], model=run["model_id"]),
                     max_length=run["settings"].max_length, overflow=run["settings"].overflow,
                     question_id=question_id, note=note)
