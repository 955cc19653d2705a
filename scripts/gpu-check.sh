#!/usr/bin/env bash
# The GPU checks of kvtier, as one command for a lent GPU machine without network
# (../shared/DEVICE.md has the recipe: the wheels in .whl/ and xxhash.h in .gpu-xxhash/,
# prepared on the CPU machine and carried along). Writes its results under $OUT.
#   run: bash scripts/gpu-check.sh      (carry: .whl .gpu-xxhash)
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
X=$(python3 -c "import sysconfig as s;print(s.get_config_var('EXT_SUFFIX'))")
I=$(python3 -c "import sysconfig as s;print(s.get_paths()['include'])")
gcc -O3 -shared -fPIC -I"$I" -I.gpu-xxhash src/kvtier/memory/_stream_copy.c \
  src/kvtier/memory/_copy_hash_avx2.c src/kvtier/memory/_copy_hash_avx512.c \
  -o "src/kvtier/memory/_stream_copy$X" || exit 1
export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# Bytes exact behind a busy stream (the gpu-marked tests), then the copy figures.
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/memory/test_device.py \
  > "$OUT/gpu-tests.txt" 2>&1; echo "gpu tests rc=$?" >> "$OUT/gpu-tests.txt"
timeout 240 python3 -m kvtier.cli.main bench cpu --device cuda --json > "$OUT/bench-cpu-cuda.json" \
  2> "$OUT/bench-cpu-cuda.err"; echo "bench cpu rc=$?" >> "$OUT/bench-cpu-cuda.err"
tail -3 "$OUT/gpu-tests.txt" "$OUT/bench-cpu-cuda.err"
