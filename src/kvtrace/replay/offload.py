"""A CPU offload tier for replays: vLLM's SimpleCPUOffloadConnector, whose scheduler side (its CPU block
pool, what to store and load) is vLLM's own and runs without a device; its workers' copies are stood in
for by `instant_offload_output`, which reports every store and load of a step as finished within that
step (an idealisation: a real copy may take longer than a step, which delays a load's request).
"""

from __future__ import annotations

from typing import Any


def offload_transfer_config(cpu_bytes: int) -> Any:
    """vLLM's KVTransferConfig for a SimpleCPUOffloadConnector tier of `cpu_bytes` (an engine argument)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                            kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes})


def instant_offload_output(meta: Any, transfers: dict[str, int]) -> Any:
    """What SimpleCPUOffloadConnector's workers would report for the step whose metadata is `meta`, had
    each transfer finished within the step: the step's load event done for its requests, its store
    event done (one worker). None for any other metadata. Counts the blocks moved in `transfers`."""
    try:
        from vllm.v1.outputs import KVConnectorOutput
        from vllm.v1.simple_kv_offload.metadata import (
            SimpleCPUOffloadMetadata,
            SimpleCPUOffloadWorkerMetadata,
        )
    except ImportError:  # a vLLM without it
        return None
    if not isinstance(meta, SimpleCPUOffloadMetadata):
        return None
    transfers["loaded_blocks"] += len(meta.load_cpu_blocks)
    transfers["stored_blocks"] += len(meta.store_cpu_blocks)
    loaded = set(meta.load_event_to_reqs.get(meta.load_event, ())) if meta.load_event >= 0 else set()
    stored = {meta.store_event: 1} if meta.store_event >= 0 else {}
    return KVConnectorOutput(finished_recving=loaded or None,
                             kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events=stored))
