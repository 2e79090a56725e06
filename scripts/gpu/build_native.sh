#!/usr/bin/env bash
# Build kvtrace's C extensions in the source tree for the Python that runs them ($PY, default python3): the
# native row logs (kvtrace/record/_columns.c) and the device ring's drain and launch
# (kvtrace/probes/kv_access/_drain.c). A setuptools that predates `ext-modules` in pyproject.toml installs
# without them, and kvtrace then falls back to its slower Python code. Built again where the source is newer
# than the module (a machine kept warm between calls keeps the module an earlier tree built). Compiler output
# goes to $OUT/install.log. Run from the repository root (setup.sh and bench/gpu_all.sh call it).
PY=${PY:-python3}
OUT=${OUT:-/tmp/kvtrace-gpu}
mkdir -p "$OUT"
suffix=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
include=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
for ext in kvtrace/record/_columns kvtrace/probes/kv_access/_drain; do
    if [ "src/$ext.c" -nt "src/$ext$suffix" ] || ! $PY -c "import ${ext//\//.}" 2>/dev/null; then
        gcc -O2 -std=c99 -shared -fPIC -pthread -I"$include" "src/$ext.c" -o "src/$ext$suffix" >>"$OUT/install.log" 2>&1 \
            || echo "build_native: src/$ext.c did not build (see $OUT/install.log); Python code is used" >&2
    fi
done
