#!/usr/bin/env bash
# One device call: time to the first training step, cold and warm compile caches, at 8B shapes.
#   [OLD=_old] [IMPORT_TIMES=0] bash bench/train_start_gpu.sh WORK [train_start.py args...]
# OLD: another version's shared/ train/ extract/ eval/ (e.g. from `git archive REV`) for the old-* runs;
# IMPORT_TIMES=0 skips timing `import torch` / `transformers` in fresh processes. WHL (default ../../.whl, else
# .whl): wheels the GPU image lacks (zarr, numcodecs, donfig, google-crc32c, datasets, ...). The checkout is imported
# as `dflash` through a folder of links, no install. Logs, results.json and machine.txt go to $OUT.
set -u
WHL=${WHL:-$([ -d ../../.whl ] && echo ../../.whl || echo .whl)}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl || exit 1
namespace() {  # namespace FOLDER SOURCE: FOLDER/dflash/{shared,train,extract,eval} -> SOURCE/...
  mkdir -p "$1/dflash"
  for d in shared train extract eval; do ln -sfn "$2/$d" "$1/dflash/$d"; done
}
namespace "$PWD/_ns" "$PWD"
export PYTHONPATH=/tmp/site:$PWD/_ns PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  df -h /tmp | tail -1
  if [ "${IMPORT_TIMES:-1}" = 1 ]; then for m in torch transformers; do  # a second import of each: files cached
    python3 -c "import $m" && python3 -c "import time; t = time.perf_counter(); import $m; print('import $m', round(time.perf_counter() - t, 2), 's')"
  done; fi; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
work=$1; shift
old_args=()
if [ -n "${OLD:-}" ]; then namespace "$PWD/_ns_old" "$PWD/$OLD"; old_args=(--old-path "$PWD/_ns_old"); fi
timeout 470 python3 bench/train_start.py --out "$work" --results "$OUT" "${old_args[@]}" "$@" 2>&1 | grep -v "^INFO:torch" | tail -40
