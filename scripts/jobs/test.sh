#!/usr/bin/env bash
# Install (idempotent) and run the whole test suite. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/jobs/install.sh
exec .venv/bin/python -m pytest -q "$@"
