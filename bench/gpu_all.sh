#!/usr/bin/env bash
# Everything the device ring needs a GPU for, in one command (one device lease): environment, the GPU tests,
# compute-sanitizer (memcheck, racecheck, synccheck) on a small driver, and the benchmark.
#
#   bash bench/gpu_all.sh                          # all stages
#   bash bench/gpu_all.sh tests memcheck bench     # some stages
#
# Logs go to $OUT (default /tmp/kvtrace-gpu); the last lines printed are a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvtrace-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STAGES=${*:-env tests memcheck racecheck synccheck bench}
declare -A RC

# kvtrace must import: an offline editable install, else the source tree on PYTHONPATH (src/ is the package's
# root).
if ! $PY -c "import kvtrace.probes.kv_access.ring" 2>/dev/null; then
    $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || true
    if ! $PY -c "import kvtrace.probes.kv_access.ring" 2>/dev/null; then
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
# The C extensions (native row logs, the ring's drain and launch), where the install did not build them:
# without them the GPU tests' native cases skip
PY=$PY OUT=$OUT bash scripts/gpu/build_native.sh

run() {  # name timeout_s command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    RC[$name]=${PIPESTATUS[0]}
    echo "=== $name: exit ${RC[$name]}"
}

for stage in $STAGES; do
    case $stage in
    env)
        run env 60 bash -c "nvidia-smi -L; $PY -c 'import torch, cupy, triton; \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cupy\", cupy.__version__, \"triton\", \
triton.__version__, torch.cuda.get_device_name())'; $PY -c 'import flash_attn; print(\"flash_attn\", \
flash_attn.__version__)' || echo 'flash_attn: not installed'; which compute-sanitizer nvcc" ;;
    tests)
        run tests 300 $PY -m pytest -q -rs -p no:cacheprovider tests/gpu tests/unit/probes/test_kv_ring.py ;;
    memcheck | racecheck | synccheck)
        # No caching allocator: every tensor is its own allocation, so an overrun is caught, not absorbed.
        run "$stage" 240 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$stage" \
            --error-exitcode 9 --print-limit 20 $PY bench/bench_device_ring.py --sanitize ;;
    bench)
        run bench 420 $PY bench/bench_device_ring.py ;;
    *) echo "unknown stage $stage" ;;
    esac
done

echo "=== summary"
for stage in $STAGES; do
    echo "$stage: exit ${RC[$stage]:-not run}"
done
grep -h -E "passed|failed|ERROR SUMMARY|RACECHECK SUMMARY|sanitize driver" "$OUT"/*.log 2>/dev/null | tail -n 12
sed -n '/^| measure/,$p' "$OUT/bench.log" 2>/dev/null
