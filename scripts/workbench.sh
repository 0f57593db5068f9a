#!/usr/bin/env bash
# Set up (first run) and start the workbench on http://127.0.0.1:8501. Without a CUDA GPU or CLEF_MODEL it starts on
# the demo model (a tiny random-weight release built on first run). Extra arguments go to `streamlit run`;
# .streamlit/config.toml holds the rest of the server settings.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m streamlit run app.py --server.address "${CLEF_HOST:-127.0.0.1}" \
  --server.port "${CLEF_PORT:-8501}" "$@"
