"""Decide: write a state, attach media, build a schema, check the token budget, run, read the answers, save a case.

Rendering only: parsing, validation, charts and labels come from clef_workbench. Nothing here runs the model
unless the Run button is pressed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import streamlit as st

from clef_engine import DEFAULT_MAX_LENGTH
from clef_engine.errors import BusyError, ClefError, RequestError, TokenBudgetError
from clef_workbench import answers, schemas, state_input
from clef_workbench.model_loader import request_model_name
from clef_workbench.store import StoreError
from ui_common import (
    format_json,
    get_engine,
    get_library,
    get_store,
    kept_widget,
    model_manager,
    page_key,
    run_queued,
    set_widget,
    use_app_navigation,
)

use_app_navigation()

@st.cache_data(max_entries=8, show_spinner=False)
def sampled_frames(video: state_input.Media, model_id: str, _engine) -> Any:
    """The frames the model reads, decoded once per video and model rather than on every rerun of the page."""
    return state_input.sampled_video_frames(_engine, video)


K = page_key("decide")
QUESTION_TYPES = list(schemas.QUESTION_TYPES)
NEW_QUESTION_DEFAULTS = {
    "noul": {},
    "choice": {"options": [{"id": "option_a", "description": ""}, {"id": "option_b", "description": ""},
                           {"id": "unknown", "description": "None of these fits."}]},
    "score": {"levels": ["Low", "Medium", "High"]},
}
PREFERRED_START_SCHEMA = "support-ticket-routing"
MAX_LENGTH_CHOICES = sorted({512, 1024, 2048, 4096, 8192, DEFAULT_MAX_LENGTH, 32_768, 65_536, 131_072, 262_144})


# ---------------------------------------------------------------------------------------------------------------
# Builder state: a list of rows (one per question) with a stable uid each, so widgets keep their values when
# questions are reordered. Widget keys: decide.q<uid>.<field>.


def _new_uid() -> int:
    uid = st.session_state.get(K("next_uid"), 0)
    st.session_state[K("next_uid")] = uid + 1
    return uid


def _row_keys(uid: int) -> dict[str, str]:
    return {f: K(f"q{uid}.{f}") for f in ("id", "type", "instructions", "options", "levels", "true", "false")}


def _set_rows(rows: list[dict[str, Any]]) -> None:
    """Replace the builder's questions; every field's widget is (re)initialised from the rows."""
    new_rows = []
    for row in rows:
        uid = _new_uid()
        keys = _row_keys(uid)
        set_widget(keys["id"], row["id"])
        set_widget(keys["type"], row["type"])
        set_widget(keys["instructions"], row.get("instructions") or "")
        set_widget(keys["options"], schemas.options_to_text(row.get("options") or []))
        set_widget(keys["levels"], schemas.levels_to_text(row.get("levels") or []))
        set_widget(keys["true"], row.get("true") or "")
        set_widget(keys["false"], row.get("false") or "")
        new_rows.append(uid)
    st.session_state[K("uids")] = new_rows


def load_schema(slug: str, *, with_example: bool = False) -> None:
    """Callback: put a library schema into the builder (and optionally its first example state into the editor)."""
    try:
        schema = get_library().load(slug)
    except schemas.SchemaError as exc:
        st.session_state[K("library_error")] = str(exc)
        return
    _set_rows(schemas.questions_to_rows(schema.questions))
    st.session_state[K("loaded_slug")] = slug
    set_widget(K("schema_name"), schema.name)
    set_widget(K("schema_description"), schema.description)
    st.session_state[K("examples")] = schema.examples
    st.session_state.pop(K("library_error"), None)
    if with_example and schema.examples:
        set_widget(K("state_text"), state_input.state_to_text(schema.examples[0]["state"]))


def add_question(qtype: str) -> None:
    uids = st.session_state[K("uids")]
    existing = {st.session_state.get(_row_keys(u)["id"]) for u in uids}
    n = len(uids) + 1
    while f"q{n}" in existing:
        n += 1
    uid = _new_uid()
    keys = _row_keys(uid)
    defaults = NEW_QUESTION_DEFAULTS[qtype]
    set_widget(keys["id"], f"q{n}")
    set_widget(keys["type"], qtype)
    set_widget(keys["instructions"], "")
    set_widget(keys["options"], schemas.options_to_text(defaults.get("options", NEW_QUESTION_DEFAULTS["choice"]
                                                                     ["options"])))
    set_widget(keys["levels"], schemas.levels_to_text(defaults.get("levels", NEW_QUESTION_DEFAULTS["score"]["levels"])))
    set_widget(keys["true"], "")
    set_widget(keys["false"], "")
    uids.append(uid)


def move_question(uid: int, step: int) -> None:
    uids = st.session_state[K("uids")]
    i = uids.index(uid)
    j = max(0, min(len(uids) - 1, i + step))
    uids[i], uids[j] = uids[j], uids[i]


def remove_question(uid: int) -> None:
    st.session_state[K("uids")].remove(uid)


def use_example(index: int) -> None:
    examples = st.session_state.get(K("examples")) or []
    if 0 <= index < len(examples):
        set_widget(K("state_text"), state_input.state_to_text(examples[index]["state"]))


def _init_page() -> None:
    """First visit: the preferred example schema. "Open in Decide" on the Schemas page leaves a pending slug."""
    pending = st.session_state.pop(K("pending_load"), None)
    if K("uids") not in st.session_state:
        st.session_state[K("uids")] = []
        if pending is None:
            slugs = get_library().slugs()
            pending = PREFERRED_START_SCHEMA if PREFERRED_START_SCHEMA in slugs else (slugs[0] if slugs else None)
    if pending:
        load_schema(pending, with_example=True)


# ---------------------------------------------------------------------------------------------------------------
# Rendering helpers


def show_messages(container, errors: list[str], warnings: list[str] = ()) -> None:
    for message in errors:
        container.error(message, icon=":material/error:")
    for message in warnings:
        container.warning(message, icon=":material/warning:")


def render_question(position: int, uid: int, count: int) -> tuple[dict[str, Any], Any]:
    """One question's editor; returns its row and a container for its messages."""
    keys = _row_keys(uid)
    with st.container(border=True, key=K(f"card{uid}")):
        top = st.columns([3, 2, 0.6, 0.6, 0.6], vertical_alignment="bottom", gap="xsmall")
        with top[0]:
            qid = kept_widget(st.text_input, f"Question {position + 1} id", keys["id"], "",
                              help="Letters, digits, _ . - (1–100 characters). Answers are keyed by it.")
        with top[1]:
            qtype = kept_widget(st.selectbox, "Type", keys["type"], "noul", options=QUESTION_TYPES,
                                help="noul: yes/no · choice: one of several options · score: ordered levels")
        top[2].button("", icon=":material/arrow_upward:", key=K(f"q{uid}.up"), on_click=move_question, args=(uid, -1),
                      disabled=position == 0, help="Move up")
        top[3].button("", icon=":material/arrow_downward:", key=K(f"q{uid}.down"), on_click=move_question,
                      args=(uid, 1),
                      disabled=position == count - 1, help="Move down")
        top[4].button("", icon=":material/delete:", key=K(f"q{uid}.remove"), on_click=remove_question, args=(uid,),
                      help="Remove")
        instructions = kept_widget(st.text_area, "Instructions", keys["instructions"], "", height=68,
                                   placeholder="The question the model answers about the state")
        row: dict[str, Any] = {"id": qid, "type": qtype, "instructions": instructions}
        if qtype == "choice":
            text = kept_widget(st.text_area, "Options — one per line: id: description", keys["options"], "",
                               height=120, help="The model reads options sorted by id; answers list them in "
                                                "this order. Add an 'unknown' option for when nothing fits.")
            row["options"] = schemas.text_to_options(text)
        elif qtype == "score":
            text = kept_widget(st.text_area, "Levels — one per line, lowest first", keys["levels"], "", height=120,
                               help="Level ids are 0, 1, 2, … in this order; the score is Σ level × probability.")
            row["levels"] = schemas.text_to_levels(text)
        else:
            sides = st.columns(2)
            with sides[0]:
                row["true"] = kept_widget(st.text_input, "“true” means (optional)", keys["true"], "",
                                          placeholder=answers.NOUL_DEFAULT_DESCRIPTIONS["true"])
            with sides[1]:
                row["false"] = kept_widget(st.text_input, "“false” means (optional)", keys["false"], "",
                                           placeholder=answers.NOUL_DEFAULT_DESCRIPTIONS["false"])
        messages = st.container()
    return row, messages


def render_answer_card(qid: str, question: dict[str, Any], answer: dict[str, Any]) -> None:
    table = answers.option_table(question, answer)
    summary = answers.summarize(qid, question, answer)
    with st.container(border=True, key=K(f"answer.{qid}")):
        st.markdown(f"**{qid}** · {answer['type']}")
        instructions = question.get("instructions")
        if instructions:
            st.caption(instructions if isinstance(instructions, str) else json.dumps(instructions))
        metrics = st.columns(4 if summary.score is not None else 3)
        answer_text = f"level {summary.top_option}" if summary.type == "score" else summary.top_option
        metrics[0].metric("Answer", answer_text,
                          help=f"P(true) = {answer['noul']:.4f}" if summary.type == "noul" else None)
        metrics[1].metric("Confidence", f"{summary.confidence:.1%}",
                          help="choice/score: P(chosen option) / max p, as the response reports it; "
                               "noul: max(p, 1 − p)")
        metrics[2].metric("Margin", f"{summary.margin:.1%}", help="top1 − top2 probability")
        if summary.score is not None:
            metrics[3].metric("Score", f"{summary.score:.2f}",
                              help=f"Σ level × probability over levels 0–{len(table) - 1}")
        st.altair_chart(answers.probability_chart(table), width="stretch",
                        height=answers.probability_chart_height(len(table)))
        if answer["type"] == "score":
            legend = " · ".join(f"**{level}** {desc}" for level, desc in answer.get("legend", {}).items())
            st.caption(f"Legend: {legend}")


# ---------------------------------------------------------------------------------------------------------------
# The page

_init_page()
st.title("Decide")
engine = get_engine()
library = get_library()

left, right = st.columns([1, 1], gap="large")

# --- State -------------------------------------------------------------------------------------------------------
with left:
    st.subheader("State")
    examples = st.session_state.get(K("examples")) or []
    if examples:
        example_cols = st.columns([4, 1], vertical_alignment="bottom")
        picked = example_cols[0].selectbox("Example states of the loaded schema", range(len(examples)),
                                           format_func=lambda i: examples[i].get("name") or f"Example {i + 1}",
                                           key=K("example_pick"))
        example_cols[1].button("Use", key=K("use_example"), on_click=use_example, args=(picked,))
    mode = kept_widget(st.radio, "Read the state as", K("state_mode"), "auto", options=["auto", "text", "json"],
                       horizontal=True, format_func={"auto": "auto (JSON if it starts with { or [)",
                                                     "text": "plain text", "json": "JSON"}.get)
    state_text = kept_widget(st.text_area, "State", K("state_text"), "", height=300,
                             placeholder='{"subject": "Refund", "body": "…"}  or plain text',
                             label_visibility="collapsed")
    state_messages = st.container()

    st.subheader("Media")
    st.caption(state_input.media_limits_text())
    image_files = st.file_uploader("Images", type=list(state_input.IMAGE_EXTENSIONS), accept_multiple_files=True,
                                   key=K("images"))
    video_files = st.file_uploader("Videos", type=list(state_input.VIDEO_EXTENSIONS), accept_multiple_files=True,
                                   key=K("videos"))
    media_messages = st.container()

images: list[state_input.Media] = []
videos: list[state_input.Media] = []
media_errors: list[str] = []
for uploaded in image_files or []:
    try:
        images.append(state_input.check_image(uploaded.name, uploaded.getvalue()))
    except state_input.MediaError as exc:
        media_errors.append(str(exc))
for uploaded in video_files or []:
    try:
        videos.append(state_input.check_video(uploaded.name, uploaded.getvalue()))
    except state_input.MediaError as exc:
        media_errors.append(str(exc))
try:
    state_input.check_media_counts(images, videos)
except state_input.MediaError as exc:
    media_errors.append(str(exc))

with left:
    if images:
        columns = st.columns(min(4, len(images)))
        for i, image in enumerate(images):
            columns[i % len(columns)].image(image.data, caption=f"{image.name} · {image.width}×{image.height} · "
                                                                f"{image.size_bytes / 1024:.0f} KB")
    for video in videos:
        st.video(video.data, format=video.content_type)
        if engine is not None:
            try:
                sampled = sampled_frames(video, engine.model_id, engine)
            except (ClefError, ValueError) as exc:
                media_errors.append(f"{video.name}: {exc}")
            else:
                st.caption(f"{video.name}: the model reads these {len(sampled.frames)} of {sampled.total_frames} "
                           f"frames ({sampled.fps:.1f} fps source).")
                shown = list(range(len(sampled.frames)))[:16]
                columns = st.columns(8)
                for n, i in enumerate(shown):
                    seconds = sampled.frame_indices[i] / sampled.fps if sampled.fps else 0
                    columns[n % 8].image(sampled.frames[i], caption=f"#{sampled.frame_indices[i]} · {seconds:.1f}s")
                if len(sampled.frames) > len(shown):
                    st.caption(f"… and {len(sampled.frames) - len(shown)} more frames.")

# --- Schema builder ----------------------------------------------------------------------------------------------
with right:
    st.subheader("Schema")
    entries = [e for e in library.list() if e.problem is None]
    lib_cols = st.columns([4, 1], vertical_alignment="bottom")
    slugs = [e.slug for e in entries]
    names = {e.slug: f"{e.name} (v{e.version}, {e.question_count} questions)" for e in entries}
    loaded_slug = st.session_state.get(K("loaded_slug"))
    pick = lib_cols[0].selectbox("Library", slugs, index=slugs.index(loaded_slug) if loaded_slug in slugs else None,
                                 format_func=names.get, key=K("library_pick"), placeholder="No schemas in the library"
                                 if not slugs else "Choose a schema")
    lib_cols[1].button("Load", key=K("load"), disabled=pick is None, on_click=load_schema, args=(pick,),
                       kwargs={"with_example": True})
    if st.session_state.get(K("library_error")):
        st.error(st.session_state[K("library_error")])

    uids = list(st.session_state[K("uids")])
    rows: list[dict[str, Any]] = []
    question_messages: list[Any] = []
    for position, uid in enumerate(uids):
        row, messages = render_question(position, uid, len(uids))
        rows.append(row)
        question_messages.append(messages)
    if not uids:
        st.info("No questions yet: add one below or load a schema from the library.")
    add_cols = st.columns([1, 1], vertical_alignment="bottom")
    new_type = add_cols[0].selectbox("New question type", QUESTION_TYPES, key=K("new_type"))
    add_cols[1].button("Add question", key=K("add"), on_click=add_question, args=(new_type,), icon=":material/add:")
    schema_messages = st.container()

    with st.expander("Save to the library"):
        schema_name = kept_widget(st.text_input, "Name", K("schema_name"), "")
        schema_description = kept_widget(st.text_area, "Description", K("schema_description"), "", height=68)
        save_cols = st.columns(2)
        save_new = save_cols[0].button("Save as new schema", key=K("save_new"))
        save_update = save_cols[1].button(f"Update “{loaded_slug}”" if loaded_slug else "Update",
                                          key=K("save_update"), disabled=not loaded_slug)
        save_messages = st.container()

# --- Validate everything, then put each message next to its field ----------------------------------------------
questions, builder_problems = schemas.rows_to_questions(rows)
lint = schemas.lint_questions(questions)


def _row_index_of(problem: schemas.SchemaProblem) -> list[int]:
    if len(problem.loc) < 2 or problem.loc[0] != "questions":
        return []
    target = problem.loc[1]
    if isinstance(target, int):
        return [target]
    return [i for i, row in enumerate(rows) if str(row["id"]).strip() == target]


schema_level_errors: list[str] = []
for problem in builder_problems + lint:
    indices = _row_index_of(problem)
    for i in indices:
        show_messages(question_messages[i], [problem.msg] if problem.severity == "error" else [],
                      [problem.msg] if problem.severity == "warning" else [])
    if not indices and problem.severity == "error":
        schema_level_errors.append(problem.msg)
show_messages(schema_messages, schema_level_errors)

state_value: Any = None
state_errors: list[str] = []
try:
    parsed = state_input.parse_state(state_text or "", mode)
    state_value = parsed.value
    kind = ("JSON " + type(parsed.value).__name__.replace("dict", "object").replace("list", "array")
            if parsed.kind == "json" else "plain text")
    size = f"{len(parsed.value)} keys" if isinstance(parsed.value, dict) else f"{len(state_text):,} characters"
    state_messages.caption(f"Read as {kind} · {size}")
    show_messages(state_messages, [], list(parsed.warnings))
except state_input.StateInputError as exc:
    state_errors.append(str(exc))
    show_messages(state_messages, state_errors)
show_messages(media_messages, media_errors)

builder_ok = not any(p.severity == "error" for p in builder_problems)
ready = builder_ok and not state_errors and not media_errors
request: dict[str, Any] | None = None
if ready:
    model_source = model_manager().state().source
    request = state_input.build_request(state_value, questions, images=images, videos=videos,
                                        model=request_model_name(model_source))


def _fingerprint(req: dict[str, Any] | None) -> str:
    return hashlib.sha256(json.dumps(req, sort_keys=True, default=str).encode()).hexdigest() if req else ""


fingerprint = _fingerprint(request)

# Errors the engine reported for this exact request (validation at the last Run) go next to their fields.
engine_problems: dict[str, list[str]] = {}
last_error = st.session_state.get(K("last_error"))
if last_error and last_error["fingerprint"] == fingerprint:
    engine_problems = last_error["by_field"]

# --- Save to library (needs the validated questions) -------------------------------------------------------------
if save_new or save_update:
    if not builder_ok:
        save_messages.error("Fix the errors in the questions first; nothing was saved.")
    else:
        schema = schemas.Schema(name=schema_name.strip() or "Untitled schema", questions=questions,
                                description=schema_description, examples=st.session_state.get(K("examples")) or [])
        try:
            if save_update and loaded_slug:
                saved = library.update(loaded_slug, schema)
                save_messages.success(f"Updated {loaded_slug}.json (version {saved.version}).")
            else:
                slug = library.create(schema)
                st.session_state[K("loaded_slug")] = slug
                save_messages.success(f"Saved as {slug}.json in {library.directory}.")
        except schemas.SchemaError as exc:
            save_messages.error(str(exc))

# --- Token budget and Run ----------------------------------------------------------------------------------------
st.divider()
st.subheader("Token budget")
budget_cols = st.columns([1, 2])
# A fixed list rather than a free number field: budgets are powers of two in practice, and a list cannot be
# left empty or mistyped to a value that refuses every request.
max_length = int(kept_widget(budget_cols[0].selectbox, "max_length (tokens)", K("max_length"), DEFAULT_MAX_LENGTH,
                             options=MAX_LENGTH_CHOICES, format_func="{:,}".format))
overflow = kept_widget(budget_cols[1].radio, "If the state does not fit", K("overflow"), "refuse",
                       options=["refuse", "truncate_state"], horizontal=True,
                       format_func={"refuse": "refuse (show an error)",
                                    "truncate_state": "truncate the end of the state"}.get)
budget_messages = st.container()
status: answers.BudgetStatus | None = None
if engine is None:
    budget_messages.info("No model is loaded, so tokens cannot be counted and nothing can run.")
elif request is None:
    budget_messages.info("Fix the errors above to see the token budget.")
else:
    cache = st.session_state.get(K("budget_cache"))
    try:
        if cache and cache[0] == (fingerprint, max_length, id(engine)):
            counts = cache[1]
        else:
            counts = engine.count_tokens(request, max_length=max_length)
            st.session_state[K("budget_cache")] = ((fingerprint, max_length, id(engine)), counts)
    except RequestError as exc:
        by_field = answers.problems_by_field(exc.problems)
        engine_problems = {k: engine_problems.get(k, []) + v for k, v in by_field.items()}
        budget_messages.error("The engine refused this request; see the messages next to the fields above.")
    else:
        status = answers.budget_status(counts)
        budget_messages.altair_chart(answers.budget_chart(counts), width="stretch", height=answers.BUDGET_CHART_HEIGHT)
        parts = " · ".join(f"{part} {counts.get(part, 0):,}" for part in answers.BUDGET_PARTS)
        budget_messages.caption(f"{parts} = {counts['total']:,} tokens; max_length {max_length:,}")
        if status.fixed_tokens_over:
            budget_messages.error(status.message)
        elif status.state_tokens_over:
            budget_messages.warning(status.message)
        else:
            budget_messages.success(status.message)

# Engine problems (from count_tokens or the last run) next to their fields.
for field, messages in engine_problems.items():
    if field == "state":
        show_messages(state_messages, messages)
    elif field in ("images", "videos"):
        show_messages(media_messages, messages)
    elif field.startswith("question:"):
        qid = field.split(":", 1)[1]
        targets = [i for i, row in enumerate(rows) if str(row["id"]).strip() == qid]
        for i in targets:
            show_messages(question_messages[i], messages)
        if not targets:
            show_messages(schema_messages, messages)
    elif field == "schema":
        show_messages(schema_messages, messages)
    else:
        show_messages(budget_messages, messages)
if last_error and last_error["fingerprint"] == fingerprint and last_error.get("budget"):
    budget_messages.error(last_error["budget"])

can_run = (engine is not None and request is not None and not engine_problems
           and not (status is not None and status.fixed_tokens_over))
run_cols = st.columns([1, 4], vertical_alignment="center")
run_clicked = run_cols[0].button("Run", type="primary", key=K("run"), disabled=not can_run,
                                 icon=":material/play_arrow:")
wait_line = run_cols[1].empty()
if run_clicked and request is not None and engine is not None:
    try:
        response = run_queued(engine, [request], max_length=max_length, overflow=overflow,
                              on_wait=lambda text: wait_line.info(text, icon=":material/hourglass_top:"))[0]
    except RequestError as exc:
        st.session_state[K("last_error")] = {"fingerprint": fingerprint,
                                             "by_field": answers.problems_by_field(exc.problems)}
        st.rerun()
    except TokenBudgetError as exc:
        st.session_state[K("last_error")] = {"fingerprint": fingerprint, "by_field": {}, "budget": str(exc)}
        st.rerun()
    except BusyError as exc:
        wait_line.error(f"The GPU queue is full: {exc}")
    except Exception as exc:  # noqa: BLE001 — a failed forward pass must not take the page down
        wait_line.error(f"The run failed: {type(exc).__name__}: {exc}")
    else:
        wait_line.empty()
        st.session_state.pop(K("last_error"), None)
        st.session_state[K("result")] = {
            "request": request,
            "response": response,
            "questions": questions,
            "state": state_value,
            "images": [(m.name, m.content_type, m.data, m.size_bytes) for m in images],
            "videos": [(m.name, m.content_type, m.data, m.size_bytes) for m in videos],
            "schema_name": schema_name or st.session_state.get(K("loaded_slug")) or "",
            "model_label": request_model_name(model_manager().state().source),
            "device": engine.info().get("device", ""),
        }

# --- Results -----------------------------------------------------------------------------------------------------
result = st.session_state.get(K("result"))
if result:
    st.divider()
    response = result["response"]
    st.subheader("Answers")
    if result["request"] != request:
        st.caption("These answers are for the request as it was when you pressed Run; the editors have changed "
                   "since.")
    counts = response.get("x_token_counts", {})
    top = st.columns(4)
    top[0].metric("Latency", f"{response.get('x_latency_ms', 0):.0f} ms", help="submit → response, queue included")
    top[1].metric("Input tokens", f"{response['usage']['input_tokens']:,}")
    top[2].metric("Truncated state tokens", f"{response.get('x_truncated_state_tokens', 0):,}")
    top[3].metric("Model", result["model_label"], help=f"on {result['device']}")
    st.caption("Tokens: " + " · ".join(f"{part} {counts.get(part, 0):,}" for part in answers.BUDGET_PARTS))
    if response.get("x_truncated_state_tokens"):
        st.warning(f"The last {response['x_truncated_state_tokens']:,} tokens of the state were cut to fit "
                   "max_length: the model did not read them.")
    items = list(response["answers"].items())
    for start in range(0, len(items), 2):
        cols = st.columns(2)
        for col, (qid, answer) in zip(cols, items[start:start + 2], strict=False):
            with col:
                render_answer_card(qid, result["questions"].get(qid, {}), answer)

    media_shown = [state_input.Media("image", n, t, d, 0, 0) for n, t, d, _ in result["images"]]
    videos_shown = [state_input.Media("video", n, t, d, 0, 0) for n, t, d, _ in result["videos"]]
    tabs = st.tabs(["Response JSON", "Request JSON"])
    with tabs[0]:
        st.code(format_json(response), language="json")
    with tabs[1]:
        if media_shown or videos_shown:
            st.caption("Media data URLs are shortened here; the download holds the exact request.")
        st.code(format_json(state_input.redact_media(result["request"], media_shown, videos_shown)), language="json")
        st.download_button("Download the exact request", format_json(result["request"]), file_name="request.json",
                           mime="application/json", key=K("download_request"))

    with st.expander("Save as case", icon=":material/bookmark_add:"):
        store = get_store()
        existing = [s["name"] for s in store.list_case_sets()]
        default_set = f"{result['schema_name'] or 'Decide'} cases"
        options = existing + ["New case set…"]
        choice = st.selectbox("Case set", options,
                              index=existing.index(default_set) if default_set in existing else len(existing),
                              key=K("case_set_pick"))
        set_name = (st.text_input("New case set name", value=default_set, key=K("case_set_new"))
                    if choice == "New case set…" else choice)
        labels = answers.expected_labels(result["questions"], response)
        st.dataframe([{"question": q, "answer as expected label": json.dumps(v)} for q, v in labels.items()],
                     hide_index=True)
        confirm = st.checkbox("I checked these answers: save them as the expected labels", key=K("confirm_labels"))
        tags = st.text_input("Tags (comma separated)", key=K("case_tags"))
        if st.button("Save as case", key=K("save_case"), icon=":material/save:"):
            try:
                case_set_id = store.get_or_create_case_set(set_name, schema_name=result["schema_name"] or None)
                case_id = store.add_case(
                    case_set_id, state=result["state"],
                    images=[d for _, _, d, _ in result["images"]] or None,
                    videos=[d for _, _, d, _ in result["videos"]] or None,
                    expected=labels if confirm else None,
                    tags=[t.strip() for t in tags.split(",") if t.strip()] or None,
                )
            except (StoreError, ValueError) as exc:
                st.error(f"Not saved: {exc}")
            else:
                with_labels = "with expected labels" if confirm else "without expected labels"
                st.success(f"Saved case #{case_id} to “{set_name}” ({with_labels}).")
