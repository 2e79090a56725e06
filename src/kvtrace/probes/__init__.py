"""Probes: patches that record what an engine does, installed in its processes.

    base.py         a probe: its patch targets (checked before patching), install/uninstall, failure
    imports.py      installing a probe when the module it patches is imported
    lifecycle.py    the probes installed in this process: close, hand over, finish
    nvtx_ranges.py  NVTX ranges and clock marks that line kvtrace up with Nsight Systems
    pins.py         the API a scheduler calls to report pins and holds
    kv_access/      per-layer KV block reads/writes: the ring buffers (CPU and CUDA)
    vllm/           vLLM's probes and its plugin entry point (one module per part of vLLM patched)

Imports record/ and format/ only; a second engine would sit beside vllm/.
"""
