"""Schema history: the library with the store as its history (every save a version, a diff between any two,
restore as a new version, delete and undo, files changed outside the workbench), and runs pinned to the exact
version they ran. Real files and a real SQLite store."""

from __future__ import annotations

import json
import sqlite3

import pytest

from clef_workbench.schema_diff import diff_schemas, diff_text, word_diff
from clef_workbench.schema_library import SchemaLibrary
from clef_workbench.schemas import Schema, SchemaError
from clef_workbench.store import RunSettings

QUESTIONS = {
    "angry": {"type": "noul", "instructions": "Is the customer angry?", "criteria": {"true": "Shouting, threats",
                                                                                    "false": "Calm"}},
    "team": {"type": "choice", "instructions": "Which team should handle it?",
             "criteria": {"billing": "Money, invoices", "tech": "Bugs", "unknown": None}},
    "severity": {"type": "score", "instructions": "How bad is it?", "criteria": ["low", "mid", "high"]},
}


@pytest.fixture
def empty_library(tmp_path, store) -> SchemaLibrary:
    """An empty schema folder whose versions `store` (tests/support/fixtures.py) keeps."""
    return SchemaLibrary(tmp_path / "schemas", history=store)


def edited(library: SchemaLibrary, slug: str, change) -> Schema:
    schema = library.load(slug)
    questions = json.loads(json.dumps(schema.questions))
    change(questions)
    schema.questions = questions
    return library.update(slug, schema)


def test_each_save_is_a_version_in_the_store_and_the_file_carries_its_number(empty_library, store):
    slug = empty_library.create(Schema(name="Tickets", questions=QUESTIONS))
    v2 = edited(empty_library, slug, lambda q: q["angry"].update(instructions="Is the customer angry or upset?"))
    unchanged = empty_library.update(slug, empty_library.load(slug))  # saving what is there is not a new version
    described = empty_library.load(slug)
    described.description = "Routing of support tickets"  # wording outside the questions is a version too
    v3 = empty_library.update(slug, described)

    assert (v2.version, unchanged.version, v3.version) == (2, 2, 3)
    versions = store.list_schema_versions(slug)
    assert [(v["number"], v["action"]) for v in versions] == [(3, "update"), (2, "update"), (1, "create")]
    assert versions[0]["schema"] == empty_library.load(slug).to_dict()  # the file is the latest version
    assert json.loads(empty_library.path_of(slug).read_text())["version"] == 3
    assert versions[2]["schema"]["questions"] == QUESTIONS
    with pytest.raises(sqlite3.IntegrityError, match="append-only"):
        store._conn().execute("UPDATE schema_versions SET schema_json = '{}'")


def test_a_file_changed_outside_the_workbench_becomes_a_version_when_read(empty_library, store, tmp_path):
    empty_library.directory.mkdir()
    data = {"name": "From git", "version": 4, "description": "", "questions": QUESTIONS}
    (empty_library.directory / "from-git.json").write_text(json.dumps(data))
    assert empty_library.load("from-git").version == 4  # a file with versions before any history keeps its number
    data["questions"] = {**QUESTIONS, "extra": {"type": "noul", "instructions": "New?"}}
    (empty_library.directory / "from-git.json").write_text(json.dumps(data))  # a git pull, the number left as it was
    assert empty_library.load("from-git").version == 5
    assert [(v["number"], v["action"]) for v in store.list_schema_versions("from-git")] == [(5, "on disk"),
                                                                                           (4, "on disk")]
    assert [e.version for e in empty_library.list()] == [5]


def test_diff_between_any_two_versions_names_questions_options_and_wording(empty_library, store):
    slug = empty_library.create(Schema(name="Tickets", questions=QUESTIONS))
    edited(empty_library, slug, lambda q: q["angry"].update(instructions="Is the customer angry or upset?"))

    def third(q):
        q["team"]["criteria"] = {"payments": "Money, invoices", "tech": "Software bugs", "sales": "Buying",
                                 "unknown": None}
        q["severity"]["criteria"] = ["low", "medium", "high", "critical"]
        del q["angry"]["criteria"]["false"]
        q["language"] = q.pop("angry")  # a question renamed, nothing else about it changed
        q["spam"] = {"type": "noul", "instructions": "Is it spam?"}

    edited(empty_library, slug, third)
    v1, v2, v3 = (store.get_schema_version_number(slug, n)["schema"] for n in (1, 2, 3))

    assert [str(c) for c in diff_schemas(v1, v2)] == [
        '~ question "angry", instructions: Is the customer [-angry?-]{+angry or upset?+}']
    changes = diff_schemas(v2, v3)
    assert [(c.kind, c.loc) for c in changes] == [
        ("removed", ("questions", "angry")),  # its criteria changed too, so it is not a rename
        ("added", ("questions", "language")),
        ("added", ("questions", "spam")),
        ("renamed", ("questions", "team", "criteria", "billing")),
        ("added", ("questions", "team", "criteria", "sales")),
        ("changed", ("questions", "team", "criteria", "tech")),
        ("changed", ("questions", "severity", "criteria", 1)),
        ("added", ("questions", "severity", "criteria", 3)),
    ]
    text = diff_text(changes)
    assert '~ question "team", option "billing" renamed to "payments"' in text
    assert '~ question "team", option "tech": [-Bugs-]{+Software bugs+}' in text
    assert '+ question "severity", level 3 added: "critical"' in text
    assert '- question "angry" removed (was noul, "Is the customer angry or upset?")' in text
    reordered = {**v1, "questions": dict(reversed(v1["questions"].items()))}
    assert [str(c) for c in diff_schemas(v1, reordered)] == [
        "~ question order: angry, team, severity → severity, team, angry"]
    renamed_only = diff_schemas(v1, {**v1, "questions": {"mood" if k == "angry" else k: v
                                                         for k, v in v1["questions"].items()}})
    assert [str(c) for c in renamed_only] == ['~ question "angry" renamed to "mood"']
    assert diff_text(diff_schemas(v3, v3)) == "No changes."
    assert word_diff("a b c", "a x c") == "a [-b-]{+x+} c"
    assert word_diff("Is it spam?", "Is it spam or junk?") == "Is it [-spam?-]{+spam or junk?+}"


def test_restore_makes_a_new_version_and_loses_nothing(empty_library, store):
    slug = empty_library.create(Schema(name="Tickets", questions=QUESTIONS))
    edited(empty_library, slug, lambda q: q.pop("severity"))
    restored = empty_library.restore(slug, 1)
    assert restored.version == 3 and empty_library.load(slug).questions == QUESTIONS
    assert [(v["number"], v["action"]) for v in store.list_schema_versions(slug)] == [
        (3, "restore"), (2, "update"), (1, "create")]
    assert store.list_schema_versions(slug)[0]["note"] == "version 1 restored"  # the History tab says which
    assert diff_schemas(store.get_schema_version_number(slug, 1)["schema"], empty_library.load(slug).to_dict()) == []
    with pytest.raises(SchemaError, match='schema "tickets" has no version 9'):
        empty_library.restore(slug, 9)


def test_a_version_keeps_the_note_saying_where_it_came_from(empty_library, store):
    slug = empty_library.create(Schema(name="Tickets", questions=QUESTIONS))
    schema = empty_library.load(slug)
    schema.questions = {**QUESTIONS, "angry": {**QUESTIONS["angry"], "instructions": "Is the customer upset?"}}
    note = "sweep #4, variant “angry: reworded”: accuracy 0.82 [0.71, 0.90] held out"
    adopted = empty_library.update(slug, schema, action="adopt", note=note)
    assert adopted.version == 2
    assert [(v["number"], v["action"], v["note"]) for v in store.list_schema_versions(slug)] == [
        (2, "adopt", note), (1, "create", "")]


def test_delete_keeps_the_history_and_undo_brings_the_schema_back(empty_library, store):
    slug = empty_library.create(Schema(name="Tickets", questions=QUESTIONS))
    edited(empty_library, slug, lambda q: q.pop("severity"))
    empty_library.delete(slug, who="ana")
    assert not empty_library.exists(slug) and empty_library.deleted() == [slug]
    assert store.list_changes(kind="schema")[0] | {"at": None, "id": None} == {
        "at": None, "id": None, "who": "ana", "action": "delete", "kind": "schema", "object_id": slug,
        "label": "Tickets (tickets.json)", "data": {"version": 2}}
    back = empty_library.restore(slug)
    assert back.version == 2 and "severity" not in empty_library.load(slug).questions
    assert empty_library.deleted() == [] and len(store.list_schema_versions(slug)) == 2  # undo is not a new version
    assert store.list_changes(kind="schema")[0]["action"] == "restore"


def test_runs_are_pinned_to_the_version_of_the_content_they_ran(empty_library, store):
    set_id = store.create_case_set("tickets")
    slug = empty_library.create(Schema(name="Tickets", questions=QUESTIONS, examples=[{"name": "e", "state": "hi"}]))
    edited(empty_library, slug, lambda q: q.pop("severity"))

    def run_of(schema: dict) -> dict:
        schema.pop("examples", None)  # as the Runs page and the CLI keep it
        return store.get_run(store.create_run(set_id, schema=schema, model_id="clef-demo",
                                              settings=RunSettings(schema_slug=slug)))

    v1 = store.get_schema_version_number(slug, 1)
    old = run_of(dict(v1["schema"]))
    new = run_of(empty_library.load(slug).to_dict())
    assert (old["schema_version"], old["schema_version_id"], old["schema_slug"]) == ("1", v1["id"], slug)
    assert (new["schema_version"], new["schema_slug"]) == ("2", slug)
    assert old["schema"]["questions"] == QUESTIONS and "severity" not in new["schema"]["questions"]
    assert store.get_schema_version(v1["id"])["run_count"] == 1
    # a version number in the dict that disagrees with the content does not matter: the content decides
    assert run_of({**empty_library.load(slug).to_dict(), "version": 1})["schema_version"] == "2"

    unsaved = run_of({"name": "Tickets", "version": 7, "questions": {"x": {"type": "noul"}}})
    assert (unsaved["schema_version"], unsaved["schema_version_id"], unsaved["schema_slug"]) == ("7", None, None)


def test_without_a_history_the_library_is_the_folder_alone(tmp_path):
    library = SchemaLibrary(tmp_path / "plain")
    slug = library.create(Schema(name="Plain", questions=QUESTIONS))
    assert library.update(slug, library.load(slug)).version == 1
    assert library.deleted() == []
    with pytest.raises(SchemaError, match="keeps no history"):
        library.restore(slug, 1)
