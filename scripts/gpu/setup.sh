# On the GPU machine, sourced from the repository root: unpack vLLM's CUDA build from the pieces that earlier
# calls staged in /tmp/stage (scripts/gpu/pack_vllm.sh made them) once, and make it and kvtrace importable
# in this shell. run_suite.sh sources it; so can any GPU command that needs vLLM:
#
#   . scripts/gpu/setup.sh && python3 bench/bench_gpu_throughput.py --out "$OUT/throughput"
#
# Sets PYTHONPATH, vLLM's offline switches and KVTRACE_GPU_OUT ($OUT, default /tmp/kvtrace-gpu).
OUT=${OUT:-/tmp/kvtrace-gpu}
mkdir -p "$OUT"
STAGE=${KVTRACE_GPU_STAGE:-/tmp/stage}
SITE=/tmp/site
if [ ! -d "$SITE/vllm" ] && ls "$STAGE"/part.* >/dev/null 2>&1; then
    echo "setup: unpacking $(cat "$STAGE"/part.* | wc -c) bytes" >&2
    cat "$STAGE"/part.* | xz -d | tar x -C /tmp || { echo "setup: the pieces do not unpack" >&2; exit 2; }
fi
# FlashInfer, where its wheel was staged too (pack_vllm.sh with WITH_FLASHINFER=1): pure Python
for whl in "$STAGE"/flashinfer_python-*.whl; do
    [ -f "$whl" ] && [ ! -d "$SITE/flashinfer" ] && python3 -m zipfile -e "$whl" "$SITE/"
done
# py-spy, where its wheel was staged (`pip download --no-deps py-spy`): bench/profile_engine_thread.py
# --py-spy "$KVTRACE_PY_SPY" samples which thread holds the GIL
for whl in "$STAGE"/py_spy-*.whl; do
    if [ -f "$whl" ] && [ ! -x /tmp/py-spy/bin/py-spy ]; then
        mkdir -p /tmp/py-spy/bin && python3 -m zipfile -e "$whl" /tmp/py-spy/whl \
            && cp /tmp/py-spy/whl/py_spy-*.data/scripts/py-spy /tmp/py-spy/bin/ && chmod +x /tmp/py-spy/bin/py-spy
    fi
done
[ -x /tmp/py-spy/bin/py-spy ] && export KVTRACE_PY_SPY=/tmp/py-spy/bin/py-spy
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export KVTRACE_GPU_OUT="$OUT"
# kvtrace installed (its vLLM plugin entry point must be visible to vLLM's processes); offline, no build
# isolation. Where that fails, the source tree and a dist-info naming the entry point do the same.
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1; then
    echo "setup: pip install failed (see install.log); using src/ and a hand-made dist-info" >&2
    mkdir -p "$SITE/kvtrace-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: kvtrace\nVersion: 0.1.0\n' >"$SITE/kvtrace-0.1.0.dist-info/METADATA"
    printf '[console_scripts]\nkvtrace = kvtrace.cli:main\n\n[vllm.general_plugins]\nkvtrace = kvtrace.probes.vllm.plugin:register\n' \
        >"$SITE/kvtrace-0.1.0.dist-info/entry_points.txt"
    export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# The native row logs and the ring's drain and launch, built for this Python (C extensions; see the script)
PY=python3 OUT=$OUT bash scripts/gpu/build_native.sh
