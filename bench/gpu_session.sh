#!/usr/bin/env bash
# The GPU benchmarks behind BENCHMARKS.md, one device call (under 10 minutes) per phase:
#   bash bench/gpu_session.sh x     # extraction: disk vs writer CPU vs one event loop; flex vs dense step
#   bash bench/gpu_session.sh y     # loader vs the flex step; memory 2k..16k; 300 variable-length steps, guards
#   bash bench/gpu_session.sh z     # extraction with 1/2/3 workers per GPU; the loader against the flex step
#   bash bench/gpu_session.sh s     # extraction with the side-stream copy, 3 runs + 2 workers per GPU; CUDA worker test
#   bash bench/gpu_session.sh w     # every array to the writer processes (0/2/3, twice); host-GPU syncs of a batch
#   bash bench/gpu_session.sh h     # the LM head's top-k ways (bench/topk_head.py); extraction x4 with the new one
#   bash bench/gpu_session.sh b     # blocking CUDA events (no spinning waits); extraction with 2 and 3 writer processes x2
#   bash bench/gpu_session.sh n     # extraction x3 on a fresh host (repeat over calls); topk_head --compiled
#   bash bench/gpu_session.sh c     # the compiled log-sum-exp in the worker; extraction over 400 samples x2
#   bash bench/gpu_session.sh d     # where the writer's time goes (pool copy/wait, processes busy, CPU per thread); 2 vs 3 processes
#   bash bench/gpu_session.sh p     # the writer processes alone (no GPU): processes x zarr concurrency x heap buffers, disk and /dev/shm
#   bash bench/gpu_session.sh e     # extraction, 400 samples x2: writer processes 2 (old: no heap buffers) / 2 / 3 / 4 x concurrency 4
#   bash bench/gpu_session.sh k     # no GPU work: one writer process's CPU per chunk, blosc alone against a zarr write
#   bash bench/gpu_session.sh f     # next: the writer processes' own chunk writes on/off, alone (writer_bench) and in extraction x2
#   bash bench/gpu_session.sh 3     # drafter step flex vs dense at 8B dims; peak memory at 2k..16k
#   bash bench/gpu_session.sh 4     # 300 variable-length steps (compiles, guards); extraction; loader (STEP_S=...)
#   bash bench/gpu_session.sh 1|2|diag   # this session's earlier calls (see BENCHMARKS.md)
# (carry .whl: pip download the wheels of zarr==3.1.6 numcodecs==0.16.6 crc32c ...)
# Logs go to $OUT (the device tool brings them back).
set -u
phase=${1:-1}
case "$phase" in x|y|z|s|w|h|b|n|c|d|p|e|k|f|3|4|1|2|diag) ;; *) echo "unknown phase '$phase' (see the list at the top)" >&2; exit 2;; esac
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
elif [ "$phase" = w ]; then   # writer processes for every array; where a batch synchronises with the GPU
  timeout 60 python3 bench/sync_check.py 2>&1 | quiet | tee "$OUT/sync_check.log"
  timeout 90 python3 -m pytest -q -x tests/test_extract.py -k cuda 2>&1 | tail -3 | tee "$OUT/pytest_cuda.log"
  timeout 330 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 \
      --writer-processes 0,2,3,0,2,3 2>&1 | quiet | grep "^{" | tee "$OUT/extract_bench.log"
elif [ "$phase" = h ]; then   # the LM head's top-k: bf16 logits ranked, fp32 log-probs gathered; extraction with it
  timeout 60 python3 bench/topk_head.py 2>&1 | quiet | tee "$OUT/topk_head.log"
  timeout 90 python3 -m pytest -q -x tests/test_extract.py -k cuda 2>&1 | tail -3 | tee "$OUT/pytest_cuda.log"
  timeout 330 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 \
      --writer-processes 2 --repeat 4 2>&1 | quiet | grep "^{" | tee "$OUT/extract_bench.log"
elif [ "$phase" = b ]; then   # blocking CUDA events: no thread spins while it waits for the GPU
  timeout 90 python3 -m pytest -q -x tests/test_extract.py -k cuda 2>&1 | tail -3 | tee "$OUT/pytest_cuda.log"
  timeout 300 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 \
      --writer-processes 2,3 --repeat 2 2>&1 | quiet | grep "^{" | tee "$OUT/extract_bench.log"
elif [ "$phase" = d ]; then   # where the writer's time goes, 400 samples, 2 and 3 writer processes twice each
  timeout 90 python3 -m pytest -q -x tests/test_extract.py -k "cuda or compiled_head" 2>&1 | tail -3 | tee "$OUT/pytest_cuda.log"
  timeout 420 python3 bench/extract_bench.py --samples 400 --length 2048 --batch-tokens 8192 \
      --writer-processes 2,3 --repeat 2 2>&1 | quiet | grep "^{" | tee "$OUT/extract_bench.log"
  nproc; cat /proc/loadavg; free -g | head -2
elif [ "$phase" = p ]; then   # the writer processes alone: where their CPU goes (user, system, page faults)
  for dir in /tmp/wb /dev/shm/wb; do
    timeout 200 python3 bench/writer_bench.py --batches 13 --work $dir \
        --pool 2:32:0:0,2:32:1:0,2:8:1:0,2:4:1:0,3:4:1:0,4:4:1:0,3:8:1:0,2:32:0:0 2>&1 | grep "^{"; rm -rf $dir
  done | tee "$OUT/writer_pool.log"
  nproc; cat /proc/loadavg; uname -r; ldd --version | head -1
elif [ "$phase" = e ]; then   # extraction with the writer processes' heap buffers: 2 (without, as before) / 2 / 3 / 4 x conc 4
  timeout 540 python3 bench/extract_bench.py --samples 400 --length 2048 --batch-tokens 8192 --repeat 2 --settings \
      '[{"writer_processes": 2, "writer_heap_buffers": false}, {"writer_processes": 2}, {"writer_processes": 3},
        {"writer_processes": 4, "write_concurrency": 4}]' 2>&1 | quiet | grep "^{" | tee "$OUT/extract_bench.log"
  nproc; cat /proc/loadavg
elif [ "$phase" = k ]; then   # one writer process's CPU per chunk: blosc alone, crc32c, a copy, a zarr write
  for i in 1 2 3; do
    timeout 60 python3 bench/chunk_cpu.py --chunks 32 --work /tmp/cc 2>&1 | grep "^{"
    timeout 60 python3 bench/chunk_cpu.py --chunks 32 --work /tmp/cc --heap-buffers 2>&1 | grep "^{"
  done | tee "$OUT/chunk_cpu.log"
  grep -m1 "model name" /proc/cpuinfo
elif [ "$phase" = f ]; then   # DirectChunks: the writer processes store whole chunks themselves (same bytes as zarr)
  timeout 90 python3 -m pytest -q -x tests/test_extract.py -k "cuda or compiled_head" 2>&1 | tail -3 | tee "$OUT/pytest_cuda.log"
  timeout 90 python3 bench/writer_bench.py --batches 13 --work /tmp/wb --pool 2:32:1:0,2:32:1:1,2:32:1:0,2:32:1:1 2>&1 \
      | grep "^{" | tee "$OUT/writer_pool.log"; rm -rf /tmp/wb
  timeout 400 python3 bench/extract_bench.py --samples 400 --length 2048 --batch-tokens 8192 --repeat 2 --settings \
      '[{"writer_processes": 2, "writer_direct_chunks": false}, {"writer_processes": 2}]' 2>&1 | quiet | grep "^{" \
      | tee "$OUT/extract_bench.log"
elif [ "$phase" = n ]; then   # next: is 0.9 robust across fresh hosts (run this on 2-3 calls); a compiled log-sum-exp
  timeout 120 python3 bench/topk_head.py --compiled 2>&1 | quiet | grep "^{" | tee "$OUT/topk_head.log"
  timeout 90 python3 -m pytest -q -x tests/test_extract.py -k cuda 2>&1 | tail -3 | tee "$OUT/pytest_cuda.log"
  timeout 300 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 \
      --writer-processes 2 --repeat 3 2>&1 | quiet | grep "^{" | tee "$OUT/extract_bench.log"
elif [ "$phase" = c ]; then   # the compiled log-sum-exp in the worker; extraction on a longer run (fixed costs amortised)
  timeout 120 python3 -m pytest -q -x tests/test_extract.py -k "cuda or compiled_head" 2>&1 | tail -3 | tee "$OUT/pytest_cuda.log"
  timeout 90 python3 bench/topk_head.py --compiled 2>&1 | quiet | grep "^{" | tee "$OUT/topk_head.log"
  timeout 330 python3 bench/extract_bench.py --samples 400 --length 2048 --batch-tokens 8192 \
      --writer-processes 2 --repeat 2 2>&1 | quiet | grep "^{" | tee "$OUT/extract_bench.log"
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
