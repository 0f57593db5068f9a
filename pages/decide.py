"""Decide: a state, media and a schema; the token budget; Run; the answers; save as case."""

from __future__ import annotations

import json
from typing import Any

import streamlit as st

from clef_engine import DEFAULT_MAX_LENGTH
from clef_engine.errors import BusyError, ClefError, RequestError, TokenBudgetError
from clef_workbench import calibration, schemas
from clef_workbench.model_loader import request_model_name
from workbench_ui import answers, links, schema_rows, shell, state_input, units
from workbench_ui import decide_actions as actions
from workbench_ui import decide_model as vm
from workbench_ui import why_view as why
from workbench_ui.decide_actions import SCHEMA_PARAM, builder

shell.render_shell(__file__)


@st.cache_data(max_entries=8, show_spinner=False)
def sampled_frames(video: state_input.Media, model_id: str, _engine) -> Any:
    """The frames the model reads, decoded once per video and model rather than on every rerun of the page."""
    return _engine.sample_video_frames(video.data)


K = vm.key
QUESTION_TYPES = list(schemas.QUESTION_TYPES)


def render_question(position: int, uid: int, count: int) -> Any:
    """One question's editor (its row is the builder's); returns a container for its messages."""
    keys = vm.row_keys(uid)
    with st.container(border=True, key=K(f"card{uid}")):
        top = st.columns([3, 2, 0.6, 0.6, 0.6], vertical_alignment="bottom", gap="xsmall")
        shell.kept_widget(top[0].text_input, f"Question {position + 1} id", keys["id"], "",
                          help="Letters, digits, _ . - (1–100 characters). Answers are keyed by it.")
        qtype = shell.kept_widget(top[1].selectbox, "Type", keys["type"], "noul", options=QUESTION_TYPES,
                                  help="noul: yes/no · choice: one of several options · score: ordered levels")
        top[2].button("", icon=":material/arrow_upward:", key=K(f"q{uid}.up"), on_click=builder().move,
                      args=(uid, -1), disabled=position == 0, help="Move up")
        top[3].button("", icon=":material/arrow_downward:", key=K(f"q{uid}.down"), on_click=builder().move,
                      args=(uid, 1), disabled=position == count - 1, help="Move down")
        top[4].button("", icon=":material/delete:", key=K(f"q{uid}.remove"), on_click=builder().remove, args=(uid,),
                      help="Remove")
        shell.kept_widget(st.text_area, "Instructions", keys["instructions"], "", height=68,
                          placeholder="The question the model answers about the state")
        if qtype == "choice":
            shell.kept_widget(st.text_area, "Options — one per line: id: description", keys["options"], "",
                              height=120, help="The model reads options sorted by id; answers list them in this "
                                               "order. Add an 'unknown' option for when nothing fits.")
        elif qtype == "score":
            shell.kept_widget(st.text_area, "Levels — one per line, lowest first", keys["levels"], "", height=120,
                              help="Level ids are 0, 1, 2, … in this order; the score is Σ level × probability.")
        else:
            for side, column in zip(("true", "false"), st.columns(2), strict=True):
                shell.kept_widget(column.text_input, f"“{side}” means (optional)", keys[side], "",
                                  placeholder=answers.NOUL_DEFAULT_DESCRIPTIONS[side])
        return st.container()


def render_undo_notice(message: str, name: str, undo, icon: str) -> None:
    cols = st.columns([4, 1], vertical_alignment="center")
    cols[0].info(message, icon=icon)
    cols[1].button("Undo", key=K(name), icon=":material/undo:", on_click=undo)


def render_removed_notice() -> None:
    render_undo_notice(f"Removed question “{builder().last_removed}”.", "undo_remove", builder().undo_remove,
                       ":material/delete:")


def render_replaced_notice(place: str) -> None:
    if message := builder().replaced(place):
        render_undo_notice(message, f"undo_replace.{place}", builder().undo_replace, ":material/swap_horiz:")


def render_answer_card(qid: str, question: dict[str, Any], answer: dict[str, Any], model: str, *,
                       calibrated: str | None = None) -> None:
    table = answers.option_table(question, answer)
    summary = answers.summarize(qid, question, answer)
    with st.container(border=True, key=K(f"answer.{qid}")):
        st.markdown(f"**{qid}** · {answer['type']} · answered by {model}" + (" · **calibrated**" if calibrated else ""))
        if calibrated:
            st.caption(calibrated)
        if instructions := question.get("instructions"):
            st.caption(instructions if isinstance(instructions, str) else json.dumps(instructions))
        # the answer on a row of its own: option ids are long, and a metric cuts what does not fit its column
        st.metric("Answer", vm.answer_text(summary, answer),
                  help=f"P(true) = {answer['noul']:.4f}" if summary.type == "noul" else None)
        metrics = st.columns(3 if summary.score is not None else 2)
        metrics[0].metric("Confidence", answers.percent(summary.confidence),
                          help="choice/score: P(chosen option) / max p, as the response reports it; "
                               "noul: max(p, 1 − p)")
        metrics[1].metric("Margin", answers.percent(summary.margin), help="top1 − top2 probability")
        if summary.score is not None:
            metrics[2].metric(f"Score (0 to {len(table) - 1})", f"{summary.score:.2f}",
                              help=f"Σ level × probability over levels 0–{len(table) - 1}")
        st.altair_chart(answers.probability_chart(table), width="stretch")
        if answer["type"] == "score":
            legend = " · ".join(f"**{level}** {desc}" for level, desc in answer.get("legend", {}).items())
            st.caption(f"Legend: {legend}")


actions.init_page()
# saved first too: a reload while the page still draws would lose the edit
actions.save_draft()
st.title("Decide")
shell.show_message(K("link_note"), icon=":material/link:")
engine = shell.get_engine()
library = shell.get_library()
messages = vm.Messages()
if (asked := st.query_params.get(SCHEMA_PARAM)) and not builder().loaded_slug and asked not in library.slugs():
    st.error(links.missing_schema(asked, library.slugs(), "the Library picker"), icon=":material/link_off:")

left, right = st.columns([1, 1], gap="large")
with right:
    run_box, answers_box, budget_box = st.container(), st.container(), st.container()
loaded_models = {model.name: model for model in shell.model_manager().loaded()}
model_name, model_note = vm.model_for_run(st.session_state, list(loaded_models), shell.model_manager().default_name())
model_name = model_name or request_model_name(shell.model_manager().state().source)
if engine is not None and len(loaded_models) > 1:
    model_name = shell.pick_model(run_box.selectbox, K("model"), loaded_models,
                                  "Which loaded model answers this page's runs (add models in the sidebar).")
if model_note:
    run_box.info(model_note, icon=":material/swap_horiz:")
if model_name in loaded_models:
    engine = loaded_models[model_name].engine
local_engine = engine is not None and not engine.info().get("remote")  # a remote endpoint counts on its side

with left:
    st.subheader("State")
    if examples := builder().examples:
        example_cols = st.columns([4, 1], vertical_alignment="bottom")
        picked = example_cols[0].selectbox("Example states of the loaded schema", range(len(examples)),
                                           format_func=lambda i: examples[i].get("name") or f"Example {i + 1}",
                                           key=K("example_pick"))
        example_cols[1].button("Use this example", key=K("use_example"), on_click=builder().use_example,
                               args=(picked,), help="Puts the example into the state editor (Undo brings back "
                                                    "what it replaces)")
        render_replaced_notice("state")
    mode = shell.kept_widget(st.radio, "Read the state as", K("state_mode"), "auto", options=["auto", "text", "json"],
                             horizontal=True, format_func={"auto": "auto (JSON if it starts with { or [)",
                                                           "text": "plain text", "json": "JSON"}.get)
    state_text = shell.kept_widget(st.text_area, "State", K("state_text"), "", height=300,
                                   placeholder='{"subject": "Refund", "body": "…"}  or plain text',
                                   label_visibility="collapsed")
    state_messages = st.container()

    st.subheader("Media")
    st.caption(state_input.media_limits_text())
    # images up to the videos' limit: one over its own is refused below in words, not by the browser's red icon
    image_files = st.file_uploader("Images", type=list(state_input.IMAGE_EXTENSIONS), accept_multiple_files=True,
                                   key=K("images"), max_upload_size=state_input.MAX_VIDEO_BYTES // state_input.MB)
    video_files = st.file_uploader("Videos", type=list(state_input.VIDEO_EXTENSIONS), accept_multiple_files=True,
                                   key=K("videos"), max_upload_size=state_input.MAX_VIDEO_BYTES // state_input.MB)
    media_messages = st.container()

images: list[state_input.Media] = []
videos: list[state_input.Media] = []
for files, check, accepted in ((image_files, state_input.check_image, images),
                               (video_files, state_input.check_video, videos)):
    for uploaded in files or []:
        try:
            accepted.append(check(uploaded.name, uploaded.getvalue()))
        except state_input.MediaError as exc:
            messages.add("media", str(exc))
restored = vm.restored_media(st.session_state)  # the uploads of this draft before a reload
images = vm.with_restored([m for m in restored if m.kind == "image"], images)
videos = vm.with_restored([m for m in restored if m.kind == "video"], videos)
vm.set_media(st.session_state, images + videos)
if restored:
    with media_messages.container(border=True):
        st.caption("Kept from this draft (the uploaders above start empty after a reload):")
        for index, medium in enumerate(restored):
            cols = st.columns([4, 1], vertical_alignment="center")
            cols[0].markdown(f"{medium.kind} **{medium.name}** · {medium.size_bytes / 1024:,.0f} KB")
            cols[1].button("Remove", key=K(f"restored_remove.{index}"), icon=":material/close:",
                           on_click=vm.remove_restored_media, args=(st.session_state, index))
try:
    state_input.check_media_counts(images, videos)
except state_input.MediaError as exc:
    messages.add("media", str(exc))

with left:
    if images:
        columns = st.columns(min(4, len(images)))
        for i, image in enumerate(images):
            columns[i % len(columns)].image(image.data, width=vm.image_preview_width(image.width),
                                            caption=f"{image.name} · {image.width}×{image.height} · "
                                                    f"{image.size_bytes / 1024:.0f} KB")
    for video in videos:
        st.video(video.data, format=video.content_type)
        if local_engine:
            try:
                sampled = sampled_frames(video, engine.model_id, engine)
            except (ClefError, ValueError) as exc:
                messages.add("media", f"{video.name}: {exc}")
            else:
                st.caption(f"{video.name}: the model reads these {len(sampled.frames)} of {sampled.total_frames} "
                           f"frames ({sampled.fps:.1f} fps source).")
                columns = st.columns(4)
                for n, (frame, index) in enumerate(zip(sampled.frames[:16], sampled.frame_indices, strict=False)):
                    columns[n % 4].image(vm.frame_thumbnail(frame), width="stretch",
                                         caption=f"#{index} · {index / sampled.fps if sampled.fps else 0:.1f}s")
                if len(sampled.frames) > 16:
                    st.caption(f"… and {len(sampled.frames) - 16} more frames.")

with left:
    st.subheader("Schema")
    if builder().unsaved_changes():
        target = f"“{builder().loaded_slug}”" if builder().loaded_slug else "the library"
        st.markdown(f":orange-badge[:material/edit: Unsaved changes] The questions differ from {target}: "
                    "save them under “Save to the library” below, or they stay only in this draft.")
    entries = [e for e in library.list() if e.problem is None]
    slugs = [e.slug for e in entries]
    names = {e.slug: f"{e.name} (v{e.version}, {e.question_count} questions)" for e in entries}
    loaded_slug = builder().loaded_slug if builder().loaded_slug in slugs else None
    if st.session_state.get(K("library_pick")) not in slugs:
        st.session_state[K("library_pick")] = None
    pick = st.selectbox("Library", slugs, format_func=names.get, key=K("library_pick"),
                        placeholder="No schemas in the library" if not slugs else "Choose a schema")
    # buttons in a row that wraps, each at its label's width: in narrow columns they were cut to "New…"
    lib_buttons = st.container(horizontal=True)
    lib_buttons.button("Load", key=K("load"), disabled=pick is None, on_click=actions.ask_load, args=(pick,),
                       help="Puts the schema's questions on screen; the state you typed stays.")
    lib_buttons.button("New schema", key=K("new_schema"), on_click=actions.new_schema,
                       icon=":material/note_add:", help="Start an empty schema; the state stays.")
    if confirm_slug := st.session_state.get(K("confirm_load")):
        with st.container(border=True, key=K("confirm_load_box")):
            st.warning(f"Loading “{names.get(confirm_slug, confirm_slug)}” replaces the questions on screen, which "
                       "have unsaved changes.", icon=":material/warning:")
            confirm_buttons = st.container(horizontal=True)
            confirm_buttons.button("Discard my changes and load", key=K("confirm_load_yes"),
                                   on_click=actions.load_schema, args=(confirm_slug,))
            confirm_buttons.button("Keep my changes", key=K("confirm_load_no"),
                                   on_click=lambda: st.session_state.pop(K("confirm_load"), None))
    render_replaced_notice("schema")
    if st.session_state.get(K("library_error")):
        st.error(st.session_state[K("library_error")])

    uids = list(builder().uids)
    question_messages: list[Any] = []
    removed = st.session_state.get(K("removed"))
    for position, uid in enumerate(uids):
        if removed and removed["position"] == position:
            render_removed_notice()
        question_messages.append(render_question(position, uid, len(uids)))
    rows = builder().rows()  # as the editors above hold them
    if removed and removed["position"] >= len(uids):
        render_removed_notice()
    if not uids:
        st.info("No questions yet: add one below or load a schema from the library.")
    add_cols = st.columns([1, 1], vertical_alignment="bottom")
    new_type = add_cols[0].selectbox("New question type", QUESTION_TYPES, key=K("new_type"))
    add_cols[1].button("Add question", key=K("add"), on_click=lambda t: builder().add_question(t), args=(new_type,),
                       icon=":material/add:")
    schema_messages = st.container()

    # open while it has news: a change above it redrew it closed, its message hidden inside
    with st.expander("Save to the library", expanded=K("save_flash") in st.session_state, key=K("save_box")):
        schema_name = shell.kept_widget(st.text_input, "Name", K("schema_name"), "")
        schema_description = shell.kept_widget(st.text_area, "Description", K("schema_description"), "", height=68)
        save_buttons = st.container(horizontal=True)
        save_buttons.button("Save as new schema", key=K("save_new"), on_click=actions.save_schema, args=(False,))
        save_buttons.button(f"Update “{loaded_slug}”" if loaded_slug else "Update", key=K("save_update"),
                            disabled=not loaded_slug, on_click=actions.save_schema, args=(True,),
                            help=f"Write these questions to {loaded_slug}.json as a new version" if loaded_slug
                            else "Load a schema from the library to update it")
        shell.show_message(K("save_flash"))

questions, builder_problems = schema_rows.rows_to_questions(rows)
vm.route_schema_problems(builder_problems + schemas.lint_questions(questions), rows, messages)

state_value: Any = None
try:
    parsed = state_input.parse_state(state_text or "", mode)
    state_value = parsed.value
    kind = ("JSON " + type(parsed.value).__name__.replace("dict", "object").replace("list", "array")
            if parsed.kind == "json" else "plain text")
    size = f"{len(parsed.value)} keys" if isinstance(parsed.value, dict) else f"{len(state_text):,} characters"
    state_messages.caption(f"Read as {kind} · {size}")
    for warning in parsed.warnings:
        messages.add("state", warning, warning=True)
except state_input.StateInputError as exc:
    messages.add("state", str(exc))

builder_ok = not any(p.severity == "error" for p in builder_problems)
ready = builder_ok and not messages.errors.get("state") and not messages.errors.get("media")
request: dict[str, Any] | None = None
if ready:
    request = state_input.build_request(state_value, questions, images=images, videos=videos, model=model_name)
fingerprint = vm.fingerprint(request)

budget_box.subheader("Token budget")
budget_cols = budget_box.columns([1, 2])
max_length = int(shell.kept_widget(budget_cols[0].selectbox, "max_length (tokens)", K("max_length"), DEFAULT_MAX_LENGTH,
                                   options=links.DECIDE_MAX_LENGTHS, format_func="{:,}".format))
overflow = shell.kept_widget(budget_cols[1].radio, "If the state does not fit", K("overflow"), "refuse",
                             options=["refuse", "truncate_state"], horizontal=True,
                             format_func={"refuse": "refuse (show an error)",
                                          "truncate_state": "truncate the end of the state"}.get)
budget_messages = budget_box.container()
# the last Run's errors go when the request or the budget settings change
run_key = (fingerprint, max_length, overflow)
last_error = st.session_state.get(K("last_error"))
if last_error and last_error["key"] != run_key:
    st.session_state.pop(K("last_error"), None)
    last_error = None
engine_refused = bool(last_error and last_error["problems"])
if last_error:
    vm.route_engine_problems(last_error["problems"], rows, messages)
status: answers.BudgetStatus | None = None
if engine is None:
    budget_messages.info("No model is loaded, so tokens cannot be counted and nothing can run.")
elif request is None:
    budget_messages.info("Fix the errors above to see the token budget.")
elif not local_engine:
    budget_messages.info(f"{model_name} is a remote endpoint: it counts tokens on its side (its answer reports "
                         "them); the budget settings travel with the request.")
else:
    try:
        counts = st.session_state.setdefault(K("budget_cache"), vm.BudgetCache()).counts(engine, request, max_length)
    except RequestError as exc:
        engine_refused = True
        vm.route_engine_problems(exc.problems, rows, messages)
        budget_messages.error("The engine refused this request; see the messages next to the fields above.")
    else:
        status = answers.budget_status(counts, overflow)
        budget_messages.altair_chart(answers.budget_chart(counts), width="stretch", height=answers.BUDGET_CHART_HEIGHT)
        parts = " · ".join(f"{part} {counts.get(part, 0):,}" for part in answers.BUDGET_PARTS)
        budget_messages.caption(f"{parts} = {counts['total']:,} tokens; max_length {max_length:,}")
        if status.fixed_tokens_over:
            budget_messages.error(status.message)
        elif status.state_tokens_over:
            budget_messages.warning(status.message)
        else:
            budget_messages.success(status.message)

for place, box in [("state", state_messages), ("media", media_messages), ("schema", schema_messages),
                   *enumerate(question_messages), ("budget", budget_messages)]:
    for message in messages.errors.get(place, []):
        box.error(message, icon=":material/error:")
    for message in messages.warnings.get(place, []):
        box.warning(message, icon=":material/warning:")
if last_error and last_error.get("budget"):
    budget_messages.error(last_error["budget"])

can_run = (engine is not None and request is not None and not engine_refused
           and not (status is not None and status.fixed_tokens_over))
# on a row of its own: in a column it was cut to "R.." at 1280×720
run_clicked = run_box.button("Run", type="primary", key=K("run"), disabled=not can_run,
                             icon=":material/play_arrow:", shortcut="Ctrl+Enter",
                             help="Runs the state and schema on screen (Ctrl+Enter).")
wait_line = run_box.empty()
random_weights_line = run_box.empty()  # filled once this run's result is known: one notice, not two
if shell.was_stopped(K("running")) and not run_clicked:
    wait_line.info("The last Run stopped when the page changed before its answers came (a field or the model "
                   "picker changed); press Run again.", icon=":material/info:")
if run_clicked and request is not None and engine is not None:
    try:
        response = shell.run_queued(engine, [request], max_length=max_length, overflow=overflow,
                                    on_wait=lambda text: wait_line.info(text, icon=":material/hourglass_top:"),
                                    stopped_key=K("running"))[0]
    except RequestError as exc:
        st.session_state[K("last_error")] = {"key": run_key, "problems": exc.problems}
        st.rerun()
    except TokenBudgetError as exc:
        st.session_state[K("last_error")] = {"key": run_key, "problems": [], "budget": vm.in_control_words(str(exc))}
        st.rerun()
    except BusyError as exc:
        wait_line.error(f"The GPU queue is full: {exc}")
    except Exception as exc:  # noqa: BLE001 — a failed forward pass must not take the page down
        wait_line.error(shell.failure_text("The run failed", exc))
    else:
        wait_line.empty()
        st.session_state.pop(K("last_error"), None)
        vm.keep_result(st.session_state, vm.DecideResult(
            request=request, response=response, questions=questions, state=state_value,
            images=tuple(images), videos=tuple(videos), schema_name=schema_name.strip() or (loaded_slug or ""),
            model_label=model_name, device=engine.info().get("device", ""), schema_slug=loaded_slug,
            random_weights=shell.model_manager().random_weights(model_name), max_length=max_length, overflow=overflow,
        ))

result: vm.DecideResult | None = st.session_state.get(K("result"))
if not (result and result.model_label == model_name):  # else the answers below say it
    with random_weights_line:
        shell.random_weights_notice(model_name)
if result:
    with answers_box:
        response = result.response
        st.subheader("Answers")
        if result.random_weights:
            st.warning(shell.random_weights_text(result.model_label), icon=":material/casino:")
        if causes := result.stale_causes(questions=questions, state=state_value, images=images, videos=videos,
                                         model=model_name, budget=status):
            st.warning(vm.stale_message(causes), icon=":material/history:")
        counts = response.get("x_token_counts", {})
        top = st.columns(2) + st.columns(2)  # two rows: the model name does not fit a quarter of half a page
        top[0].metric("Latency", units.duration(response.get("x_latency_ms", 0)),
                      help="submit → response, queue included")
        input_tokens = response.get("usage", {}).get("input_tokens")  # a stored answer from elsewhere may lack it
        top[1].metric("Input tokens", "–" if input_tokens is None else f"{input_tokens:,}")
        top[2].metric("Truncated state tokens", f"{response.get('x_truncated_state_tokens', 0):,}")
        top[3].metric("Model", result.model_label, help=f"on {result.device}")
        st.caption("Tokens: " + " · ".join(f"{part} {counts.get(part, 0):,}" for part in answers.BUDGET_PARTS))
        if response.get("x_truncated_state_tokens"):
            st.warning(f"The last {response['x_truncated_state_tokens']:,} tokens of the state were cut to fit "
                       "max_length: the model did not read them.")
        shown, calibration_note = response["answers"], None
        if chosen := shell.pick_calibration(
                "Probabilities", K("calibration"), result.schema_name, verdicts=True,
                help="A calibration fitted on a run's labelled cases (Runs → Calibrate) maps each question's "
                     "probabilities to how often such answers were right"):
            every_question = st.checkbox("Apply it also where it did not help", key=K("calibration_all"),
                                         help="Questions marked “not applied” above stay raw unless this is on")
            stored, shown = calibration.calibrated_response(shell.get_store(), chosen, response,
                                                            every_question=every_question)
            calibration_note = (f"Calibrated with “{chosen}” (fitted on {stored['model_id']}'s answers in run "
                                f"{stored['run_id']}); choose raw above to see the model's own probabilities.")
            if stored["model_id"] != result.model_label:
                calibration_note += f" This answer is from {result.model_label}, not {stored['model_id']}."
        for qid, answer in shown.items():  # one card per row: half a page is one card wide
            render_answer_card(qid, result.questions.get(qid, {}), answer, result.model_label,
                               calibrated=calibration_note if answer is not response["answers"][qid] else None)
        # Why explains the answers shown: with the model that gave them while it is loaded, and their budget
        explainer = loaded_models.get(result.model_label)
        why_engine, why_note = (explainer.engine, None) if explainer else (engine, why.explained_by_note(
            model_name, result.model_label, model_name, "the answers above"))
        if why_engine is not None and st.toggle("Why", key=K("why"), help="Which sentences, fields, image regions "
                                                "and frames moved each answer: each is removed in turn and the "
                                                "record decided again, in one batched run"):
            why_cols = st.columns(2)
            unit = why_cols[0].selectbox("Explain by", why.units_for(result.request), key=K("why_unit"),
                                         format_func=why.UNIT_LABELS.get,
                                         help="Which parts are removed in turn — everything: the state's "
                                              "sentences or fields, image regions and video frames. More parts "
                                              "cost more tokens.")
            why.render_explained(K("why_result"), why_engine, result.request, unit=unit,
                                 max_length=result.max_length or max_length, overflow=result.overflow or overflow,
                                 picker=why_cols[1], note=why_note)

        tabs = st.tabs(["Response JSON", "Request JSON"])
        with tabs[0]:
            st.code(shell.format_json(response), language="json")
        with tabs[1]:
            if result.images or result.videos:
                st.caption("Media data URLs are shortened here; the download holds the exact request.")
            st.code(shell.format_json(result.redacted_request()), language="json")
            st.download_button("Download the exact request", shell.format_json(result.request),
                               file_name="request.json", mime="application/json", key=K("download_request"))

        with st.expander("Save as case", icon=":material/bookmark_add:"):
            st.caption(f"The expected labels proposed below are {result.model_label}'s answers above.")
            store = shell.get_store()
            existing = [s["name"] for s in store.list_case_sets()]
            default_set = result.default_case_set()
            options = existing + ["New case set…"]
            choice = st.selectbox("Case set", options,
                                  index=existing.index(default_set) if default_set in existing else len(existing),
                                  key=K("case_set_pick"))
            set_name = (st.text_input("New case set name", value=default_set, key=K("case_set_new"))
                        if choice == "New case set…" else choice)
            labels = result.expected_labels()
            st.dataframe([{"question": q, "answer as expected label": json.dumps(v)} for q, v in labels.items()],
                         hide_index=True)
            confirm = st.checkbox("I checked these answers: save them as the expected labels",
                                  key=K("confirm_labels"))
            tags = st.text_input("Tags (comma separated)", key=K("case_tags"))
            if st.button("Save as case", key=K("save_case"), icon=":material/save:"):
                case_id, refused = units.refusal(vm.save_as_case, store, result, set_name, with_labels=confirm,
                                                 tags_text=tags)
                if refused:
                    st.error(f"Not saved: {refused}")
                else:
                    with_labels = "with expected labels" if confirm else "without expected labels"
                    st.success(f"Saved case #{case_id} to “{set_name}” ({with_labels}).")

if builder().loaded_slug:
    st.query_params[SCHEMA_PARAM] = builder().loaded_slug
elif st.query_params.get(SCHEMA_PARAM) in shell.get_library().slugs():  # unloaded since; a missing one's link stays
    del st.query_params[SCHEMA_PARAM]

actions.save_draft()  # and again for what this run changed itself
