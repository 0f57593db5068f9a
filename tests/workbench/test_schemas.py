"""Schema library: files on disk, validation by the System One contract, lint warnings (hosted-service limits
included), import/export safety."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clef_engine.protocol import HOSTED
from clef_workbench.schema_library import SchemaLibrary, slugify
from clef_workbench.schemas import Schema, SchemaError, lint_questions, validate_questions
from tests.support import REPO
from workbench_ui.schema_rows import questions_to_rows, rows_to_questions

SHIPPED = REPO / "schemas"


def noul(instructions: str = "Is it so?") -> dict:
    return {"type": "noul", "instructions": instructions, "criteria": None}


def choice(options: dict, instructions: str = "Which one?") -> dict:
    return {"type": "choice", "instructions": instructions, "criteria": options}


def score(levels: list, instructions: str = "How much?") -> dict:
    return {"type": "score", "instructions": instructions, "criteria": levels}


GOOD_QUESTIONS = {
    "spam": noul("Is this message spam?"),
    "team": choice({"billing": "Money matters.", "tech": "Broken things.", "unknown": "None of these."}),
    "urgency": score(["Low", "Medium", "High"]),
}


@pytest.fixture
def plain_library(tmp_path: Path) -> SchemaLibrary:
    """An empty schema folder without a history: the library is the folder alone."""
    return SchemaLibrary(tmp_path / "schemas")


def messages(problems) -> list[str]:
    return [p.msg for p in problems]


# --- validation ------------------------------------------------------------------------------------------------


def test_valid_questions_have_no_errors_or_warnings():
    assert validate_questions(GOOD_QUESTIONS) == []
    assert lint_questions(GOOD_QUESTIONS) == []


@pytest.mark.parametrize(
    ("questions", "expected"),
    [
        ({}, '"questions": at least one question is required'),
        ({"team": choice({})}, 'question "team", field "criteria": a choice needs at least one option'),
        ({"u": score([])}, 'question "u", field "criteria": a score needs at least one level'),
        ({"u": score("low, high")}, 'question "u", field "criteria": score criteria must be a list of level'),
        ({"u": score(["low", None])},
         'question "u", field "criteria", level 1: a level description must be text or JSON, not null'),
        ({"": noul()}, 'question "": ids must be non-empty strings'),
        ({"q": {"type": "bool", "instructions": "?"}},
         'question "q", field "type": type must be one of noul, choice, score; got "bool"'),
        ({"q": {"instructions": "?"}}, 'question "q", field "type": field required'),
        ({"q": {"type": "noul", "criteria": {"yes": "y"}}},
         'question "q", field "criteria", key "yes": noul criteria keys must be \'true\' or \'false\''),
        ({"q": {"type": "noul", "criteria": {"true": float("nan")}}},
         'question "q", field "criteria", key "true": must be text or a JSON value'),
        ({"q": {"type": "noul", "criteria": ["a", "b"]}}, 'question "q", field "criteria": noul criteria must be null'),
        ({"q": choice(["a", "b"])}, 'question "q", field "criteria": choice criteria must be a map option id'),
        ({"q": {"type": "choice", "instructions": "?"}}, 'question "q", field "criteria": field required'),
        ({"q": {**noul(), "options": []}}, 'question "q", field "options": unknown field'),
        ([noul()], '"questions" must be a map'),
    ],
)
def test_invalid_questions_are_reported_with_question_and_field(questions, expected):
    found = messages(validate_questions(questions))
    assert any(expected in m for m in found), found


HOSTED_REFUSALS = [
    ({f"q{i}": noul() for i in range(HOSTED.questions[-1] + 1)}, "questions", "it takes 1–64 questions, this has 65"),
    ({"team": choice({"only": "x"})}, "team", "a choice takes 2–255 options, this has 1"),
    ({"team": choice({f"o{i}": None for i in range(HOSTED.choice_options[-1] + 1)})}, "team",
     "a choice takes 2–255 options, this has 256"),
    ({"u": score(["low"])}, "u", "a score takes 2–10 levels, this has 1"),
    ({"u": score([str(i) for i in range(11)])}, "u", "a score takes 2–10 levels, this has 11"),
    ({"bad id!": noul()}, "bad id!", "question ids must be 1–100 letters, digits"),
    ({"x" * 101: noul()}, "x" * 101, "question ids must be 1–100 letters, digits"),
    ({"질문": noul()}, "질문", "question ids must be 1–100 letters, digits"),
    ({"a/b": noul()}, "a/b", "question ids must be 1–100 letters, digits"),
]


@pytest.mark.parametrize(("questions", "question_id", "expected"), HOSTED_REFUSALS)
def test_hosted_service_limits_are_lint_warnings_not_errors(questions, question_id, expected):
    """The contract (and the local engine) accepts these; only the hosted service would refuse them."""
    assert validate_questions(questions) == []
    hosted = [p for p in lint_questions(questions) if "the hosted service would refuse this" in p.msg]
    assert [p.severity for p in hosted] == ["warning"], hosted
    assert expected in hosted[0].msg
    assert hosted[0].question_id == (None if question_id == "questions" else question_id)
    schema = Schema(name="Beyond hosted", questions=questions)
    assert not [p for p in schema.problems() if p.severity == "error"]


def test_hosted_limits_accept_their_boundaries():
    at_limits = {f"q{i}": noul() for i in range(HOSTED.questions[-1] - 2)}
    at_limits["big"] = choice({f"o{i}": None for i in range(HOSTED.choice_options[-1])})
    at_limits["ten"] = score([f"level {i}" for i in range(10)])
    assert len(at_limits) == HOSTED.questions[-1]
    for questions in (at_limits, {"two": choice({"a": None, "b": None}), "s": score(["lo", "hi"])},
                      {"a.b-c_D9": noul(), "x" * 100: noul()}):
        assert validate_questions(questions) == []
        assert not [p for p in lint_questions(questions) if "hosted service" in p.msg]


def test_descriptions_may_be_json_as_in_the_contract():
    questions = {"q": choice({"a": {"detail": "structured"}, "b": None, "unknown": "None of these."}),
                 "s": score([{"level": "low"}, "high"])}
    assert validate_questions(questions) == []
    row = questions_to_rows(questions)[0]
    assert row["options"][0] == {"id": "a", "description": '{"detail": "structured"}'}


def test_noul_criteria_may_be_one_sided_null_or_absent():
    assert validate_questions({"a": {"type": "noul", "instructions": "?", "criteria": {"true": "yes"}},
                               "b": {"type": "noul", "instructions": "?"}}) == []


def test_duplicate_question_and_option_ids_in_a_file_are_errors(plain_library: SchemaLibrary):
    text = """{"name": "Dup", "version": 1, "description": "",
               "questions": {"a": {"type": "noul", "instructions": "x"},
                             "a": {"type": "choice", "instructions": "y",
                                   "criteria": {"k": null, "k": null, "l": null}}}}"""
    with pytest.raises(SchemaError) as caught:
        plain_library.import_json(text, filename="dup.json")
    found = messages(caught.value.problems)
    assert any('question "a": the id appears more than once' in m for m in found), found
    assert any('option id "k" appears more than once' in m for m in found), found
    assert not plain_library.slugs(), "an invalid schema must not be written"


# --- lint ------------------------------------------------------------------------------------------------------


def test_lint_warns_about_choice_without_unknown_option():
    warnings = lint_questions({"team": choice({"billing": "Money.", "tech": "Broken things."})})
    assert [w.severity for w in warnings] == ["warning"]
    assert 'question "team", field "criteria": no "unknown" / "none of these" option' in warnings[0].msg


@pytest.mark.parametrize(
    "options",
    [
        {"billing": "Money.", "other": None},
        {"billing": "Money.", "none_of_these": "Nothing fits."},
        {"billing": "Money.", "cannot-tell": "x"},
        {"billing": "Money.", "x9": "Unknown or not enough information."},
        {"billing": "Money.", "needs_more_data": "Ask the customer."},
    ],
)
def test_lint_accepts_unknown_type_options_by_id_or_description(options):
    assert [w for w in lint_questions({"team": choice(options)}) if "unknown" in w.msg] == []


def test_lint_is_not_fooled_by_the_word_other_in_an_ordinary_description():
    warnings = lint_questions({"t": choice({"hw": "Phones and other equipment.", "sw": "Software."})})
    assert any('no "unknown"' in w.msg for w in warnings)


def test_lint_warns_about_empty_instructions():
    for empty in ("", "   ", None, {}):
        warnings = lint_questions({"spam": {"type": "noul", "instructions": empty}})
        assert messages(warnings) == ['question "spam", field "instructions": empty; the model will read only the '
                                      'id "spam" as the question']


def test_lint_warns_about_near_duplicate_descriptions():
    questions = {"colour": choice({"red": "The car is painted red.", "redd": "The car is painted red!",
                                   "blue": "The car is blue.", "unknown": "Cannot tell."})}
    found = messages(lint_questions(questions))
    assert any('option "red" and option "redd" have nearly the same description' in m for m in found), found
    assert not any('"blue"' in m for m in found), "clearly different descriptions must not be flagged"
    levels = lint_questions({"s": score(["Very low risk", "Very low risk.", "High risk"])})
    assert any("level 0 and level 1 have nearly the same description" in m for m in messages(levels))


def test_lint_warns_about_ids_differing_only_in_case():
    found = messages(lint_questions({"Team": noul("a"), "team": noul("b")}))
    assert any('question "team", field "id": differs from "Team" only in letter case' in m for m in found), found


def test_lint_warns_about_options_without_description():
    found = messages(lint_questions({"t": choice({"a": None, "b": "Bee", "unknown": "x"})}))
    assert found == ['question "t", field "criteria": option "a" has no description; the model sees only its id']


# --- builder rows ----------------------------------------------------------------------------------------------


def test_rows_round_trip_to_the_same_questions_map():
    questions = {
        "spam": {"type": "noul", "instructions": "Spam?", "criteria": {"true": "It is spam."}},
        "team": choice({"z_last": "Z", "a_first": None, "unknown": "None of these."}),
        "urgency": score(["Low", "High"]),
    }
    rebuilt, problems = rows_to_questions(questions_to_rows(questions))
    assert problems == []
    assert rebuilt == questions
    assert list(rebuilt["team"]["criteria"]) == ["z_last", "a_first", "unknown"], "author's option order is kept"


def test_rows_report_duplicate_question_ids_instead_of_merging_them():
    rows = questions_to_rows({"a": noul("first"), "b": noul("second")})
    rows[1]["id"] = "a"
    questions, problems = rows_to_questions(rows)
    assert list(questions) == ["a"]
    assert any('question "a": the id appears more than once' in p.msg for p in problems)


def test_rows_report_missing_ids_and_duplicate_option_ids():
    rows = [
        {"id": "", "type": "noul", "instructions": "x"},
        {"id": "c", "type": "choice", "instructions": "x",
         "options": [{"id": "a", "description": ""}, {"id": "a", "description": "again"},
                     {"id": "", "description": "?"}]},
    ]
    _, problems = rows_to_questions(rows)
    found = messages(problems)
    assert 'question 1, field "id": required' in found
    assert 'question "c", field "criteria": option id "a" appears more than once' in found
    assert 'question "c", field "criteria": an option has no id' in found


# --- the library on disk ---------------------------------------------------------------------------------------


def test_create_writes_a_stable_diffable_file(plain_library: SchemaLibrary):
    schema = Schema(name="Ticket routing: EU/US", description="Route tickets.", questions=GOOD_QUESTIONS,
                    examples=[{"state": {"body": "hi"}, "name": "hello"}])
    slug = plain_library.create(schema)
    assert slug == "ticket-routing-eu-us"
    text = (plain_library.directory / f"{slug}.json").read_text(encoding="utf-8")
    assert text.endswith("}\n") and text.startswith('{\n  "name": "Ticket routing: EU/US",\n  "version": 1,')
    data = json.loads(text)
    assert list(data) == ["name", "version", "description", "questions", "examples"]
    assert list(data["examples"][0]) == ["name", "state"]
    assert list(data["questions"]["team"]) == ["type", "instructions", "criteria"]
    # Saving again what was loaded gives identical bytes: no churn in git.
    plain_library.update(slug, plain_library.load(slug))
    assert (plain_library.directory / f"{slug}.json").read_text(encoding="utf-8") == text


def test_create_never_overwrites_and_picks_a_new_slug(plain_library: SchemaLibrary):
    first = plain_library.create(Schema(name="Claims", questions=GOOD_QUESTIONS))
    second = plain_library.create(Schema(name="claims", questions={"x": noul()}))
    assert (first, second) == ("claims", "claims-2")
    assert plain_library.load("claims").questions == GOOD_QUESTIONS


def test_update_bumps_version_when_anything_but_the_version_changes(plain_library: SchemaLibrary):
    slug = plain_library.create(Schema(name="Alerts", questions=GOOD_QUESTIONS))
    assert plain_library.update(slug, plain_library.load(slug)).version == 1  # saving what is there changes nothing
    described = plain_library.load(slug)
    described.description = "Only the description changed."
    assert plain_library.update(slug, described).version == 2  # each save of new content is a version
    changed = plain_library.load(slug)
    changed.questions = {**changed.questions, "extra": noul("Another question?")}
    saved = plain_library.update(slug, changed)
    assert saved.version == 3
    assert plain_library.load(slug).version == 3 and "extra" in plain_library.load(slug).questions


def test_invalid_schema_is_refused_and_nothing_is_written(plain_library: SchemaLibrary):
    slug = plain_library.create(Schema(name="Keep me", questions=GOOD_QUESTIONS))
    before = (plain_library.directory / f"{slug}.json").read_bytes()
    broken = plain_library.load(slug)
    broken.questions = {"team": choice({})}
    with pytest.raises(SchemaError, match='question "team", field "criteria": a choice needs at least one option'):
        plain_library.update(slug, broken)
    assert (plain_library.directory / f"{slug}.json").read_bytes() == before


def test_duplicate_and_delete(plain_library: SchemaLibrary):
    slug = plain_library.create(Schema(name="Invoices", questions=GOOD_QUESTIONS, version=1))
    changed = plain_library.load(slug)
    changed.questions = {"only": noul()}
    plain_library.update(slug, changed)
    copy = plain_library.duplicate(slug)
    assert copy == "invoices-copy"
    assert plain_library.load(copy).name == "Invoices (copy)"
    assert plain_library.load(copy).version == 1
    assert plain_library.load(copy).questions == {"only": noul()}
    plain_library.delete(slug)
    assert plain_library.slugs() == [copy]
    with pytest.raises(SchemaError, match='no schema "invoices"'):
        plain_library.load(slug)


def test_export_then_import_round_trips(plain_library: SchemaLibrary, tmp_path: Path):
    slug = plain_library.create(Schema(name="Round trip", questions=GOOD_QUESTIONS, description="d"))
    exported = plain_library.export_json(slug)
    other = SchemaLibrary(tmp_path / "other")
    new_slug = other.import_json(exported.encode("utf-8"), filename="anything.json")
    assert new_slug == "round-trip"
    assert other.export_json(new_slug) == exported


def test_import_ignores_the_uploaded_file_name_for_paths(plain_library: SchemaLibrary, tmp_path: Path):
    text = json.dumps({"name": "../../etc/passwd", "version": 1, "description": "", "questions": GOOD_QUESTIONS})
    slug = plain_library.import_json(text, filename="../../../evil.json")
    assert slug == "etc-passwd"
    assert [p.name for p in plain_library.directory.iterdir()] == ["etc-passwd.json"]
    assert not (tmp_path / "evil.json").exists()
    with pytest.raises(SchemaError, match="is not a schema id"):
        plain_library.load("../secrets")
    with pytest.raises(SchemaError, match="is not a schema id"):
        plain_library.delete("/etc/passwd")


def test_import_a_bare_questions_map_or_a_request_named_after_the_file(plain_library: SchemaLibrary):
    slug = plain_library.import_json(json.dumps(GOOD_QUESTIONS), filename="Ticket triage.json")
    assert slug == "ticket-triage" and plain_library.load(slug).questions == GOOD_QUESTIONS
    request = {"model": "clef", "state": "hi", "questions": GOOD_QUESTIONS}
    slug = plain_library.import_json(json.dumps(request), filename="req.json")
    assert plain_library.load(slug).name == "req"


def test_import_reports_json_syntax_errors_with_line_and_column(plain_library: SchemaLibrary):
    with pytest.raises(SchemaError, match=r"bad\.json: not valid JSON: Expecting ',' delimiter at line 3, column 3"):
        plain_library.import_json('{"name": "x",\n "version": 1\n  "questions": {}}', filename="bad.json")
    with pytest.raises(SchemaError, match="not UTF-8"):
        plain_library.import_json(b"\xff\xfe\x00garbage", filename="bin.json")


def test_import_with_overwrite_replaces_same_named_schema(plain_library: SchemaLibrary):
    plain_library.create(Schema(name="Same", questions={"a": noul()}))
    text = Schema(name="Same", questions=GOOD_QUESTIONS).to_json()
    assert plain_library.import_json(text) == "same-2"
    assert plain_library.import_json(text, overwrite=True) == "same"
    assert plain_library.load("same").questions == GOOD_QUESTIONS


def test_listing_shows_broken_files_instead_of_failing(plain_library: SchemaLibrary):
    plain_library.create(Schema(name="Good", questions=GOOD_QUESTIONS))
    (plain_library.directory / "broken.json").write_text('{"name": "Broken", "questions": {}}\n', encoding="utf-8")
    entries = {e.slug: e for e in plain_library.list()}
    assert entries["good"].problem is None and entries["good"].question_count == 3
    assert "\"questions\": at least one question is required" in entries["broken"].problem


def test_library_folder_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CLEF_SCHEMAS_DIR", str(tmp_path / "from-env"))
    assert SchemaLibrary().directory == tmp_path / "from-env"
    monkeypatch.delenv("CLEF_SCHEMAS_DIR")
    assert SchemaLibrary().directory == Path("schemas")


def test_slugify():
    assert slugify("Security alert triage") == "security-alert-triage"
    assert slugify("Réclamation dégâts — photo") == "reclamation-degats-photo"
    assert slugify("../..") == "schema"
    assert len(slugify("x" * 500)) == 80


# --- the shipped examples --------------------------------------------------------------------------------------


def test_shipped_example_schemas_are_valid_lint_clean_and_canonical():
    library = SchemaLibrary(SHIPPED)
    slugs = library.slugs()
    assert len(slugs) >= 4
    for slug in slugs:
        schema = library.load(slug)
        assert schema.problems() == [], slug
        assert 3 <= len(schema.examples) <= 5, slug
        types = {q["type"] for q in schema.questions.values()}
        assert types == {"noul", "choice", "score"}, slug
        # The file is exactly what the library would write: hand edits that break the format show up here.
        assert (SHIPPED / f"{slug}.json").read_text(encoding="utf-8") == schema.to_json(), slug


def test_shipped_schemas_keep_their_question_ids():
    """The example case sets refer to these question ids; renaming one breaks them."""
    expected_ids = {
        "invoice-triage": ["is_invoice", "expense_category", "po_match", "needs_approval", "fraud_risk",
                           "payment_urgency"],
        "support-ticket-routing": ["team", "priority", "customer_mood", "churn_threat", "needs_human_agent"],
        "vehicle-damage-claim-photo": ["photo_shows_vehicle", "damaged_area", "severity", "matches_description",
                                       "needs_adjuster_visit"],
        "security-alert-triage": ["verdict", "attack_tactic", "severity", "page_oncall", "privileged_account"],
    }
    library = SchemaLibrary(SHIPPED)
    for slug, ids in expected_ids.items():
        assert list(library.load(slug).questions) == ids, slug
