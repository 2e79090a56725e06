#!/usr/bin/env bash
# On a machine with PyPI (the CPU machines): vLLM's CUDA build, and what it and kvtrace need beyond the GPU
# machine's image, unpacked into one folder and packed as pieces that each fit one device call.
#
#   bash scripts/gpu/pack_vllm.sh            # -> .gpu/p0/part.00, .gpu/p1/part.01, .gpu/p2/part.02
#   WITH_FLASHINFER=1 bash scripts/gpu/pack_vllm.sh   # and .gpu/pflashinfer/: FlashInfer's wheel, for the
#                                            # FlashInfer case (it compiles its kernels at first use: minutes)
#
# The GPU machine has no registry access and takes at most 64 MiB per call (working tree included), but
# files it writes outside the working tree survive between calls while it stays warm. So: one call per
# piece, each carrying its folder (`carry: [".gpu/p0"]`) and copying it to /tmp/stage, back to back; the
# last one runs `bash scripts/gpu/run_suite.sh`, which unpacks them (docs/gpu.md). vLLM 0.26.0 is the
# newest release whose CUDA wheel pins the image's torch (2.11.0); its native libraries link CUDA 13.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
OUT=${OUT:-.gpu}
WORK=${KVTRACE_GPU_WORK:-/tmp/kvtrace-gpu-pack}
PIECE_MB=${PIECE_MB:-50}
mkdir -p "$WORK/wheels"
rm -rf "$WORK/site" && mkdir -p "$WORK/site"

# Wheels for the GPU image's Python (3.12, x86-64). Besides vLLM: what vLLM imports on the offline path and
# the image lacks (seen with vLLM 0.26.0, ../shared/notes/gpu-vllm.md), and kvtrace's duckdb and nvtx.
DEPS="vllm==$VLLM_VERSION annotated_types==0.8.0 apache_tvm_ffi==0.1.10 cachetools==8.0.2 cbor2==6.3.0
fastapi==0.136.3 httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 llguidance==1.7.6 msgspec==0.22.0
openai==3.57.0 openai_harmony==0.0.8 partial_json_parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4
pydantic_core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5
typing_inspection==0.4.5 xgrammar==0.2.7 duckdb nvtx"
echo "pack: downloading wheels into $WORK/wheels" >&2
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_35_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$WORK/wheels" $DEPS >"$WORK/download.log" 2>&1 || { grep -v "^WARNING: Location" "$WORK/download.log" >&2; exit 1; }
for w in "$WORK"/wheels/*.whl; do unzip -q -o "$w" -d "$WORK/site"; done
# Not used on an H100, and most of the size: FlashAttention 2 (pre-Hopper; Hopper runs FlashAttention 3),
# the Rust front end, DeepGEMM's builds for other Pythons.
rm -f "$WORK/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$WORK/site/vllm/vllm-rs"
rm -f "$WORK"/site/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*
echo "pack: compressing $(du -sh "$WORK/site" | cut -f1)" >&2
tar -C "$WORK" -cf - site | xz -T2 -6 > "$WORK/site.tar.xz"
rm -rf "$OUT" && mkdir -p "$OUT"
(cd "$OUT" && split -b "${PIECE_MB}M" -d "$WORK/site.tar.xz" part.)
i=0
for part in "$OUT"/part.*; do
    mkdir -p "$OUT/p$i" && mv "$part" "$OUT/p$i/"
    i=$((i + 1))
done
if [ "${WITH_FLASHINFER:-0}" = 1 ]; then
    # The version vLLM pins; it imports with what the GPU image has, and JIT-compiles its kernels with
    # the image's nvcc and ninja. setup.sh installs it when it finds the wheel in /tmp/stage.
    mkdir -p "$OUT/pflashinfer"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$OUT/pflashinfer" \
        "flashinfer-python==$(unzip -p "$WORK"/wheels/vllm-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: flashinfer-python==\([^ ;]*\).*/\1/p')" \
        >>"$WORK/download.log" 2>&1 || { echo "pack: flashinfer-python did not download" >&2; exit 1; }
fi
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
ls -la "$OUT"/p*/ >&2
echo "pack: $i pieces in $OUT (carry each as its own call: .gpu/p0 ... .gpu/p$((i - 1)))" >&2
