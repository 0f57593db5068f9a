"""Run `python -m clef_workbench` pausing at a chosen point until a file appears (for tests that signal or kill it
there): `python -m tests.support.paused_run POINT N GATE ARGS...`. POINT is where: `results`, after the N-th chunk of
results written (between transactions); `case-row`, after the N-th case row inserted (inside an import's
transaction). On pausing it creates `GATE.paused`; it goes on once GATE exists. The signal
lands at the same point on every machine, however fast or busy."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from clef_workbench.__main__ import main
from clef_workbench.store import Store, cases

POINTS = {"results": (Store, "record_results"), "case-row": (cases, "now_iso")}


def pause_after(point: str, calls: int, gate: Path) -> None:
    owner, name = POINTS[point]
    original = getattr(owner, name)
    made = [0]

    def pausing(*args: Any, **kwargs: Any) -> Any:
        value = original(*args, **kwargs)
        made[0] += 1
        if made[0] == calls:
            gate.with_name(gate.name + ".paused").touch()
            while not gate.exists():
                time.sleep(0.05)
        return value

    setattr(owner, name, pausing)


if __name__ == "__main__":
    pause_after(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
    sys.exit(main(sys.argv[4:]))
