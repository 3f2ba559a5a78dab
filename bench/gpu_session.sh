#!/usr/bin/env bash
# The GPU benchmarks behind BENCHMARKS.md, one device call (under 10 minutes) per phase (the write
# path's comparison and fixed costs: bench/extract_write_paths.sh):
#   bash bench/gpu_session.sh x     # extraction: disk vs writer CPU vs one event loop; flex vs dense step
#   bash bench/gpu_session.sh y     # loader vs the flex step; memory 2k..16k; 300 variable-length steps, guards
#   bash bench/gpu_session.sh z     # extraction with 1/2/3 workers per GPU; the loader against the flex step
#   bash bench/gpu_session.sh s     # extraction with the side-stream copy, 3 runs + 2 workers per GPU; CUDA worker test
#   bash bench/gpu_session.sh 3     # drafter step flex vs dense at 8B dims; peak memory at 2k..16k
#   bash bench/gpu_session.sh 4     # 300 variable-length steps (compiles, guards); extraction; loader (STEP_S=...)
#   bash bench/gpu_session.sh 1|2|diag   # this session's earlier calls (see BENCHMARKS.md)
# (carry .whl: pip download the wheels of zarr==3.1.6 numcodecs==0.16.6 crc32c ...)
# Logs go to $OUT (the device tool brings them back).
set -u
phase=${1:-1}
case "$phase" in x|y|z|s|3|4|1|2|diag) ;; *) echo "unknown phase '$phase' (see the list at the top)" >&2; exit 2;; esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || export PYTHONPATH=/tmp/site:$PWD/_nsroot
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, zarr, numcodecs; print(torch.__version__, transformers.__version__, zarr.__version__, numcodecs.__version__)"
  python3 bench/matmul_peak.py; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
quiet() { grep -vi "warn" | grep -v "^INFO:torch"; }
if [ "$phase" = 1 ]; then
  timeout 200 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 2>&1 | quiet | tee "$OUT/extract_bench.log"
  timeout 190 python3 bench/train_bench.py --ctx 3072 --attention flex,dense --steps 8 2>&1 | quiet | tee "$OUT/train_bench.log"
  timeout 160 python3 bench/train_loop.py --out /tmp/tl --steps 30 --samples 40 --loader-workers 1,2,4,8 2>&1 | quiet | tail -40 | tee "$OUT/train_loop_8b.log"
elif [ "$phase" = x ]; then   # where extraction's writer limit lies (disk, CPU, one event loop), then flex vs dense
  timeout 30 dd if=/dev/zero of=/tmp/ddtest bs=8M count=512 oflag=direct 2>&1 | tail -1 | tee "$OUT/disk.log"; rm -f /tmp/ddtest
  df -h /tmp /dev/shm | tee -a "$OUT/disk.log"
  for dir in /tmp/wb /dev/shm/wb; do echo "== writer_bench in $dir"
    timeout 60 python3 bench/writer_bench.py --batches 12 --work $dir --procs 1,2,4 --only-procs 2>&1 | quiet; rm -rf $dir
  done | tee "$OUT/writer_bench.log"
  timeout 150 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 --variants 1 2>&1 \
      | quiet | grep -v "it/s\]" | tee "$OUT/extract_bench.log"
  timeout 80 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 --variants 1 \
      --cache-dir /dev/shm/xb 2>&1 | quiet | grep "^{" | tee -a "$OUT/extract_bench.log"; rm -rf /dev/shm/xb
  timeout 200 python3 bench/train_bench.py --ctx 3072 --attention flex,dense --steps 6 --stack-every 90 \
      > "$OUT/train_bench.log" 2>&1; grep -v "^  File\|^Thread\|^$" "$OUT/train_bench.log" | quiet | tail -30
elif [ "$phase" = y ]; then   # loader vs the flex step; peak memory 2k..16k; 300 variable-length steps + guards
  timeout 50 python3 bench/train_loop.py --out /tmp/tl --samples 20 --loader-workers 1,2,4,8 --loader-only "${STEP_S:-0.1617}" \
      2>&1 | quiet | grep loader | tee "$OUT/loader.log"
  timeout 220 python3 bench/train_bench.py --ctx 2048,4096,8192,16384 --attention flex --steps 2 2>&1 | quiet \
      | tee "$OUT/train_bench_memory.log"
  timeout 290 python3 bench/train_loop.py --out /tmp/tlv --hidden 1024 --intermediate 3072 --heads 8 --kv-heads 4 \
      --vocab 32000 --min-ctx 200 --ctx 3072 --buckets 1024,2048,3072 --anchors 256 --steps 300 --samples 256 \
      --guards 2>&1 | quiet | tee "$OUT/train_loop_varlen.log" | tail -40
elif [ "$phase" = z ]; then   # extraction with 1/2/3 workers on the GPU; the loader after its copy fixes
  timeout 330 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 --variants 1 \
      --workers-per-gpu 2,3 2>&1 | quiet | grep -v "it/s\]" | tee "$OUT/extract_bench.log"
  timeout 60 python3 bench/train_loop.py --out /tmp/tl --samples 20 --loader-workers 1,2,4,8 --loader-only "${STEP_S:-0.1617}" \
      2>&1 | quiet | grep loader | tee "$OUT/loader.log"
elif [ "$phase" = s ]; then   # D2H on a side stream: the CUDA worker test, then extraction x3 and 2 workers per GPU
  timeout 90 python3 -m pytest -q -x tests/test_extract.py -k cuda 2>&1 | tail -3 | tee "$OUT/pytest_cuda.log"
  timeout 300 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 --variants 1 --repeat 3 \
      --workers-per-gpu 2 2>&1 | quiet | grep -v "it/s\]" | tee "$OUT/extract_bench.log"
elif [ "$phase" = 3 ]; then   # the drafter step: flex vs dense at 8B dims, then memory against context
  timeout 200 python3 bench/train_bench.py --ctx 3072 --attention flex,dense --steps 6 --stack-every 90 \
      > "$OUT/train_bench.log" 2>&1; grep -v "^  File\|^Thread\|^$" "$OUT/train_bench.log" | quiet | tail -30
  timeout 300 python3 bench/train_bench.py --ctx 2048,4096,8192,16384 --attention flex --steps 2 2>&1 | quiet \
      | tee "$OUT/train_bench_memory.log"
elif [ "$phase" = 4 ]; then   # 300 variable-length steps through the loop, guards; extraction and loader
  timeout 280 python3 bench/train_loop.py --out /tmp/tlv --hidden 1024 --intermediate 3072 --heads 8 --kv-heads 4 \
      --vocab 32000 --min-ctx 200 --ctx 3072 --buckets 1024,2048,3072 --anchors 256 --steps 300 --samples 256 \
      --guards 2>&1 | quiet | tail -40 | tee "$OUT/train_loop_varlen.log"
  timeout 130 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 --variants 1 2>&1 \
      | quiet | grep -v "it/s\]" | tee "$OUT/extract_bench.log"
  # is the writer disk-bound? the disk's own write rate, then the worker and the writer alone with the cache in RAM
  timeout 40 dd if=/dev/zero of=/tmp/ddtest bs=8M count=512 oflag=direct 2>&1 | tail -1 | tee "$OUT/disk.log"; rm -f /tmp/ddtest
  timeout 100 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 --variants 1 \
      --cache-dir /dev/shm/xb 2>&1 | quiet | grep "^{" | tee -a "$OUT/extract_bench.log"; rm -rf /dev/shm/xb
  timeout 60 python3 bench/writer_bench.py --batches 12 --work /dev/shm/wb 2>&1 | quiet | tee "$OUT/writer_bench_shm.log"
  rm -rf /dev/shm/wb
  timeout 60 python3 bench/train_loop.py --out /tmp/tl --samples 20 --loader-workers 1,2,4,8 --loader-only "${STEP_S:-0.23}" \
      2>&1 | quiet | grep loader | tee "$OUT/loader.log"
elif [ "$phase" = diag ]; then
  timeout 100 python3 bench/writer_bench.py --batches 12 2>&1 | quiet | tee "$OUT/writer_bench.log"
  TORCH_LOGS=graph_breaks,recompiles timeout 200 python3 bench/train_bench.py --ctx 3072 --attention flex --steps 4 \
      --stack-every 45 > "$OUT/train_bench_diag.log" 2>&1; tail -c 20000 "$OUT/train_bench_diag.log" | grep -v "^$" | tail -60
  timeout 170 python3 bench/train_loop.py --out /tmp/tlv --hidden 1024 --intermediate 3072 --heads 8 --kv-heads 4 \
      --vocab 32000 --min-ctx 200 --ctx 3072 --buckets 1024,2048,3072 --anchors 256 --steps 300 --samples 256 \
      --guards 2>&1 | quiet | tail -40 | tee "$OUT/train_loop_varlen.log"
  timeout 80 python3 -m pytest -q -x tests/test_train_compile.py tests/test_attention.py 2>&1 | tail -15 | tee "$OUT/pytest_cuda.log"
elif [ "$phase" = 2 ]; then
  timeout 210 python3 bench/train_bench.py --ctx 2048,4096,8192,16384 --attention flex --steps 3 2>&1 | quiet | tee "$OUT/train_bench_memory.log"
  timeout 200 python3 bench/train_loop.py --out /tmp/tlv --hidden 1024 --intermediate 3072 --heads 8 --kv-heads 4 \
      --vocab 32000 --min-ctx 200 --ctx 3072 --buckets 1024,2048,3072 --anchors 256 --steps 300 --samples 256 \
      --guards 2>&1 | quiet | tail -40 | tee "$OUT/train_loop_varlen.log"
  timeout 150 python3 -m pytest -q -x tests/test_train_compile.py tests/test_attention.py tests/test_train.py 2>&1 | tail -15 | tee "$OUT/pytest_cuda.log"
fi
