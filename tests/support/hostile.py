"""What the hostile-request tests measure a real server process with: its resident memory sampled while a request
runs (`RssSampler`), its own CPU time (`cpu_seconds`, whatever the machine's load does to the clock), an engine
metric, and the bounds these must stay within."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import httpx

from tests.support.bodies import make_request

MAX_GROWTH_MB = 500
MAX_WORK_SECONDS = 5.0  # of the server's CPU for one hostile request (the issue's bound)
SMALL = make_request(3)


class RssSampler:
    """The server's resident memory, sampled every few milliseconds in a thread until stopped."""

    def __init__(self, pid: int):
        self.pid = pid
        self.baseline = self.rss_mb()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss_mb())
            time.sleep(0.02)

    def stop(self) -> float:
        """The growth in MB over the baseline."""
        self._stop.set()
        self._thread.join()
        return self.peak - self.baseline


def noul_questions(count: int) -> dict:
    return {f"q{i}": {"type": "noul", "instructions": f"Is the customer asking about order {i}?"}
            for i in range(count)}


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_metric(http: httpx.Client, name: str) -> float:
    text = http.get("/metrics").text
    return float(re.search(rf"^{name}\{{model=\"[^\"]+\"\}} (\S+)", text, re.M).group(1))
