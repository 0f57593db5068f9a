"""Files as people export them, for the import tests: tickets with accents, smart quotes, commas and semicolons in
their text, written in each encoding, delimiter and format that spreadsheets and scripts produce, and the states and
expected answers they must import as."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass

import openpyxl

from clef_workbench.store import Store

HEADER = ["subject", "body", "expected_team", "priority"]

# Rows each encoding can carry: Latin-1 has accents but no smart quotes; Windows-1252 adds “ ” ’ – … €.
LATIN1_ROWS = [
    ["Remboursement demandé", "Bonjour, je suis Françoise Dupré; j'ai été débitée deux fois.", "billing", "2"],
    ["Envío dañado", "José Núñez: el paquete llegó roto, ¿me devuelven el dinero?", "shipping", "1"],
    ["Konto gesperrt", "Björk Guðmundsdóttir aus Reykjavík kann sich nicht anmelden.", "account_security", "3"],
]
CP1252_ROWS = LATIN1_ROWS + [
    ["“Refund” please", "It’s been three weeks – still nothing… I paid €40 twice.", "billing", "2"],
]
UNICODE_ROWS = CP1252_ROWS + [["配送の遅れ", "注文 #4411 がまだ届きません。", "shipping", "1"]]


def delimited(rows: list[list[str]], delimiter: str = ",", *, header: list[str] = HEADER,
              line_end: str = "\r\n") -> str:
    out = io.StringIO()
    writer = csv.writer(out, delimiter=delimiter, lineterminator=line_end)
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def xlsx(rows: list[list[str]]) -> bytes:
    workbook = openpyxl.Workbook()
    sheet = workbook.active
    sheet.append(HEADER)
    for subject, body, team, priority in rows:
        sheet.append([subject, body, team, int(priority)])  # a number cell, as Excel stores a typed 2
    out = io.BytesIO()
    workbook.save(out)
    return out.getvalue()


def jsonl(rows: list[list[str]]) -> bytes:
    return "".join(json.dumps({"state": {"subject": s, "body": b}, "expected": {"team": t, "priority": int(p)}},
                              ensure_ascii=False) + "\n" for s, b, t, p in rows).encode()


@dataclass
class Kind:
    file_name: str
    data: bytes
    rows: list[list[str]]
    encoding: str | None
    delimiter: str | None


KINDS = {
    "utf-16 with BOM": Kind("tickets.csv", delimited(UNICODE_ROWS).encode("utf-16"), UNICODE_ROWS, "utf-16", ","),
    "utf-16 big-endian with BOM": Kind("tickets.csv", ("\ufeff" + delimited(UNICODE_ROWS)).encode("utf-16-be"),
                                       UNICODE_ROWS, "utf-16", ","),
    # Excel's "Save as: Unicode text": tab-separated UTF-16 LE with a BOM, CRLF, in a .txt file
    "excel unicode text": Kind("tickets.txt", b"\xff\xfe" + delimited(UNICODE_ROWS, "\t").encode("utf-16-le"),
                               UNICODE_ROWS, "utf-16", "\t"),
    "latin-1": Kind("tickets.csv", delimited(LATIN1_ROWS).encode("latin-1"), LATIN1_ROWS, "latin-1", ","),
    "cp1252": Kind("tickets.csv", delimited(CP1252_ROWS).encode("cp1252"), CP1252_ROWS, "cp1252", ","),
    "utf-8 with BOM": Kind("tickets.csv", delimited(UNICODE_ROWS).encode("utf-8-sig"), UNICODE_ROWS, "utf-8-sig",
                           ","),
    # Excel in a locale whose decimal mark is a comma writes semicolons; the bodies hold commas
    "semicolon": Kind("tickets.csv", delimited(UNICODE_ROWS, ";").encode(), UNICODE_ROWS, "utf-8", ";"),
    "tab": Kind("tickets.tsv", delimited(UNICODE_ROWS, "\t", line_end="\n").encode(), UNICODE_ROWS, "utf-8", "\t"),
    "jsonl": Kind("tickets.jsonl", jsonl(UNICODE_ROWS), UNICODE_ROWS, "utf-8", None),
    "xlsx": Kind("tickets.xlsx", xlsx(UNICODE_ROWS), UNICODE_ROWS, None, None),
}


def expected_cases(rows: list[list[str]]) -> list[tuple[dict, dict]]:
    return [({"subject": s, "body": b}, {"team": t, "priority": int(p)}) for s, b, t, p in rows]


def stored(store: Store, set_id: int) -> list[tuple[dict, dict]]:
    return [(c["state"], c["expected"]) for c in store.list_cases(set_id)]


RAGGED = ("subject,body,expected_team,priority\r\n"
          "Refund,\"I was charged twice, please help\",billing,2\r\n"
          "Login,cannot log in\r\n"                                    # row 3: two cells short
          "Parcel,\"Arrived broken\",shipping,1,extra\r\n"              # row 4: one cell too many
          "Invoice,Wrong VAT number on INV-88,billing,0\r\n")
