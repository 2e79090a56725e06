"""A KV connector that holds KV after a request finishes, as an async sender does (test helper).

ExampleConnector (saves and loads KV through disk, runs on the CPU build) plus a delayed free: its
scheduler side returns True from `request_finished` for every request, so vLLM keeps the request's
blocks, and its worker side reports the send finished `delay_steps` worker steps (get_finished calls)
after the request finished. No connector that delays frees runs on the CPU build (Nixl, Mooncake and
LMCache need their libraries), hence this one.

Loaded through `kv_transfer_config={"kv_connector": "DelayFreeConnector", "kv_connector_module_path":
"delay_free_connector", "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": DIR,
"delay_steps": 3}}` with this folder on the path of every vLLM process.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class DelayFreeConnector(ExampleConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self.delay_steps = int(self._kv_transfer_config.get_from_extra_config("delay_steps", 3))
        self.sending: dict[str, int] = {}  # worker side: request -> get_finished calls left

    # Scheduler side (EngineCore).
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        super().request_finished(request, block_ids)
        # Every finished request goes to the worker in SchedulerOutput.finished_req_ids, and the
        # worker reports every one of them below: delaying all of them keeps both sides in step.
        return True, None

    # Worker side.
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for rid in finished_req_ids:
            self.sending[rid] = self.delay_steps
        done = set()
        for rid in list(self.sending):
            self.sending[rid] -= 1
            if self.sending[rid] <= 0:
                del self.sending[rid]
                done.add(rid)
        return (done or None), None
