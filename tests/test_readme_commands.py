"""Every command in the README's ```bash blocks runs as written, unless it needs what a CPU machine has not.

Each line of a block (a line ending in a backslash continues on the next) is one case, so a command added to the
README is tested without touching this file. The rule, in order, first match wins:

1. `NEEDS`: a command naming a published Clef release, a Hugging Face download, the test runner itself or `...`
   (an elided example) is skipped with that reason: they need a CUDA GPU and a 19-55 GB download, or recurse.
2. `SERVERS`: a command that starts a server (the workbench, the API) is started on a free port (CLEF_PORT, the
   Streamlit port variable, `--port`), must answer its health check, and is then stopped.
3. A command that talks to the README's example API address (127.0.0.1:8000) runs against a demo-release API
   server started here with `--api-key-env CLEF_API_KEY`, the README's own setting, and must get answers back.
4. Anything else must exit 0.

Commands run with bash in a fresh checkout-like folder (the repository's files linked in, no `data/`), so a
command that writes the database writes a new one, as on a new machine. The repository's environment is the
`.venv` there; `scripts/setup.sh` finds it installed (its stamp files are written), as after the first run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.browser_harness import free_port
from tests.conftest import REPO

pytestmark = pytest.mark.slow

README = REPO / "README.md"
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)
EXAMPLE_API = "127.0.0.1:8000"
API_KEY = "readme-example-key"

NEEDS = [
    (re.compile(r"Cloudflare/clef"), "needs a published Clef release: a CUDA GPU and a 19-55 GB download"),
    (re.compile(r"\bhf download\b"), "downloads a release from the Hugging Face Hub"),
    (re.compile(r"scripts/test\.sh"), "runs this test suite itself"),
    (re.compile(r"(^|\s)\.\.\.(\s|$)"), "an elided example: `...` stands for the arguments of the line above"),
]
# (pattern, health path): commands that serve until stopped.
SERVERS = [
    (re.compile(r"scripts/workbench\.sh|streamlit run"), "/_stcore/health"),
    (re.compile(r"clef_engine serve"), "/health"),
]
NOT_YET = [  # commands of features on their way; strict, so the mark goes once the feature is here
    (re.compile(r"clef_workbench import\b"), "needs clef_workbench import (branch import)",
     lambda: "import" not in subprocess_help("clef_workbench")),
]
STARTUP_SECONDS = 300


def subprocess_help(module: str) -> str:
    return subprocess.run([str(REPO / ".venv/bin/python"), "-m", module, "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120).stdout


def readme_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks, one per logical line, continuations joined."""
    commands = []
    for block in BASH_BLOCK.findall(text):
        for command in re.sub(r"\\\n\s*", "", block).splitlines():
            if command.strip() and not command.lstrip().startswith("#"):
                commands.append(command.strip())
    return commands


def case(command: str):
    marks = [pytest.mark.xfail(reason=reason, strict=True) for pattern, reason, missing in NOT_YET
             if pattern.search(command) and missing()]
    return pytest.param(command, marks=marks, id=command.split("  #")[0].strip()[:70])


COMMANDS = [case(command) for command in readme_commands(README.read_text())]


def setup_stamp(requirements: str) -> str:
    """The stamp scripts/setup.sh writes after installing requirements.txt plus `requirements`."""
    text = (REPO / "requirements.txt").read_bytes() + (REPO / requirements).read_bytes()
    return f".installed-{hashlib.sha256(text).hexdigest()[:16]}"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A folder that looks like a fresh clone with its environment installed: every top-level entry of the
    repository linked in but `data/` and the venv, which is a folder linking the shared venv's entries plus
    setup.sh's stamps."""
    root = tmp_path_factory.mktemp("checkout")
    for entry in REPO.iterdir():
        if entry.name not in {"data", ".venv", ".git"} and not entry.name.endswith("_cache"):
            (root / entry.name).symlink_to(entry)
    venv = root / ".venv"
    venv.mkdir()
    for entry in (REPO / ".venv").resolve().iterdir():
        if not entry.name.startswith(".installed-"):
            (venv / entry.name).symlink_to(entry)
    for requirements in ("requirements.txt", "requirements-test.txt"):
        (venv / setup_stamp(requirements)).touch()
    return root


@pytest.fixture(scope="module")
def example_api(tiny_release, tmp_path_factory):
    """The README's keyed API on the demo release, at a free port."""
    from tests.test_server import ServerProcess

    server = ServerProcess(tiny_release, tmp_path_factory.mktemp("logs") / "readme-api.log",
                           "--api-key-env", "CLEF_API_KEY", env={"CLEF_API_KEY": API_KEY})
    yield server
    server.stop()


def command_env(checkout: Path, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "CLEF_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "CLEF_DEVICE": "cpu",
            "STREAMLIT_SERVER_HEADLESS": "true", "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false",
            "STREAMLIT_SERVER_FILE_WATCHER_TYPE": "none"}


def serve_until_healthy(command: str, health: str, cwd: Path, env: dict[str, str]) -> None:
    port = free_port()
    env = {**env, "CLEF_PORT": str(port), "STREAMLIT_SERVER_PORT": str(port)}
    if "--port" in command:
        command = re.sub(r"--port \d+", f"--port {port}", command)
    elif "clef_engine serve" in command:
        command += f" --port {port}"
    log = cwd / f"server-{port}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # its own group: bash and the server it starts stop together
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
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs_as_written(command, checkout, tmp_path, request):
    for pattern, reason in NEEDS:
        if pattern.search(command):
            pytest.skip(reason)
    env = command_env(checkout, tmp_path)
    for pattern, health in SERVERS:
        if pattern.search(command):
            serve_until_healthy(command, health, checkout, env)
            return
    if EXAMPLE_API in command:
        api = request.getfixturevalue("example_api")
        command = command.replace(EXAMPLE_API, f"127.0.0.1:{api.port}")
    done = subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=STARTUP_SECONDS)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if EXAMPLE_API in request.node.callspec.params["command"]:
        body = json.loads(done.stdout)
        assert "answers" in body, body


def test_the_readme_has_commands_of_every_kind_the_rule_knows():
    commands = readme_commands(README.read_text())
    assert any(EXAMPLE_API in command for command in commands)
    assert any(pattern.search(command) for pattern, _ in SERVERS for command in commands)
    assert any(not any(p.search(command) for p, _ in NEEDS) for command in commands)
