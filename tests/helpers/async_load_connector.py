"""A KV consumer connector whose every load is asynchronous, scheduler side only (test helper).

It offers every full block of a prompt that is not cached locally (all but the prompt's last token's
block, so one token is always computed) as loadable from outside, to be loaded between steps. It keeps
what vLLM told it (`allocs`: (request, external tokens) in call order) and lists in each step's metadata
the loads it was told to start since the last one; `finished_output(meta)` is what a worker would report
for that step once they are done. No model runs: the driven scheduler (tests/helpers/driven_scheduler.py)
hands that report back to vLLM as the step's `kv_connector_output`.

Loaded through `kv_transfer_config={"kv_connector": "AsyncLoadConnector", "kv_connector_module_path":
"tests.helpers.async_load_connector", "kv_role": "kv_consumer"}` (the repository on the path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


@dataclass
class LoadsMetadata(KVConnectorMetadata):
    loads: list[str] = field(default_factory=list)  # requests whose external KV this step loads


class AsyncLoadConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.allocs: list[tuple[str, int]] = []
        self.starting: list[str] = []

    # Scheduler side (EngineCore).
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        loadable = (request.num_tokens - 1) // self.block_size * self.block_size
        external = max(0, loadable - num_computed_tokens)
        return external, external > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.allocs.append((request.request_id, num_external_tokens))
        if num_external_tokens:
            self.starting.append(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> LoadsMetadata:
        meta = LoadsMetadata(self.starting)
        self.starting = []
        return meta

    # Worker side: never built (no model runs).
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_layer_load(self, layer_name: str) -> None:
        raise NotImplementedError

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def wait_for_save(self) -> None:
        raise NotImplementedError


def finished_output(meta: Any) -> Any:
    """The KVConnectorOutput a worker would give back for the step whose metadata is `meta`: its loads
    done. None for any other metadata."""
    from vllm.v1.outputs import KVConnectorOutput

    if not isinstance(meta, LoadsMetadata) or not meta.loads:
        return None
    return KVConnectorOutput(finished_recving=set(meta.loads))
