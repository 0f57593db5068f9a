"""The Schemas page's view-model: what the library table, the questions table and the history show, on the
shipped schemas, a broken file and a real store as the history."""

from __future__ import annotations

import json

from workbench_ui import schemas_view as view


def test_the_library_table_lists_every_file_and_says_which_one_does_not_load(library):
    (library.directory / "broken.json").write_text("{not json", encoding="utf-8")
    lenient = library.load("support-ticket-routing")
    lenient.questions["vague"] = {"type": "noul", "instructions": "", "criteria": None}  # lint: empty instructions
    library.update("support-ticket-routing", lenient)

    shown = view.listing(library)
    rows = {row["file"]: row for row in shown.table()}

    assert list(rows) == [f"{slug}.json" for slug in library.slugs()]
    assert rows["broken.json"] == {"file": "broken.json", "name": "broken", "version": None, "questions": None,
                                   "lint": "cannot load", "description": ""}
    routing = rows["support-ticket-routing.json"]
    assert routing["lint"] == f"{len(shown.lint['support-ticket-routing'])} warning(s)"
    assert any("empty" in p.msg for p in shown.lint["support-ticket-routing"])
    assert (routing["version"], routing["questions"]) == (2, len(lenient.questions))
    assert rows["invoice-triage.json"]["lint"] == "ok"
    assert "broken" not in shown.schemas
    assert shown.label("invoice-triage") == f"{library.load('invoice-triage').name} (invoice-triage.json)"


def test_the_questions_table_names_the_answers_each_question_allows(library):
    schema = library.load("support-ticket-routing")
    rows = {row["id"]: row for row in view.question_rows(schema)}

    assert list(rows) == list(schema.questions)
    for qid, question in schema.questions.items():
        expected = {"noul": "true / false", "choice": ", ".join(question["criteria"] or {}),
                    "score": f"{len(question['criteria'] or [])} levels"}[question["type"]]
        assert rows[qid] == {"id": qid, "type": question["type"], "instructions": question["instructions"],
                             "answers": expected}
    assert {row["type"] for row in rows.values()} >= {"choice"}
    assert view.overview(schema) == (f"**{schema.name}** · version 1 · {len(schema.questions)} questions · "
                                     f"{len(schema.examples)} example states")


def test_the_history_compares_the_version_before_the_latest_with_the_latest(library):
    slug = "support-ticket-routing"
    schema = library.load(slug)
    qid, question = next(iter(schema.questions.items()))
    old_wording = question["instructions"]
    schema.questions = json.loads(json.dumps(schema.questions))
    schema.questions[qid]["instructions"] = old_wording + " Be strict."
    library.update(slug, schema)

    versions = library.history.list_schema_versions(slug)
    rows = view.version_rows(versions)
    numbers = [row["version"] for row in rows]
    assert numbers == [2, 1] and [row["how"] for row in rows] == ["update", "on disk"]
    assert "T" not in rows[0]["saved"] and len(rows[0]["saved"]) == 19
    assert numbers[view.default_diff_from(numbers)] == 1
    assert view.default_diff_from([1]) == 0  # a schema with one version compares it with itself

    diff = view.version_diff(versions, 1, 2)
    assert diff.title == "Changes from version 1 to version 2"
    assert "{+Be strict.+}" in diff.text and f'question "{qid}"' in diff.text
    assert len(diff.rows) == 1
    same = view.version_diff(versions, 2, 2)
    assert (same.text, same.rows) == ("No changes.", [])


def test_action_messages_and_the_starter_schema(library):
    starter = view.starter_schema("Refund triage", "EU refunds")
    slug = library.create(starter)
    assert library.load(slug).problems() == []  # a new schema is valid as it is
    assert view.restored_message(slug, None, library.load(slug)) == "Restored refund-triage.json."
    assert view.restored_message(slug, 1, library.load(slug)) == "Restored version 1 as version 1."
    assert view.delete_unconfirmed_message(slug) == "Tick “Yes, delete refund-triage.json” first: nothing was deleted."
