"""`pip install .` is a working install: the wheel declares version ranges around the pins of requirements.txt (the
exact versions the tests run on; each range starts at its pin and stops before the next version that may break, so
the two files cannot drift), the `ray` and `test` extras, the licence, and the `clef-engine` and `clef-workbench`
commands, whose entry points are the `python -m` mains. The wheel is built from a copy of the project with the build
tools already installed (no download), as `pip install .` builds it. scripts/setup.sh installs the project
(editable, its dependencies the pins) so that the commands are in `.venv/bin`: checked at the end on the `.venv`
this test runs in, which scripts/setup.sh made."""

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

from tests.support import REPO

pytestmark = pytest.mark.slow  # builds a wheel
PROJECT_FILES = ["pyproject.toml", "README.md", "LICENSE", "clef_engine", "clef_workbench", "workbench_ui"]


def pins(path: Path) -> dict[str, Requirement]:
    """The requirements of a requirements file by name (comments, blank lines and `-r` includes left out)."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {r.name: r for r in (Requirement(line) for line in lines if line and not line.startswith("-r"))}


def assert_ranges_around_pins(ranges: list[Requirement], pinned: dict[str, Requirement], extra: str = "") -> None:
    """Each range names a pinned package, starts at its pin and stops before the next major version (the next minor
    for 0.x), on the same Pythons."""
    assert sorted(r.name for r in ranges) == sorted(pinned)
    for declared in ranges:
        pin = pinned[declared.name]
        (version,) = [spec.version for spec in pin.specifier if spec.operator == "=="]
        major, minor = (int(part) for part in version.split(".")[:2])
        upper = f"0.{minor + 1}" if major == 0 else str(major + 1)
        assert {str(spec) for spec in declared.specifier} == {f">={version}", f"<{upper}"}, declared
        for python in ("3.11", "3.14"):
            environment = {"python_version": python, "extra": extra}
            assert (declared.marker is None or declared.marker.evaluate(environment)) \
                == (pin.marker is None or pin.marker.evaluate(environment)), (declared, python)


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


def test_the_wheel_requires_ranges_around_what_requirements_txt_pins(wheel):
    metadata = email.parser.Parser().parsestr(dist_info(wheel, "METADATA"))
    required = [Requirement(line) for line in metadata.get_all("Requires-Dist")]

    def in_extra(requirement: Requirement, extra: str) -> bool:
        return f'extra == "{extra}"' in str(requirement.marker)

    runtime = pins(REPO / "requirements.txt")
    assert_ranges_around_pins([r for r in required if "extra" not in str(r.marker)],
                              {name: pin for name, pin in runtime.items() if name != "ray"})
    assert_ranges_around_pins([r for r in required if in_extra(r, "ray")], {"ray": runtime["ray"]}, "ray")
    assert_ranges_around_pins([r for r in required if in_extra(r, "test")], pins(REPO / "requirements-test.txt"),
                              "test")
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


@pytest.mark.parametrize("command", ["clef-engine", "clef-workbench"])
def test_the_setup_installs_the_commands(command):
    """scripts/setup.sh installs the project, so its commands are beside the interpreter that runs the tests."""
    done = subprocess.run([str(Path(sys.executable).parent / command), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")
