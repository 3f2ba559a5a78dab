#!/usr/bin/env bash
# One device call for the lossy-codec figures (BENCHMARKS.md, "Lossy hidden-state codecs in the
# cache (issue 16)"): extraction throughput per hidden codec against the lossless path, same run,
# interleaved repeats; then the training loader per codec at 8B dims, decoding in the loader
# workers or on the GPU. Carry .whl (zarr, numcodecs, zarrs, ...). Logs go to $OUT.
#   SAMPLES=160 bash bench/codec_gpu.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, zarr; print(torch.__version__, transformers.__version__, zarr.__version__)"; } \
  > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout "${EXTRACT_S:-330}" python3 bench/extract_bench.py --samples "${SAMPLES:-160}" --length 2048 --batch-tokens 8192 \
  --variants 1 --repeat 2 --codecs bf16,fp8,int8,int4 --references runner 2>&1 | grep -v "^INFO:torch" > "$OUT/codec-extract.log"
timeout "${LOADER_S:-150}" python3 bench/train_loop.py --out /tmp/tl --samples 10 --loader-batches 32 --loader-workers 4 \
  --loader-only 0.161 --hidden-codecs bf16,fp8,int8,int4 2>&1 | grep -v "^INFO" > "$OUT/codec-loader.log"
grep -v '^{"worker_settings"' "$OUT/codec-extract.log" | tail -n 80; cat "$OUT/codec-loader.log"
