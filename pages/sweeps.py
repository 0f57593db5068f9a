"""Sweeps: versions of a schema scored on a labelled case set at once; leaderboard, flips, adopt."""

from __future__ import annotations

import streamlit as st

from clef_workbench import sweeps
from workbench_ui import run_charts, shell
from workbench_ui import sweeps_view as sv
from workbench_ui.cases_view import case_set_label
from workbench_ui.compare_view import missing_for_start, proposed_schema

shell.render_shell(__file__)
K = shell.page_key("sweeps")
store, library, runner = shell.get_store(), shell.get_library(), shell.get_sweep_runner()


def flash(kind: str, message: str, undo: sv.Adopted | None = None) -> None:
    st.session_state[K("flash")] = (kind, message, None if undo is None else (undo,))


def written(slug: str) -> list:
    return st.session_state.setdefault(K(f"written.{slug}"), [])


def add_alternative(slug: str, question_id: str, question: dict) -> None:
    editor = K(f"alt.{slug}.{question_id}")
    alternative, problems = sv.written_alternative(question_id, question, st.session_state.get(f"{editor}.text", ""),
                                                   st.session_state.get(f"{editor}.options", ""))
    if alternative is None:
        st.session_state[K("alt_problems")] = problems
        return
    st.session_state.pop(K("alt_problems"), None)
    written(slug).append([question_id, alternative])


def render_alternatives(slug: str, schema: dict) -> None:
    questions = schema["questions"]
    question_id = st.selectbox("Question", list(questions), key=K(f"alt_question.{slug}"))
    editor = K(f"alt.{slug}.{question_id}")
    filled = sv.alternative_editor(questions[question_id])
    st.text_area("Instructions", filled.instructions, key=f"{editor}.text", height=68)
    st.text_area("Options", filled.options, key=f"{editor}.options", help=filled.options_help, height=120)
    st.button("Add this alternative", key=K("alt_add"), icon=":material/add:", on_click=add_alternative,
              args=(slug, question_id, questions[question_id]))
    for message in st.session_state.get(K("alt_problems"), []):
        st.error(message)
    for index, (qid, question) in enumerate(written(slug)):
        cols = st.columns([6, 1], vertical_alignment="center")
        cols[0].markdown(f"`{qid}`: {question['instructions'] or '(no instructions)'}")
        if cols[1].button("Remove", key=K(f"alt_remove.{slug}.{index}")):
            written(slug).pop(index)
            st.rerun()


def start(set_id: int, slug: str, variants: list, folds: int) -> None:
    default = next(iter(shell.model_manager().loaded()), None)
    if default is None:
        flash("error", "No model is loaded, so the sweep cannot start. Choose a model in the sidebar.")
        return
    sweep_id, message = sv.start_sweep(store, runner, default.engine, default.name, set_id, slug, variants,
                                       folds=folds)
    flash("success" if sweep_id else "error", message)
    if sweep_id is not None:
        shell.set_widget(K("selected"), sweep_id)
        st.query_params["sweep"] = str(sweep_id)


def render_start() -> None:
    sets, slugs = store.list_case_sets(), library.slugs()
    if missing := missing_for_start(sets, slugs, shell.model_manager().state().engine, needs="A sweep needs",
                                    case_set="a labelled case set"):
        st.info(missing)
        return
    set_labels = {s["id"]: case_set_label(s) for s in sets}
    set_id = shell.kept_widget(st.selectbox, "Labelled case set", K("start.set"), sets[0]["id"],
                               options=list(set_labels), format_func=set_labels.get)
    slug = shell.kept_widget(st.selectbox, "Schema", K(f"start.schema.{set_id}"),
                             proposed_schema(next(s for s in sets if s["id"] == set_id), slugs), options=slugs)
    schema, problem = sv.library_schema(library, slug)
    if schema is None:
        st.error(problem)
        return
    st.markdown("**Automatic variants** — one per question where the change applies")
    cols = st.columns(3)
    kinds = [kind for index, (kind, label) in enumerate(sv.AUTO_KIND_LABELS.items())
             if shell.kept_widget(cols[index % 3].checkbox, label, K(f"start.kind.{kind}"), False)]
    with st.expander(f"Alternatives you write ({len(written(slug))})", icon=":material/edit:"):
        render_alternatives(slug, schema)
    folds = shell.kept_widget(st.number_input, "Folds (the best wording is chosen on the others, scored on each)",
                              K("start.folds"), sweeps.DEFAULT_FOLDS, min_value=2, max_value=20)
    variants, line = sv.planned_variants(schema, kinds, written(slug))
    st.caption(line)
    st.button("Start the sweep", key=K("start.go"), type="primary", icon=":material/play_arrow:",
              disabled=not sv.can_start(variants), on_click=start, args=(set_id, slug, variants, int(folds)))


def follow(sweep_id: int) -> None:
    """The sweep's progress; the whole page again when a sweep this process ran ends (its final leaderboard)."""
    sweep = sv.sweep_row(store, sweep_id)
    shown = sv.progress_shown(runner, sweep)
    st.progress(shown.fraction, text=shown.text)
    if shown.live:
        st.button("Cancel", key=K(f"cancel.{sweep_id}"), icon=":material/stop:", on_click=runner.cancel,
                  args=(sweep_id,))
    elif shown.problem:
        st.warning(shown.problem)
        if sweep["done"] < sweep["total"]:
            st.button(f"Resume ({sweep['total'] - sweep['done']} cases left)", key=K(f"resume.{sweep_id}"),
                      icon=":material/play_arrow:",
                      on_click=lambda: flash(*sv.resume_sweep(runner, shell.model_manager(), sweep)))
    if shell.ended_since_last_poll(K(f"was_live.{sweep_id}"), shown.live):
        st.rerun(scope="app")


def render_leaderboard(result) -> str | None:
    """The chart and the table of every variant; returns the variant whose row is selected."""
    st.subheader("Leaderboard")
    st.caption(sv.leaderboard_caption(result))
    chart = sv.chart_frame(result)
    if chart.empty:
        st.info("No labelled answers yet: the leaderboard appears with the first finished cases.")
        return None
    st.altair_chart(run_charts.leaderboard_chart(chart), width="content")
    table = sv.leaderboard_table(result)
    st.caption("Select a variant's row to list the cases it flips against the base.")
    event = st.dataframe(table, hide_index=True, width="stretch", key=K(f"board.{result.id}.{result.done}"),
                         on_select="rerun", selection_mode="single-row")
    for flagged, line in sv.order_sensitivity_lines(result):
        (st.warning if flagged else st.caption)(line)
    if best := sv.best_text(result):
        st.markdown(best)
    return str(table.iloc[event.selection.rows[0]]["variant"]) if event.selection.rows else None


def render_flips(result, variant: str) -> None:
    flips = sv.flipped_cases(store, result, variant)
    st.subheader(f"Cases “{variant}” flips")
    if flips.empty:
        st.info(f"“{variant}” answers every case as the base does.")
        return
    st.caption(f"{len(flips)} answer(s) differ from the base. Select a row to open its case in Decide with the "
               "variant's questions (“Open” does the same in a new tab), or in Review with the variant's answer.")
    event = st.dataframe(flips, hide_index=True, width="stretch", key=K(f"flips.{result.id}.{variant}"),
                         on_select="rerun", selection_mode="single-row",
                         column_config={"state": st.column_config.TextColumn(width="large"),
                                        "decide": st.column_config.LinkColumn("Decide", display_text="Open")})
    if event.selection.rows:
        row = flips.iloc[event.selection.rows[0]]
        st.link_button(f"Open case {row['case']} in Decide", row["decide"], icon=":material/psychology:")
        if st.button(f"Open case {row['case']} in Review", key=K("review"), icon=":material/rate_review:"):
            st.switch_page("pages/review.py", query_params=sv.review_params(store, result, variant, int(row["case"]),
                                                                            str(row["question"])))


def render_adopt(result) -> None:
    st.subheader("Adopt")
    choices = sv.adoption_choices(result)
    if not choices:
        st.info("Nothing to adopt yet.")
        return
    choice = st.selectbox("Version to adopt", list(choices), format_func=choices.get, key=K(f"adopt.{result.id}"))
    if st.session_state.get(K("confirm_adopt")) != (result.id, choice):
        if st.button("Adopt…", key=K("adopt"), icon=":material/check:"):
            st.session_state[K("confirm_adopt")] = (result.id, choice)
            st.rerun()
    elif shell.confirm(sv.adopt_question(library, result, choice), K, K("confirm_adopt"), yes_label="Yes, adopt it",
                       icon=":material/help:"):
        adopted, message = sv.adopt(library, result, choice)
        flash("success" if adopted else "error", message, adopted)
        st.rerun()


st.title("Schema sweeps")
st.caption("Many versions of a schema scored on a labelled case set at once: each case's state is read once and "
           "every version continues from it.")
all_sweeps = sweeps.list_sweeps(store)
with st.expander("Start a sweep", expanded=not all_sweeps, icon=":material/play_arrow:"):
    render_start()
shell.show_message(K("flash"), lambda adopted: flash("info", sv.undo_adoption(library, adopted)))
if not all_sweeps:
    st.stop()
sweep_id = shell.pick_id([s["id"] for s in all_sweeps], K("selected"), "Sweep",
                         {s["id"]: sv.sweep_label(s) for s in all_sweeps}.get, param="sweep", what="sweep")
if sweep_id is None:  # the link names a sweep that is not here: said above
    st.stop()
st.fragment(follow, run_every=1.0 if runner.is_running(sweep_id) else None)(sweep_id)
threshold = shell.kept_widget(st.slider, "Flag a question whose answers change with the options' order for more than",
                              K("threshold"), 0.1, min_value=0.0, max_value=1.0, step=0.05, format="%.2f")
result = sv.scored_sweep(store, sweep_id, threshold)
if picked := render_leaderboard(result):
    render_flips(result, picked)
render_adopt(result)
