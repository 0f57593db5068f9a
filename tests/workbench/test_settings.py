"""The workbench's settings (clef_workbench/settings.py): every variable of docs/operations.md's settings table is read
by WorkbenchSettings or by the engine's EngineConfig, and a value the workbench cannot use is refused with the
variable's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from clef_workbench.settings import ENVIRONMENT, SettingsError, WorkbenchSettings
from tests.support import REPO

# Read by the engine's library functions, for callers without the workbench, and by huggingface_hub.
ENGINE_LIBRARY_VARIABLES = {"CLEF_CACHE_DIR": "clef_engine/tiny.py", "HF_HUB_OFFLINE": None, "HF_HUB_CACHE": None}


class RecordingEnvironment(dict):
    """An environment that remembers every variable asked for."""

    def __init__(self, values: dict[str, str]):
        super().__init__(values)
        self.asked: set[str] = set()

    def get(self, name, default=None):
        self.asked.add(name)
        return super().get(name, default)


def documented_settings() -> set[str]:
    page = REPO.joinpath("docs", "operations.md").read_text(encoding="utf-8")
    section = page.split("\n## Settings\n")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1])}


def test_every_documented_setting_is_read_in_a_settings_module():
    from clef_engine.config import ENVIRONMENT as ENGINE_ENVIRONMENT

    environment = RecordingEnvironment({})
    WorkbenchSettings.from_env(environment)
    documented = documented_settings()
    assert {"CLEF_DB", "CLEF_PORT", "CLEF_TOKEN_BUDGET", "HF_HUB_CACHE"} <= documented  # the table was found
    unread = documented - environment.asked - set(ENGINE_ENVIRONMENT.values()) - set(ENGINE_LIBRARY_VARIABLES)
    assert not unread, f"documented but read by no settings module: {sorted(unread)}"
    assert environment.asked <= documented, f"read but not documented: {sorted(environment.asked - documented)}"
    assert environment.asked == set(ENVIRONMENT.values())
    for name, module in ENGINE_LIBRARY_VARIABLES.items():
        assert module is None or name in REPO.joinpath(module).read_text(encoding="utf-8")


def test_the_settings_come_from_the_environment_with_blank_meaning_the_default():
    settings = WorkbenchSettings.from_env({
        "CLEF_MODEL": " Cloudflare/clef-flash ", "CLEF_DB": "/srv/clef/workbench.sqlite3", "CLEF_PORT": "8600",
        "CLEF_STATUS_REFRESH_S": "0.5", "CLEF_API_KEY": "s3cret", "CLEF_RAY_ADDRESS": "auto", "CLEF_REVISION": " ",
        "CLEF_HOST": "0.0.0.0"})
    assert settings == WorkbenchSettings(model="Cloudflare/clef-flash", db_path=Path("/srv/clef/workbench.sqlite3"),
                                         port=8600, status_refresh_s=0.5, api_key="s3cret", ray_address="auto",
                                         host="0.0.0.0")
    assert "s3cret" not in repr(settings)
    assert WorkbenchSettings.from_env({}) == WorkbenchSettings()
    assert WorkbenchSettings().db_path == Path("data") / "workbench.sqlite3"


@pytest.mark.parametrize(("name", "value", "message"), [
    ("CLEF_PORT", "eighty", "CLEF_PORT='eighty': use a port number from 1 to 65535"),
    ("CLEF_PORT", "70000", "CLEF_PORT='70000': use a port number from 1 to 65535"),
    ("CLEF_STATUS_REFRESH_S", "0", "CLEF_STATUS_REFRESH_S='0': use a number of seconds above 0"),
    ("CLEF_STATUS_REFRESH_S", "soon", "CLEF_STATUS_REFRESH_S='soon': use a number of seconds above 0"),
])
def test_a_value_the_workbench_cannot_use_is_refused_by_name(name, value, message):
    with pytest.raises(SettingsError, match=re.escape(message)):
        WorkbenchSettings.from_env({name: value})


def test_the_services_take_the_settings(monkeypatch, tmp_path):
    from clef_workbench.distributed import ray_address
    from clef_workbench.model_loader import default_source, load_options
    from clef_workbench.schema_library import SchemaLibrary

    monkeypatch.setenv("CLEF_SCHEMAS_DIR", str(tmp_path / "library"))
    monkeypatch.setenv("CLEF_RAY_ADDRESS", " head:6379 ")
    monkeypatch.setenv("CLEF_MODEL", "/models/flash")
    monkeypatch.setenv("CLEF_REVISION", "2f3de3d")
    assert SchemaLibrary().directory == tmp_path / "library"
    assert ray_address() == "head:6379" and ray_address("") is None and ray_address("auto") == "auto"
    assert default_source(cuda=False) == "/models/flash"
    assert load_options() == {"revision": "2f3de3d"}
