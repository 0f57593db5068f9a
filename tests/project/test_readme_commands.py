"""Every command in the ```bash blocks of the README, CONTRIBUTING.md and docs/*.md runs as written, unless it needs
what a CPU machine has not.

A block that starts a server in the background (a line ending in `&`) is one case, run whole as a script: it waits
for its server, talks to it and stops it. In any other block each line (a line ending in a backslash continues on the
next) is one case. So a command added to a page is tested without touching this file. The rule, in order, first
match wins:

1. `NEEDS`: a command naming a published Clef release, a Hugging Face download, the test runner itself or `...`
   (an elided example) is skipped with that reason: they need a CUDA GPU and a 19-55 GB download, or recurse.
2. `SERVERS`: a command that starts a server (the workbench, the API) is started on a free port (CLEF_PORT, the
   Streamlit port variable, `--port`), must answer its health check, and is then stopped.
3. A script block runs with its example port 8000 moved to a free one and `set -e`; it must exit 0, and if it posts to
   `/v1/systemone`, print a response with answers.
4. Any other command must exit 0.

Commands run with bash in a fresh checkout-like folder (the repository's files linked in, no `data/`), so a
command that writes the database writes a new one, as on a new machine. The repository's environment is the
`.venv` there; `scripts/setup.sh` finds it installed (its stamp files are written), as after the first run. Nothing
runs at collection: the cases are read from the pages' text.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support import REPO
from tests.support.servers import free_port

pytestmark = pytest.mark.slow

PAGES = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
EXAMPLE_PORT = "8000"

NEEDS = [
    (re.compile(r"Cloudflare/clef"), "needs a published Clef release: a CUDA GPU and a 19-55 GB download"),
    (re.compile(r"\bhf download\b"), "downloads a release from the Hugging Face Hub"),
    (re.compile(r"scripts/test\.sh"), "runs this test suite itself"),
    (re.compile(r"(^|\s)\.\.\.(\s|$)"), "an elided example: `...` stands for the arguments of the line above"),
]
# (pattern, health path): commands that serve until stopped.
SERVERS = [
    (re.compile(r"scripts/workbench\.sh|streamlit run"), "/_stcore/health"),
    (re.compile(r"clef[-_]engine serve"), "/health"),
]
STARTUP_SECONDS = 300


def commands(block: str) -> list[str]:
    """A block's commands, one per logical line, continuations joined, comments and blank lines left out."""
    lines = re.sub(r"\\\n\s*", "", block).splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def is_script(block: str) -> bool:
    return any(re.search(r"&\s*(#.*)?$", command) for command in commands(block))


def cases(page: Path) -> list:
    """The page's cases: a script block whole, or each command of another block."""
    name = page.relative_to(REPO)
    found = []
    for block in BASH_BLOCK.findall(page.read_text()):
        if is_script(block):
            found.append(pytest.param(block, id=f"{name}: script {commands(block)[0].split('  #')[0].strip()[:50]}"))
        else:
            found += [pytest.param(command, id=f"{name}: {command.split('  #')[0].strip()[:70]}")
                      for command in commands(block)]
    return found


CASES = [case for page in PAGES for case in cases(page)]


def setup_stamps() -> list[str]:
    """The stamps scripts/setup.sh writes after installing requirements.txt (plus requirements-test.txt with --test)
    and the project."""
    runtime = (REPO / "requirements.txt").read_bytes()
    stamps = [f".installed-{hashlib.sha256(runtime + (REPO / name).read_bytes()).hexdigest()[:16]}"
              for name in ("requirements.txt", "requirements-test.txt")]
    return [*stamps, f".installed-project-{hashlib.sha256((REPO / 'pyproject.toml').read_bytes()).hexdigest()[:16]}"]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A folder that looks like a fresh clone with its environment installed: every top-level entry of the
    repository linked in but `data/` and the venv, which is a folder linking the shared venv's entries plus
    setup.sh's stamps (so no command installs anything into the shared venv)."""
    root = tmp_path_factory.mktemp("checkout")
    for entry in REPO.iterdir():
        if entry.name not in {"data", ".venv", ".git"} and not entry.name.endswith("_cache"):
            (root / entry.name).symlink_to(entry)
    venv = root / ".venv"
    venv.mkdir()
    for entry in (REPO / ".venv").resolve().iterdir():
        if not entry.name.startswith(".installed-"):
            (venv / entry.name).symlink_to(entry)
    for stamp in setup_stamps():
        (venv / stamp).touch()
    return root


def command_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "CLEF_DEVICE": "cpu", "STREAMLIT_SERVER_HEADLESS": "true",
            "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false", "STREAMLIT_SERVER_FILE_WATCHER_TYPE": "none"}


def stop(process: subprocess.Popen) -> None:
    """Stop the process group the command started (bash and every server it started)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def serve_until_healthy(command: str, health: str, cwd: Path, env: dict[str, str]) -> None:
    port = free_port()
    env = {**env, "CLEF_PORT": str(port), "STREAMLIT_SERVER_PORT": str(port)}
    if "--port" in command:
        command = re.sub(r"--port \d+", f"--port {port}", command)
    elif SERVERS[1][0].search(command):
        command += f" --port {port}"
    log = cwd / f"server-{port}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            assert process.poll() is None, f"{command!r} exited with {process.returncode}:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}{health}", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{command!r} did not answer {health}:\n{log.read_text()[-3000:]}"
            time.sleep(0.5)
    finally:
        stop(process)


def run_script(block: str, cwd: Path, env: dict[str, str]) -> str:
    """The block as one bash script (set -e), its example port moved to a free one; its output."""
    port = free_port()
    script = re.sub(rf"(:|--port ){EXAMPLE_PORT}\b", rf"\g<1>{port}", block)
    process = subprocess.Popen(["bash", "-e", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=STARTUP_SECONDS)
    finally:
        stop(process)
    assert process.returncode == 0, f"exit {process.returncode}\n{output[-3000:]}"
    return output


@pytest.mark.parametrize("command", CASES)
def test_documented_command_runs_as_written(command, checkout):
    for pattern, reason in NEEDS:
        if pattern.search(command):
            pytest.skip(reason)
    env = command_env()
    if is_script(command):
        output = run_script(command, checkout, env)
        if "/v1/systemone" in command:
            assert '"answers"' in output, output[-3000:]
        return
    for pattern, health in SERVERS:
        if pattern.search(command):
            serve_until_healthy(command, health, checkout, env)
            return
    done = subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=STARTUP_SECONDS)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_pages_have_commands_of_every_kind_the_rule_knows():
    found = [case.values[0] for case in CASES]
    assert any(is_script(case) and "/v1/systemone" in case for case in found)
    assert any(pattern.search(case) for pattern, _ in SERVERS for case in found if not is_script(case))
    assert any(not any(p.search(case) for p, _ in NEEDS) for case in found if not is_script(case))


def test_collecting_the_cases_starts_no_process(monkeypatch):
    """Collection only reads the pages, so `pytest --collect-only` works where the project's `.venv` is not."""
    import runpy

    def refuse(*args, **kwargs):
        raise AssertionError(f"a process started at collection: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    assert runpy.run_path(__file__)["CASES"] == CASES


def test_every_link_between_the_pages_resolves():
    """A relative link of the README, CONTRIBUTING.md, docs/*.md or bench/README.md names a file that exists, and its
    #anchor a heading of that file (as GitHub makes anchors of headings)."""
    def anchors(path: Path) -> set[str]:
        headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
        return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}

    broken = []
    for page in [*PAGES, REPO / "bench" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists() or (anchor and anchor not in anchors(path)):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []
