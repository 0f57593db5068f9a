"""No process outlives the server, and stopping it is orderly: a real `python -m clef_engine serve` process and a
real `streamlit run serve_workbench.py` process on the tiny release, their big-body worker started by a body of a
megabyte, then sent SIGTERM, SIGINT or SIGKILL; their descendants are read from /proc before the signal and must
all be gone after it. The workbench's own API answers only its own host names, as the standalone server does."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import ServerProcess, serving_workbench

pytestmark = pytest.mark.slow  # real server processes
SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGKILL]
GONE_SECONDS = 60  # how long the descendants of a dead server may take to be reaped: a bound for a failure only


# --- processes, as /proc shows them ------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ..., starttime at [19]); None once gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of `root`: pid → its start time (to tell a pid reused later from the process)."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
            started[int(entry)] = fields[19]
    found, pending = {}, [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found[child] = started[child]
            pending.append(child)
    return found


def still_running(processes: dict[int, str]) -> dict[int, str]:
    """Those of `processes` still running (not exited, not a zombie), with their command lines."""
    running = {}
    for pid, started in processes.items():
        fields = _stat(pid)
        if fields is not None and fields[19] == started and fields[0] != "Z":
            running[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return running


def wait_until_gone(processes: dict[int, str]) -> dict[int, str]:
    deadline = time.monotonic() + GONE_SECONDS
    while still_running(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    return still_running(processes)


def start_big_body_worker(url: str) -> None:
    """A body of over a megabyte is parsed in the big-body worker process, which starts with the first one."""
    body = json.dumps({"state": "x" * (1 << 20), "questions": {"q": {"type": "noul", "instructions": "?"}}})
    reply = httpx.post(f"{url}/v1/systemone", content=body, headers={"content-type": "application/json"}, timeout=120)
    assert reply.status_code == 413, reply.text  # far over the token budget: refused, after being parsed


# --- tests -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sent", SIGNALS, ids=lambda sent: sent.name)
def test_no_process_outlives_serve(tiny_release: Path, tmp_path: Path, sent: signal.Signals) -> None:
    server = ServerProcess(tiny_release, tmp_path / "server.log")
    try:
        start_big_body_worker(server.url)
        children = descendants(server.process.pid)
        # the worker and multiprocessing's resource tracker, which it shares with the server
        assert len(children) >= 2, still_running(children)
        server.process.send_signal(sent)
        status = server.process.wait(timeout=120)
    finally:
        server.stop()
    assert wait_until_gone(children) == {}
    # stopped in order, it says so with its exit status; a kill leaves it none of its own
    assert status == (-signal.SIGKILL if sent == signal.SIGKILL else 0), server.log()
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("sent", SIGNALS, ids=lambda sent: sent.name)
def test_no_process_outlives_the_workbench(tiny_release: Path, tmp_path: Path, sent: signal.Signals) -> None:
    with serving_workbench(tiny_release, tmp_path) as (process, url):
        start_big_body_worker(url)
        children = descendants(process.pid)
        assert len(children) >= 2, still_running(children)
        process.send_signal(sent)
        process.wait(timeout=120)
    assert wait_until_gone(children) == {}


def test_sigint_with_requests_in_flight_answers_them_and_exits_0(tiny_release: Path, tmp_path: Path) -> None:
    """Three long requests are with the engine when SIGINT comes; with no grace to finish, each gets a 503 saying
    the server is stopping (or its answer, had it come first), never a bare 500, and the process exits 0."""
    server = ServerProcess(tiny_release, tmp_path / "server.log", "--shutdown-grace", "0")
    long_request = {"state": "word " * 5000, "questions": {"q": {"type": "noul", "instructions": "Is it long?"}},
                    "x_overflow": "truncate_state"}
    replies: list[httpx.Response] = []

    def send() -> None:
        replies.append(httpx.post(f"{server.url}/v1/systemone", json=long_request, timeout=120))

    senders = [threading.Thread(target=send) for _ in range(3)]
    try:
        for sender in senders:
            sender.start()
        while not re.search(r"^clef_api_requests_in_flight 3\.0$", httpx.get(f"{server.url}/metrics").text, re.M):
            assert all(sender.is_alive() for sender in senders), [reply.text for reply in replies]
            time.sleep(0.05)
        server.process.send_signal(signal.SIGINT)
        for sender in senders:
            sender.join()
        status = server.process.wait(timeout=120)
    finally:
        server.stop()
    for reply in replies:
        assert reply.status_code == 200 or (reply.status_code == 503 and reply.json()["detail"]["error_type"]
                                            == "shutting_down"), reply.text
    assert status == 0, server.log()
    assert "Traceback" not in server.log()


def test_the_workbench_answers_only_its_own_host_names(tiny_release: Path, tmp_path: Path) -> None:
    with serving_workbench(tiny_release, tmp_path) as (_, url):
        for path in ("/health", "/v1/models", "/"):  # the API and the UI alike
            rebound = httpx.get(f"{url}{path}", headers={"host": "evil.example"}, timeout=30)
            assert rebound.status_code == 421, rebound.text
            assert rebound.json()["detail"]["error_type"] == "misdirected_request"
            assert "evil.example" in rebound.json()["detail"]["message"]
            assert httpx.get(f"{url}{path}", headers={"host": "localhost"}, timeout=30).status_code == 200
