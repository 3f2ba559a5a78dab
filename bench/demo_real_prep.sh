#!/usr/bin/env bash
# Here, before bench/demo_real_gpu.sh's two device calls: everything they carry, all git-ignored.
#   .whl/     wheels of what the GPU image lacks (Python 3.12, x86-64): zarr and its codecs, datasets, gguf
#   .carry1/, .carry2/   the SmolLM2 GGUF (98 MB) in two halves, as one call carries at most 64 MiB
#   .real/data.tgz       the demo's chats and prompts (python -m dflash.eval.demo_real prepare)
# Needs the real extra (make real-deps).   bash bench/demo_real_prep.sh [--set conversations=N ...]
set -euo pipefail
for d in /.whl/ /.carry1/ /.carry2/ /.real/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl zarr zarrs numcodecs donfig msgspec crc32c google-crc32c datasets dill \
  multiprocess gguf
gguf=$(python -c "from dflash.eval.benchmarks import package_file; from dflash.eval.gguf import SMOLLM2
print(package_file(*SMOLLM2))")  # names make real-deps where the GGUF is not installed
rm -rf .carry1 .carry2 && mkdir -p .carry1 .carry2
split -n 2 -d "$gguf" /tmp/smol_part_ && mv /tmp/smol_part_00 .carry1/part_aa && mv /tmp/smol_part_01 .carry2/part_ab
python -m dflash.eval.demo_real prepare --out .real/out "$@"
(cd .real/out && tar czf ../data.tgz data data.demo.json)
echo "GGUF sha256 $(sha256sum "$gguf" | cut -d' ' -f1)"; du -sh .whl .carry1 .carry2 .real/data.tgz
