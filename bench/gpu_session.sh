#!/usr/bin/env bash
# One device call: install the carried wheels, then the benchmarks behind BENCHMARKS.md.
# Logs go to $OUT (the device tool brings them back).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || export PYTHONPATH=/tmp/site:$PWD/_nsroot
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nproc > "$OUT/machine.txt"; nvidia-smi --query-gpu=name,memory.total --format=csv >> "$OUT/machine.txt"
timeout 180 python3 bench/extract_bench.py --samples 160 --length 2048 --batch-tokens 8192 2>&1 | grep -vi warn | tee "$OUT/extract_bench.log"
timeout 170 python3 bench/train_bench.py --ctx 3072 --attention flex,dense --steps 8 2>&1 | grep -vi warn | tee "$OUT/train_bench.log"
timeout 120 python3 bench/train_loop.py --out /tmp/tl --steps 40 --samples 32 2>&1 | grep -vi warn | tail -60 > "$OUT/train_loop.log"
timeout 110 python3 bench/train_bench.py --ctx 2048,8192,16384 --attention flex --steps 3 2>&1 | grep -vi warn | tee -a "$OUT/train_bench.log"
