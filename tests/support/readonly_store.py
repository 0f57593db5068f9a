"""Run `python -m clef_workbench` with its database turning read-only after the run has written N chunks of
results (for tests/workbench/test_cli_run.py): `python -m tests.support.readonly_store N ARGS...`.

Tests run as root, for whom a read-only file mode changes nothing, and a read-only remount needs privileges a
container lacks. So the database is made read-only by SQLite itself: from the N-th results write on, every
connection the store hands out has `PRAGMA query_only` on, and every write fails inside SQLite with the error a
read-only file gives ("attempt to write a readonly database", sqlite3.OperationalError); reads go on, as they do on
a read-only file. Counting writes rather than watching the clock keeps the moment the same on a busy machine."""

from __future__ import annotations

import sqlite3
import sys
import threading

from clef_workbench.__main__ import main
from clef_workbench.store import Store
from clef_workbench.store.base import StoreBase


def turn_read_only_after(writes: int) -> None:
    read_only = threading.Event()
    written = [0]
    connect, record_results = StoreBase._conn, Store.record_results

    def conn(self: StoreBase) -> sqlite3.Connection:
        connection = connect(self)
        if read_only.is_set() and not connection.in_transaction:
            connection.execute("PRAGMA query_only = ON")
        return connection

    def counting(self: Store, run_id: int, results: list[dict]) -> int:
        new = record_results(self, run_id, results)
        written[0] += 1
        if written[0] >= writes:
            read_only.set()
        return new

    StoreBase._conn = conn  # type: ignore[method-assign]
    Store.record_results = counting  # type: ignore[method-assign]


if __name__ == "__main__":
    turn_read_only_after(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
