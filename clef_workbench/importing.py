"""Files people export, read into cases: CSV and tab-separated text in the encoding it was saved in (detected,
or chosen), its delimiter sniffed (or chosen), JSONL, and Excel .xlsx workbooks. Rows that do not fit the header
(ragged, empty, or with an empty state) are listed by row number and imported only without them, when the user
agrees. The Case sets page's Import tab and `python -m clef_workbench import` both read files through here.

Row numbers count the header as row 1, as a spreadsheet shows them.
"""

from __future__ import annotations

import csv
import io
import re
import zipfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import charset_normalizer
import pandas as pd

from clef_workbench.casesets import CaseImportError, CsvMapping, label_like_columns, parse_jsonl, parse_rows
from clef_workbench.store import NewCase

# The encodings spreadsheets and text editors save in: codec → what the user is shown.
ENCODINGS = {
    "utf-8": "UTF-8",
    "utf-8-sig": "UTF-8 with BOM",
    "utf-16": "UTF-16 with BOM",
    "utf-16-le": "UTF-16 LE",
    "utf-16-be": "UTF-16 BE",
    "cp1252": "Windows-1252 (CP-1252)",
    "latin-1": "Latin-1 (ISO-8859-1)",
}
# Detection chooses among these only: left free, charset-normalizer reads short Western European text as Central
# European (cp1250 turns "Núñez" into "Núńez").
DETECTABLE = ["utf_8", "utf_16", "utf_16_le", "utf_16_be", "cp1252", "latin_1"]
DELIMITERS = {",": "comma", ";": "semicolon", "\t": "tab"}
SNIFF_ROWS = 50


@dataclass(frozen=True)
class BadRow:
    """A row that is not imported unless the user agrees to skip it: where it is and what is wrong with it."""

    row: int
    problem: str

    def __str__(self) -> str:
        return f"row {self.row}: {self.problem}"


class BadRowsError(CaseImportError):
    """The file has rows that do not fit (ragged, empty, empty state) and skipping them was not agreed to."""

    def __init__(self, bad_rows: list[BadRow]):
        self.bad_rows = list(bad_rows)
        super().__init__([str(bad) for bad in self.bad_rows])


@dataclass
class SourceFile:
    """A file as read: how it was decoded and split, its header, the rows that fit it and those that do not. JSONL
    keeps its text (each line is a record, not a row of columns)."""

    name: str
    kind: str  # "delimited", "jsonl" or "xlsx"
    encoding: str | None = None
    detected_encoding: str | None = None
    delimiter: str | None = None
    columns: list[str] = field(default_factory=list)
    rows: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    bad_rows: list[BadRow] = field(default_factory=list)
    text: str = ""

    def describe(self) -> str:
        """How the file was read, in words: "UTF-16 with BOM, tab-separated, 12 rows"."""
        parts = []
        if self.encoding:
            parts.append(ENCODINGS.get(self.encoding, self.encoding))
        if self.kind == "xlsx":
            parts.append("Excel workbook (first sheet)")
        if self.delimiter:
            parts.append(f"{DELIMITERS.get(self.delimiter, repr(self.delimiter))}-separated")
        if self.kind != "jsonl":
            count = len(self.rows) + len(self.bad_rows)
            parts.append(f"{count} row" + ("" if count == 1 else "s"))
        return ", ".join(parts)


FILE_SUFFIXES = (".csv", ".tsv", ".txt", ".jsonl", ".json", ".xlsx")  # what the Import tab and `import` take


def file_kind(name: str) -> str:
    suffix = Path(name).suffix.lower()
    if suffix == ".xlsx":
        return "xlsx"
    return "jsonl" if suffix in (".jsonl", ".json") else "delimited"


def read_source(name: str, data: bytes, *, encoding: str | None = None, delimiter: str | None = None) -> SourceFile:
    """Read an uploaded file: .xlsx as a workbook, .jsonl/.json as JSON lines, anything else as delimited text.
    `encoding` and `delimiter` override what is detected. Raises CaseImportError saying what is wrong and where."""
    if not data:
        raise CaseImportError([f"{name} is empty"])
    kind = file_kind(name)
    if kind == "xlsx":
        return read_xlsx(name, data)
    detected = detect_encoding(data)
    text = decode(data, encoding or detected)
    if kind == "jsonl":
        return SourceFile(name, kind, encoding=encoding or detected, detected_encoding=detected, text=text)
    source = read_delimited(text, delimiter, name=name)
    source.encoding, source.detected_encoding = encoding or detected, detected
    return source


def detect_encoding(data: bytes) -> str | None:
    """The codec of `data` among ENCODINGS, or None when it is none of them (not text, or another encoding)."""
    match = charset_normalizer.from_bytes(data, cp_isolation=DETECTABLE).best()
    if match is None:
        return None
    if match.encoding == "utf_8":
        return "utf-8-sig" if match.bom else "utf-8"
    if match.encoding in ("utf_16", "utf_16_le", "utf_16_be"):
        return match.encoding.replace("_", "-")
    # Latin-1 and Windows-1252 differ only in 0x80-0x9F: control characters in Latin-1, the smart quotes, dashes
    # and € that Windows writes in Windows-1252.
    if re.search(rb"[\x80-\x9f]", data):
        try:
            data.decode("cp1252")
            return "cp1252"
        except UnicodeDecodeError:
            pass
    return "latin-1"


def decode(data: bytes, encoding: str | None) -> str:
    """`data` as text in `encoding` (a byte order mark dropped); CaseImportError with the line of the first byte
    that is not valid in it."""
    if encoding is None:
        raise CaseImportError(["the file is not text in a supported encoding (" + ", ".join(ENCODINGS.values())
                               + "); choose the encoding it was saved in"])
    try:
        text = data.decode(encoding)
    except LookupError:
        raise CaseImportError([f"unknown encoding {encoding!r} (use one of: {', '.join(ENCODINGS)})"]) from None
    except UnicodeDecodeError as exc:
        line = data[:exc.start].decode(encoding, errors="replace").count("\n") + 1
        raise CaseImportError([f"line {line}: byte 0x{data[exc.start]:02x} is not valid "
                               f"{ENCODINGS.get(encoding, encoding)}; choose the encoding the file was saved in"]
                              ) from None
    if "\x00" in text:  # text never holds NUL: a binary file, or UTF-16 read as a one-byte encoding
        line = text[:text.index("\x00")].count("\n") + 1
        raise CaseImportError([f"line {line} holds a NUL character, which {ENCODINGS.get(encoding, encoding)} text "
                               "never does: the file is binary, or UTF-16 without a byte order mark (choose UTF-16 "
                               "LE or BE)"])
    return text.removeprefix("\ufeff")


def sniff_delimiter(text: str) -> str:
    """The delimiter among comma, semicolon and tab that splits the most of the first rows into the header's
    number of columns (ties go to the earlier; a file of one column reads as comma-separated)."""
    head = text.splitlines()[:SNIFF_ROWS]

    def fit(delimiter: str) -> tuple[int, int]:
        try:
            rows = list(csv.reader(head, delimiter=delimiter))
        except csv.Error:  # e.g. a cell over the csv module's size limit: read_delimited names it
            return 0, 0
        width = len(rows[0]) if rows else 0
        return (sum(len(row) == width for row in rows[1:]) if width > 1 else 0), width

    return max(DELIMITERS, key=fit)


def read_delimited(text: str, delimiter: str | None = None, *, name: str = "the file") -> SourceFile:
    """Delimited text → header and rows; `delimiter` None: sniffed."""
    used = delimiter or sniff_delimiter(text)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=used)
    try:
        records = list(reader)
    except csv.Error as exc:
        raise CaseImportError([f"line {reader.line_num}: {exc}"]) from None
    source = SourceFile(name, "delimited", delimiter=used)
    return _split_rows(source, records)


def read_xlsx(name: str, data: bytes) -> SourceFile:
    """The first sheet of an Excel workbook, every cell as the text it shows (an empty cell as "")."""
    try:
        frame = pd.read_excel(io.BytesIO(data), header=None, dtype=str, keep_default_na=False, engine="openpyxl")
    except (zipfile.BadZipFile, ValueError, KeyError, OSError) as exc:
        raise CaseImportError([f"{name} is not an Excel .xlsx workbook ({exc})"]) from None
    return _split_rows(SourceFile(name, "xlsx"), frame.values.tolist())


def _split_rows(source: SourceFile, records: list[list[str]]) -> SourceFile:
    if not records or not any(cell.strip() for cell in records[0]):
        raise CaseImportError([f"row 1: {source.name} has no header row (the column names)"])
    header = list(records[0])
    while header and not header[-1].strip():  # spreadsheets pad a row with empty cells; a named column is kept
        header.pop()
    duplicates = sorted(c for c, count in Counter(header).items() if count > 1)
    if duplicates:
        raise CaseImportError([f"row 1: column name(s) {', '.join(map(repr, duplicates))} appear more than once"])
    source.columns = header
    for number, cells in enumerate(records[1:], start=2):
        cells = list(cells)
        if not any(cell.strip() for cell in cells):
            source.bad_rows.append(BadRow(number, "empty"))
            continue
        if source.kind == "xlsx":  # a sheet pads rows to its widest one: only a value outside the header counts
            while len(cells) > len(header) and not cells[-1].strip():
                cells.pop()
        if len(cells) != len(header):
            source.bad_rows.append(BadRow(number, f"{len(cells)} cells where the header has {len(header)} columns"))
            continue
        source.rows.append((number, dict(zip(header, cells, strict=True))))
    return source


def empty_state_rows(source: SourceFile, mapping: CsvMapping) -> list[BadRow]:
    """Rows whose every state cell is empty: imported, they would be cases with an empty state."""
    state_columns = [mapping.state_text_column] if mapping.state_text_column else mapping.state_columns
    if not state_columns or not set(state_columns) <= set(source.columns):
        return []  # parse_rows names the missing mapping
    return [BadRow(number, "the state is empty (" + ", ".join(state_columns) + " have no value)")
            for number, row in source.rows if not any(row[column].strip() for column in state_columns)]


def repeated_id_rows(source: SourceFile, id_column: str, skipped: set[int]) -> list[BadRow]:
    """Rows whose id an earlier row (not otherwise skipped) has: a case's own id names one case."""
    first: dict[str, int] = {}
    repeated = []
    for number, row in source.rows:
        value = row.get(id_column, "").strip()
        if not value or number in skipped:
            continue
        if value in first:
            repeated.append(BadRow(number, f"its id {value!r} is row {first[value]}'s too (an id names one case)"))
        else:
            first[value] = number
    return repeated


def bad_rows(source: SourceFile, mapping: CsvMapping | None) -> list[BadRow]:
    """Every row that would not import as a case, in row order."""
    found = list(source.bad_rows) + (empty_state_rows(source, mapping) if mapping else [])
    if mapping and mapping.id_column:
        found += repeated_id_rows(source, mapping.id_column, {bad.row for bad in found})
    return sorted(found, key=lambda bad: bad.row)


def parse_cases(source: SourceFile, mapping: CsvMapping | None, schema: dict | None, *,
                skip_bad_rows: bool = False, base_dir: Path | None = None) -> list[NewCase]:
    """The cases of a read file. Raises BadRowsError when rows do not fit and `skip_bad_rows` is false (nothing
    is imported then), and CaseImportError for bad cells."""
    if source.kind == "jsonl":
        return parse_jsonl(source.text, schema, base_dir=base_dir)
    skipped = bad_rows(source, mapping)
    if skipped and not skip_bad_rows:
        raise BadRowsError(skipped)
    skip = {bad.row for bad in skipped}
    rows = [(number, row) for number, row in source.rows if number not in skip]
    return parse_rows(source.columns, rows, mapping or CsvMapping(), schema, base_dir=base_dir)


def guess_expected_columns(columns: list[str], question_ids: Sequence[str]) -> dict[str, str]:
    """question id → the column named after it (`team`, `expected_team`, `expected.team`), where there is one."""
    guessed = {}
    for question_id in question_ids:
        for column in columns:
            name = column.strip().lower()
            if name in (question_id.lower(), *(f"expected{sep}{question_id.lower()}" for sep in "._ ")):
                guessed[question_id] = column
                break
    return guessed


def suggested_state_columns(columns: list[str], used: set[str], question_ids: Sequence[str] = ()) -> list[str]:
    """Columns the model should read: those not mapped to answers, tags or media and not named like an answer."""
    label_like = set(label_like_columns(columns, question_ids))
    return [c for c in columns if c.strip() and c not in used and c not in label_like]


# Column names of a record's own id (`ticket_id`, `id`, `case key`, `ticketId`): kept with the case as its source
# id, never evidence the model reads.
ID_COLUMN = re.compile(r"^(.*[ _.-])?(id|uuid|key|ref)$|[a-z]Id$", re.IGNORECASE)


def id_like_columns(columns: list[str]) -> list[str]:
    """The columns named like a record's own id, in file order (the first is suggested as the cases' source id)."""
    return [c for c in columns if ID_COLUMN.search(c.strip())]


def suggest_mapping(columns: list[str], question_ids: Sequence[str] = ()) -> CsvMapping:
    """The mapping proposed for a file's columns (the Case sets page's and `python -m clef_workbench import`'s
    default): a column named after a question (`team`, `expected_team`) holds its expected answers; the first
    id-like column (`ticket_id`) is the case's own id; `tags` its tags; every other column is evidence the model
    reads, except those named like an answer (`label`, `gold_*`, a question of `question_ids`), which the model
    must never read unless the user maps them there."""
    expected = {column: question_id for question_id, column in guess_expected_columns(columns, question_ids).items()}
    id_column = next((c for c in id_like_columns(columns) if c not in expected), None)
    tags_column = "tags" if "tags" in columns and "tags" not in expected else None
    used = {c for c in (*expected, id_column, tags_column) if c}
    return CsvMapping(state_columns=suggested_state_columns(columns, used, question_ids), expected_columns=expected,
                      tags_column=tags_column, id_column=id_column)

