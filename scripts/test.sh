#!/usr/bin/env bash
# Set up (first run) and run the tests: ruff, mypy on the modules pyproject.toml lists, then pytest.
#   bash scripts/test.sh            every test (engine, services, API server processes, app pages, Ray, browser)
#   bash scripts/test.sh --quick    the quick tier: no browser, no Ray cluster, no process kills, nothing marked slow
# Other arguments go to pytest: a layer's folder, a file, a test (e.g. bash scripts/test.sh --quick tests/workbench -k
# drafts). Tests run on CLEF_TEST_WORKERS pytest-xdist workers (default: one per CPU core; 0 runs them in this
# process), a test file on one worker (its servers start once), the longest files first (tests/conftest.py); workers
# take turns with the local Ray cluster (tests/support/ray_cluster.py).
set -euo pipefail
cd "$(dirname "$0")/.."
quick=()
if [ "${1:-}" = "--quick" ]; then
  shift
  quick=(-m "not browser and not ray and not kill and not slow")
fi
bash scripts/setup.sh --test
.venv/bin/python -m ruff check .
.venv/bin/python -m mypy
# --durations: the report ends with the slowest tests, to show where the time goes
exec .venv/bin/python -m pytest -q -n "${CLEF_TEST_WORKERS:-auto}" --dist loadfile --no-loadscope-reorder \
  --durations=25 "${quick[@]}" "$@"
