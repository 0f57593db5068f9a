"""`python -m clef_engine` whose multipart parser holds every body until the test lets it go (for
tests/api/test_server_stall.py): `python -m tests.support.held_multipart serve ARGS...`, with HELD_MULTIPART_DIR
naming a folder.

Starting to parse a body, the parser touches `parsing` in that folder, then blocks its thread, as parsing a big body
keeps a core busy, until `release` exists there; only then does it parse. Had the server parsed on its event loop,
the block would hold up every other request too: then, rather than hang the test, it gives up waiting after
GIVE_UP_SECONDS and writes `gave-up`, which the test reads as the other requests having been held up."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from clef_engine.__main__ import main
from clef_engine.serve.bodies import _RawFieldsParser

GIVE_UP_SECONDS = 120


def hold_every_parse(folder: Path) -> None:
    parse = _RawFieldsParser.parse

    async def held(self: _RawFieldsParser):  # type: ignore[no-untyped-def]
        (folder / "parsing").touch()
        given_up_at = time.monotonic() + GIVE_UP_SECONDS
        while not (folder / "release").exists():
            if time.monotonic() > given_up_at:
                (folder / "gave-up").touch()
                break
            time.sleep(0.01)  # blocking: the thread is as busy as a parse would keep it
        return await parse(self)

    _RawFieldsParser.parse = held  # type: ignore[method-assign]


if __name__ == "__main__":
    hold_every_parse(Path(os.environ["HELD_MULTIPART_DIR"]))
    sys.exit(main(sys.argv[1:]))
