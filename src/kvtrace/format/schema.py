"""The recorded tables: one place that names every column, its Arrow type, its unit and its meaning.

Probes append rows as plain tuples in the column order given here (the cheapest thing the hot path
can do); the shard writer turns a batch of tuples into an Arrow RecordBatch with `arrow_schema(table)`;
ingest adds the columns every database row carries (`session`, `rank`, `pid`) and loads them into
DuckDB. `docs/schema.md` is generated from this module (`python -m kvtrace.format.schema`), so the docs
cannot drift from the code.

Clock: every `*_ns` timestamp is the host's CLOCK_MONOTONIC in nanoseconds (`time.monotonic_ns()`),
shared by every process of one machine. The manifest stores anchor pairs (monotonic, UTC) so that
UTC-based sources (Nsight's session start, vLLM's wall-clock arrival times) map onto it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import pyarrow as pa

# Bump when a column is removed or changes meaning, or a table is added (older readers refuse shards of
# tables they do not know); adding a trailing column is compatible (older shards read with nulls).
SCHEMA_VERSION = 6  # 2: decode rows may come as decode_runs shards; 3: kv_access_records, offload_block_events;
# 4: kv_access_records.layer_copies; 5: batch_slots rows may come as batch_slot_runs shards;
# 6: kv_access_records come as frame files (format/kv_frames.py), which older readers would skip
# Readers accept shards and manifests from this version up to SCHEMA_VERSION.
OLDEST_READABLE_SCHEMA_VERSION = 1

# Probe statuses that are not a problem (probes.status): anything else is reported as disabled.
# queries/summary.sql spells the same list out (tests/integration/test_queries.py checks that they agree).
PROBE_FINE_STATUSES = ("attached", "off", "unused")
PROBE_FINE_SQL = "(" + ", ".join(f"'{s}'" for s in PROBE_FINE_STATUSES) + ")"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    unit: str
    meaning: str


def _c(name: str, type_: pa.DataType, unit: str, meaning: str) -> Column:
    return Column(name, type_, unit, meaning)


i8, i16, i32, i64, f64, s = pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.float64(), pa.string()
i32_list = pa.list_(pa.int32())
i64_list = pa.list_(pa.int64())

# Columns that ingest adds to every table from the process that wrote the shard.
PROCESS_COLUMNS: tuple[Column, ...] = (
    _c("session", s, "", "session id (manifest `session_id`)"),
    _c("rank", i32, "", "data-parallel rank x 1000 + tensor-parallel rank of the writing process"),
    _c("pid", i32, "", "OS process id of the writing process"),
)

# One row per BlockPool call (EngineCore), of the engine's own pool (the scheduler's KVCacheManager's).
BLOCK_EVENT_COLUMNS: tuple[Column, ...] = (
    _c("ts_ns", i64, "ns", "when it happened"),
    _c("step", i64, "", "engine step id"),
    _c("event", s, "", "alloc, free, cache, touch (a prefix-cache hit), evict; hold, release: a KV "
       "connector's own reference taken or dropped (blocks kept while stored or loaded)"),
    _c("kv_group", i16, "", "KV-cache group id (0 for single-group models)"),
    _c("request_id", s, "", "request the call was made for, when known"),
    _c("block_ids", i32_list, "", "physical block ids"),
    _c("block_hashes", i64_list, "",
       "cache and evict: first 8 bytes of each block's hash as signed int64 (not reversible)"),
)

TABLES: dict[str, tuple[Column, ...]] = {
    # One row per engine step (EngineCore). A step = one Scheduler.schedule() + update_from_output().
    "steps": (
        _c("step", i64, "", "engine step id (vLLM's Scheduler.current_step after schedule())"),
        _c("t_start_ns", i64, "ns", "schedule() entered"),
        _c("t_sched_end_ns", i64, "ns", "schedule() returned"),
        _c("t_end_ns", i64, "ns", "update_from_output() returned (step finished); null if never"),
        _c("scheduled_tokens", i32, "tokens", "tokens scheduled for the forward pass"),
        _c("prefill_tokens", i32, "tokens", "of which prefill (prompt or recompute) tokens"),
        _c("decode_tokens", i32, "tokens", "of which decode tokens"),
        _c("num_prefill_reqs", i32, "requests", "requests scheduled in prefill this step"),
        _c("num_decode_reqs", i32, "requests", "requests scheduled in decode this step"),
        _c("num_running", i32, "requests", "running queue length after schedule()"),
        _c("num_waiting", i32, "requests", "waiting queue length after schedule()"),
        _c("kv_blocks_used", i32, "blocks", "KV blocks in use after schedule() (excl. null block)"),
        _c("kv_blocks_total", i32, "blocks", "usable KV blocks in the pool"),
        _c("token_budget", i32, "tokens", "max_num_scheduled_tokens for this step"),
        _c("max_num_seqs", i32, "requests", "max running requests"),
        _c("admission_stop", s, "",
           "why the waiting queue stopped being admitted: tok-budget, max-seqs, kv-insuf, blocked, "
           "lora, preempted, prefill-throttle, prefill-cadence, skipped, none"),
        _c("num_preempted", i32, "requests", "requests preempted during this step's schedule()"),
        _c("num_new_reqs", i32, "requests", "requests scheduled for the first time"),
        _c("num_resumed_reqs", i32, "requests", "preempted requests scheduled again"),
        _c("num_finished", i32, "requests", "requests that finished in update_from_output()"),
        _c("prompt_tokens_new", i32, "tokens", "full prompt length of the newly scheduled requests"),
        _c("cached_tokens_new", i32, "tokens", "prefix-cache hit tokens (local + external) of those"),
    ),
    # One row per (step, request) scheduled: the scheduler's decision for that request.
    "step_requests": (
        _c("step", i64, "", "engine step id"),
        _c("request_id", s, "", "vLLM request id"),
        _c("tokens", i32, "tokens", "tokens scheduled for this request"),
        _c("phase", s, "", "prefill or decode"),
        _c("chunk_index", i32, "", "0-based index of this prefill chunk (chunked prefill); -1 for decode"),
        _c("computed_before", i32, "tokens", "num_computed_tokens before this step"),
        _c("new_blocks", i32, "blocks", "blocks newly allocated for this request this step"),
        _c("kind", s, "", "new, resumed or running"),
    ),
    # Request lifecycle events (EngineCore). `requests` in DuckDB is built from these.
    "request_events": (
        _c("ts_ns", i64, "ns", "when it happened"),
        _c("step", i64, "", "engine step id (current step when it happened)"),
        _c("request_id", s, "", "vLLM request id"),
        _c("event", s, "",
           "arrival, queued, scheduled, first_token, preempted, resumed, finished; for a streaming-input "
           "session (vLLM's resumable requests): turn_end (a turn stopped, the session goes on), input "
           "(its next input chunk came), queued again when vLLM merged the chunk into it"),
        _c("value", i64, "",
           "arrival, queued: prompt tokens (a session queued again: its whole prompt so far, the kept "
           "outputs included); input: the chunk's tokens; finished, turn_end: output tokens of the "
           "request (of a session: of its last turn); preempted: computed tokens lost; scheduled: tokens "
           "already computed (prefix-cache hits; a session's later turn: its own resident tokens)"),
        _c("reason", s, "", "finished, turn_end: finish reason (stop, length, abort, ...)"),
    ),
    # KV block events (EngineCore), one row per call with the list of blocks it touched; ingest
    # unnests them to one row per block.
    "block_events": BLOCK_EVENT_COLUMNS,
    # The same calls on BlockPools other than the engine's own (EngineCore): an offload tier's pool
    # (SimpleCPUOffloadConnector's CPU blocks, say) numbers its blocks from 0 as the GPU's does, so its
    # rows are kept apart, with the pool they belong to.
    "offload_block_events": (
        *BLOCK_EVENT_COLUMNS,
        _c("pool", s, "", "the pool: its owner's attribute path (Connector.attr.attr), or unnamed-N"),
    ),
    # Prefix-cache lookups (EngineCore), one per lookup vLLM counts (KVCacheManager.record_prefix_cache_stats).
    "prefix_lookups": (
        _c("ts_ns", i64, "ns", "when vLLM counted the lookup (at admission, in the step of the lookup)"),
        _c("step", i64, "", "engine step id"),
        _c("request_id", s, "", "vLLM request id"),
        _c("query_tokens", i32, "tokens", "tokens the lookup was for (vLLM counts request.num_tokens)"),
        _c("hit_tokens", i32, "tokens", "tokens found in the local prefix cache"),
        _c("hit_blocks", i32, "blocks", "blocks found in the local prefix cache"),
        _c("full_blocks", i32, "blocks", "full blocks of the query that have a hash (can hit); with vLLM 0.33's "
           "lookahead block hashes (sessions.engine_config hash_lookahead_tokens L > 0) a block has one "
           "once L more tokens follow it, so a prompt's last full block may not"),
        _c("tail_tokens", i32, "tokens", "tokens past the last hashed block (can never hit)"),
        _c("missed_hashes", i64_list, "",
           "hashes (int64 prefix) of the full blocks after the hit that missed; the canned query "
           "prefix_misses classifies them (never-cached, evicted, capped, after-miss); null when the "
           "local cache was not consulted"),
        _c("external_hit_tokens", i32, "tokens",
           "tokens a KV connector said it can load (get_num_new_matched_tokens); null without one"),
        _c("after_preemption", i8, "",
           "1 for the lookup of a request resumed after preemption (vLLM counts those apart, as "
           "preempted_queries), 0 otherwise"),
    ),
    # Preemptions (EngineCore).
    "preemptions": (
        _c("ts_ns", i64, "ns", "when the request was preempted"),
        _c("step", i64, "", "engine step id"),
        _c("request_id", s, "", "vLLM request id"),
        _c("computed_tokens_lost", i32, "tokens", "num_computed_tokens thrown away"),
        _c("blocks_freed", i32, "blocks", "blocks the request held"),
        _c("output_tokens", i32, "tokens", "output tokens generated so far"),
    ),
    # KV connector calls (both sides), observed by wrapping whatever KVConnectorFactory created.
    "transfers": (
        _c("ts_start_ns", i64, "ns", "call entered"),
        _c("ts_end_ns", i64, "ns", "call returned"),
        _c("step", i64, "", "engine step id (tagged on the scheduler output), -1 if unknown"),
        _c("connector", s, "", "connector class name"),
        _c("method", s, "", "connector method called"),
        _c("direction", s, "",
           "save, load, match, alloc, finish, other; get_finished rows mark completions (save = send "
           "done, load = receive done, bytes null), and for a connector whose metadata lists whole blocks "
           "(SimpleCPUOffloadConnector) the copies that call launched (bytes and tokens set)"),
        _c("request_id", s, "", "request, when the call is per request"),
        _c("layer", s, "", "layer name, when the call is per layer"),
        _c("bytes", i64, "bytes", "bytes of KV moved (save_kv_layer: the layer's slots of the step)"),
        _c("tokens", i32, "tokens",
           "match: matched tokens; alloc: admitted external tokens; save/load: slots moved; "
           "finish: 1 if the free was delayed"),
    ),
    # Pins and holds: KV kept against eviction for a reason other than a running request.
    "pins": (
        _c("ts_ns", i64, "ns", "when it happened"),
        _c("step", i64, "", "engine step id"),
        _c("event", s, "", "pin, unpin, expire, reuse, hold, release"),
        _c("request_id", s, "", "request whose KV is pinned/held"),
        _c("block_ids", i32_list, "", "blocks involved"),
        _c("ttl_ns", i64, "ns", "pin time-to-live, when the policy has one"),
        _c("reason", s, "", "policy or connector that pinned/held"),
    ),
    # Token ids, only with `kvtrace record --record-tokens` (traces carry no prompt data otherwise).
    "request_tokens": (
        _c("ts_ns", i64, "ns", "when recorded"),
        _c("request_id", s, "", "vLLM request id"),
        _c("kind", s, "", "prompt (at arrival) or output (at finish)"),
        _c("token_ids", i32_list, "", "the token ids"),
    ),
    # Which request sits in which batch slot of a step (Worker), for decoding device records.
    "batch_slots": (
        _c("step", i64, "", "engine step id"),
        _c("slot", i32, "", "row of the request in the attention metadata"),
        _c("request_id", s, "", "vLLM request id"),
    ),
    # Per-layer KV reads and writes (Worker), from the attention metadata (device or CPU ring).
    "kv_access": (
        _c("step", i64, "", "engine step id"),
        _c("layer", i16, "", "layer index (model.layers.N)"),
        _c("ts_ns", i64, "ns", "when the access was recorded (device timer mapped to host clock)"),
        _c("op", i8, "", "0 = read, 1 = write"),
        _c("slot", i32, "", "request's row in the batch (see batch_slots)"),
        _c("block_id", i32, "", "physical block id"),
        _c("token_offset", i32, "tokens", "first token offset inside the block"),
        _c("token_count", i32, "tokens", "tokens read or written in the block"),
    ),
    # Per-layer timing without block lists (default granularity on the device path).
    "layer_timings": (
        _c("step", i64, "", "engine step id"),
        _c("layer", i16, "", "layer index"),
        _c("ts_ns", i64, "ns", "first access of the layer in the step"),
        _c("reads", i32, "records", "read records this layer would have produced"),
        _c("writes", i32, "records", "write records this layer would have produced"),
    ),
    # Anchor pairs between clocks (host monotonic/UTC, device timer), written periodically.
    "clock_anchors": (
        _c("monotonic_ns", i64, "ns", "host CLOCK_MONOTONIC"),
        _c("utc_ns", i64, "ns", "host CLOCK_REALTIME (UTC)"),
        _c("device_ns", i64, "ns", "device %globaltimer at the same moment, null on the host"),
        _c("source", s, "", "host, cuda:N"),
    ),
    # Counters of what was lost, per process and table (written with every flush).
    "drops": (
        _c("ts_ns", i64, "ns", "when counted"),
        _c("table_name", s, "", "table whose rows were lost"),
        _c("dropped", i64, "rows", "rows lost since the previous drops row of this table"),
        _c("cause", s, "", "ring-wrap, drain-error, writer-error, buffer-cap, max-size, bad-row"),
    ),
}

# Tables that exist only as shards: ingest expands each into the rows of another table (RUN_TABLES[t][0])
# and stores nothing under its own name.
RUN_TABLES: dict[str, tuple[str, tuple[Column, ...]]] = {
    # Decode rows of step_requests (phase decode, chunk_index -1, kind running), one row per run of a
    # request's consecutive decode steps: row i of a run (0 <= i < steps) is step `step + i` with
    # `tokens` tokens, computed_before `computed_before + i * tokens`, and new_blocks `new_blocks` for
    # i = 0, else 0. The scheduler probe writes these instead of a row per (step, request): ~20x fewer.
    "decode_runs": ("step_requests", (
        _c("step", i64, "", "engine step id of the run's first row"),
        _c("steps", i32, "steps", "rows in the run: one per step, consecutive"),
        _c("request_id", s, "", "vLLM request id"),
        _c("tokens", i32, "tokens", "tokens scheduled for the request in each step of the run"),
        _c("computed_before", i32, "tokens", "num_computed_tokens before the run's first step"),
        _c("new_blocks", i32, "blocks", "blocks newly allocated in the run's first step (0 in the others)"),
    )),
    # batch_slots rows, one row per slot of a run of consecutive steps whose batches held the same
    # requests in the same rows: row i of a run (0 <= i < steps) is step `step + i`. The attention probe
    # writes these instead of a row per (step, slot): a decode batch keeps its rows for many steps.
    "batch_slot_runs": ("batch_slots", (
        _c("step", i64, "", "engine step id of the run's first step"),
        _c("steps", i32, "steps", "consecutive steps in which the batch held the same requests in the same rows"),
        _c("slot", i32, "", "row of the request in the attention metadata"),
        _c("request_id", s, "", "vLLM request id"),
    )),
    # kv_access rows as the KV access ring stores them: a row per drain (a large drain's in rows of at most
    # 4 MB, kv_records.BATCH_BYTES), its records packed as they are
    # (32 bytes each, format/kv_records.py REC_DTYPE) with the clock mapping of that moment; ingest decodes
    # them (host_ns = clock_ref_host_ns + rint((ts - clock_ref_device_ns) * clock_slope)). Decoding ~10,000
    # records a step inside the engine's process cost the engine's thread GIL time.
    "kv_access_records": ("kv_access", (
        _c("clock_ref_device_ns", i64, "ns", "device timer at the clock fit's reference (0 on the host)"),
        _c("clock_ref_host_ns", i64, "ns", "host CLOCK_MONOTONIC at that reference (0 on the host)"),
        _c("clock_slope", f64, "", "host ns per device ns (1.0 on the host)"),
        _c("records_count", i64, "records", "records in the row"),
        _c("records", pa.large_binary(), "", "the records, 32 bytes each, little-endian"),
        _c("layer_copies", pa.list_(pa.int32()), "",
           "pairs (layer, source layer), flattened: layers recorded once, as their source, because they read "
           "its block table (they share a KV-cache group); ingest writes each source row again for each "
           "such layer. Empty or null: none"),
    )),
}

# Every table a recording writes shards of.
SHARD_TABLES: dict[str, tuple[Column, ...]] = {**TABLES, **{t: cols for t, (_, cols) in RUN_TABLES.items()}}



def columns(table: str) -> tuple[Column, ...]:
    return TABLES[table]


def column_names(table: str) -> list[str]:
    return [c.name for c in TABLES[table]]


@cache  # called per batch on the recording path: build each schema once
def arrow_schema(table: str) -> pa.Schema:
    """The schema of `table`'s shard files (without the process columns ingest adds)."""
    meta = {b"kvtrace.table": table.encode(), b"kvtrace.schema_version": str(SCHEMA_VERSION).encode()}
    return pa.schema([pa.field(c.name, c.type) for c in SHARD_TABLES[table]], metadata=meta)


def markdown() -> str:
    """The schema as Markdown tables (docs/schema.md)."""
    out = [
        "# kvtrace schema",
        "",
        f"`schema_version` {SCHEMA_VERSION}. Generated by `python -m kvtrace.store.schema_doc` (`make schema-doc`); do not edit.",
        "",
        "Every table in the DuckDB database and the Parquet dataset also has these columns, added "
        "by ingest from the process that wrote the shard:",
        "",
        "| column | type | unit | meaning |",
        "|---|---|---|---|",
    ]
    out += [f"| {c.name} | {c.type} | {c.unit} | {c.meaning} |" for c in PROCESS_COLUMNS]
    for table, cols in TABLES.items():
        out += ["", f"## {table}", "", "| column | type | unit | meaning |", "|---|---|---|---|"]
        out += [f"| {c.name} | {c.type} | {c.unit} | {c.meaning} |" for c in cols]
    for table, (into, cols) in RUN_TABLES.items():
        out += ["", f"## {table} (shards only: ingest expands it into `{into}`)", "",
                "| column | type | unit | meaning |", "|---|---|---|---|"]
        out += [f"| {c.name} | {c.type} | {c.unit} | {c.meaning} |" for c in cols]
    return "\n".join(out) + "\n"
