"""Runs: start, follow, resume and retry batch runs; their results, statistics, export and comparison."""

from __future__ import annotations

import streamlit as st

from clef_engine import DEFAULT_MAX_LENGTH
from clef_workbench import calibration
from clef_workbench.compare import compare_link
from clef_workbench.jobs import EngineUnreachableError, JobAlreadyRunningError, check_engine, fmt_seconds
from clef_workbench.run_status import run_outcome, status_label
from clef_workbench.schemas import SchemaError
from workbench_ui import run_charts, run_view, shell, units
from workbench_ui import why_view as why
from workbench_ui.answers import option_table, probability_chart
from workbench_ui.cases_view import when

shell.render_shell(__file__)
K = shell.page_key("runs")
STATS_REFRESH_S = 5.0

st.title("Runs")
store = shell.get_store()
runner = shell.get_job_runner()
library = shell.get_library()
sets = store.list_case_sets()
runs = store.list_runs()


OVERFLOW_CHOICES = {"refuse": "refuse (the case gets an error result)",
                    "truncate_state": "truncate the end of the state (counted in the results)"}


def budget_inputs(columns, name: str, settings: run_view.RunSettings, *, retry: bool = False) -> tuple[int, str]:
    """max_length and overflow, for a new run ("start") or the retry of a run's failed cases (its settings)."""
    when = " in the retry" if retry else ""
    max_length = shell.kept_widget(columns[0].number_input, f"max_length (tokens){when}", K(f"{name}.max_length"),
                                   settings.max_length or DEFAULT_MAX_LENGTH, min_value=256,
                                   max_value=262_144, step=1024)
    overflow = shell.kept_widget(columns[1].radio, f"If a state does not fit{when}", K(f"{name}.overflow"),
                                 settings.overflow, options=list(OVERFLOW_CHOICES),
                                 format_func=OVERFLOW_CHOICES.get)
    return int(max_length), overflow


def undo_delete_run(deleted_id: int) -> None:
    _, refused = units.refusal(store.restore_run, deleted_id)
    if not refused:
        shell.set_widget(K("selected"), deleted_id)
    st.session_state[K("flash")] = ("error", f"Not restored: {refused}", None) if refused else (
        "success", f"Restored run #{deleted_id}.", None)


def render_delete(run: dict) -> None:
    """Delete this run: asks first, then offers Undo (the run is only hidden, and the change log says who)."""
    confirm_key = K(f"confirm_delete.{run['id']}")
    if not st.session_state.get(confirm_key):
        if st.button("Delete this run…", key=K(f"delete.{run['id']}"), icon=":material/delete:",
                     disabled=runner.is_running(run["id"])):
            refusal = store.delete_run_refusal(run["id"])
            if refusal:  # refused anyway: say why at once rather than ask first
                st.error(refusal)
                return
            st.session_state[confirm_key] = True
            st.rerun()
        return
    if shell.confirm(f"Delete run #{run['id']} and its {run['done']} result(s)? You can undo this.", K, confirm_key):
        _, refused = units.refusal(store.delete_run, run["id"])
        if refused:
            st.error(refused)
            return
        st.session_state[K("flash")] = ("success", f"Deleted run #{run['id']}.", (run["id"],))
        st.rerun()


def rerun_when_loaded() -> None:
    if not shell.model_manager().state().busy:
        st.rerun(scope="app")


models_busy = shell.model_manager().state().busy
if models_busy:
    st.fragment(rerun_when_loaded, run_every=1.0)()

# open when there is no run yet, or when the Case sets page's "Run this case set" sent the person here
with st.expander("Start a run", expanded=not runs or st.session_state.pop(shell.RUNS_START_OPEN, False),
                 icon=":material/play_arrow:"):
    if not sets:
        st.info("No case sets yet: create or import one on the Case sets page.")
    else:
        set_labels = {s["id"]: f"{s['name']} ({s['case_count']} cases)" for s in sets}
        shell.forget_widget(shell.RUNS_START_SET, unless_in=set_labels)
        start_set = shell.kept_widget(st.selectbox, "Case set", shell.RUNS_START_SET, sets[0]["id"],
                                      options=list(set_labels), format_func=lambda i: set_labels[i])
        slugs = library.slugs()
        default_slug = next((s["schema_name"] for s in sets if s["id"] == start_set), None)
        schema_slug = shell.kept_widget(st.selectbox, "Schema", K(f"start.schema.{start_set}"),
                                        default_slug if default_slug in slugs else slugs[0],
                                        options=slugs) if slugs else None
        cols = st.columns(3)
        chunk_size = shell.kept_widget(cols[0].number_input, "Records per batch", K("start.chunk"), 8, min_value=1,
                                       max_value=256, help="Sent to the engine together at bulk priority (interactive "
                                                     "requests from the Decide page go first).")
        max_length, overflow = budget_inputs(cols[1:], "start", run_view.RunSettings())
        loaded_models = {model.name: model for model in shell.model_manager().loaded()}  # the default first
        run_model = next(iter(loaded_models), None)
        if len(loaded_models) > 1:
            shell.forget_widget(K("start.model"), unless_in=loaded_models)
            run_model = shell.pick_model(st.selectbox, K("start.model"), loaded_models,
                                         "Which loaded model runs the case set (add models in the sidebar).",
                                         default=run_model)
        engine = loaded_models[run_model].engine if run_model else None
        over_budget = None
        if schema_slug is not None and engine is not None:
            try:
                over_budget = run_view.schema_over_budget(engine, library.load(schema_slug).questions,
                                                          int(max_length))
            except SchemaError:
                pass  # said when Start is pressed
        if over_budget:
            st.error(over_budget, icon=":material/data_usage:")
        start_label, loading = run_view.model_button("Start run", models_busy)
        if st.button(start_label, key=K("start.go"), type="primary", icon=":material/play_arrow:",
                     disabled=loading or schema_slug is None or over_budget is not None):
            try:
                schema = library.load(schema_slug).to_dict()
            except SchemaError as exc:
                st.error(f"Schema {schema_slug!r} does not load: {exc}")
                st.stop()
            if engine is None:
                st.error("No model is loaded, so the run cannot start. Choose a model in the sidebar.")
                st.stop()
            try:
                check_engine(engine)  # a remote endpoint that stopped: said now, not as one error per case later
            except EngineUnreachableError as exc:
                st.error(str(exc), icon=":material/cloud_off:")
                st.stop()
            run_id = run_view.create_run(store, start_set, schema, schema_slug, run_model, engine.info(),
                                         chunk_size=int(chunk_size), max_length=int(max_length), overflow=overflow)
            runner.start(run_id, engine, check=False)  # checked above, before the run was recorded
            shell.set_widget(K("selected"), run_id)
            st.rerun()

shell.show_message(K("flash"), undo_delete_run)

if sweeps_listed := run_view.sweep_rows(store.list_sweeps()):
    with st.expander(f"Schema sweeps ({len(sweeps_listed)})", icon=":material/leaderboard:"):
        st.dataframe(sweeps_listed, hide_index=True, width="stretch",
                     column_config={"open": st.column_config.LinkColumn("link", display_text="Open in Sweeps")})

if not runs:
    st.info("No runs yet.")
    st.stop()


run_id = shell.pick_run(runs, K("selected"), run_view.run_label)
if run_id is None:  # the link names a run that is not here: said above, nothing else shown in its place
    st.stop()
selected_run = next(r for r in runs if r["id"] == run_id)
st.session_state[K(f"drawn_status.{run_id}")] = status_label(selected_run)  # what the selector says
shell.random_weights_notice(selected_run["model_id"])
with st.expander("All runs", icon=":material/list:"):
    st.dataframe([{"run": r["id"], "status": status_label(r), "case set": r["case_set_name"],
                   "schema": f"{r['schema_name']} v{r['schema_version']}", "model": r["model_id"],
                   "revision": r["model_revision"], "done": r["done"], "total": r["total"], "errors": r["errors"],
                   "created": when(r["created_at"])} for r in runs],
                 hide_index=True, width="stretch")


def render_progress(run_id: int) -> None:
    progress = runner.progress(run_id)
    # The run ended since the last poll, or the selector or sidebar show another status: the whole page again, so
    # that "Finished" is drawn with the final results and their export (not beside an export of an older refresh).
    if shell.ended_since_last_poll(K(f"was_live.{run_id}"), progress["live"]) or run_view.surfaces_stale(
            st.session_state.get(K(f"drawn_status.{run_id}")), st.session_state.get(shell.RUNNING_SHOWN_KEY),
            store.get_run(run_id), shell.running_run_ids()):
        st.rerun(scope="app")
    outcome = run_outcome(store.get_run(run_id), store.list_results(run_id)) if not progress["live"] else None
    st.progress(progress["done"] / max(progress["total"], 1),
                text=f"{progress['done']} / {progress['total']} cases · {progress['errors']} errors · "
                     f"status **{outcome.label if outcome else progress['status']}**")
    if progress["live"]:
        cols = st.columns([3, 1])
        eta = fmt_seconds(progress["eta_s"]) if progress["eta_s"] is not None else "after the first batch"
        rate = f"{progress['rate_per_s']:.2f} cases/s" if progress["rate_per_s"] else "measuring…"
        cols[0].markdown(f"**Running** · {rate} · ETA {eta}"
                         + (" · cancelling after the batch in flight…" if progress["cancelling"] else ""))
        if cols[1].button("Cancelling…" if progress["cancelling"] else "Cancel", key=K(f"cancel.{run_id}"),
                          icon=":material/stop:", disabled=progress["cancelling"]):
            runner.cancel(run_id)
            st.rerun(scope="fragment")
    elif progress["elsewhere"]:
        st.info("Another workbench process is running this run; its progress shows here as results arrive.")
    else:
        if progress["interrupted"]:
            st.warning("This run was interrupted (the workbench stopped while it ran). Its finished results are "
                       "saved; resume to run the remaining cases.")
        render_outcome(run_id, outcome)
        if progress["remaining"] and progress["status"] != "pending":
            if (engine := run_engine_button(run_id, f"Resume ({progress['remaining']} cases left)", "resume",
                                            ":material/play_arrow:")) is not None:
                start_again(run_id, engine)
    # the page reruns for the first results only: later ones refresh themselves (`render_results`)
    if progress["live"] and progress["done"] and not st.session_state.get(K(f"shown.{run_id}")):
        st.rerun(scope="app")


def run_engine_button(run_id: int, label: str, name: str, icon: str):
    """A button that runs on the run's own model: that engine once clicked; None, said why when not loaded."""
    label, loading = run_view.model_button(label, shell.model_manager().state().busy)
    if not st.button(label, key=K(f"{name}.{run_id}"), icon=icon, disabled=loading):
        return None
    engine, missing = run_view.run_engine(shell.model_manager(), store.get_run(run_id)["model_id"])
    if missing:
        st.error(missing)
    return engine


def start_again(run_id: int, engine, *, retry_failed: bool = False) -> None:
    try:
        runner.start(run_id, engine, retry_failed=retry_failed)
    except EngineUnreachableError as exc:
        st.error(f"Not started: {exc}", icon=":material/cloud_off:")
        return
    except JobAlreadyRunningError as exc:
        st.info(str(exc))
    st.rerun()


def render_outcome(run_id: int, outcome) -> None:
    """What happened: the outcome, the failed cases and a retry of only those."""
    if outcome is None or not outcome.message:
        return
    getattr(st, outcome.tone)(outcome.message, icon={"error": ":material/error:", "warning": ":material/warning:",
                                                     "success": ":material/check_circle:",
                                                     "info": ":material/info:"}[outcome.tone])
    if not outcome.errors:
        return
    st.dataframe(run_view.error_rows(store.list_results(run_id)), hide_index=True, width="stretch",
                 key=K(f"errors.{run_id}"))
    if not outcome.can_retry:
        return
    with st.container(border=True, key=K(f"retry_box.{run_id}")):
        st.caption("Retry runs only the failed cases again, into this run, with these settings: change what made "
                   "them fail (a budget too small) first. Answered cases are kept as they are.")
        max_length, overflow = budget_inputs(st.columns(2), f"retry.{run_id}", store.get_run(run_id)["settings"],
                                            retry=True)
        if (engine := run_engine_button(run_id, f"Retry failed cases ({outcome.errors})", "retry",
                                        ":material/replay:")) is not None:
            store.update_run_settings(run_id, max_length=max_length, overflow=overflow)
            start_again(run_id, engine, retry_failed=True)


def render_results(run_id: int, live: bool) -> None:
    run = store.get_run(run_id)
    results = store.list_results(run_id)
    st.caption(run_view.settings_caption(run))
    render_delete(run)
    st.session_state[K(f"shown.{run_id}")] = len(results)
    if not results:
        st.info("The first results appear here when the first batch finishes." if live else "No results yet.")
        return
    frame, covered = run_view.answers(results, run["schema"])
    if covered["answered"]:
        render_browse(run_id, run_view.browse(run_id, results, run["schema"]), run["schema"]["questions"])
        render_speed(run_view.speed(results, len(run["schema"]["questions"])), results)
        render_quality(run_id, frame, run["schema"]["questions"], covered)
        render_cases(run, results, frame)
    else:
        st.info(covered["sentence"])
    render_export(run, len(results), live)
    if covered["answered"]:
        render_compare(run)


def render_browse(run_id: int, browse: run_view.Browse, questions: dict) -> None:
    st.subheader("Results")
    filter_cols = st.columns([1, 1, 2, 2])
    wrong_only = shell.kept_widget(filter_cols[0].toggle, "Wrong only", K(f"browse.wrong.{run_id}"), False,
                                   help="Answers that disagree with the case's expected answer")
    low_conf = shell.kept_widget(filter_cols[1].toggle, "Low confidence", K(f"browse.low.{run_id}"), False)
    threshold = shell.kept_widget(filter_cols[1].slider, "Confidence below", K(f"browse.threshold.{run_id}"), 0.6,
                                  min_value=0.0, max_value=1.0, step=0.05, disabled=not low_conf)
    picked_questions = shell.kept_widget(filter_cols[2].multiselect, "Questions", K(f"browse.questions.{run_id}"), [],
                                         options=list(questions), placeholder="All questions")
    picked_tags = shell.kept_widget(filter_cols[3].multiselect, "Tags", K(f"browse.tags.{run_id}"), [],
                                    options=browse.tags, placeholder="All tags", disabled=not browse.tags)
    search = shell.kept_widget(st.text_input, "Search the states and answers", K(f"browse.search.{run_id}"), "",
                               placeholder="e.g. refund, or an option id")
    shown, caption, rows_digest = run_view.browsed(browse.table, wrong_only=wrong_only, questions=picked_questions,
                                                   confidence_below=threshold if low_conf else None,
                                                   tags=picked_tags, search=search)
    st.caption(caption)
    picked = st.dataframe(shown, hide_index=True, width="stretch", key=K(f"browse.table.{run_id}.{rows_digest}"),
                          on_select="rerun", selection_mode="single-row",
                          column_order=["case", "question", "decide", "review",
                                        *(c for c in shown.columns
                                          if c not in ("case", "question", "decide", "review"))],
                          column_config={"state": st.column_config.TextColumn(width="large"),
                                         "confidence": st.column_config.NumberColumn(format="%.3f"),
                                         "margin": st.column_config.NumberColumn(format="%.3f"),
                                         "correct": st.column_config.CheckboxColumn(),
                                         "decide": st.column_config.LinkColumn("Decide", display_text="Open"),
                                         "review": st.column_config.LinkColumn("Review", display_text="Open")})
    if picked.selection.rows:
        row = shown.iloc[picked.selection.rows[0]]
        open_cols = st.columns(2)
        open_cols[0].link_button(f"Open case {row['case']} in Decide", row["decide"], icon=":material/psychology:",
                                 width="stretch")
        open_cols[1].link_button(f"Open case {row['case']} · {row['question']} in Review", row["review"],
                                 icon=":material/fact_check:", width="stretch")


def render_metrics(metrics: list[run_view.Metric]) -> None:
    for column, metric in zip(st.columns(len(metrics)), metrics, strict=True):
        column.metric(metric.label, metric.value, help=metric.help)


def render_speed(speed: run_view.Speed, results: list[dict]) -> None:
    st.subheader("Latency and throughput")
    render_metrics(speed.latency)
    for note in speed.latency_notes:
        st.caption(note)
    render_metrics(speed.throughput)
    st.caption(speed.throughput_note)
    st.altair_chart(run_charts.latency_histogram(results), width="stretch")


def render_quality(run_id: int, frame, questions: dict, covered: dict) -> None:
    st.subheader("Accuracy against expected answers")
    if not covered["with_expected"]:
        st.info(covered["sentence"])
        return
    st.caption(covered["sentence"])
    quality = run_view.quality(frame, questions)
    cols = st.columns([1, 1])
    cols[0].dataframe(quality.accuracy, hide_index=True, width="stretch",
                      column_config={"accuracy": st.column_config.NumberColumn(format="percent")})
    cols[1].altair_chart(run_charts.accuracy_chart(quality.accuracy), width="stretch",
                         height=run_charts.accuracy_chart_height(quality.accuracy_rows))
    if not quality.score_mae.empty:
        st.markdown("**Score questions — mean absolute error** of Σ i·p_i against the expected level")
        st.dataframe(quality.score_mae, hide_index=True)
    if quality.choice_questions:
        st.markdown("**Confusion matrices** (choice questions; rows expected, columns predicted)")
        chart_cols = st.columns(min(2, quality.choice_questions))
        for index, (question_id, matrix) in enumerate(quality.confusions):
            chart_cols[index % len(chart_cols)].altair_chart(
                run_charts.confusion_heatmap(matrix, question_id), width="stretch",
                height=run_charts.confusion_heatmap_height(len(matrix.index)))
    st.markdown("**Calibration** — confidence = probability of the predicted answer; 10 equal-width bins; "
                "ECE = Σ (n_b/N)·|accuracy_b − confidence_b|; Brier: yes/no (p − y)², "
                "choice/score Σ_k (p_k − y_k)²")
    st.dataframe(quality.calibration, hide_index=True,
                 column_config=dict.fromkeys(("ece", "brier"), st.column_config.NumberColumn(format="%.3f")))
    diagram_cols = st.columns(3)
    for index, (question_id, bins) in enumerate(quality.reliability):
        diagram_cols[index % 3].altair_chart(run_charts.reliability_diagram(question_id, bins))
    render_calibrate(run_id)


def render_calibrate(run_id: int) -> None:
    fitted_key = K(f"calibration.{run_id}")
    if st.button("Fit a calibration on these labelled cases", key=K(f"calibrate.{run_id}"),
                 icon=":material/tune:", help="Per question: Platt scaling (yes/no) or a temperature (choice, "
                 "score), judged on held-out cases (5-fold); kept for this schema and model, and offered on "
                 "Decide and in Review's rules"):
        refused, fitted = run_view.fit_calibration(store, run_id)
        if refused:
            st.warning(refused)
        else:
            st.session_state[fitted_key] = fitted
    if fitted := st.session_state.get(fitted_key):
        name, reports = fitted
        st.success(f"Kept as calibration “{name}”. ECE and Brier after: on cases each fold's fit did not see; "
                   "[95% bootstrap interval].")
        st.dataframe(calibration.summary_table(reports), hide_index=True)
        after_cols = st.columns(3)
        for index, report in enumerate(r for r in reports if r.calibration is not None):
            after_cols[index % 3].altair_chart(run_charts.reliability_diagram(
                report.question_id, report.bins_before, report.bins_after))


def render_cases(run: dict, results: list[dict], frame) -> None:
    run_id = run["id"]
    st.subheader("Slowest and least confident cases")
    slowest, least_confident = run_view.extremes(results, frame)
    cols = st.columns(2)
    cols[0].markdown("**Slowest**")
    cols[0].dataframe(slowest, hide_index=True, width="stretch")
    cols[1].markdown("**Least confident** (smallest margin top-1 − top-2)")
    cols[1].dataframe(least_confident, hide_index=True, width="stretch")
    with st.expander("One case's answers", icon=":material/search:"):
        if responses := {r["case_id"]: r["response"] for r in results if r.get("response")}:
            picked_case = st.selectbox("Case", list(responses), key=K(f"inspect.{run_id}"))
            for question_id, answer in responses[picked_case]["answers"].items():
                table = option_table(run["schema"]["questions"].get(question_id, {}), answer)
                st.altair_chart(probability_chart(table, title=question_id), width="stretch")
            why_key = K(f"why.{run_id}.{picked_case}")
            if st.button("Why: compute which parts of this case moved its answers", key=K(f"why_button.{run_id}"),
                         icon=":material/highlight:", help="Each sentence, field, image region and frame is removed "
                         "in turn and the case decided again, in one batched run") or why_key in st.session_state:
                why.render_case_why(why_key, shell.model_manager().loaded(), run, store.get_case(picked_case))


def render_export(run: dict, result_count: int, live: bool) -> None:
    run_id = run["id"]
    files = run_view.export(store, run, result_count, live)
    st.subheader("Export")
    st.caption(files.caption)
    cols = st.columns(2)
    cols[0].download_button("Results CSV (case × question, every option's probability)", files.csv,
                            file_name=f"{files.stem}.csv", mime="text/csv",
                            key=K(f"export_csv.{run_id}.{result_count}"),
                            icon=":material/download:", on_click="ignore")
    cols[1].download_button("Results JSONL", files.jsonl, file_name=f"{files.stem}.jsonl",
                            mime="application/jsonl", key=K(f"export_jsonl.{run_id}.{result_count}"),
                            icon=":material/download:", on_click="ignore")


def render_compare(run: dict) -> None:
    st.subheader("Compare with another run of the same case set")
    others, without_answers = run_view.comparison_baselines(runs, run)
    if without_answers:
        st.caption(f"{without_answers} other run(s) of this case set have no answers (every case failed) and are "
                   "not offered as a baseline.")
    if not others:
        st.caption("No other run of this case set with answers yet: run it again with another schema version or "
                   "model.")
        return
    # the Compare page shows two runs side by side (agreement, flips, metrics, each case); the older is the baseline
    st.markdown("Open this run beside another on the Compare page:\n" + "\n".join(
        f"- [{run_view.run_label(other)}]({compare_link(sorted((other['id'], run['id'])))})" for other in others))


progress_now = runner.progress(run_id)
live = runner.is_running(run_id) or progress_now["elsewhere"]
# what this full run of the page shows below (the progress fragment, rerunning alone, compares against it)
st.session_state[K(f"shown.{run_id}")] = progress_now["done"]
st.fragment(render_progress, run_every=1.0 if live else None)(run_id)
# A live run's results refresh as a fragment (its timer runs in the browser, which sends what it holds): a rerun
# started by the server carried stale widget values, losing a search being typed.
st.fragment(render_results, run_every=STATS_REFRESH_S if live else None)(run_id, live)
