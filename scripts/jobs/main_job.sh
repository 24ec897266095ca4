#!/usr/bin/env bash
# The main job on a fresh machine, with no network beyond the package registry (the README's first command):
# install into .venv, convert the packaged SmolLM2-135M to ELN and to DyT with calibration on the offline default
# text, recover each with a short run of recipes/finetune.py, evaluate all four against the original on held-out
# text, print the table, leave the checkpoints in ./out/.
# Options go to scripts/jobs/main_job.py (--eval-tokens, --calib-blocks, --out, ... ; see --help).
set -euo pipefail
cd "$(dirname "$0")/../.."
SECONDS=0
bash scripts/jobs/install.sh
echo "[main job] installed in ${SECONDS}s"
.venv/bin/python scripts/jobs/main_job.py "$@"
echo "[main job] done in $((SECONDS / 60)) min $((SECONDS % 60)) s (install included)"
