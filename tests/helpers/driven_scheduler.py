"""vLLM's real Scheduler and KV cache manager, driven without a model (EngineCore process code, run here).

Used by `tests/integration/test_host_exactness.py` (small exact scenarios) and `bench/bench_host_probes.py` (the cost
of the host probes). Everything on the scheduling path is vLLM's own code: the `Scheduler`, its
`KVCacheManager` and `BlockPool`, the `StructuredOutputManager`, requests hashed with the engine's block
hasher (`get_request_block_hasher` over `prefix_caching_hash_algo`, as `EngineCore` sets it up). Only the
model is missing: each step's `ModelRunnerOutput` is made up, one sampled token per scheduled request
that finished its prompt (a partial prefill chunk samples nothing, as in the real model runner).
`step()` schedules a step and gives its output back at once; `run_overlapped()` keeps two steps in flight,
as an engine with async scheduling does.

The `VllmConfig` comes from `EngineArgs(model=<tiny model dir>).create_engine_config()`, like a real
engine's; the Scheduler is built as `kvtrace replay` builds its own (`kvtrace.replay.engine.build_scheduler`:
one full-attention group shaped like the tiny model's layers, as the worker would report it, with
`num_blocks` blocks; block 0 is vLLM's null block).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvtrace.replay.offload import instant_offload_output, offload_transfer_config

VOCAB = 512  # the tiny model's vocabulary


@dataclass
class DrivenConfig:
    """What a `DrivenScheduler` is built with (engine-arg names where there is one)."""

    num_blocks: int = 1000  # num_gpu_blocks_override: usable blocks = num_blocks - 1 (null block)
    block_size: int = 32
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    log_stats: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # more EngineArgs
    # SimpleCPUOffloadConnector with this many bytes of CPU blocks (None: no connector). Its scheduler
    # side is vLLM's; the worker side is `instant_offload_output`.
    cpu_offload_bytes: int | None = None
    # vLLM 0.33's lookahead block hashes (`VllmConfig.num_hash_lookahead_tokens`, which EAGLE-style
    # drafting turns on): set here on the config as the drafter's settings would (no draft model needed
    # to schedule); the Scheduler, its block pool and the block hasher then run vLLM's lookahead code.
    hash_lookahead_tokens: int = 0
    # A Scheduler subclass to build instead of vLLM's Scheduler (e.g. AsyncScheduler, for `run_overlapped`).
    scheduler_cls: Any = None
    # What the workers report for a step, from its connector metadata (a KVConnectorOutput or None);
    # default: the offload connector's transfers done within the step (`instant_offload_output`).
    worker_output: Any = None


_config_cache: dict[tuple, Any] = {}


def vllm_config(model: str, cfg: DrivenConfig):
    """A VllmConfig as `LLM(...)` would build it for the tiny model (cached: building one takes ~1 s)."""
    import copy

    key = (model, cfg.num_blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens,
           cfg.max_model_len, cfg.enable_prefix_caching, repr(sorted(cfg.extra.items())), cfg.cpu_offload_bytes,
           cfg.hash_lookahead_tokens)
    if key not in _config_cache:
        from vllm.engine.arg_utils import EngineArgs

        extra = dict(cfg.extra)
        if cfg.cpu_offload_bytes is not None:
            extra["kv_transfer_config"] = offload_transfer_config(cfg.cpu_offload_bytes)
        args = EngineArgs(model=model, dtype="float32", max_model_len=cfg.max_model_len,
                          block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                          enable_prefix_caching=cfg.enable_prefix_caching, enforce_eager=True,
                          num_gpu_blocks_override=cfg.num_blocks, seed=0, **extra)
        config = args.create_engine_config()
        if cfg.hash_lookahead_tokens:
            if not hasattr(type(config), "num_hash_lookahead_tokens"):
                raise NotImplementedError("this vLLM has no lookahead block hashes (0.33+)")
            # a property of VllmConfig derived from the speculative config: a subclass fixes its value
            config.__class__ = type("LookaheadVllmConfig", (type(config),),
                                    {"num_hash_lookahead_tokens": cfg.hash_lookahead_tokens})
        _config_cache[key] = config
    config = copy.deepcopy(_config_cache[key])
    # What EngineCore._initialize_kv_caches sets once the workers reported their memory.
    config.cache_config.num_gpu_blocks = cfg.num_blocks
    return config


class DrivenScheduler:
    """One Scheduler + KV cache manager; `add()` requests, `step()` to run one engine step."""

    def __init__(self, model: str, cfg: DrivenConfig | None = None, keep_stats: bool = False):
        from kvtrace.replay.engine import build_scheduler

        self.cfg = cfg = cfg or DrivenConfig()
        self.config = vllm_config(model, cfg)
        # With the offload connector, the worker's tensors too: it sizes its CPU pool from them.
        self.sched, self.block_hasher = build_scheduler(self.config, cfg.block_size, cfg.num_blocks,
                                                        with_tensors=cfg.cpu_offload_bytes is not None,
                                                        log_stats=cfg.log_stats, scheduler_cls=cfg.scheduler_cls)
        self.outputs: Any = {}  # EngineCoreOutputs of the last step, by client
        self.transfers = {"stored_blocks": 0, "loaded_blocks": 0}  # what the offload "worker" moved
        self.steps = 0
        # What vLLM itself reported, when asked for (keep_stats): SchedulerStats of every step and the
        # KV event batches its publisher got (with kv_events_config).
        self.stats: list[Any] | None = [] if keep_stats else None
        self.kv_event_batches: list[Any] = []
        if keep_stats and self.sched.kv_event_publisher is not None:
            publish = self.sched.kv_event_publisher.publish

            def keep(batch: Any) -> None:
                self.kv_event_batches.append(batch)
                publish(batch)

            self.sched.kv_event_publisher.publish = keep

    # ---- requests -----------------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], max_tokens: int, **request_args: Any) -> Any:
        """A request (`request_args`: more of vLLM's Request parameters, e.g. resumable=True for a
        streaming-input session, whose next chunks are requests with the same id)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        req = Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                      pooling_params=None, block_hasher=self.block_hasher, **request_args)
        self.sched.add_request(req)
        return req

    # ---- one engine step ----------------------------------------------------------------------
    def step(self, **schedule_args: Any) -> Any:
        """schedule(**schedule_args) -> a made-up ModelRunnerOutput -> update_from_output(); returns the
        SchedulerOutput."""
        launched = self.schedule(**schedule_args)
        self.finish(launched)
        return launched[0]

    def schedule(self, **schedule_args: Any) -> tuple[Any, Any]:
        """One step scheduled: (its SchedulerOutput, the ModelRunnerOutput its model run gives back)."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.sched.schedule(**schedule_args)
        requests = self.sched.requests
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[] if requests[r].is_prefill_chunk else [(self.steps * 31 + i) % VOCAB]
                   for i, r in enumerate(req_ids)]
        meta = out.kv_connector_metadata
        worker = (self.cfg.worker_output(meta) if self.cfg.worker_output is not None
                  else instant_offload_output(meta, self.transfers))
        self.steps += 1
        return out, ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                      sampled_token_ids=sampled, kv_connector_output=worker)

    def finish(self, launched: tuple[Any, Any]) -> None:
        """update_from_output() of a scheduled step, with its ModelRunnerOutput."""
        self.outputs = self.sched.update_from_output(*launched)
        if self.stats is not None:
            self.stats.extend(eco.scheduler_stats for eco in self.outputs.values()
                              if eco.scheduler_stats is not None)

    def run_overlapped(self, arrivals: Any = None, max_steps: int = 100_000) -> int:
        """Run to the end with two steps in flight, as an async-scheduling engine does
        (`EngineCore.step_with_batch_queue`, a queue of 2): the next step is scheduled before the last
        one's output is given back. `arrivals(n)`, if given, is called before the n-th schedule (from 0)
        to add requests. Returns the steps scheduled."""
        from collections import deque

        in_flight: deque = deque()
        n = 0
        while (self.has_work() or in_flight) and n < max_steps:
            if arrivals is not None:
                arrivals(n)
            if self.has_work():
                launched = self.schedule()
                n += 1
                in_flight.append(launched)
                if len(in_flight) < 2 and (launched[0].total_num_scheduled_tokens > 0 or self.has_work()):
                    continue  # the queue is not full: schedule the next step first
            if in_flight:
                self.finish(in_flight.popleft())
        return n

    def eviction_events(self) -> list[Any]:
        """vLLM's KVCacheEvictionEvents (kv_cache_metrics) of every step so far, in order."""
        return [e for st in self.stats or () for e in st.kv_cache_eviction_events]

    def has_work(self) -> bool:
        return self.sched.has_requests()

    def run(self, max_steps: int = 100_000) -> int:
        n = 0
        while self.has_work() and n < max_steps:
            self.step()
            n += 1
        return n


def shared_prefix_prompts(n: int, groups: int, prefix_tokens: int, suffix_tokens: int,
                          seed: int = 0) -> list[list[int]]:
    """`n` prompts in `groups` families: a family shares its first `prefix_tokens` tokens (the first
    half of which all families share too, like a system prompt), then each prompt has its own suffix."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(prefix_tokens // 2)]
    fams = [system + [rng.randrange(VOCAB) for _ in range(prefix_tokens - len(system))]
            for _ in range(groups)]
    return [fams[i % groups] + [rng.randrange(VOCAB) for _ in range(suffix_tokens)] for i in range(n)]


# ---- recording a driven scheduler with the host probes -----------------------------------------------
HOST_PROBES = ("scheduler", "kv_blocks", "prefix_cache", "connector")


def host_probe_classes() -> list[type]:
    from kvtrace.probes.vllm.connector import ConnectorProbe
    from kvtrace.probes.vllm.kv_blocks import BlockPoolProbe, PrefixCacheProbe
    from kvtrace.probes.vllm.scheduler import SchedulerProbe

    return [SchedulerProbe, BlockPoolProbe, PrefixCacheProbe, ConnectorProbe]


def install_probes(rec: Any, names: tuple[str, ...] = HOST_PROBES) -> list:
    """Install the host probes (as the plugin would, in the EngineCore) on `rec`; all must attach.
    They are registered with the plugin as in an engine, so `take_pending()` reaches them."""
    from kvtrace.probes import lifecycle

    return lifecycle.install_classes(rec, [cls for cls in host_probe_classes() if cls.name in names])


def uninstall_probes(probes: list) -> None:
    """Flush what the probes hold (pending steps, decode rows), then restore every patched target."""
    from kvtrace.probes import lifecycle

    lifecycle.uninstall(probes)


def record_driven(session_dir: Any, model: str, cfg: DrivenConfig, scenario: Any,
                  names: tuple[str, ...] = HOST_PROBES, keep_stats: bool = False,
                  options: dict | None = None) -> Any:
    """Run `scenario(driven)` on a fresh DrivenScheduler with the probes recording to `session_dir`
    (a session without manifest, as the probes alone write it; `options` as KVTRACE_OPTIONS would give
    them); returns the scenario's result."""
    from pathlib import Path

    from kvtrace.record.context import ctx
    from kvtrace.record.recorder import Recorder

    rec = Recorder(Path(session_dir), "engine", dict(options or {}))
    ctx.step, ctx.request_id = 0, None  # a fresh engine: no step scheduled yet (ctx is per process)
    probes = install_probes(rec, names)  # before the Scheduler is made, as in an engine process
    try:
        d = DrivenScheduler(model, cfg, keep_stats=keep_stats)
        result = scenario(d)
    finally:
        uninstall_probes(probes)
        rec.close()
    return result


def read_rows(session_dir: Any, table: str) -> list[dict]:
    """Every row of `table` as the probes recorded it (shard order, before ingest unnests anything; the
    rows of run tables that stand for `table`, decode_runs for step_requests, expanded as ingest does)."""
    from pathlib import Path

    from kvtrace.format.shards import ShardRead, list_shards, loaded_batch, loads_into, read_shard

    rows: list[dict] = []
    for proc in sorted((Path(session_dir) / "procs").iterdir()):
        for shard in list_shards(proc):
            if loads_into(shard.table) == table:
                for batch in read_shard(shard, ShardRead()):
                    rows.extend(loaded_batch(shard.table, batch).to_pylist())
    return rows
