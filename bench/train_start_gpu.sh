#!/usr/bin/env bash
# One device call: time to the first training step, cold and warm compile caches, at 8B shapes.
#   bash bench/train_start_gpu.sh WORK [train_start.py args...]   (carry .whl: Python 3.12 wheels of zarr, numcodecs,
#   donfig, google-crc32c, datasets, dill and multiprocess, which the GPU image lacks)
#   SETUP=1 bash bench/train_start_gpu.sh WORK ...   then also bench/train_setup.py (setup phases) on WORK
# Logs and results.json go to $OUT; the machine's GPU, torch and Triton versions to $OUT/machine.txt.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  df -h /tmp | tail -1; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
work=$1; shift
timeout 470 python3 bench/train_start.py --out "$work" --results "$OUT" "$@" 2>&1 | grep -v "^INFO:torch" | tail -30
if [ "${SETUP:-0}" = 1 ]; then
  timeout 90 python3 bench/train_setup.py --out "$work" 2>&1 | grep -v "^INFO:torch" | tee "$OUT/setup_phases.txt" | tail -25
fi
