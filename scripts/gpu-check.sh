#!/usr/bin/env bash
# The GPU checks of kvtier, as one command for a lent GPU machine without network
# (../shared/DEVICE.md has the recipe: the wheels in .whl/ and xxhash.h in .gpu-xxhash/,
# prepared on the CPU machine and carried along). Writes its results under $OUT.
#   run: bash scripts/gpu-check.sh      (carry: .whl .gpu-xxhash)
#
# What it measures (issue 57, part 4), each against the same bytes copied by torch in the
# same run, one step after another, each under its own timeout so that one stuck step cannot
# eat the visit (the whole script stays under ~9 minutes: a device command may run 10):
#   1. bytes exact through the tiers behind a busy stream  gpu-tests.txt     (pytest -m gpu)
#   2. kvtier bench cpu --device cuda: store/retrieve     bench-cpu-cuda.json
#   3. paged save/load per layout: the Triton kernel vs   bench-paged-cuda.json
#      torch vs a pinned DMA, bit-exactness, scratch;
#      the worker's one-copy path (kernel <-> pages)      one-copy.txt
#   4. TTFT efficiency, 8B shape, 16k and 32k tokens,     ttft-<tokens>-<mode>.json
#      90 % cached, layer-wise off and on
#   5. GPU memory kvtier allocates                        in 3 (scratch_*_bytes) and
#                                                         gpu-memory.json
# summary.txt collects the headline figures; a step that could not run says why there.
#   dry run on a CPU host (checks every Python piece with small shapes, no GPU):
#     DRY_RUN=1 bash scripts/gpu-check.sh
#   some steps only (the TTFT runs alone may take ~5 minutes: split a visit in two commands):
#     STEPS=1,2,3,5 bash scripts/gpu-check.sh;  STEPS=4 bash scripts/gpu-check.sh
set -uo pipefail
OUT=${OUT:-/tmp/kvtier-gpu}
mkdir -p "$OUT"
DEVICE=cuda
PY=python3
if [ "${DRY_RUN:-0}" = 1 ]; then
  DEVICE=cpu
  PY=${PY_DRY:-.venv/bin/python}
  export PYTHONPATH=$PWD/src:$PWD PYTHONUNBUFFERED=1
else
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  X=$($PY -c "import sysconfig as s;print(s.get_config_var('EXT_SUFFIX'))")
  I=$($PY -c "import sysconfig as s;print(s.get_paths()['include'])")
  gcc -O3 -shared -fPIC -I"$I" -I.gpu-xxhash src/kvtier/memory/_stream_copy.c \
    src/kvtier/memory/_copy_hash_avx2.c src/kvtier/memory/_copy_hash_avx512.c \
    -o "src/kvtier/memory/_stream_copy$X" || exit 1
  export PYTHONPATH=$PWD/src:$PWD:/tmp/site PYTHONUNBUFFERED=1
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
fi
SUMMARY="$OUT/summary.txt"
echo "kvtier gpu-check on $DEVICE, $(date -u +%FT%TZ)" > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
want() { [[ ",${STEPS:-1,2,3,4,5}," == *",$1,"* ]]; }

# 1. Bytes exact behind a busy stream: every gpu-marked test (stores through disk and a coded
#    CPU tier behind a queue of kernels, a load whose request ends at once, the kernel's
#    gather into and scatter from pinned pages, the engine and transformers round trips).
GPU_TESTS="tests/memory/test_device.py tests/integrations/vllm/test_paged_kernel_gpu.py
  tests/engine/test_core.py tests/integrations/test_transformers.py
  tests/integrations/test_transformers_layerwise.py tests/test_hosts.py
  tests/bench/test_cpu.py"
if ! want 1; then :
elif [ "$DEVICE" = cuda ]; then
  # shellcheck disable=SC2086
  timeout 180 $PY -m pytest -q -p no:cacheprovider -m gpu $GPU_TESTS > "$OUT/gpu-tests.txt" 2>&1
  note "1. gpu tests rc=$? ($(tail -1 "$OUT/gpu-tests.txt"))"
else
  # shellcheck disable=SC2086
  timeout 180 $PY -m pytest -q -p no:cacheprovider -m gpu --collect-only $GPU_TESTS \
    > "$OUT/gpu-tests.txt" 2>&1
  note "1. gpu tests collected rc=$? ($(tail -1 "$OUT/gpu-tests.txt"))"
fi

# 2. The CPU tier's store/retrieve with the KV on the device, against torch's pinned copies.
if [ "$DEVICE" = cuda ]; then BENCH_CPU=""; else BENCH_CPU="--chunks 2 --repeats 1"; fi
want 2 && {
# shellcheck disable=SC2086
timeout 120 $PY -m kvtier.cli.main bench cpu --device "$DEVICE" $BENCH_CPU --json \
  > "$OUT/bench-cpu-$DEVICE.json" 2> "$OUT/bench-cpu-$DEVICE.err"
note "2. bench cpu rc=$? $($PY - "$OUT/bench-cpu-$DEVICE.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:  # noqa: BLE001 - a summary line, whatever went wrong
    print(f"(no result: {exc})"); raise SystemExit
print({k: r.get(k) for k in ("store_ratio", "retrieve_ratio", "d2h_gbps", "h2d_gbps")})
PY
)"
}

# 3. Paged save/load for each layout vLLM hands a connector: kernel vs torch vs pinned DMA.
if [ "$DEVICE" = cuda ]; then BENCH_PAGED="--tokens 4096 --repeats 9"; else
  BENCH_PAGED="--layers 2 --kv-heads 2 --head-dim 16 --tokens 64 --repeats 2"; fi
want 3 && {
# shellcheck disable=SC2086
TRITON_INTERPRET=$([ "$DEVICE" = cpu ] && echo 1 || echo 0) timeout 150 \
  $PY -m kvtier.cli.main bench paged --device "$DEVICE" $BENCH_PAGED --json \
  > "$OUT/bench-paged-$DEVICE.json" 2> "$OUT/bench-paged-$DEVICE.err"
note "3. bench paged rc=$? $($PY - "$OUT/bench-paged-$DEVICE.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:  # noqa: BLE001
    print(f"(no result: {exc})"); raise SystemExit
print()
for k, v in r.items():
    if k.endswith("_vs_dma") or k.endswith("_bytes") or k in ("device", "kernel"):
        print(f"   {k} = {v}")
PY
)"
# The worker's one-copy path itself (integrations/vllm/one_copy.py): blocks <-> the engine's
# pinned pages through the kernel, bytes exact behind a busy stream, no payload copy_, less
# than a chunk of GPU memory (a dry run only collects it: it needs CUDA).
ONE_COPY=(-m gpu tests/integrations/vllm/test_one_copy_gpu.py)
[ "$DEVICE" = cuda ] || ONE_COPY+=(--collect-only)
timeout 120 $PY -m pytest -q -p no:cacheprovider "${ONE_COPY[@]}" > "$OUT/one-copy.txt" 2>&1
note "3. one-copy worker path rc=$? ($(tail -1 "$OUT/one-copy.txt"))"
}

# 4. TTFT efficiency: 8B shape (32 layers, 32 query heads, 8 KV heads of 128, hidden 4096,
#    random bf16 weights made on the GPU), 16k and 32k tokens, 90 % cached, layer-wise loads
#    off and on: one process per run (each builds its model). Estimated on an H100/H200:
#    ~25 s to start and build the model, then 2 warm-ups, one 90 % prefill + store and 3
#    repeats of (full, cached, ideal): ~30 s at 16k, ~60 s at 32k, so the four runs take
#    ~3.5 minutes (a timeout of 150 s each bounds them at 10). A dry run: the tiny model on
#    the CPU, one short prompt, both modes.
want 4 && {
TTFT_ARGS="--dtype bfloat16 --chunk-size 256 --fractions 90 --device $DEVICE"
if [ "$DEVICE" = cuda ]; then
  SIZES="16384 32768"; REPEATS=3; TTFT_ARGS="$TTFT_ARGS --model-size 8b"
else
  SIZES="512"; REPEATS=1; TTFT_ARGS="$TTFT_ARGS --model-size tiny"
fi
for tokens in $SIZES; do
  for mode in off on; do
    # shellcheck disable=SC2086
    timeout 150 $PY -m benchmarks ttft $TTFT_ARGS --layerwise "$mode" --prompt-tokens "$tokens" \
      --repeats "$REPEATS" --json > "$OUT/ttft-$tokens-$mode.json" 2> "$OUT/ttft-$tokens-$mode.err"
    rc=$?
    note "4. ttft $tokens tokens, layer-wise $mode: rc=$rc $($PY - "$OUT/ttft-$tokens-$mode.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:  # noqa: BLE001
    print(f"(no result: {exc})"); raise SystemExit
keys = ("efficiency_90", "ttft_full_ms", "ttft_cached_90_ms", "ttft_ideal_90_ms", "load_90_ms",
        "layerwise_scratch_bytes", "device", "model")
print({k: r.get(k) for k in keys})
PY
)"
  done
done
}

# 5. GPU memory kvtier allocates: an engine storing and retrieving a device KV (its copy
#    streams, events and any staging), measured as torch's allocated bytes around it.
want 5 && {
timeout 90 $PY - "$DEVICE" > "$OUT/gpu-memory.json" 2> "$OUT/gpu-memory.err" <<'PY'
import json, sys

import torch

from kvtier.config import Config
from kvtier.engine import Engine
from kvtier.layout import KVLayout

device = torch.device(sys.argv[1])
cuda = device.type == "cuda"
layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
chunk, chunks = 256, 16 if cuda else 1
if not cuda:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
tokens = list(range(chunk * chunks))
kv = torch.randn(layout.kv_shape(len(tokens)), device=device).to(layout.dtype)
out = torch.zeros_like(kv)
alloc = (lambda: torch.cuda.memory_allocated(device)) if cuda else (lambda: 0)
if cuda:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
before = alloc()
size = f"{layout.chunk_bytes(chunk) * (chunks + 2)}B"
cfg = Config.load(env={}, overrides={"chunk_size": chunk, "max_local_cpu_size": size})
with Engine(cfg, layout, model_name="gpu-memory") as engine:
    engine.store(tokens, kv)
    with engine.request("r"):
        engine.lookup(tokens + [1], "r")
        engine.retrieve_into(tokens + [1], "r", out)
    if cuda:
        torch.cuda.synchronize(device)
    held = alloc() - before
    peak = (torch.cuda.max_memory_allocated(device) - before) if cuda else 0
    stats = engine.stats()


def device_fields(tree, prefix=""):
    """Every stats() field, at any depth, that names device memory or scratch."""
    found = {}
    for key, value in (tree.items() if isinstance(tree, dict) else []):
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found.update(device_fields(value, name + "."))
        elif "device" in name or "scratch" in name:
            found[name] = value
    return found


exact = bool(torch.equal(out.view(torch.int16), kv.view(torch.int16)))
print(json.dumps({
    "kv_bytes": kv.numel() * kv.element_size(),
    "held_after_bytes": held,
    "peak_extra_bytes": peak,
    "chunk_bytes": layout.chunk_bytes(chunk),
    "exact": exact,
    "stats_device": device_fields(stats),
}))
PY
note "5. gpu memory rc=$? $(cat "$OUT/gpu-memory.json" 2>/dev/null)"
}
exit 0
