"""The database's tables, as definitions: what is stored where, with which columns and types.

Every row gets the process columns (`session`, `rank`, `pid`). Block events are unnested to one row
per block; device access records get their request id from the worker's batch slots (same process,
step and slot).

The big tables, millions of rows in a long run (`KEYED_TABLES`), store keys instead of values that
repeat on every row: `kvtrace_store.<table>` has `proc INTEGER` where the others have the three
process columns (into `kvtrace_store.proc_keys`), `request_key INTEGER` for `request_id` (into
`kvtrace_store.request_keys`, per session; layer_timings has none), and UTINYINT codes for the labels
(step_requests' `phase` and `kind`, block_events' `event`; into `kvtrace_store.labels`). `main.<table>`
is a view with the same name, columns and types that joins the values back. DuckDB pays per row on
insert for such values (a text column costs several integer ones): on bench_scale's 10 M-event session
the process key made ingest 13% faster, and the request keys and labels made it faster again and the
file smaller. Queries see the same rows and run about as fast: DuckDB joins key tables of a few rows
(processes, labels) or a few thousand (requests) into the scan. Edit those tables through
`stored_table()`, as views take no UPDATE, DELETE or INSERT; `keyed.insert_rows()` inserts rows as the
view shows them. Their columns' compression is chosen from the first chunk a database stores
(compression.py).

After the shards, ingest derives `requests` (one row per request) and the session-level tables
(`sessions`, `procs`, `probes`, `ingest_issues`): `SESSION_TABLES`.
"""

from __future__ import annotations

import pyarrow as pa

from kvtrace.format import schema
from kvtrace.store import compression

DUCK_TYPES = {"int8": "TINYINT", "int16": "SMALLINT", "int32": "INTEGER", "int64": "BIGINT",
              "double": "DOUBLE", "string": "VARCHAR", "list<item: int32>": "INTEGER[]",
              "list<item: int64>": "BIGINT[]"}

# The tables stored with keys, and where (see the module docstring).
STORE = "kvtrace_store"

KEYED_TABLES = ("step_requests", "batch_slots", "kv_access", "layer_timings", "block_events")


# Text columns of the keyed tables stored as a small integer into a key table (the view gives the text):
# request ids as `request_key` into `request_keys` (per session; key 0 is the null request id, so the
# view's join is an inner one, which DuckDB may reorder and filter through), labels (a few values:
# prefill, decode, ...) as a UTINYINT code into `labels` (1-based position in the list of label texts).
# kv_access's request ids come from the batch slots' keys (`_match_slots`), never as text.
REQUEST_KEYED = ("step_requests", "batch_slots", "kv_access", "block_events")

NULL_REQUEST_KEY = 0


LABEL_COLUMNS = {"step_requests": ("phase", "kind"), "block_events": ("event",)}

KNOWN_LABELS = ("prefill", "decode", "new", "resumed", "running",  # codes 1.. on a new database
                "alloc", "free", "touch", "cache", "evict")


KEY_TABLES_DDL = (
    f"CREATE TABLE IF NOT EXISTS {STORE}.proc_keys (proc INTEGER, session VARCHAR, rank INTEGER, pid INTEGER)",
    f"CREATE TABLE IF NOT EXISTS {STORE}.request_keys (request_key INTEGER, session VARCHAR, request_id VARCHAR)",
    f"CREATE TABLE IF NOT EXISTS {STORE}.labels (label UTINYINT, text VARCHAR)",
)

# Columns of the DuckDB tables that differ from the shard columns.
UNNESTED = {"block_events": ("block_ids", "block_hashes", "block_id INTEGER", "block_hash BIGINT"),
            "offload_block_events": ("block_ids", "block_hashes", "block_id INTEGER", "block_hash BIGINT")}

# `seq` numbers a process's block event calls in recording order (the rows of one call share it):
# events of a block at the same ts_ns (an evict and the alloc of the same call) are ordered by it.
EXTRA_COLUMNS = {"kv_access": ["request_id VARCHAR"], "block_events": ["seq BIGINT"],
                 "offload_block_events": ["seq BIGINT"]}


def has_seq(table: str) -> bool:
    return "seq BIGINT" in EXTRA_COLUMNS.get(table, ())


SESSION_TABLES = {
    "sessions": """session VARCHAR, session_dir VARCHAR, status VARCHAR, schema_version INTEGER,
        kvtrace_version VARCHAR, vllm_version VARCHAR, command VARCHAR, start_utc_ns BIGINT,
        start_monotonic_ns BIGINT, end_monotonic_ns BIGINT, exit_code INTEGER, block_size INTEGER,
        num_kv_blocks INTEGER, max_num_seqs INTEGER, max_num_batched_tokens INTEGER,
        enable_prefix_caching BOOLEAN, enable_chunked_prefill BOOLEAN, kv_connector VARCHAR,
        model VARCHAR, job_pattern VARCHAR, manifest JSON, ingested_utc_ns BIGINT""",
    "procs": """session VARCHAR, pid INTEGER, rank INTEGER, role VARCHAR, host VARCHAR, status VARCHAR,
        rows_written JSON, dropped JSON, stopped_reason VARCHAR""",
    "probes": "session VARCHAR, pid INTEGER, role VARCHAR, probe VARCHAR, status VARCHAR, reason VARCHAR",
    "ingest_issues": "session VARCHAR, file VARCHAR, problem VARCHAR, bytes_cut BIGINT",
    "requests": """session VARCHAR, rank INTEGER, request_id VARCHAR, job_id VARCHAR, turn INTEGER,
        arrival_ns BIGINT, queued_ns BIGINT, first_scheduled_ns BIGINT, first_token_ns BIGINT,
        finish_ns BIGINT, finish_reason VARCHAR, prompt_tokens INTEGER, output_tokens INTEGER,
        cached_tokens INTEGER, num_preemptions INTEGER, num_resumptions INTEGER""",
}

# What the SESSION_TABLES columns mean (docs/schema.md; units in parentheses).
DERIVED_MEANINGS = {
    "sessions": {
        "session": "session id (manifest `session_id`)", "session_dir": "the directory ingested (absolute)",
        "status": "complete (every process closed its shards, nothing lost, every probe attached and recorded), "
                  "degraded (whole, but a probe did not attach or recorded nothing, or rows were lost: "
                  "ingest_issues says what), empty (no vLLM process recorded anything), or incomplete (a process "
                  "did not close its shards, a shard was cut, the command did not end cleanly, or the session "
                  "was still being recorded when ingested)",
        "schema_version": "the manifest's schema version", "kvtrace_version": "kvtrace that recorded it",
        "vllm_version": "vLLM that ran", "command": "the recorded command line (secret-looking values redacted)",
        "start_utc_ns": "start, UTC (ns)", "start_monotonic_ns": "start, host CLOCK_MONOTONIC (ns)",
        "end_monotonic_ns": "end, host CLOCK_MONOTONIC (ns)", "exit_code": "the command's exit status",
        "block_size": "KV block size (tokens)", "num_kv_blocks": "usable KV blocks in the pool (blocks)",
        "max_num_seqs": "max running requests (requests)",
        "max_num_batched_tokens": "token budget per step (tokens)",
        "enable_prefix_caching": "prefix caching on", "enable_chunked_prefill": "chunked prefill on",
        "kv_connector": "KV connector class, or null", "model": "model name or path",
        "job_pattern": "regex that split request ids into requests.job_id / turn",
        "manifest": "the whole manifest (JSON)", "ingested_utc_ns": "when ingested, UTC (ns)"},
    "procs": {
        "session": "session id", "pid": "OS process id", "rank": "DP rank x 1000 + TP rank",
        "role": "api, engine, worker or proc", "host": "host name",
        "status": "running, flushed, complete (closed its shards) or unknown (proc.json missing)",
        "rows_written": "rows written per shard table (JSON; decode_runs and batch_slot_runs count runs, not the step_requests and batch_slots rows they expand into; kv_access_records counts ring drains, not the kv_access rows they hold)",
        "dropped": "rows lost per table and cause (JSON: ring-wrap, drain-error, writer-error, buffer-cap, max-size, bad-row)",
        "stopped_reason": "why the process stopped writing (writer-error, max-size), or null"},
    "probes": {
        "session": "session id", "pid": "OS process id", "role": "the process's role",
        "probe": "probe name", "status": "attached, off, unused (its vLLM module never loaded in this process), or why not (disabled, failed, ...)",
        "reason": "the detail, when not attached"},
    "ingest_issues": {
        "session": "session id", "file": "the shard, or '' for the session as a whole",
        "problem": "what ingest found (a cut batch, a probe that did not attach, rows lost, ...)",
        "bytes_cut": "bytes after the last complete batch (bytes)"},
    "requests": {
        "session": "session id", "rank": "rank of the engine that served it", "request_id": "vLLM request id",
        "job_id": "job, parsed from the request id by the job pattern", "turn": "turn, likewise",
        "arrival_ns": "arrival (ns)", "queued_ns": "entered the waiting queue (ns)",
        "first_scheduled_ns": "first scheduled (ns)", "first_token_ns": "first output token (ns)",
        "finish_ns": "finished (ns)", "finish_reason": "stop, length, abort, ...",
        "prompt_tokens": "prompt length (tokens)", "output_tokens": "output length (tokens)",
        "cached_tokens": "prefix-cache hit tokens when first scheduled (tokens)",
        "num_preemptions": "times preempted", "num_resumptions": "times resumed after preemption"},
}


def duck_type(t: pa.DataType) -> str:
    return DUCK_TYPES[str(t)]


def stored_table(table: str) -> str:
    """Where `table`'s rows are stored: `kvtrace_store.<table>` (with a `proc` key in place of the process
    columns) for the keyed tables, else the table itself. UPDATE and DELETE go there."""
    return f"{STORE}.{table}" if table in KEYED_TABLES else table


def view_columns(table: str) -> list[str]:
    """`table`'s columns as queries see them ("name TYPE"): process columns, shard columns (block lists
    unnested), extra columns."""
    list_col, hash_col, id_def, hash_def = UNNESTED.get(table, (None, None, None, None))
    cols = [f"{c.name} {duck_type(c.type)}" for c in schema.PROCESS_COLUMNS]
    for c in schema.TABLES[table]:
        cols.append(id_def if c.name == list_col else hash_def if c.name == hash_col
                    else f"{c.name} {duck_type(c.type)}")
    return cols + EXTRA_COLUMNS.get(table, [])


def stored_columns(table: str) -> list[str]:
    """`table`'s columns as stored ("name TYPE"): for a keyed table, `proc` in place of the process
    columns, `request_key` in place of `request_id`, label codes in place of label texts."""
    if table not in KEYED_TABLES:
        return view_columns(table)
    cols = ["proc INTEGER"]
    for col in view_columns(table)[len(schema.PROCESS_COLUMNS):]:
        name = col.split()[0]
        if name == "request_id" and table in REQUEST_KEYED:
            cols.append("request_key INTEGER")
        elif name in LABEL_COLUMNS.get(table, ()):
            cols.append(f"{name} UTINYINT")
        else:
            cols.append(col)
    return cols


def table_ddl(table: str, methods: dict[str, str] | None = None) -> str:
    """`table`'s CREATE TABLE; `methods` ({column: compression method}, see store/compression.py) are
    declared with the columns they name."""
    methods = methods or {}
    cols = [c + compression.column_clause(methods.get(c.split()[0])) for c in stored_columns(table)]
    return f"CREATE TABLE IF NOT EXISTS {stored_table(table)} ({', '.join(cols)})"


def keyed_view_ddl(table: str, labels: list[str]) -> str:
    """The view that gives a keyed table its process columns, request ids and labels back (the same
    columns, in the same order, as `view_columns`). `labels` are the database's label texts in code
    order: written into the view as a constant list, which DuckDB indexes per row for free, where a
    list read from the `labels` table was copied to every row (fragmentation 0.56 -> 0.72 s); so the
    views are made again whenever a label is added (`create_keyed_views`)."""
    names = LABEL_COLUMNS.get(table, ())
    texts = "([" + ", ".join(f"'{sql_str(t)}'" for t in labels) + "]::VARCHAR[])"
    select = ["p.session", "p.rank", "p.pid"]
    for col in view_columns(table)[len(schema.PROCESS_COLUMNS):]:
        name = col.split()[0]
        select.append("q.request_id" if name == "request_id" and table in REQUEST_KEYED else
                      f"{texts}[r.{name}] AS {name}" if name in names else f"r.{name}")
    source = f"{STORE}.{table} r JOIN {STORE}.proc_keys p USING (proc)"
    if table in REQUEST_KEYED:
        source += f" JOIN {STORE}.request_keys q USING (request_key)"
    return f"CREATE OR REPLACE VIEW main.{table} AS SELECT {', '.join(select)} FROM {source}"


def sql_str(s: str) -> str:
    return s.replace("'", "''")
