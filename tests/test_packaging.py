"""`pip install .` is a working install: the wheel declares the dependencies requirements.txt pins (the same
versions, so the two files cannot drift), the `ray` and `test` extras, the licence, and the `clef-engine` and
`clef-workbench` commands, whose entry points are the `python -m` mains. The wheel is built from a copy of the
project with the build tools already installed (no download), as `pip install .` builds it.

Checked by hand in a throwaway venv (the shared environment's packages on its path): `pip install .` resolves the
dependencies and `clef-engine --help` / `clef-workbench --help` print their usage."""

from __future__ import annotations

import configparser
import email.parser
import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # builds a wheel
PROJECT_FILES = ["pyproject.toml", "README.md", "LICENSE", "clef_engine", "clef_workbench", "workbench_ui"]


def pins(path: Path) -> set[str]:
    """The requirement lines of a requirements file, normalized (comments, blank lines and `-r` includes left out)."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {str(Requirement(line)) for line in lines if line and not line.startswith("-r")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    source = tmp_path_factory.mktemp("project")
    for name in PROJECT_FILES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                            "--no-index", "-w", str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (path,) = out.glob("clef_workbench-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (member,) = [m for m in wheel.namelist() if m.endswith(f".dist-info/{name}")]
    return wheel.read(member).decode()


def test_the_wheel_requires_what_requirements_txt_pins(wheel):
    metadata = email.parser.Parser().parsestr(dist_info(wheel, "METADATA"))
    required = [Requirement(line) for line in metadata.get_all("Requires-Dist")]
    def in_extra(requirement: Requirement) -> bool:
        return "extra" in str(requirement.marker)

    plain = {str(r) for r in required if not in_extra(r)}
    by_extra = {extra: {f"{r.name}{r.specifier}" for r in required
                        if in_extra(r) and r.marker.evaluate({"extra": extra})}
                for extra in metadata.get_all("Provides-Extra")}
    runtime = pins(REPO / "requirements.txt")
    assert plain == {pin for pin in runtime if not pin.startswith("ray")}
    assert by_extra["ray"] == {pin for pin in runtime if pin.startswith("ray")}
    assert by_extra["test"] == pins(REPO / "requirements-test.txt")
    assert metadata["License-Expression"] == "Apache-2.0"
    assert any(m.endswith(".dist-info/licenses/LICENSE") for m in wheel.namelist())


def test_the_wheel_holds_every_package_of_the_product(wheel):
    on_disk = {str(p.parent.relative_to(REPO)).replace("/", ".")
               for name in ("clef_engine", "clef_workbench", "workbench_ui")
               for p in (REPO / name).rglob("__init__.py")}
    in_wheel = {name.rsplit("/", 1)[0].replace("/", ".") for name in wheel.namelist()
                if name.endswith("/__init__.py")}
    assert on_disk == in_wheel


def test_the_commands_are_the_python_m_mains(wheel):
    scripts = configparser.ConfigParser()
    scripts.read_string(dist_info(wheel, "entry_points.txt"))
    commands = dict(scripts["console_scripts"])
    assert commands == {"clef-engine": "clef_engine.__main__:main", "clef-workbench": "clef_workbench.__main__:main"}
    for command, target in commands.items():
        module, function = target.split(":")
        main = getattr(importlib.import_module(module), function)
        with pytest.raises(SystemExit) as done:
            main(["--help"])
        assert done.value.code == 0, command
