"""`python -m clef_engine` with a first warm-up step that waits until a file appears (for tests that watch an engine
warm up): `python -m tests.support.warming_server serve ARGS...`, with WARM_UP_GATE naming the file and CLEF_WARM_UP=1.
The engine answers while it waits; its warm-up (and so its "warming" state) ends only after the gate exists, however
fast or busy the machine."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from clef_engine.__main__ import main
from clef_engine.engine import Engine


def wait_for(gate: Path) -> None:
    while not gate.exists():
        time.sleep(0.05)


def hold_warm_up_until(gate: Path) -> None:
    steps = Engine.warm_up_steps
    Engine.warm_up_steps = lambda self: [lambda: wait_for(gate), *steps(self)]  # type: ignore[method-assign]


if __name__ == "__main__":
    hold_warm_up_until(Path(os.environ["WARM_UP_GATE"]))
    sys.exit(main(sys.argv[1:]))
