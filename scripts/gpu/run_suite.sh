#!/usr/bin/env bash
# On the GPU machine, in the repository root: unpack vLLM's CUDA build from the pieces that earlier calls
# staged in /tmp/stage (scripts/gpu/pack_vllm.sh made them), install kvtrace, run the GPU suite.
#
#   bash scripts/gpu/run_suite.sh                  # tests/gpu (device ring and real vLLM runs)
#   bash scripts/gpu/run_suite.sh tests/gpu/test_vllm_cuda.py -k flash
#
# Logs, a results table (results.jsonl) and the runs' logs go to $OUT (the device tool brings them back).
# Without the pieces, vLLM's tests skip and the device ring tests still run.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvtrace-gpu}
mkdir -p "$OUT"
STAGE=${KVTRACE_GPU_STAGE:-/tmp/stage}
SITE=/tmp/site
if [ ! -d "$SITE/vllm" ] && ls "$STAGE"/part.* >/dev/null 2>&1; then
    echo "run_suite: unpacking $(cat "$STAGE"/part.* | wc -c) bytes" >&2
    cat "$STAGE"/part.* | xz -d | tar x -C /tmp || { echo "run_suite: the pieces do not unpack" >&2; exit 2; }
fi
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export KVTRACE_GPU_OUT="$OUT"
# kvtrace installed (its vLLM plugin entry point must be visible to vLLM's processes); offline, no build
# isolation. Where that fails, the source tree and a dist-info naming the entry point do the same.
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1; then
    echo "run_suite: pip install failed (see install.log); using src/ and a hand-made dist-info" >&2
    mkdir -p "$SITE/kvtrace-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: kvtrace\nVersion: 0.1.0\n' >"$SITE/kvtrace-0.1.0.dist-info/METADATA"
    printf '[console_scripts]\nkvtrace = kvtrace.cli:main\n\n[vllm.general_plugins]\nkvtrace = kvtrace.probes.vllm.plugin:register\n' \
        >"$SITE/kvtrace-0.1.0.dist-info/entry_points.txt"
    export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
for name in ("vllm", "kvtrace", "duckdb", "pyarrow", "cupy", "nvtx"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"), m.__file__)
    except Exception as exc:
        print(name, "NOT IMPORTABLE:", exc)
import kvtrace.record.buffers as b
print("native row logs:", b.native())
PY
python3 -m pytest -q -rs -p no:cacheprovider "${@:-tests/gpu}" 2>&1 | tee "$OUT/pytest.log"
exit "${PIPESTATUS[0]}"
