"""Per-layer KV block reads and writes, recorded from the attention metadata into a ring buffer.

    ring.py               the record format and the CPU ring (the reference semantics)
    cuda_ring.py          the same ring on a CUDA device: CuPy kernels, CUDA-graph safe, no host sync
    cuda_ring_kernels.cu  its kernels (package data)

Engine-agnostic: the vLLM attention probe (probes/vllm/attention.py) feeds it.
"""

from __future__ import annotations

from typing import Any

from kvtrace.probes.kv_access.ring import CPUKVAccessRing, KVAccessRing


def make_ring(device: Any = "cpu", **kw: Any) -> KVAccessRing:
    """The ring for `device`: CUDA (CuPy kernels) for a CUDA device, the CPU ring otherwise.

    Raises RuntimeError for a CUDA device when CuPy cannot be imported (the caller decides whether to fall
    back to copying metadata to the host, which would sync).
    """
    dev_type = getattr(getattr(device, "device", device), "type", None)
    if dev_type is None:
        dev_type = str(device).split(":")[0]
    if dev_type == "cuda":
        from kvtrace.probes.kv_access.cuda_ring import CudaKVAccessRing, cupy_available

        ok, why = cupy_available()
        if not ok:
            raise RuntimeError(f"kvtrace device ring needs CuPy on CUDA: {why}")
        return CudaKVAccessRing(getattr(device, "device", device), **kw)
    return CPUKVAccessRing(**kw)
