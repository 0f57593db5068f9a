"""Case sets in and out: CSV / JSONL import with column mapping, JSONL / CSV export, results export, and building
System One requests from a stored case and a schema.

A schema here is a dict {name, version, description, questions} where `questions` is the System One map
id → {type, instructions, criteria}. Expected answers are stored as: choice → option id (str), noul → bool,
score → level index (int).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from clef_engine import protocol
from clef_workbench.stats import answer_frame, state_text
from clef_workbench.store import Case, NewCase, Result, Store, media_content_type
from clef_workbench.store.review import coerce_label


class CaseImportError(ValueError):
    """An import was refused; `problems` lists every bad cell as 'row N, column C: what is wrong'. Nothing was
    imported."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        shown = "; ".join(self.problems[:10])
        more = f" (and {len(self.problems) - 10} more)" if len(self.problems) > 10 else ""
        super().__init__(f"{len(self.problems)} problem(s), nothing imported: {shown}{more}")


# -- requests ---------------------------------------------------------------------------------------------------

data_url = protocol.data_url


def build_request(case: Case, schema: dict, *, model: str = protocol.DEFAULT_MODEL_NAME) -> dict:
    """System One request for a stored case (Store.get_case with media) and a schema. Media stay the bytes the
    store holds: the local engine takes bytes, and a remote one sends them as data URLs (remote.media_for_wire)."""
    return protocol.build_request(
        case["state"], schema["questions"], model=model,
        images=[m["data"] for m in case.get("images") or ()],
        videos=[m["data"] for m in case.get("videos") or ()],
    )


# -- expected answers -------------------------------------------------------------------------------------------

def option_ids(question: dict) -> list[str]:
    """Answer keys of a question (the keys of its answer's probabilities), as used in distributions and expected
    answers."""
    return list(protocol.option_ids(question["type"], question.get("criteria")))


# -- CSV import -------------------------------------------------------------------------------------------------

@dataclass
class CsvMapping:
    """How CSV columns become a case.

    state_columns: columns that become fields of a JSON-object state (a dotted name like `customer.tier` nests);
    state_text_column: alternatively one column whose text is the whole state (JSON text is parsed if it is an
    object or array); expected_columns: column → question id; tags_column: tags separated by ';' or ',';
    id_column: the case's own id (a ticket number: kept with the case, never sent to the model);
    image_columns / video_columns: file paths (relative to the CSV's folder) or data URLs."""

    state_columns: list[str] = field(default_factory=list)
    state_text_column: str | None = None
    expected_columns: dict[str, str] = field(default_factory=dict)
    tags_column: str | None = None
    id_column: str | None = None
    image_columns: list[str] = field(default_factory=list)
    video_columns: list[str] = field(default_factory=list)


def _infer_scalar(text: str) -> Any:
    """CSV cell → JSON scalar: integers, finite floats and true/false become numbers and booleans."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for number_type in (int, float):
        try:
            number = number_type(text)
        except ValueError:
            continue
        return number if math.isfinite(number) else text
    return text


def _set_dotted(target: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        target = target.setdefault(part, {})
    target[parts[-1]] = value


def json_value(text: str) -> Any:
    """JSON text → value, refusing with a ValueError what Python's json reads but no case can hold: NaN, Infinity
    and numbers too large for a float (every request built from them fails) and lone surrogates (`"\\ud800"`: not
    a character, it cannot be stored)."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not a JSON number (write a number, or null)")

    def finite(number: str) -> float:
        value = float(number)
        if not math.isfinite(value):
            raise ValueError(f"{number[:40]} is too large for a number")
        return value

    try:
        value = json.loads(text, parse_constant=refuse, parse_float=finite)
        json.dumps(value, ensure_ascii=False).encode()
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    except UnicodeEncodeError as exc:
        raise ValueError(f"holds a lone surrogate (\\u{ord(exc.object[exc.start]):04x}), which is not a character"
                         ) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return value


def _load_media(ref: Any, kind: str, base_dir: Path | None) -> bytes:
    """An image or video named in a file: {"content_type", "base64"}, a base64 data URL, or a path inside
    `base_dir`, the folder of a file read from disk. An uploaded file (no `base_dir`) names no paths: it must never
    make the server read its own files."""
    if isinstance(ref, dict):
        data = base64.b64decode(ref["base64"], validate=True)
    elif (ref := str(ref).strip()).startswith("data:"):
        header, _, payload = ref.partition(",")
        if ";base64" not in header:
            raise ValueError("data URL must be base64-encoded")
        data = base64.b64decode(payload, validate=True)
    elif base_dir is None:
        raise ValueError(f"{kind} {ref[:80]!r} is a file path, which an uploaded file cannot name: embed the {kind} "
                         f"as a data URL (data:{kind}/…;base64,…)")
    else:
        folder = base_dir.resolve()
        path = (folder / ref).resolve()
        if not path.is_relative_to(folder):
            raise ValueError(f"{kind} file {ref[:80]!r} is outside the file's folder {folder}: media paths must point "
                             "inside it")
        if not path.is_file():
            raise ValueError(f"{kind} file {str(path)!r} not found")
        data = path.read_bytes()
    media_content_type(data, kind)  # raises with a clear message if the bytes are not a supported format
    return data


def parse_expected(answers: list[tuple[str, str, Any]], schema: dict | None, problems: list[str]) -> dict[str, Any]:
    """(where, question id, raw answer) → the expected answers to store; each bad one is added to `problems`."""
    expected: dict[str, Any] = {}
    questions = (schema or {}).get("questions", {})
    for where, question_id, value in answers:
        if schema is None:
            expected[question_id] = value
        elif question_id not in questions:
            problems.append(f"{where}: the schema {schema.get('name')!r} has no such question")
        else:
            try:
                question = questions[question_id]
                expected[question_id] = coerce_label(question_id, question["type"], option_ids(question), value)
            except ValueError as exc:
                problems.append(f"{where}: {exc}")
    return expected


def _media(refs: list[tuple[str, str, Any]], base_dir: Path | None, problems: list[str]) -> dict[str, list[bytes]]:
    """(where, "image" or "video", reference) → {"images": [bytes], "videos": [bytes]}; each bad one is added to
    `problems`."""
    media: dict[str, list[bytes]] = {"images": [], "videos": []}
    for where, kind, ref in refs:
        try:
            media[kind + "s"].append(_load_media(ref, kind, base_dir))
        except (ValueError, KeyError, TypeError, OSError) as exc:
            problems.append(f"{where}: {exc}")
    return media


def _parsed(cases: list[NewCase], problems: list[str], no_cases: str) -> list[NewCase]:
    if problems or not cases:
        raise CaseImportError(problems or [no_cases])
    return cases


def parse_rows(header: list[str], rows: list[tuple[int, dict[str, str]]], mapping: CsvMapping,
               schema: dict | None = None, *, base_dir: Path | None = None) -> list[NewCase]:
    """Rows of a table (row number, column → cell text) → case dicts (state, expected, tags, images, videos).
    Raises CaseImportError listing every bad cell."""
    problems: list[str] = []
    in_header = set(header)  # not the list: thousands of columns, each looked up
    for column in [*mapping.state_columns, *mapping.expected_columns, *mapping.image_columns, *mapping.video_columns,
                   *(c for c in (mapping.state_text_column, mapping.tags_column, mapping.id_column) if c)]:
        if column not in in_header:
            problems.append(f"column {column!r} is not in the CSV (columns: {', '.join(header)})")
    if not mapping.state_columns and not mapping.state_text_column:
        problems.append("map at least one column to the state")
    state_fields = set(mapping.state_columns)
    for column in mapping.state_columns:
        parts = column.split(".")
        for end in range(1, len(parts)):
            if ".".join(parts[:end]) in state_fields:
                problems.append(f"state columns {'.'.join(parts[:end])!r} and {column!r} both name the state field "
                                f"{'.'.join(parts[:end])!r}: map one of them")
    questions = (schema or {}).get("questions", {})
    for column, question_id in mapping.expected_columns.items():
        if schema is not None and question_id not in questions:
            problems.append(f"column {column!r} is mapped to question {question_id!r}, which the schema "
                            f"{schema.get('name')!r} does not have")
    if problems:
        raise CaseImportError(problems)
    cases: list[NewCase] = []
    for row_number, row in rows:
        where = f"row {row_number}"
        state: Any
        if mapping.state_text_column:
            text = row[mapping.state_text_column] or ""
            state = text
            if text.strip().startswith(("{", "[")):
                try:
                    state = json_value(text)
                except ValueError as exc:
                    problems.append(f"{where}, column {mapping.state_text_column!r}: looks like JSON but {exc}")
                    continue
        else:
            state = {}
            for column in mapping.state_columns:
                cell = row[column]
                if cell is None or cell == "":
                    continue  # empty cells are left out of the state rather than sent as ""
                _set_dotted(state, column, _infer_scalar(cell))
        if state in ({}, ""):
            problems.append(f"{where}: the state is empty (no value in its state column(s))")
            continue
        expected = parse_expected([(f"{where}, column {column!r}", question_id, cell)
                                   for column, question_id in mapping.expected_columns.items()
                                   if (cell := (row[column] or "").strip())], schema, problems)
        tags: list[str] = []
        if mapping.tags_column and row[mapping.tags_column]:
            tags = [t.strip() for t in row[mapping.tags_column].replace(",", ";").split(";") if t.strip()]
        media = _media([(f"{where}, column {column!r}", kind, row[column])
                        for kind, columns in (("image", mapping.image_columns), ("video", mapping.video_columns))
                        for column in columns if row[column]], base_dir, problems)
        source_id = (row[mapping.id_column] or "").strip() if mapping.id_column else ""
        cases.append(NewCase(state=state, expected=expected, tags=tags, source_id=source_id or None,
                             images=media["images"], videos=media["videos"]))
    return _parsed(cases, problems, "the file has no data rows")


def parse_jsonl(jsonl_text: str, schema: dict | None = None, *, base_dir: Path | None = None) -> list[NewCase]:
    """JSONL → case dicts. Each line: {"state": any, "id"?: the case's own id, "expected"?: {question: answer},
    "tags"?: [str], "images"?: [data URL | {"content_type", "base64"} | path], "videos"?: same}. Blank lines are
    skipped."""
    problems: list[str] = []
    cases: list[NewCase] = []
    id_lines: dict[str, int] = {}  # a case's own id → the line that has it first
    for line_number, line in enumerate(jsonl_text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"line {line_number}"
        try:
            record = json_value(line)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if not isinstance(record, dict) or "state" not in record:
            problems.append(f"{where}: each line must be an object with a 'state' field")
            continue
        state = record["state"]
        if state is None or state in ({}, []) or (isinstance(state, str) and not state.strip()):
            problems.append(f"{where}: the state is empty (the model would have no evidence to read)")
            continue
        if not isinstance(record.get("expected") or {}, dict):
            problems.append(f"{where}, expected: must be an object of question → answer")
            continue
        expected = parse_expected([(f"{where}, expected.{question_id}", question_id, value)
                                   for question_id, value in (record.get("expected") or {}).items()],
                                  schema, problems)
        for kind in ("images", "videos"):
            if not isinstance(record.get(kind) or [], list):
                problems.append(f"{where}, {kind}: must be a list")
        media = _media([(f"{where}, {kind}s[{index}]", kind, ref) for kind in ("image", "video")
                        if isinstance(refs := record.get(kind + "s") or [], list)
                        for index, ref in enumerate(refs)], base_dir, problems)
        tags = record.get("tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            problems.append(f"{where}, tags: must be a list of strings")
            tags = []
        source_id = record.get("id")
        if source_id is not None and not isinstance(source_id, str | int):
            problems.append(f"{where}, id: must be text or a whole number")
            source_id = None
        elif source_id is not None and id_lines.setdefault(str(source_id), line_number) != line_number:
            problems.append(f"{where}, id: {str(source_id)!r} is line {id_lines[str(source_id)]}'s too (an id names "
                            "one case)")
        cases.append(NewCase(state=state, expected=expected, tags=tags,
                             source_id=None if source_id is None else str(source_id),
                             images=media["images"], videos=media["videos"]))
    return _parsed(cases, problems, "the file has no records")


def import_cases(store: Store, case_set_id: int, cases: list[NewCase]) -> list[int]:
    """Add parsed cases in one transaction, skipping those already in the set (a file imported twice adds its rows
    once); the ids of the cases added."""
    return store.add_cases(case_set_id, cases, skip_existing=True)


# Column names that say they hold an answer rather than evidence: put into the state, they leak the answer into
# the model's input.
LABEL_COLUMN = re.compile(r"^(expected|label|labels|gold|golden|answer|answers|target|truth|ground[ _.-]?truth|"
                          r"correct|y)([ _.-].*)?$", re.IGNORECASE)


def label_like_columns(columns: list[str], question_ids: Sequence[str] = ()) -> list[str]:
    """The columns that look like expected answers: named expected_* / label / gold / answer / target / truth …,
    or named after a question of the schema."""
    questions = {q.lower() for q in question_ids}
    return [c for c in columns if LABEL_COLUMN.match(c.strip()) or c.strip().lower() in questions]


# -- export -----------------------------------------------------------------------------------------------------

def export_jsonl(store: Store, case_set_id: int) -> str:
    """The case set as JSONL, media inlined as data URLs (re-importable with parse_jsonl)."""
    lines = []
    for summary in store.list_cases(case_set_id):
        case = store.get_case(summary["id"])
        record: dict[str, Any] = {"state": case["state"], "expected": case["expected"], "tags": case["tags"]}
        if case["source_id"] is not None:
            record = {"id": case["source_id"], **record}
        for kind, media in (("images", case["images"]), ("videos", case["videos"])):
            if media:
                record[kind] = [data_url(m["content_type"], m["data"]) for m in media]
        lines.append(json.dumps(record, ensure_ascii=False))
    return "\n".join(lines) + ("\n" if lines else "")


def cases_table(store: Store, case_set_id: int) -> pd.DataFrame:
    """One row per case: object states flattened to `state.<key>` (values JSON-encoded unless scalar), an expected
    answer per question, media counted."""
    cases = store.list_cases(case_set_id)
    rows = []
    flatten = bool(cases) and all(isinstance(c["state"], dict) for c in cases)
    for case in cases:
        row: dict[str, Any] = {"id": case["id"], "source_id": case["source_id"]}
        if flatten:
            for key, value in case["state"].items():
                row[f"state.{key}"] = value if isinstance(value, str | int | float | bool) or value is None \
                    else json.dumps(value, ensure_ascii=False)
        else:
            row["state"] = state_text(case["state"])
        for question_id, value in case["expected"].items():
            row[f"expected.{question_id}"] = value
        row["tags"] = "; ".join(case["tags"])
        row["images"] = case["image_count"]
        row["videos"] = case["video_count"]
        rows.append(row)
    return pd.DataFrame(rows)


def export_csv(store: Store, case_set_id: int) -> str:
    """The case set as CSV (see cases_table; media are counted, not inlined — use JSONL to carry them)."""
    return excel_csv(cases_table(store, case_set_id))


def excel_csv(table: pd.DataFrame) -> str:
    """A table as CSV text that Excel opens as UTF-8: a byte order mark first (without one, Excel reads it in the
    machine's legacy code page and "Müller" shows as "MÃ¼ller"). The workbench's import drops the mark; Python reads
    it with encoding="utf-8-sig"."""
    return "\ufeff" + table.to_csv(index=False)


def _run_answers(store: Store, run_id: int) -> tuple[list[Result], pd.DataFrame, dict[int, str | None]]:
    """A run's results, their answer frame, and each case's own id."""
    results = store.list_results(run_id)
    return results, answer_frame(results, store.get_run(run_id)["schema"]), {r["case_id"]: r["source_id"]
                                                                             for r in results}


def results_table(store: Store, run_id: int) -> pd.DataFrame:
    """One row per case × question of a run: answer, confidence, margin, expected, correct, score, and one
    `p:<option>` column per option with that option's probability (empty for options of other questions).
    Failed cases appear once with their error."""
    results, frame, source_ids = _run_answers(store, run_id)
    rows = []
    for row in frame.itertuples(index=False):
        out = {"run_id": run_id, "case_id": row.case_id, "source_id": source_ids[row.case_id],
               "position": row.position, "question_id": row.question_id, "question_type": row.question_type,
               "predicted": row.predicted, "confidence": row.confidence, "margin": row.margin, "score": row.score,
               "expected": row.expected, "correct": row.correct, "latency_ms": row.latency_ms,
               "input_tokens": row.input_tokens, "error": None}
        out.update({f"p:{option}": p for option, p in row.distribution.items()})
        rows.append(out)
    for result in results:
        if result["error"]:
            rows.append({"run_id": run_id, "case_id": result["case_id"], "source_id": result["source_id"],
                         "position": result["position"], "error": result["error"]})
    # the columns are named even when no case has an answer (every case failed): a run of errors exports its errors
    options = list(dict.fromkeys(c for row in rows for c in row if c.startswith("p:")))
    table = pd.DataFrame(rows, columns=[*RESULT_COLUMNS, *options])
    if not table.empty:
        table = table.sort_values(["position", "question_id"], kind="stable", na_position="last")
    return table.reset_index(drop=True)


RESULT_COLUMNS = ["run_id", "case_id", "source_id", "position", "question_id", "question_type", "predicted",
                  "confidence", "margin", "score", "expected", "correct", "latency_ms", "input_tokens", "error"]


EXPORT_DECIMALS = 4


def plain_label(value: Any) -> str:
    """An answer as a person writes it in a cell: true / false, 2, billing — never JSON-quoted."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value).lower() if isinstance(value, bool) else str(value)


def export_results_csv(store: Store, run_id: int) -> str:
    """The results table for a person with a spreadsheet: the case's state as text beside each answer,
    probabilities, confidence and margin rounded to 4 decimals, correct and expected as true / false / plain
    labels (empty where the case has no expected answer)."""
    table = results_table(store, run_id)
    if table.empty:
        return excel_csv(table)
    states = {r["case_id"]: state_text(r["state"]) for r in store.list_results(run_id)}
    table.insert(table.columns.get_loc("question_id"), "state", table["case_id"].map(states))
    numbers = [c for c in table.columns if c.startswith("p:")] + ["confidence", "margin", "score"]
    table[numbers] = table[numbers].astype(float).round(EXPORT_DECIMALS)
    table["correct"] = table["correct"].map(lambda v: "" if pd.isna(v) else ("true" if v else "false"))
    table["expected"] = table["expected"].map(plain_label)
    return excel_csv(table)


def export_results_jsonl(store: Store, run_id: int) -> str:
    """One JSON object per case × question with a `probabilities` map of every option."""
    results, frame, source_ids = _run_answers(store, run_id)
    lines = []
    for row in frame.itertuples(index=False):
        lines.append(json.dumps({
            "run_id": run_id, "case_id": int(row.case_id), "source_id": source_ids[row.case_id],
            "question_id": row.question_id,
            "question_type": row.question_type, "predicted": row.predicted, "confidence": row.confidence,
            "margin": row.margin, "probabilities": row.distribution,
            "score": None if pd.isna(row.score) else row.score, "expected": row.expected,
            "correct": None if pd.isna(row.correct) else bool(row.correct),
            "latency_ms": row.latency_ms, "input_tokens": None if pd.isna(row.input_tokens)
            else int(row.input_tokens),
        }, ensure_ascii=False))
    for result in results:
        if result["error"]:
            lines.append(json.dumps({"run_id": run_id, "case_id": result["case_id"], "source_id": result["source_id"],
                                     "error": result["error"]}))
    return "\n".join(lines) + ("\n" if lines else "")


# -- shipped examples ---------------------------------------------------------------------------------------------

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples" / "casesets"


def load_example_case_sets(store: Store, schemas_dir: Path | None = None) -> dict[str, int]:
    """Import each shipped example case set (examples/casesets/<schema slug>.jsonl) whose schema is in the library
    and that is not there yet, as "Example: <schema name>"; {schema slug: case set id}."""
    from clef_workbench.schema_library import SchemaLibrary  # the library module is the other half of the workbench

    library = SchemaLibrary(schemas_dir)
    loaded: dict[str, int] = {}
    for path in sorted(EXAMPLES_DIR.glob("*.jsonl")):
        slug = path.stem
        if not library.exists(slug):
            continue
        schema = library.load(slug)
        name = f"Example: {schema.name}"
        existing = [s for s in store.list_case_sets() if s["name"] == name]
        if existing:
            loaded[slug] = existing[0]["id"]
            continue
        cases = parse_jsonl(path.read_text(encoding="utf-8"), schema.to_dict(), base_dir=EXAMPLES_DIR)
        case_set_id = store.create_case_set(name, schema_name=slug,
                                            description=f"Shipped example cases for the schema {schema.name!r}")
        store.add_cases(case_set_id, cases)
        loaded[slug] = case_set_id
    return loaded

