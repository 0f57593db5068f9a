"""Several models in one process (issue 14): one workbench process holds two tiny releases of different sizes and a
remote endpoint (our own API server in a subprocess) at once, runs one case set on all three and compares them; one
API server process serves two models and routes each request by its `model`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import clef_engine
from clef_workbench import compare
from clef_workbench.casesets import build_request
from clef_workbench.jobs import JobRunner
from clef_workbench.model_loader import ModelManager
from clef_workbench.store import Store
from tests.support import REPO
from tests.support.api import metric, parse_metrics
from tests.support.apptest import APP, TIMEOUT, button, no_exceptions
from tests.support.bodies import make_request
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow  # real server processes
QUESTIONS = make_request(0)["questions"]


@pytest.fixture(scope="module")
def small_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny release, wider and deeper than conftest's (`python -m clef_engine tiny --size small`)."""
    from clef_engine.tiny import build_tiny_release

    return build_tiny_release(tmp_path_factory.mktemp("small") / "small-release", seed=1, size="small")


@pytest.fixture(scope="module")
def two_model_server(tiny_release: Path, small_release: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`python -m clef_engine serve --model TINY --model SMALL`: the tiny release is the default."""
    process = ServerProcess(tiny_release, tmp_path_factory.mktemp("logs") / "two-models.log",
                            "--model", str(small_release))
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def small_engine(small_release: Path):
    engine = clef_engine.load(small_release, device="cpu", dtype="float32")
    yield engine
    engine.close()


def probabilities(response: dict) -> list[float]:
    """Every probability of a response, in order (noul's P(true), then each choice / score distribution)."""
    out = []
    for answer in response["answers"].values():
        out += [answer["noul"]] if answer["type"] == "noul" else list(answer["probabilities"].values())
    return out


# --- the HTTP API: one process, two models --------------------------------------------------------------------------


def test_models_lists_every_loaded_model_and_the_alias(two_model_server, tiny_release, small_release):
    listed = httpx.get(f"{two_model_server.url}/v1/models", timeout=30).json()["models"]
    assert [m["name"] for m in listed] == [tiny_release.name, small_release.name, "jev-latest"]
    assert "The default" in listed[0]["description"] and listed[2]["description"] == f"Alias of {tiny_release.name}."
    health = httpx.get(f"{two_model_server.url}/health", timeout=30).json()
    assert health["ready"] and health["model"] == tiny_release.name
    assert health["models"] == [tiny_release.name, small_release.name]


def test_requests_are_routed_by_model_and_any_other_name_goes_to_the_default(
        two_model_server, tiny_release, small_release, tiny_engine, small_engine):
    request = make_request(3)
    on_tiny = probabilities(tiny_engine.decide(request))
    on_small = probabilities(small_engine.decide(request))
    assert on_tiny != pytest.approx(on_small, abs=1e-3), "the two releases must answer differently to tell them apart"
    with httpx.Client(base_url=two_model_server.url, timeout=60) as http:
        for model, expected in [(small_release.name, on_small), (f"someone/{small_release.name.upper()}", on_small),
                                (tiny_release.name, on_tiny), ("jev-latest", on_tiny), ("gpt-4o", on_tiny)]:
            response = http.post("/v1/systemone", json=dict(request, model=model))
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model  # echoed as sent, whichever engine answered
            assert probabilities(response.json()) == pytest.approx(expected, abs=2e-4), model
        no_model = {k: v for k, v in request.items() if k != "model"}
        assert http.post("/v1/systemone", json=no_model).json()["model"] == tiny_release.name


def test_metrics_report_each_resident_model(two_model_server, tiny_release, small_release):
    """/metrics has one series per model (label `model`): a request routed to one model shows in its batches and
    tokens, not in the other's."""
    def batches_and_tokens(samples: dict, name: str) -> tuple[float, float]:
        return (metric(samples, f'clef_engine_batches_total{{model="{name}"}}'),
                metric(samples, f'clef_engine_batch_tokens_total{{model="{name}"}}'))

    with httpx.Client(base_url=two_model_server.url, timeout=60) as http:
        before = parse_metrics(http.get("/metrics").text)
        for _ in range(2):
            assert http.post("/v1/systemone", json=dict(make_request(5), model=small_release.name)).status_code == 200
        text = http.get("/metrics").text
    after = parse_metrics(text)
    for name in (tiny_release.name, small_release.name):
        assert f'clef_engine_queue_depth{{model="{name}"}}' in after, text
        assert f'clef_engine_weights_bytes{{model="{name}"}}' in after, text
    small_before = batches_and_tokens(before, small_release.name)
    small_after = batches_and_tokens(after, small_release.name)
    assert small_after[0] - small_before[0] >= 1 and small_after[1] - small_before[1] > 0
    assert batches_and_tokens(after, tiny_release.name) == batches_and_tokens(before, tiny_release.name)
    assert after["clef_engine_ready"] == 1


def test_serve_refuses_a_model_that_does_not_fit_before_loading_it(tiny_release, small_release):
    """The memory check of `serve`: a state cache far larger than this machine's RAM makes the second model's need
    exceed what is free; the command says so and exits 2 instead of running out of memory."""
    env = {**os.environ, "CLEF_STATE_CACHE_BYTES": str(2**50)}
    done = subprocess.run([sys.executable, "-m", "clef_engine", "serve", "--model", str(tiny_release), "--device",
                           "cpu"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert f"error: {tiny_release} needs ~" in done.stderr and "free on cpu" in done.stderr
    assert "CLEF_STATE_CACHE_BYTES" in done.stderr and "Traceback" not in done.stderr


# --- the workbench: two local models and a remote endpoint in one process ------------------------------------------


def test_one_workbench_process_runs_a_case_set_on_two_local_models_and_a_remote_one(
        two_model_server, tiny_release, small_release, tmp_path, monkeypatch):
    monkeypatch.delenv("CLEF_API_KEY", raising=False)
    monkeypatch.delenv("CLEF_MODEL", raising=False)
    manager = ModelManager()
    manager.request(str(tiny_release))
    manager.add(str(small_release))
    manager.add(two_model_server.url)
    state = manager.wait(300)
    assert state.error is None and state.source == str(tiny_release)
    remote_name = two_model_server.url.removeprefix("http://")
    names = [tiny_release.name, small_release.name, remote_name]
    loaded = {m.name: m for m in manager.loaded()}
    assert manager.loaded()[0].name == tiny_release.name and sorted(loaded) == sorted(names)  # the default first
    models = [loaded[name] for name in names]
    tiny, small, remote = (m.engine for m in models)
    assert small.backbone_parameters > 2 * tiny.backbone_parameters
    assert remote.info()["remote"] and manager.get(remote_name) is remote
    assert tiny.scheduler.turn is small.scheduler.turn, "local engines of one device share its GPU queue"

    store = Store(tmp_path / "workbench.sqlite3")
    case_set = store.create_case_set("tickets")
    store.add_cases(case_set, [{"state": make_request(i)["state"],
                                "expected": {"billing": i % 3 != 0, "tone": ["angry", "calm", "neutral"][i % 3]}}
                               for i in range(10)])
    schema = {"name": "triage", "version": "1", "questions": QUESTIONS}
    runner = JobRunner(store)
    run_ids = compare.start_runs(store, runner, case_set, schema, {m.name: m.engine for m in models})
    for run_id in run_ids:
        assert runner.wait(run_id, timeout=300)
        run = store.get_run(run_id)
        assert run["status"] == "finished" and run["errors"] == 0 and run["done"] == 10
    assert [store.get_run(i)["model_id"] for i in run_ids] == [m.name for m in models]
    runs = compare.load_runs(store, run_ids)

    table = compare.agreement(runs, n_boot=200)
    assert len(table) == 3 * len(QUESTIONS)  # three pairs of runs × each question
    assert (table["n"] == 10).all()
    assert ((table["low"] <= table["agreement"]) & (table["agreement"] <= table["high"])).all()
    # the remote endpoint serves the tiny release as its default (the run's model name is not one it has loaded)
    local_remote = table[(table["run_a_id"] == run_ids[0]) & (table["run_b_id"] == run_ids[2])]
    assert list(local_remote["agreement"]) == [1.0] * len(QUESTIONS)

    flipped = compare.flips(runs)
    for _, row in table.iterrows():
        mine = flipped[(flipped["run_a_id"] == row["run_a_id"]) & (flipped["run_b_id"] == row["run_b_id"])
                       & (flipped["question_id"] == row["question_id"])]
        assert sorted(mine["case_id"]) == sorted(row["flipped_case_ids"]) and len(mine) == row["flips"]
    # the flips of tiny vs small are exactly the cases where their stored answers' top choice differs
    answers = {run.id: {r["case_id"]: r["response"]["answers"] for r in run.results} for run in runs}
    tone = {run_id: {case: a["tone"]["choice"] for case, a in answers[run_id].items()} for run_id in run_ids[:2]}
    expected_flips = sorted(c for c in tone[run_ids[0]] if tone[run_ids[0]][c] != tone[run_ids[1]][c])
    tiny_small = table[(table["run_a_id"] == run_ids[0]) & (table["run_b_id"] == run_ids[1])]
    assert sorted(tiny_small.set_index("question_id").loc["tone", "flipped_case_ids"]) == expected_flips
    assert tiny_small["flips"].sum() > 0, "two different models agreeing everywhere would show no flip to check"
    assert any(probabilities({"answers": answers[run_ids[0]][c]}) != pytest.approx(
        probabilities({"answers": answers[run_ids[1]][c]}), abs=1e-3) for c in answers[run_ids[0]])

    side_by_side = compare.metrics(runs, n_boot=200)
    accuracy = side_by_side[side_by_side["metric"] == "accuracy"]
    assert sorted(accuracy["run_id"].unique()) == sorted(run_ids) and (accuracy["n"] == 10).all()
    assert ((accuracy["low"] <= accuracy["value"]) & (accuracy["value"] <= accuracy["high"])).all()
    for model in models:
        manager.remove(model.name)
    assert manager.loaded() == [] and manager.state().engine is None


# --- the workbench pages: pick the model per Decide run and per batch run; add and unload in the sidebar ----------


def test_decide_and_runs_pick_among_loaded_models_and_the_sidebar_unloads_after_asking(workbench, small_release):
    from streamlit.testing.v1 import AppTest

    from workbench_ui import decide_model, shell

    manager = shell.model_manager()
    manager.wait(300)
    default, default_label = manager.loaded()[0].name, manager.loaded()[0].label
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    assert "decide.model" not in [s.key for s in at.selectbox], "one model loaded: no model picker"
    sidebar = AppTest.from_function(sidebar_models, default_timeout=TIMEOUT)  # the sidebar's model part, alone
    sidebar.run()
    sidebar.selectbox(key="sidebar.add_choice").set_value("Local release folder").run()
    sidebar.text_input(key="sidebar.add_local").input(str(small_release)).run()
    button(sidebar, "Add").click().run()
    no_exceptions(sidebar)
    assert manager.wait(300).error is None
    from workbench_ui.server import resident_models  # the workbench's HTTP API serves the same models

    assert list(resident_models()) == [default, small_release.name]
    try:
        at.run()
        no_exceptions(at)
        picker = at.selectbox(key="decide.model")
        assert picker.options == [f"{default} · {default_label}", f"{small_release.name} · {small_release}"]
        assert picker.value == default
        picker.set_value(small_release.name).run()
        button(at, "Run").click()
        at.run()
        no_exceptions(at)
        result = at.session_state["decide.result"]  # what the page shows, as the run left it
        response, request = result.response, result.request
        assert response["model"] == request["model"] == result.model_label == small_release.name
        small = manager.get(small_release.name)
        assert response["answers"] == small.decide(request)["answers"]

        case_set = Store(workbench / "workbench.sqlite3").create_case_set("tickets")
        Store(workbench / "workbench.sqlite3").add_cases(case_set, [{"state": "refund please"}])
        at.switch_page("pages/runs.py")
        at.run()
        no_exceptions(at)
        assert at.selectbox(key="runs.start.model").options[0] == f"{default} · {default_label}"

        # a run started on the second model resumes on it, not on the default
        store = Store(workbench / "workbench.sqlite3")
        schema = {"name": "refunds", "questions": {"refund": {"type": "noul", "instructions": "Wants a refund?"}}}
        run_id = store.create_run(case_set, schema=schema, model_id=small_release.name)
        store.set_run_status(run_id, "cancelled")
        at.run()
        at.selectbox(key="runs.selected").set_value(run_id).run()
        button(at, "Resume (1 cases left)").click().run()
        shell.get_job_runner().wait(run_id)
        result = store.list_results(run_id)[0]
        assert result["response"]["answers"] == small.decide(build_request(
            store.list_cases(case_set)[0], schema, model=small_release.name))["answers"]

        # the sidebar lists both (drawn alone here: AppTest keeps no sidebar across reruns of app.py)
        at = AppTest.from_function(sidebar_models, default_timeout=TIMEOUT)
        at.run()
        no_exceptions(at)
        assert [m.value for m in at.markdown][:2] == [
            f"**{default}** (default) · random weights  \n{default_label}",
            f"**{small_release.name}** · random weights  \n{small_release}"]
        button(at, "Make default").click().run()
        assert manager.default_name() == small_release.name
        [b for b in at.button if b.key == f"sidebar.remove.{small_release.name}"][0].click().run()
        assert any(f"Unload {small_release.name}?" in w.value for w in at.warning)
        assert small_release.name in [m.name for m in manager.loaded()], "nothing is unloaded before the answer"
        button(at, "Yes, unload").click().run()
        no_exceptions(at)
        assert [m.name for m in manager.loaded()] == [default] and manager.default_name() == default
    finally:
        if small_release.name in [m.name for m in manager.loaded()]:
            manager.remove(small_release.name)
    assert decide_model.chosen_model([default], small_release.name) == default  # a picked model unloaded since
    assert decide_model.chosen_model([], None) is None


def sidebar_models() -> None:
    from workbench_ui import shell

    shell.render_models(shell.model_manager())
    shell.render_add_model(shell.model_manager())


def test_make_default_switches_decide_and_every_random_weight_answer_is_flagged_with_its_model(workbench,
                                                                                                small_release):
    """Issue 23 point 3: after Make default, Decide answers with the new default; a tiny release added by path (its
    config.json says random_weights) is flagged next to its answers on Decide and Runs, each answer naming its model."""
    from streamlit.testing.v1 import AppTest

    from workbench_ui import shell

    manager = shell.model_manager()
    manager.wait(300)
    default = manager.default_name()
    manager.add(str(small_release))
    assert manager.wait(300).error is None
    small = small_release.name
    try:
        at = AppTest.from_file(APP, default_timeout=TIMEOUT)
        at.run()
        assert at.selectbox(key="decide.model").value == default
        manager.set_default(small)  # "Make default" in the sidebar (of this or any session)
        at.run()
        no_exceptions(at)
        assert at.selectbox(key="decide.model").value == small
        button(at, "Run").click().run()
        no_exceptions(at)
        result = at.session_state["decide.result"]
        assert result.response["model"] == result.model_label == small
        assert [w.value for w in at.warning if f"{small} has random weights" in w.value], \
            "the added tiny release's answers are flagged"
        cards = [m.value for m in at.markdown if "answered by" in m.value]
        assert cards and all(card.endswith(f"answered by {small}") for card in cards)

        store = Store(workbench / "workbench.sqlite3")
        case_set = store.create_case_set("tickets")
        store.add_cases(case_set, [{"state": "refund please"}])
        store.create_run(case_set, schema={"name": "r", "questions": QUESTIONS}, model_id=small)
        at.switch_page("pages/runs.py")
        at.run()
        no_exceptions(at)
        assert any(f"{small} has random weights" in w.value for w in at.warning), "Runs flags the run's model"
    finally:
        manager.set_default(default)
        manager.remove(small)
    assert manager.random_weights("clef-demo") and not manager.random_weights(small), \
        "a demo run stays flagged; an unloaded release is not guessed at"


def whole_sidebar() -> None:
    from workbench_ui import shell

    shell.render_sidebar()


def in_order(node) -> list[tuple[str, str]]:
    """Every element under an AppTest node as (kind, text), in the order the page draws them."""
    children = getattr(node, "children", None)
    if children is None:
        return [(type(node).__name__, str(getattr(node, "value", "") or getattr(node, "label", "")))]
    return [item for index in sorted(children) for item in in_order(children[index])]


def test_adding_a_model_reports_in_place_and_the_selector_follows_make_default(workbench, small_release):
    """Issue 23 points 8 and 13: Add shows its progress and its success under the Add button and the list shows the
    model; after Make default the top selector shows the model that is the default (no "Load Demo model" offered
    while the demo is loaded); the Unload question appears under the model it is about."""
    from streamlit.testing.v1 import AppTest

    from workbench_ui import shell

    manager = shell.model_manager()
    manager.wait(300)
    default = manager.default_name()
    small = small_release.name
    at = AppTest.from_function(whole_sidebar, default_timeout=TIMEOUT)
    at.run()
    assert not [b for b in at.sidebar.button if b.label.startswith("Load ")]
    at.sidebar.selectbox(key="sidebar.add_choice").set_value("Local release folder").run()
    at.sidebar.text_input(key="sidebar.add_local").input(str(small_release)).run()
    try:
        button(at.sidebar, "Add").click().run()
        no_exceptions(at)
        adding = at.sidebar.expander[0]
        assert [i.value for i in adding.info if "Adding" in i.value] or \
            [s.value for s in adding.success if small in s.value], "the add reports under its button"
        assert manager.wait(300).error is None
        at.run()
        added = [s.value for s in at.sidebar.expander[0].success]
        assert added and added[0].startswith(f"Added {small}")
        assert f"**{small}** · random weights  \n{small_release}" in [m.value for m in at.sidebar.markdown]

        button(at.sidebar, "Make default").click().run()
        no_exceptions(at)
        assert manager.default_name() == small
        assert at.sidebar.selectbox(key="sidebar.model_choice").value == "Local release folder"
        assert not [b.label for b in at.sidebar.button if b.label.startswith("Load ")], \
            "no offer to load a model that is loaded"
        at.sidebar.selectbox(key="sidebar.model_choice").set_value("Demo model (random weights)").run()
        assert not [b.label for b in at.sidebar.button if b.label.startswith("Load ")]
        button(at.sidebar, f"Make {default} the default").click().run()
        assert manager.default_name() == default

        [b for b in at.sidebar.button if b.key == f"sidebar.remove.{default}"][0].click().run()
        drawn = in_order(at.sidebar)
        question = next(i for i, (_, text) in enumerate(drawn) if f"Unload {default}?" in text)
        other = next(i for i, (_, text) in enumerate(drawn) if text.startswith(f"**{small}**"))
        own = next(i for i, (_, text) in enumerate(drawn) if text.startswith(f"**{default}**"))
        assert own < question < other, "the question sits under the model it is about, not below the list"
        button(at.sidebar, "Cancel").click().run()
        assert not [w for w in at.sidebar.warning if "Unload" in w.value]
    finally:
        manager.set_default(default)
        if small in [m.name for m in manager.loaded()]:
            manager.remove(small)
