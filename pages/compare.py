"""Compare: runs of one case set side by side, and one action that runs a schema with several models."""

from __future__ import annotations

import streamlit as st

from clef_workbench import compare
from clef_workbench.model_loader import DEMO_SOURCE, request_model_name
from clef_workbench.schemas import SchemaError
from workbench_ui import cases_view, shell
from workbench_ui import compare_view as cv
from workbench_ui.answers import probability_chart

shell.render_shell(__file__)
K = shell.page_key("compare")
store = shell.get_store()
library = shell.get_library()
DEMO_MODEL = request_model_name(DEMO_SOURCE)


def start_comparison(set_id: int, slug: str, number: int, names: list[str]) -> None:
    """The one action's callback; the pickers are read at the click (a choice just made is newer than the arguments)."""
    state = st.session_state
    set_id = state.get(K("start.set"), set_id)
    slug = state.get(K(f"start.schema.{set_id}"), slug)
    number, names = state.get(K(f"start.version.{slug}"), number), state.get(K("start.models"), names)
    run_ids, message = cv.start_comparison(store, shell.get_job_runner(), compare.model_choices(shell.model_manager()),
                                           set_id, slug, number, names)
    if not run_ids:
        st.session_state[K("flash")] = ("error", message)
        return
    shell.set_widget(K("set"), set_id)
    # oldest first: the first run is the baseline the others are read against
    picked = sorted({*run_ids, *st.session_state.get(K(f"runs.{set_id}"), [])})
    shell.set_widget(K(f"runs.{set_id}"), picked)
    st.query_params["runs"] = ",".join(map(str, picked))
    st.session_state[K("flash")] = ("success", message)
    st.session_state[K("started")] = run_ids


def open_case(case_id: int | None) -> None:
    if case_id is None:
        st.query_params.pop("case", None)
    else:
        st.query_params["case"] = str(case_id)


def open_selected(table: str, selection: list, case_of) -> None:
    """Open the case of a new selection (a kept selection must not reopen a closed case)."""
    seen = K(f"{table}.seen")
    if selection and selection != st.session_state.get(seen):
        open_case(case_of(selection[0]))
    st.session_state[seen] = selection


st.title("Compare runs")

sets = store.list_case_sets()
all_runs = {r["id"]: r for r in store.list_runs()}
groups = compare.runs_by_case_set(list(all_runs.values()))
with st.expander("Run a schema on a case set with these models", expanded=not groups,
                 icon=":material/play_arrow:"):
    models = compare.model_choices(shell.model_manager())
    if not models and shell.get_engine(show_errors=False) is not None:  # the first model is loading: wait for it
        models = compare.model_choices(shell.model_manager())
    slugs = library.slugs()
    if missing := cv.missing_for_start(sets, slugs, models):
        st.info(missing)
    else:
        set_names = {s["id"]: cases_view.case_set_label(s) for s in sets}
        start_set = shell.kept_widget(st.selectbox, "Case set", K("start.set"), sets[0]["id"], options=list(set_names),
                                      format_func=set_names.get)
        cols = st.columns(2)
        slug = shell.kept_widget(cols[0].selectbox, "Schema", K(f"start.schema.{start_set}"),
                                 cv.proposed_schema(next(s for s in sets if s["id"] == start_set), slugs),
                                 options=slugs)
        try:
            library.load(slug)  # a file changed outside the workbench becomes its newest version here
            numbers = [v["number"] for v in store.list_schema_versions(slug)]
        except SchemaError as exc:
            numbers = []
            st.error(f"{slug}.json does not load: {exc}")
        number = shell.kept_widget(cols[1].selectbox, "Version", K(f"start.version.{slug}"),
                                   numbers[0] if numbers else None, options=numbers,
                                   format_func=lambda n: f"v{n}" + (" (current)" if n == numbers[0] else ""))
        labels = {m.name: m.label for m in models}
        names = shell.kept_widget(st.multiselect, "Models", K("start.models"), [models[0].name], options=list(labels),
                                  format_func=lambda n: labels.get(n, n))
        st.button("Run this schema on this case set with these models", key=K("start.go"), type="primary",
                  icon=":material/play_arrow:", disabled=not numbers or not names, on_click=start_comparison,
                  args=(start_set, slug, number, names))

shell.show_message(K("flash"))


def follow_started(run_ids: list[int]) -> None:
    """The started runs, followed to their end; then the whole page again."""
    runs_now = {r["id"]: r for r in store.list_runs()}
    shown = [runs_now[r] for r in run_ids if r in runs_now]
    for run in shown:
        st.markdown(cv.started_run_line(run))
    if shell.ended_since_last_poll(K("started_running"), any(cv.is_unfinished(run) for run in shown)):
        st.rerun(scope="app")


if started := st.session_state.get(K("started"), []):
    started_running = any(cv.is_unfinished(all_runs[r]) for r in started if r in all_runs)
    st.fragment(follow_started, run_every=2.0 if started_running else None)(started)

linked = compare.parse_run_ids(st.query_params.get("runs"))
linked_missing = cv.missing_runs(linked, all_runs)
if linked_missing and shell.KEEP_PREFIX + K("set") not in st.session_state:
    # a link to runs that are not here: said, with the runs there are; never other runs in their place
    shell.show_not_found(linked_missing)
    st.stop()
if not groups:
    st.info("Comparing needs two runs of one case set: start them above, or on the Runs page.")
    st.stop()

runs_by_id = {r["id"]: r for group in groups.values() for r in group}
if shell.KEEP_PREFIX + K("set") not in st.session_state and linked and linked[0] in runs_by_id:
    st.session_state[K("set")] = runs_by_id[linked[0]]["case_set_id"]  # a link names the runs: open their case set
set_label = {set_id: cv.case_set_label(group) for set_id, group in groups.items()}
set_id = shell.pick_id(list(groups), K("set"), "Case set", set_label.get, param="set", what="case set")
if set_id is None:  # the link names a case set that is not here: said above
    st.stop()
run_label = {r["id"]: cv.run_label(r) for r in groups[set_id]}
default = cv.default_runs(linked, list(run_label))
kept = st.session_state.get(K(f"runs.{set_id}"), st.session_state.get(shell.KEEP_PREFIX + K(f"runs.{set_id}")))
if kept is None or (shell.KEEP_PREFIX + K(f"runs.{set_id}") not in st.session_state and linked):
    kept = default  # a session's first visit opens the runs its link names
st.session_state[K(f"runs.{set_id}")] = [r for r in kept if r in run_label]  # a deleted run drops out
picked = shell.kept_widget(st.multiselect, "Runs to compare", K(f"runs.{set_id}"), default, options=list(run_label),
                           format_func=run_label.get)
st.query_params["runs"] = ",".join(map(str, picked))
if len(picked) < 2:
    st.info("Pick two runs or more.")
    st.stop()

shell.random_weights_notice(DEMO_MODEL if any(runs_by_id[r]["model_id"] == DEMO_MODEL for r in picked) else None)
unfinished = [runs_by_id[r] for r in picked if cv.is_unfinished(runs_by_id[r])]


@st.fragment(run_every=2.0 if unfinished else None)
def progress() -> None:
    now = [store.get_run(r["id"]) for r in unfinished]
    for run in now:
        st.caption(f"Run #{run['id']}: {run['status']}, {run['done']}/{run['total']} cases.")
    if not all(cv.is_unfinished(run) for run in now):
        st.rerun(scope="app")


if unfinished:
    progress()

calibrated = st.toggle("Calibrated probabilities", key=K("calibrated"),
                       help="Each run's probabilities as the newest calibration fitted for its schema and model "
                            "(Runs → Fit a calibration) maps them; agreement, metrics, the matrix and the case all "
                            "read them")
view = compare.build_view(store, picked, disagreements_only=st.session_state.get(K("disagree"), False),
                          calibrated=calibrated)
if calibrated:
    st.info("**Calibrated probabilities** — " + "; ".join(
        f"{label}: “{name}”" if name else f"{label}: raw (no calibration for its schema and model)"
        for label, name in view.calibrations.items()) + ". Turn the switch off for the models' own.",
        icon=":material/tune:")

if view.schema_changes:
    with st.expander(f"The runs' schemas differ ({len(view.schema_changes)} pair(s))", icon=":material/difference:"):
        for run_a, run_b, text in view.schema_changes:
            st.markdown(f"**{run_a}** → **{run_b}**")
            st.code(text, language=None, wrap_lines=True)


st.subheader("Agreement per question")
st.caption("How often two runs give the same answer, over the cases both answered (n), with a 95 % bootstrap "
           "interval over cases. A flip is a case where they differ.")
st.dataframe(view.agreement, hide_index=True, width="stretch",
             column_config={"agreement": st.column_config.NumberColumn(format="percent"),
                            "flipped": st.column_config.TextColumn("flipped cases", width="large")})
if not view.flips.empty:
    st.markdown(f"**Flips** ({len(view.flips)}): select one to open its case.")
    flips_event = st.dataframe(
        view.flips, hide_index=True, width="stretch", key=K("flips"), on_select="rerun",
        selection_mode="single-row",
        column_order=["question_id", "case_id", "expected", "run_a", "predicted_a", "confidence_a", "run_b",
                      "predicted_b", "confidence_b", "change", "open"],
        column_config={"confidence_a": st.column_config.NumberColumn(format="%.3f"),
                       "confidence_b": st.column_config.NumberColumn(format="%.3f"),
                       "open": st.column_config.LinkColumn("link", display_text="Open")})
    open_selected("flips", flips_event.selection.rows, lambda row: int(view.flips.iloc[row]["case_id"]))


st.subheader("Accuracy, calibration and latency")
st.caption("Each cell: value [95 % bootstrap interval] and n, the cases it rests on. Accuracy, ECE and Brier "
           "per question over the cases with an expected answer; latency per run, as each run recorded it "
           "(a remote model's includes the network).")
st.dataframe(view.metrics, hide_index=True, width="stretch")

st.subheader("Cases × runs")
disagree = st.toggle("Only cases where the runs disagree", key=K("disagree"))
st.caption("Click a cell to open its case below; “Open” is a link to it you can send.")
st.caption("Each run's cell: its answer (confidence); green where it matches the expected answer, red where it does "
           "not. Hover a header for the run it shows.")
matrix_name = cv.matrix_key(disagree)
widths = cv.matrix_widths(view.matrix, view.headers)
matrix_event = st.dataframe(view.matrix.style.apply(compare.matrix_styles, axis=None, verdicts=view.verdicts),
                            hide_index=True, width="stretch", key=K(matrix_name), on_select="rerun",
                            selection_mode="single-cell",
                            column_config={"open": st.column_config.LinkColumn("link", display_text="Open"),
                                           "state": st.column_config.TextColumn("state", width="medium"),
                                           **{name: st.column_config.TextColumn(name, help=full, width=widths[name])
                                              for name, full in view.headers.items()}})
open_selected(matrix_name, [list(cell) for cell in matrix_event.selection.cells],
              lambda cell: int(view.matrix.iloc[cell[0]]["case"]))


def show_case(detail: cv.CaseShown) -> None:
    st.subheader(f"Case {detail.case_id}")
    if isinstance(detail.state, str):
        st.code(detail.state, language=None, wrap_lines=True)
    else:
        st.code(shell.format_json(detail.state), language="json", wrap_lines=True)
    if detail.expected:
        st.caption(detail.expected)
    for column, run in zip(st.columns(len(detail.runs)), detail.runs, strict=True):
        with column:
            st.markdown(f"**{run.title}**")
            if run.error:
                st.error(run.error)
            for answer in run.answers:
                st.markdown(answer.text)
                st.altair_chart(probability_chart(answer.chart), width="stretch")
            if run.latency:
                st.caption(run.latency)
    st.button("Close the case", key=K("close_case"), on_click=open_case, args=(None,))


opened = shell.url_int("case")
if opened is not None:
    detail = cv.case_shown(view, opened)
    if detail is None:
        st.warning(cv.no_result_message(opened))
    else:
        show_case(detail)
