#!/usr/bin/env bash
# Stage one's fixed costs on the GPU host (BENCHMARKS.md, "Extraction"):
#   bash bench/extract_write_paths.sh fixed   # dflash-extract end to end, 256 x 2048: where the time outside the loop goes
#   RUNS="before after after" BEFORE_NS=DIR: a run labelled "before" imports dflash from DIR (DIR/dflash holds the
#   older code's shared, extract, ...), the others this checkout's; each run's phases go to fixed_costs.log. A label
#   "pyc" runs nothing and turns on a bytecode cache (PYTHONPYCACHEPREFIX=/tmp/pyc) that the next run writes, as a pip
#   install would have, and the later ones read. BUILD_ARGS="--layers 8": fewer target layers (same width and
#   vocabulary); SAMPLES (default 256) rows; WORK (default /tmp/xbench) holds target, rows and cache; DEVICE_ARGS
#   (default none: one process on cuda:0). A CPU dry run: BUILD_ARGS="--layers 2 --hidden 64 --intermediate 128
#   --vocab 512 --device cpu" DEVICE_ARGS="--device cpu" SAMPLES=4. Needs zarr, zarrs, ... importable (carry the wheels); logs to $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  env | grep "^PYTHON" | grep -v PYTHONPATH
  python3 -c "import sys, torch, os; print('dont_write_bytecode', sys.dont_write_bytecode, 'torch in', os.path.dirname(torch.__file__), 'writable', os.access(os.path.dirname(torch.__file__), os.W_OK))"
  python3 -c "import torch, transformers, zarr, numcodecs, zarrs; print(torch.__version__, transformers.__version__, zarr.__version__, numcodecs.__version__, zarrs.__version__)"
} > "$OUT/machine_$1.txt" 2>&1
cat "$OUT/machine_$1.txt"
quiet() { grep -vi "warn" | grep -v "^INFO:torch"; }
case "${1:-}" in
fixed)   # the CLI as a user runs it; imports = the summary's started_at minus the shell's clock before the call
  WORK=${WORK:-/tmp/xbench}
  python3 bench/extract_bench.py --samples ${SAMPLES:-256} --length 2048 --build-only --work "$WORK" ${BUILD_ARGS:-} 2>&1 | quiet | tail -1
  run=0; bytecode=none
  for label in ${RUNS:-after after}; do
    if [ "$label" = pyc ]; then
      export PYTHONPYCACHEPREFIX=/tmp/pyc; unset PYTHONDONTWRITEBYTECODE; bytecode=writing; continue
    fi
    run=$((run + 1))
    rm -rf "$WORK/cli.zarr"
    path=${PYTHONPATH:-}; [ "$label" = before ] && path=$BEFORE_NS:$path
    t0=$(date +%s.%N)
    PYTHONPATH=$path timeout 200 python3 -m dflash.extract.cli --data "$WORK/rows.jsonl" --model "$WORK/target" \
        --out "$WORK/cli.zarr" ${DEVICE_ARGS:-} --max-length 2048 --batch-tokens 8192 --no-progress \
        --summary-json "$WORK/summary_$run.json" ${EXTRA:-} 2>&1 | quiet | tail -20
    t1=$(date +%s.%N)
    cat "$WORK/summary_$run.json" | python3 -c "import json,sys; print(json.dumps(json.load(sys.stdin)))" \
        >> "$OUT/fixed_summaries.jsonl"   # one file for every run: a call brings back at most 8
    T0=$t0 T1=$t1 RUN=$run LABEL=$label BYTECODE=$bytecode python3 bench/fixed_costs_line.py "$WORK/summary_$run.json" \
        | tee -a "$OUT/fixed_costs.log"
    [ "$bytecode" = writing ] && bytecode=cached
  done
  ;;
*) echo "usage: $0 fixed" >&2; exit 2;;
esac
