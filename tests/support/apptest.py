"""The workbench's pages through Streamlit's AppTest, as a person uses them: open the app or a page (a link with its
query parameters), find a button, read the page's text, wait for a run, create a case set, find the importer."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from tests.support import REPO
from workbench_ui import shell

APP = str(REPO / "app.py")
TIMEOUT = 180  # s, a safety limit: a page's first run loads the demo model


def start() -> AppTest:
    """The app's first page."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    no_exceptions(at)
    return at


def open_page(page: str, **query: str) -> AppTest:
    """A new session opening `page` (`pages/….py`), with `query` as a link someone sent carries it."""
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    at.switch_page(page)
    for name, value in query.items():  # a link to the page: its first visit reads them
        at.query_params[name] = value
    at.run()
    no_exceptions(at)
    return at


def no_exceptions(at: AppTest) -> None:
    assert not at.exception, [(e.message, e.stack_trace[-4:]) for e in at.exception]


def button(at: AppTest, label: str, *, startswith: bool = False):
    found = [b for b in at.button if (b.label.startswith(label) if startswith else b.label == label)]
    assert found, f"no button {label!r}: {[b.label for b in at.button]}"
    return found[0]


def texts(at: AppTest) -> str:
    """Every text the page shows: markdown, captions, messages, code and subheaders, one a line."""
    return "\n".join([m.value for m in at.markdown] + [c.value for c in at.caption] + [s.value for s in at.success]
                     + [w.value for w in at.warning] + [e.value for e in at.error] + [i.value for i in at.info]
                     + [c.value for c in at.code] + [h.value for h in at.subheader])


def engine():
    """The engine of the session's resident model."""
    return shell.model_manager().state().engine


def wait_for_run(run_id: int, timeout: float = TIMEOUT) -> None:
    assert shell.get_job_runner().wait(run_id, timeout), f"run {run_id} did not end within {timeout} s"


def new_case_set(at: AppTest, name: str) -> int:
    """On the Case sets page: a new case set `name` for the shipped support-ticket-routing schema; its id."""
    at.text_input(key="cases.new_name").input(name)
    at.selectbox(key="cases.new_schema").select("support-ticket-routing")
    button(at, "Create").click()
    at.run()
    no_exceptions(at)
    return at.selectbox(key="cases.selected").value


def case_uploader(at: AppTest):
    """The Import tab's uploader (a new one after each import, so its key carries a count)."""
    (uploader,) = [u for u in at.get("file_uploader") if u.key.startswith("cases.upload")]
    return uploader
