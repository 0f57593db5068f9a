#!/usr/bin/env bash
# Set up (first run) and run every test: ruff, then pytest (engine, services, API server, app pages, browser).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest -q "$@"
