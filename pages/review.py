"""Review: a run's queue from per-schema rules, worked through worst first; blind mode; audit log; golden set."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from clef_workbench import review
from workbench_ui import links, shell, units
from workbench_ui import review_view as view
from workbench_ui import why_view as why
from workbench_ui.answers import probability_chart
from workbench_ui.decide_model import FRAME_THUMBNAIL_PX, frame_thumbnail

shell.render_shell(__file__)
K = shell.page_key("review")

st.title("Review")
store = shell.get_store()
all_runs = store.list_runs()
runs = view.reviewable_runs(all_runs)
if not runs:
    st.info(view.nothing_to_review(all_runs))
    st.stop()

# the name lives in the URL too, so a reload keeps it
reviewer = shell.kept_widget(st.text_input, "Your name (recorded with every action)", K("reviewer"),
                             default=st.query_params.get("reviewer", ""), placeholder="e.g. ana.lopez").strip()
if reviewer:
    st.query_params["reviewer"] = reviewer
else:
    st.query_params.pop("reviewer", None)
run_id = shell.pick_run(runs, K("run"), view.run_label)
if run_id is None:  # the link names a run that is not here (or has no results): said above
    st.stop()
run = store.get_run(run_id)
shell.random_weights_notice(run["model_id"])
questions = run["schema"]["questions"]


def linked_item() -> dict | None:
    """The item a link names, on the first visit of this run; a link to an answer the run lacks says so."""
    seen_key = K(f"link_seen.{run_id}")
    if st.session_state.get(seen_key):
        return None
    if st.query_params.get("case") is None:  # from here on the URL names the item on screen, not a link
        st.session_state[seen_key] = True
        return None
    case_id, question_id = shell.url_int("case"), st.query_params.get("question")
    item = None if case_id is None else review.item_for_link(store, run_id, case_id, question_id)
    if item is None:
        shell.show_not_found(links.missing_review_item(run_id, st.query_params.get("case"), question_id,
                                                       store.list_review_items(run_id)))
        if st.button("Go to the review queue", key=K("not_found_queue"), icon=":material/arrow_forward:"):
            st.session_state[seen_key] = True
            st.query_params.pop("case", None)
            st.query_params.pop("question", None)
            st.rerun()
        st.stop()
    st.session_state[seen_key] = True
    return item


linked = linked_item()

progress = store.review_progress(run_id)
with st.expander(f"Queue rules for schema “{run['schema_name']}”", expanded=progress["total"] == 0,
                 icon=":material/rule:"):
    saved = review.load_rules(store, run["schema_name"])
    cols = st.columns(2)
    use_margin = cols[0].checkbox("Margin (top-1 − top-2) below", value=saved.margin_below is not None,
                                  key=K(f"rules.use_margin.{run_id}"))
    margin = cols[0].slider("margin threshold", 0.0, 1.0, view.margin_default(saved), 0.01,
                            key=K(f"rules.margin.{run_id}"), disabled=not use_margin, label_visibility="collapsed")
    use_confidence = cols[1].checkbox("Confidence (top-1 probability) below",
                                      value=saved.confidence_below is not None, key=K(f"rules.use_conf.{run_id}"))
    confidence = cols[1].slider("confidence threshold", 0.0, 1.0, view.confidence_default(saved), 0.01,
                                key=K(f"rules.conf.{run_id}"), disabled=not use_confidence,
                                label_visibility="collapsed")
    cols = st.columns(2)
    unknown = cols[0].checkbox("An unknown-type option was chosen", value=saved.unknown_option,
                               key=K(f"rules.unknown.{run_id}"),
                               help=view.unknown_options_help(questions))
    disagree = cols[1].checkbox("Disagrees with the expected answer", value=saved.disagree_with_expected,
                                key=K(f"rules.disagree.{run_id}"))
    picked_questions = st.multiselect("Questions", list(questions), default=saved.questions or list(questions),
                                      key=K(f"rules.questions.{run_id}"))
    read_from = shell.pick_calibration(
        "Confidence and margin read from", K(f"rules.calibration.{run_id}"), run["schema_name"],
        saved=saved.calibration, always=True, verdicts=True,
        help="A calibration fitted on a run's labelled cases (Runs → Fit a calibration): the thresholds then apply "
             "to calibrated confidence, how often such answers were right")
    rules = view.rules_from_form(questions, use_confidence=use_confidence, confidence=confidence,
                                 use_margin=use_margin, margin=margin, unknown=unknown, disagree=disagree,
                                 picked_questions=picked_questions, calibration=read_from)
    preview = review.preview(store, run_id, rules)
    st.markdown(view.preview_summary(preview))
    if breakdown := view.preview_breakdown(preview):
        st.caption(breakdown)
    if st.button(f"Add {preview['new']} item(s) to the queue", key=K(f"apply.{run_id}"), type="primary",
                 disabled=preview["new"] == 0):
        review.save_rules(store, run["schema_name"], rules)
        added = review.apply_rules(store, run_id, rules)
        st.success(f"Queued {added} item(s); their reasons are frozen as of now.")
        st.rerun()

if progress["total"] == 0:
    st.info("The queue of this run is empty. Set the rules above and add items.")
    st.stop()
st.progress(view.progress_fraction(progress), text=view.progress_text(progress))

current_key = K(f"current.{run_id}")
notice_key = K("notice")


def current_item() -> dict | None:
    if linked is not None:
        st.session_state[current_key] = linked["id"]
        return linked  # shown whatever its status: the sender wants the receiver to see this one
    item_id = st.session_state.get(current_key)
    if item_id is not None:
        item = store.get_review_item(item_id)
        if item["status"] in view.OPEN or st.session_state.get(K("showing_link")) == item_id:
            return item
    item = review.next_item(store, run_id)
    st.session_state[current_key] = None if item is None else item["id"]
    return item


confirm_key = K("confirm_gold")


def act(item: dict, action: str, label=None, *, confirmed: bool = False) -> None:
    """Apply an action as of the version shown and advance; an answer against the gold label waits for confirmation."""
    if not reviewer:
        st.session_state[notice_key] = ("error", view.NAME_FIRST)
        return
    action, label = view.resolved_action(item, action, label, blind=blind)
    expected = store.get_case(item["case_id"], with_media=False)["expected"].get(item["question_id"])
    gold = review.gold_conflict(item, expected, action, label)
    if gold is not None and not confirmed:
        st.session_state[confirm_key] = (item["id"], action, label, gold)
        return
    st.session_state.pop(confirm_key, None)
    st.session_state[notice_key] = view.apply_action(store, item, action, label, reviewer=reviewer, blind=blind,
                                                     comment=st.session_state.get(K(f"comment.{item['id']}")))
    if st.session_state[notice_key][0] == "success":
        # stay on the record until its questions are done: the reviewer has just read it
        following = review.next_item(store, run_id, after_item_id=item["id"], case_id=item["case_id"])
        st.session_state[current_key] = None if following is None else following["id"]


@st.dialog("This answer overrides the gold label", on_dismiss=lambda: st.session_state.pop(confirm_key, None))
def confirm_gold(item: dict, action: str, label, gold: str) -> None:
    """A modal before an answer against the gold label (in front of the reviewer, however they acted)."""
    asked = view.gold_question(item, action, label, gold)
    st.warning(asked.warning, icon=":material/warning:")
    cols = st.columns(2)
    if cols[0].button(asked.yes, key="review-confirm-yes"):
        act(item, action, label, confirmed=True)
        st.rerun()
    if cols[1].button(asked.keep, key="review-confirm-no", type="primary",
                      help="Records the gold label as this item's answer"):
        act(item, asked.keep_action, asked.keep_label, confirmed=True)
        st.rerun()


def undo() -> None:
    if not reviewer:
        st.session_state[notice_key] = ("error", view.NAME_FIRST_FOR_UNDO)
        return
    item, refused = units.refusal(store.undo_last_action, reviewer, run_id=run_id)
    if refused:
        st.session_state[notice_key] = ("warning", refused)
    else:
        st.session_state[current_key] = item["id"]
        st.session_state[notice_key] = ("info", view.undone_message(item))


blind = st.toggle("Blind review: hide the model's answer until I decide", key=K("blind"),
                  help="The distribution, the model's answer and the reason it was queued stay hidden; choose the "
                       "right answer yourself. Choosing the model's answer records an accept.")

shell.show_message(notice_key)
if not reviewer:
    st.warning("Enter your name above to review.")

item = current_item()
if item is not None:  # the address bar links to the item on screen
    st.query_params["case"], st.query_params["question"] = str(item["case_id"]), item["question_id"]
    if reviewed_note := view.reviewed_note(item):
        st.session_state[K("showing_link")] = item["id"]
        st.info(reviewed_note)


def show_item(item: dict) -> None:
    """The item on screen: evidence, distribution (hidden when blind), actions and the record's other questions."""
    question = questions.get(item["question_id"], {"type": item["question_type"]})
    case = store.get_case(item["case_id"])
    shown = view.card(item, question, case["expected"].get(item["question_id"]), blind=blind)
    with st.container(key="review-card", border=True):
        header = st.columns([3, 2])
        header[0].markdown(shown.title)
        if case["source_id"]:
            header[0].caption(f"Source id: {case['source_id']}")
        header[0].markdown(shown.question)
        header[1].markdown(shown.queued)
        if shown.show_model:  # Decide can run the case again, which would show the model's answer
            header[1].link_button("Open this case in Decide", links.decide_url(run_id, item["case_id"]),
                                  icon=":material/psychology:")
        body = st.columns([1, 1])
        with body[0]:
            show_evidence(item, case, shown)
        with body[1]:
            show_distribution(item, question, shown)
        pending = st.session_state.get(confirm_key)
        if pending and pending[0] == item["id"]:
            confirm_gold(item, *pending[1:])
        show_actions(item, shown)
        show_record(item)


def show_evidence(item: dict, case: dict, shown: view.Card) -> None:
    st.markdown("**State**")
    if isinstance(case["state"], str):
        st.text(case["state"])
    else:
        st.json(case["state"], expanded=True)
    for index, image in enumerate(case["images"]):
        st.image(image["data"], caption=f"image {index + 1}", width=360)
    for index, video in enumerate(case["videos"]):
        st.markdown(f"**Video {index + 1}**")
        st.video(video["data"], format=video["content_type"])
        try:
            engine = shell.model_manager().state().engine
            sampled = engine.sample_video_frames(video["data"]) if engine is not None else None
            if sampled is not None:  # the frames the model actually saw
                frames = list(sampled.frames[:: max(1, len(sampled.frames) // 8)])
                st.image([frame_thumbnail(f) for f in frames], width=FRAME_THUMBNAIL_PX,
                         caption=[f"frame {i}" for i in range(len(frames))])
        except Exception as exc:  # noqa: BLE001 — a preview problem must not block the review
            st.caption(shell.failure_text("Sampled frames unavailable", exc))
    if shown.expected:
        st.markdown(shown.expected)
    # Why shows which way each part pushed the answer, so it would give the answer away in blind mode
    if shown.show_model and st.toggle("Why: highlight what moved this answer", key=K(f"why.{item['id']}"),
                                      help="Each sentence, field, image region and frame is removed in turn and the "
                                           "record decided again, in one batched run"):
        why.render_case_why(K(f"why_result.{run_id}.{item['case_id']}"), shell.model_manager().loaded(), run, case,
                            question_id=item["question_id"])


def show_distribution(item: dict, question: dict, shown: view.Card) -> None:
    if not shown.show_model:
        st.info("The model's answer is hidden: decide from the evidence, then choose below.",
                icon=":material/visibility_off:")
        return
    chosen = shell.pick_calibration("Probabilities", K(f"probabilities.{run_id}"), run["schema_name"],
                                    saved=rules.calibration, help="The model's own probabilities, or a "
                                                                  "calibration's map of them")
    distribution = view.distribution(store, item, question, chosen)
    st.markdown(distribution.heading)
    if distribution.verdict:
        st.caption(distribution.verdict)
    st.altair_chart(probability_chart(distribution.table), width="stretch")
    st.caption(distribution.caption)


def show_actions(item: dict, shown: view.Card) -> None:
    st.text_input("Comment (optional, saved with your action)", key=K(f"comment.{item['id']}"),
                  placeholder="e.g. the second sentence is sarcasm")
    buttons = st.container(horizontal=True)
    # Streamlit's own button shortcuts: they ignore keys typed into inputs, so the name field is safe
    if shown.accept:
        buttons.button(shown.accept, key="review-accept", on_click=act, args=(item, "accept"),
                       type="primary" if shown.accept_primary else "secondary", disabled=not reviewer, shortcut="A")
    buttons.button("Mark unknown", key="review-unknown", on_click=act, args=(item, "unknown"),
                   disabled=not reviewer, shortcut="U")
    buttons.button("Skip", key="review-skip", on_click=act, args=(item, "skip"), disabled=not reviewer, shortcut="S")
    buttons.button("Undo my last action", key="review-undo", on_click=undo, disabled=not reviewer, shortcut="Z")
    st.markdown(shown.answer_heading)
    options = view.option_buttons(item, blind=blind, has_reviewer=bool(reviewer))
    option_cols = st.columns(min(len(options), view.MAX_OPTION_COLUMNS))
    for index, option in enumerate(options):
        option_cols[index % len(option_cols)].button(
            option.text, key=f"review-correct-{index + 1}", on_click=act, args=(item, "correct", option.label),
            disabled=option.disabled, shortcut=option.shortcut)
    st.caption(shown.keys)


def show_record(item: dict) -> None:
    record = review.record_items(store, run_id, item["case_id"])
    with st.container(key="review-record", border=True):
        st.markdown(view.record_heading(record, item["case_id"]))
        for other in record:
            row = st.columns([2, 2, 2, 1], vertical_alignment="center")
            current = other["id"] == item["id"]
            for column, text in zip(row[:3], view.record_row(other, current=current, blind=blind), strict=True):
                column.markdown(text)
            row[3].button("Open", key=f"review-record-open-{other['id']}", disabled=current,
                          on_click=lambda item_id=other["id"]: st.session_state.update(
                              {current_key: item_id, K("showing_link"): item_id}))


if item is None:
    st.success("Nothing left to review in this run's queue.")
    st.button("Undo my last action", key="review-undo", on_click=undo, disabled=not reviewer, shortcut="Z")
else:
    show_item(item)


with st.expander("Audit log", icon=":material/history:"):
    log = store.list_review_actions(run_id=run_id)
    st.dataframe(pd.DataFrame(view.audit_rows(log)), hide_index=True, width="stretch")

with st.expander("Export reviewed labels", icon=":material/download:"):
    labels_csv = view.labels_csv(store.list_review_items(run_id))
    st.download_button("Reviewed labels (CSV)", labels_csv, file_name=f"review-run-{run_id}.csv",
        # the key changes with the data: a download button kept under one key can serve its first file again
        mime="text/csv", key=K(f"labels_csv.{run_id}.{len(log)}"), on_click="ignore")
    golden_name = st.text_input("Golden set name", value=view.golden_name(run),
                                key=K(f"golden_name.{run_id}"))
    if st.button("Export as a new case set", key=K(f"golden.{run_id}"), icon=":material/workspace_premium:"):
        golden_id, refused = units.refusal(review.export_golden_set, store, run_id, golden_name)
        st.session_state[K("golden_result")] = ("error", refused) if refused else ("success", view.golden_message(
            golden_id, golden_name, store.get_case_set(golden_id)["case_count"]))
shell.show_message(K("golden_result"))  # outside the expander, so it stays visible if the expander closes
