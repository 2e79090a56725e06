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
. scripts/gpu/setup.sh
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
