"""Run `python -m clef_workbench` with its run pausing after it has written N chunks of results, until a file
appears (for tests/test_cli_run.py): `python -m tests.paused_run N GATE ARGS...`. On pausing it creates
`GATE.paused`; it goes on once GATE exists. A test signals the process while it is paused, then opens the gate: the
signal lands mid-run on every machine, however fast or busy."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from clef_workbench.__main__ import main
from clef_workbench.store import Store


def pause_after(writes: int, gate: Path) -> None:
    written = [0]
    record_results = Store.record_results

    def pausing(self: Store, run_id: int, results: list[dict]) -> int:
        new = record_results(self, run_id, results)
        written[0] += 1
        if written[0] == writes:
            gate.with_name(gate.name + ".paused").touch()
            while not gate.exists():
                time.sleep(0.05)
        return new

    Store.record_results = pausing  # type: ignore[method-assign]


if __name__ == "__main__":
    pause_after(int(sys.argv[1]), Path(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
