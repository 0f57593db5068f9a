"""The shared fixtures live in tests/support/fixtures.py, importable like every other shared helper."""

pytest_plugins = ["tests.support.fixtures"]
