#!/usr/bin/env bash
# One device call of a GPU benchmark behind BENCHMARKS.md (under 10 minutes each):
#   bash bench/gpu.sh NAME [ARGS...]
# ARGS, when given, replace the default arguments listed here. Carry .whl (wheels of the
# packages the GPU image lacks: zarr, numcodecs, donfig, crc32c, ...). Logs go to $OUT.
#   extract         bench/extract_bench.py --samples 400 --length 2048 --batch-tokens 8192 --references runner --repeat 3
#   extract-fixed   bench/extract_write_paths.sh fixed                the CLI end to end, 256 x 2048, its phases (RUNS with labels before/after/pyc, BEFORE_NS)
#   train-step      bench/train_bench.py --ctx 3072 --attention flex,dense --steps 6
#   train-memory    bench/train_bench.py --ctx 2048,4096,8192,16384 --attention flex --steps 2
#   loader          bench/train_loop.py --out /tmp/tl --samples 20 --loader-workers 1,2,4,8 --loader-only 0.161
#   cuda-tests      python -m pytest -q -m cuda tests                 the tests that need a GPU
# (own wrappers: bench/train_start_gpu.sh, time to the first training step; bench/demo_real_gpu.sh, make demo-real)
set -u
name=${1:-}
shift $(( $# > 0 ? 1 : 0 ))
case "$name" in
  extract)       script=extract_bench.py; defaults=(--samples 400 --length 2048 --batch-tokens 8192 --references runner --repeat 3) ;;
  extract-fixed) script=extract_write_paths.sh; defaults=(fixed) ;;
  train-step)    script=train_bench.py;   defaults=(--ctx 3072 --attention flex,dense --steps 6) ;;
  train-memory)  script=train_bench.py;   defaults=(--ctx 2048,4096,8192,16384 --attention flex --steps 2) ;;
  loader)        script=train_loop.py;    defaults=(--out /tmp/tl --samples 20 --loader-workers 1,2,4,8 --loader-only 0.161) ;;
  cuda-tests)    script=;                 defaults=() ;;
  *) echo "usage: bash bench/gpu.sh NAME [ARGS...]; NAME is one of those listed at the top of bench/gpu.sh" >&2; exit 2 ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, zarr, numcodecs; print(torch.__version__, transformers.__version__, zarr.__version__, numcodecs.__version__)"
  [ "$name" = extract-fixed ] || python3 bench/train_bench.py --peak; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ $# -eq 0 ]; then set -- "${defaults[@]}"; fi
if [ -z "$script" ]; then
  timeout 570 python3 -m pytest -q -m cuda tests "$@" 2>&1 | tail -15 | tee "$OUT/$name.log"
elif [ "${script%.sh}" != "$script" ]; then
  OUT=$OUT timeout 570 bash "bench/$script" "$@" 2>&1 | tee "$OUT/$name.log"
else
  timeout 570 python3 "bench/$script" "$@" 2>&1 | grep -v "^INFO:torch" | tee "$OUT/$name.log"
fi
