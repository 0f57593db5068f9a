#!/usr/bin/env bash
# Create .venv (Python 3.11+), install the pinned packages and the project itself (editable: `clef-engine` and
# `clef-workbench` in .venv/bin). Idempotent: a second run installs nothing new.
# Usage: bash scripts/setup.sh [--test]   (--test adds test tools and Debian's chromium for the browser tests)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"'
[ -x .venv/bin/python ] || python3 -m venv .venv
requirements=requirements.txt
[ "${1:-}" = "--test" ] && requirements=requirements-test.txt
stamp=".venv/.installed-$(cat requirements.txt "$requirements" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r "$requirements"
  touch "$stamp"
fi
project=".venv/.installed-project-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$project" ]; then
  # Its dependencies are the pins just installed: --no-deps keeps pip from resolving pyproject's ranges again.
  .venv/bin/python -m pip install -q --no-deps -e .
  touch "$project"
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && [ ! -f .venv/.installed-fla-0.6.0 ]; then
  # A CUDA GPU: the engine refuses to start on the slow fallback kernels (CLEF_ALLOW_SLOW_KERNELS=1 allows them), so
  # the GPU's kernels come with the setup. Not in requirements.txt: they need CUDA.
  .venv/bin/python -m pip install -q flash-linear-attention==0.6.0
  touch .venv/.installed-fla-0.6.0
fi
if [ "${1:-}" = "--test" ] && [ ! -x /usr/bin/chromium ]; then
  # The browser tests drive Debian's chromium with Playwright (never a browser download).
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium
fi
