"""Loading a session into DuckDB: one table per recorded table, plus what ingest derives.

Every row gets the process columns (`session`, `rank`, `pid`). Block events are unnested to one row
per block; device access records get their request id from the worker's batch slots (same process,
step and slot).

The big tables, millions of rows in a long run (`KEYED_TABLES`), store keys instead of values that
repeat on every row: `kvtrace_store.<table>` has `proc INTEGER` where the others have the three
process columns (into `kvtrace_store.proc_keys`), `request_key INTEGER` for `request_id` (into
`kvtrace_store.request_keys`, per session; layer_timings has none), and UTINYINT codes for the labels
(step_requests' `phase` and `kind`, block_events' `event`; into `kvtrace_store.labels`). `main.<table>` is a view with the same
name, columns and types that joins the values back. DuckDB pays per row on insert for such values (a
text column costs several integer ones): on bench_scale's 10 M-event session the process key made
ingest 13% faster, and the request keys and labels made it faster again and the file smaller
(docs/performance.md). Queries see the same rows and run about as fast: DuckDB joins key tables of a
few rows (processes, labels) or a few thousand (requests) into the scan. Edit those tables through
`stored_table()`, as views take no UPDATE, DELETE or INSERT; `insert_rows()` inserts rows as the view
shows them. A database written by an older kvtrace is converted on its next ingest. Their columns'
compression is chosen from the first chunk a database stores (ingest/compression.py).

After the shards, ingest derives `requests` (one row per request) and the session-level tables
(`sessions`, `procs`, `probes`, `ingest_issues`). Re-ingesting a session replaces its rows, so ingest
is idempotent.

Loading streams: shard batches (a recorder flush each, often a few hundred rows) are gathered into
one INSERT of up to `INSERT_ROWS` rows / `INSERT_BYTES` bytes, because DuckDB's cost per statement
(~5 ms: planning, registering the Arrow data) would otherwise dwarf the rows. The main thread reads
and prepares chunks while one helper thread (`_Inserter`) stores them, in order, through the
session's one connection. Memory is bounded by the chunks queued there (`QUEUE_ROWS`), a worker's batch
slots kept for its device accesses (`_SlotIndex.MAX_ROWS`) and DuckDB's own buffers, never by the
session's size. One transaction per session: a failed ingest leaves the database as it was.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace import schema
from kvtrace.errors import KvtraceError
from kvtrace.ingest import compression
from kvtrace.ingest.shards import ShardRead, list_shards, loaded_batch, loads_into, read_shard
from kvtrace.session import proc_dirs, read_manifest, read_proc

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
UNNESTED = {"block_events": ("block_ids", "block_hashes", "block_id INTEGER", "block_hash BIGINT")}
EXTRA_COLUMNS = {"kv_access": ["request_id VARCHAR"], "block_events": ["seq BIGINT"]}
# `seq` numbers a process's block event calls in recording order (the rows of one call share it):
# events of a block at the same ts_ns (an evict and the alloc of the same call) are ordered by it.


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
        "status": "complete, or incomplete: a process did not close its shards, a shard was cut, or the "
                  "session was still being recorded when ingested",
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
        "rows_written": "rows written per shard table (JSON; decode_runs counts runs, not the step_requests rows they expand into)",
        "dropped": "rows lost per table and cause (JSON: ring-wrap, writer-error, buffer-cap, max-size, bad-row)",
        "stopped_reason": "why the process stopped writing (writer-error, max-size), or null"},
    "probes": {
        "session": "session id", "pid": "OS process id", "role": "the process's role",
        "probe": "probe name", "status": "attached, off, unused (its vLLM module never loaded in this process), or why not (disabled, failed, ...)",
        "reason": "the detail, when not attached"},
    "ingest_issues": {
        "session": "session id", "file": "the shard", "problem": "what ingest found (a cut batch, ...)",
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


def markdown() -> str:
    """docs/schema.md's part on what the DuckDB database (and the Parquet dataset) holds beyond the shard
    tables: appended by `python -m kvtrace.schema`."""
    out = ["", "# In the database", "",
           "Ingest loads each shard table above into a DuckDB table of the same name, with the process "
           "columns first, except `decode_runs`, whose runs it expands into the `step_requests` rows they "
           "stand for. Two differ:", "",
           "- `block_events` has one row per block: `block_ids` / `block_hashes` become `block_id` INTEGER "
           "and `block_hash` BIGINT (null where the call had no hashes). A trailing `seq` BIGINT numbers the "
           "process's calls in recording order (the rows of one call share it; in a database converted from "
           "an older kvtrace, each row has its own): order by (ts_ns, seq) for the events of a block that "
           "share a timestamp, such as the evict and the alloc of one call.",
           "- `kv_access` has a trailing `request_id` VARCHAR, taken from the worker's `batch_slots` "
           "(same pid, step and slot).", "",
           f"The big tables ({', '.join(f'`{t}`' for t in KEYED_TABLES)}) are views with the same "
           f"columns: their rows are stored in `{STORE}.<table>` with keys in place of values that repeat "
           f"on every row, which the view joins back: a `proc` INTEGER for the process columns "
           f"(`{STORE}.proc_keys`: proc, session, rank, pid), a `request_key` INTEGER for `request_id` in "
           f"all of them but layer_timings (`{STORE}.request_keys`: request_key, session, request_id; key "
           f"0 is the null id), and UTINYINT codes for the labels `phase` and `kind` of step_requests and "
           f"`event` of block_events (`{STORE}.labels`: label, text). Read them as tables; change rows "
           "(UPDATE, DELETE) in the stored table, and request ids in the key table. A database written by "
           "an older kvtrace, with plain tables there or text in place of the request and label keys "
           "(kv_access and block_events kept their request ids as text until 2026-11-23), is converted on "
           "its next ingest. The stored tables' columns declare their compression (`USING COMPRESSION "
           "rle` or `bitpacking`), chosen when a table gets its first chunk of at least a row group "
           "(122,880 rows) in the database: DuckDB's own size estimates over that chunk, which spares "
           "DuckDB estimating every segment again (ingest/compression.py); smaller tables keep DuckDB's "
           "choice per segment.", "",
           "It derives these tables per session. The Parquet dataset (docs/dataset.md) has the same "
           "tables and columns; Nsight Systems tables are in docs/nsys.md."]
    for table, cols in SESSION_TABLES.items():
        out += ["", f"## {table}", "", "| column | type | meaning |", "|---|---|---|"]
        for col in cols.split(","):
            name, type_ = col.split()
            out.append(f"| {name} | {type_} | {DERIVED_MEANINGS[table].get(name, '')} |")
    return "\n".join(out) + "\n"


# Shard rows gathered into one INSERT (block_events rows unnest to ~10 database rows each).
INSERT_ROWS = 1_000_000
INSERT_BYTES = 192 << 20
ROW_GROUP = compression.ROW_GROUP
INGEST_MEMORY_LIMIT = 1 << 30  # bytes DuckDB may keep during an ingest (it spills past it)


_pyarrow_settled = False  # settle_pyarrow_without_pandas ran: pyarrow has made its pandas check


def warm_up_pyarrow() -> None:
    """Let pyarrow import pandas in a helper thread now, instead of on the first `pa.array()` call.

    pyarrow imports pandas (if installed) the first time it converts Python or NumPy values, to check
    for pandas inputs: ~0.45 s of CPU on this project's machines, which an ingest otherwise spends in
    its main thread while DuckDB waits for the first chunk (10% of bench_scale's 10 M-event ingest).
    Started before the database is opened and its tables made, it runs beside them. Nothing is done
    when pandas is imported already or not installed, or after `settle_pyarrow_without_pandas`."""
    import importlib.util
    import sys

    if _pyarrow_settled or "pandas" in sys.modules or importlib.util.find_spec("pandas") is None:
        return

    def convert_once() -> None:
        try:
            pa.array([0])
        except Exception:  # only a warm-up: the real call will say what is wrong
            pass

    threading.Thread(target=convert_once, daemon=True, name="kvtrace-pyarrow-warm-up").start()


def settle_pyarrow_without_pandas() -> None:
    """Have pyarrow conclude, without importing it, that pandas is not there: for a process that will
    not use pandas (`kvtrace ingest`). Saves the ~0.45 CPU-s import that `warm_up_pyarrow` only moves to
    another thread: a fifth of the CPU of a 1 M-event `kvtrace ingest`, which stores no pandas object.

    pyarrow checks for pandas once, on its first conversion of Python or NumPy values. Here that check
    meets an ImportError, so pyarrow stops looking for pandas inputs; its explicit pandas calls
    (`to_pandas()`) still import pandas when they run. Nothing is done when pandas is imported already
    or pyarrow has checked."""
    import importlib.abc
    import sys

    if "pandas" in sys.modules:
        return

    class NoPandas(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "pandas" or name.startswith("pandas."):
                raise ImportError(f"{name}: not imported for this kvtrace command")
            return None

    finder = NoPandas()
    sys.meta_path.insert(0, finder)
    try:
        pa.array([0])
    except Exception:  # only a settling: the real conversions will say what is wrong
        pass
    finally:
        sys.meta_path.remove(finder)
    global _pyarrow_settled
    _pyarrow_settled = True


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
    """`table`'s CREATE TABLE; `methods` ({column: compression method}, see ingest/compression.py) are
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
    texts = "([" + ", ".join(f"'{_sql_str(t)}'" for t in labels) + "]::VARCHAR[])"
    select = ["p.session", "p.rank", "p.pid"]
    for col in view_columns(table)[len(schema.PROCESS_COLUMNS):]:
        name = col.split()[0]
        select.append("q.request_id" if name == "request_id" and table in REQUEST_KEYED else
                      f"{texts}[r.{name}] AS {name}" if name in names else f"r.{name}")
    source = f"{STORE}.{table} r JOIN {STORE}.proc_keys p USING (proc)"
    if table in REQUEST_KEYED:
        source += f" JOIN {STORE}.request_keys q USING (request_key)"
    return f"CREATE OR REPLACE VIEW main.{table} AS SELECT {', '.join(select)} FROM {source}"


def create_keyed_views(con: duckdb.DuckDBPyConnection) -> None:
    labels = [t for t, in con.execute(f"SELECT text FROM {STORE}.labels ORDER BY label").fetchall()]
    for table in KEYED_TABLES:
        con.execute(keyed_view_ddl(table, labels))


def create_tables(con: duckdb.DuckDBPyConnection) -> None:
    """Every kvtrace table and view (IF NOT EXISTS), in one transaction: DuckDB commits each DDL
    statement on its own otherwise, and ~100 commits cost ~0.8 s on a database file.

    Nothing is done when this code laid the database out already (`_layout_is_current`): checking each
    table and making its view again cost ~65 ms, paid by every session ingested into the database."""
    if _layout_is_current(con):
        return
    try:
        con.execute("BEGIN TRANSACTION")
    except duckdb.TransactionException:  # the caller's transaction: its COMMIT covers these too
        _create_tables(con)
        _note_layout(con)
        return
    try:
        _create_tables(con)
        _note_layout(con)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def _layout_digest() -> str:
    """A fingerprint of the tables and views `_create_tables` makes (their DDL as this code writes it,
    labels aside): a database whose `kvtrace_meta` holds it was laid out by code that makes the same."""
    import hashlib

    from kvtrace.ingest import nsys, nsys_align

    parts = [str(schema.SCHEMA_VERSION), *KEY_TABLES_DDL, *KNOWN_LABELS,
             *(table_ddl(t) for t in schema.TABLES), *(keyed_view_ddl(t, []) for t in KEYED_TABLES),
             *(f"{t} ({c})" for t, c in SESSION_TABLES.items()), *(f"{t} ({c})" for t, c in nsys.TABLES.items()),
             *nsys_align.NSYS_VIEWS, *nsys_align.STEP_VIEWS]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _catalog(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The database's tables and views, as "schema.name"."""
    return {f"{s}.{n}" for s, n in con.execute(
        "SELECT table_schema, table_name FROM information_schema.tables WHERE table_catalog = current_database()"
    ).fetchall()}


def _note_layout(con: duckdb.DuckDBPyConnection) -> None:
    """Remember in `kvtrace_meta` which code laid the database out, and what it made."""
    objects = json.dumps(sorted(_catalog(con)))
    con.execute("INSERT OR REPLACE INTO kvtrace_meta VALUES ('layout', ?), ('layout_objects', ?)",
                [_layout_digest(), objects])


def _layout_is_current(con: duckdb.DuckDBPyConnection) -> bool:
    """True when `_note_layout` saw this code lay the database out and every table and view it made is
    still there (a user may have dropped one)."""
    try:
        meta = dict(con.execute("SELECT key, value FROM kvtrace_meta WHERE key IN ('layout', 'layout_objects')"
                                ).fetchall())
    except duckdb.CatalogException:  # a new database, or one from before kvtrace_meta
        return False
    if meta.get("layout") != _layout_digest():
        return False
    try:
        made = set(json.loads(meta.get("layout_objects") or "null"))
    except (TypeError, ValueError):
        return False
    return made <= _catalog(con)


def _create_tables(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(f"CREATE SCHEMA IF NOT EXISTS {STORE}")
    for ddl in KEY_TABLES_DDL:
        con.execute(ddl)
    if not con.execute(f"SELECT count(*) FROM {STORE}.request_keys WHERE request_key = {NULL_REQUEST_KEY}"
                       ).fetchall()[0][0]:
        con.execute(f"INSERT INTO {STORE}.request_keys VALUES ({NULL_REQUEST_KEY}, NULL, NULL)")
    if not con.execute(f"SELECT count(*) FROM {STORE}.labels").fetchall()[0][0]:
        _insert_labels(con, _give_label_codes({}, list(KNOWN_LABELS)))
    existing = _catalog(con)
    for table in schema.TABLES:
        older = (_older_layout(con, table) if table in KEYED_TABLES and existing & {f"main.{table}", f"{STORE}.{table}"}
                 else None)
        con.execute(table_ddl(table))
        if older is not None:
            source, drop = older
            store_view_rows(con, table, source)
            con.execute(drop)
    create_keyed_views(con)
    for table, cols in SESSION_TABLES.items():
        con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({cols})")
    con.execute("CREATE TABLE IF NOT EXISTS kvtrace_meta (key VARCHAR PRIMARY KEY, value VARCHAR)")
    from kvtrace.ingest.nsys import create_nsys_tables

    create_nsys_tables(con)  # empty nsys_* tables and views: the nsys queries run on any database
    con.execute("INSERT OR REPLACE INTO kvtrace_meta VALUES ('schema_version', ?)",
                [str(schema.SCHEMA_VERSION)])


def _older_layout(con: duckdb.DuckDBPyConnection, table: str) -> tuple[str, str] | None:
    """A database from an older kvtrace holds keyed `table` as a plain table with the process columns,
    or stored with a process key but with its request ids and labels as text. Either way: set the old
    rows aside and return (a relation that reads them with the view's columns, the statement that
    drops them), for `store_view_rows` to move them into the new store; None if the layout is current."""
    kind = con.execute("SELECT table_type FROM information_schema.tables WHERE table_schema = 'main' AND "
                       "table_name = ?", [table]).fetchall()
    if kind and kind[0][0] == "BASE TABLE":
        # block_events' `seq` is the recording order, which such a table kept as its row order.
        seq = ", rowid AS seq" if has_seq(table) else ""
        return f"(SELECT *{seq} FROM main.{table})", f"DROP TABLE main.{table}"
    stored = _column_types(con, STORE, table)
    if not stored or list(stored) == [c.split()[0] for c in stored_columns(table)]:
        return None
    con.execute(f"DROP VIEW IF EXISTS main.{table}")
    con.execute(f"ALTER TABLE {STORE}.{table} RENAME TO {table}_older")
    # Label columns stored as codes already (kv_access and block_events before their request keys) are
    # read as their texts, as the view showed them.
    coded = [c for c in LABEL_COLUMNS.get(table, ()) if stored.get(c) == "UTINYINT"]
    texts = "".join(f" REPLACE (l_{c}.text AS {c})" for c in coded)
    joins = "".join(f" LEFT JOIN {STORE}.labels l_{c} ON l_{c}.label = r.{c}" for c in coded)
    return (f"(SELECT k.session, k.rank, k.pid, r.* EXCLUDE (proc){texts} FROM {STORE}.{table}_older r "
            f"JOIN {STORE}.proc_keys k USING (proc){joins})", f"DROP TABLE {STORE}.{table}_older")


def store_view_rows(con: duckdb.DuckDBPyConnection, table: str, source: str) -> None:
    """INSERT into keyed `table`'s store the rows of `source` (a table or subquery with the view's
    column names; missing trailing columns read as null), adding the keys and labels they need.
    For moving older layouts and for rows written by hand (`insert_rows`), not for ingest's bulk path."""
    src = f"kvtrace_src_{table}"
    con.execute(f"CREATE OR REPLACE TEMP VIEW {src} AS SELECT * FROM {source}")
    have = {r[0] for r in con.execute(f"DESCRIBE {src}").fetchall()}
    con.execute(f"""INSERT INTO {STORE}.proc_keys
        SELECT (SELECT coalesce(max(proc), 0) FROM {STORE}.proc_keys) + row_number() OVER (), session, rank, pid
        FROM (SELECT DISTINCT session, rank, pid FROM {src}
              EXCEPT SELECT session, rank, pid FROM {STORE}.proc_keys)""")
    joins = f"""JOIN {STORE}.proc_keys k ON k.session IS NOT DISTINCT FROM t.session
            AND k.rank IS NOT DISTINCT FROM t.rank AND k.pid IS NOT DISTINCT FROM t.pid"""
    if table in REQUEST_KEYED and "request_id" in have:
        con.execute(f"""INSERT INTO {STORE}.request_keys
            SELECT (SELECT coalesce(max(request_key), 0) FROM {STORE}.request_keys) + row_number() OVER (),
                session, request_id
            FROM (SELECT DISTINCT session, request_id FROM {src} WHERE request_id IS NOT NULL
                  EXCEPT SELECT session, request_id FROM {STORE}.request_keys)""")
        joins += f" LEFT JOIN {STORE}.request_keys q ON q.session = t.session AND q.request_id = t.request_id"
    for name in LABEL_COLUMNS.get(table, ()):
        if name in have:
            known = dict(con.execute(f"SELECT text, label FROM {STORE}.labels").fetchall())
            _insert_labels(con, _give_label_codes(known, [r[0] for r in con.execute(
                f"SELECT DISTINCT {name} FROM {src}").fetchall()]))
            joins += f" LEFT JOIN {STORE}.labels l_{name} ON l_{name}.text = t.{name}"
    select = ["k.proc"]
    for col in stored_columns(table)[1:]:
        name = col.split()[0]
        select.append(f"coalesce(q.request_key, {NULL_REQUEST_KEY})" if name == "request_key" and "request_id" in have else
                      f"l_{name}.label" if name in LABEL_COLUMNS.get(table, ()) and name in have else
                      f"t.{name}" if name in have else "NULL")
    con.execute(f"INSERT INTO {STORE}.{table} SELECT {', '.join(select)} FROM {src} t {joins}")
    con.execute(f"DROP VIEW {src}")


def _check_label_count(n: int) -> None:
    if n > 255:  # codes are UTINYINT
        raise KvtraceError(f"more than 255 distinct values in the label columns "
                           f"({', '.join(f'{t}.{c}' for t, cs in LABEL_COLUMNS.items() for c in cs)}): "
                           f"not what kvtrace writes")


def _give_label_codes(labels: dict[str, int], texts: list) -> list[tuple[int, str]]:
    """Give the `texts` not in `labels` (text -> code, updated) the next codes; returns them as
    (code, text). Codes are dense from 1: the views index a list of the texts by them."""
    new = [t for t in dict.fromkeys(texts) if t is not None and t not in labels]
    _check_label_count(len(labels) + len(new))
    for text in new:
        labels[text] = len(labels) + 1
    return [(labels[t], t) for t in new]


def _insert_labels(con: duckdb.DuckDBPyConnection, labels: list[tuple[int, str]]) -> None:
    """INSERT (code, text) labels; the views need making again after (create_keyed_views)."""
    for label, text in labels:
        con.execute(f"INSERT INTO {STORE}.labels VALUES (?, ?)", [label, text])


def _column_types(con: duckdb.DuckDBPyConnection, schema_name: str, table: str) -> dict[str, str]:
    """{column: type} of a table, in column order; {} when there is no such table."""
    return dict(con.execute(
        "SELECT column_name, data_type FROM information_schema.columns WHERE table_schema = ? AND table_name = ? "
        "ORDER BY ordinal_position", [schema_name, table]).fetchall())


def proc_key(con: duckdb.DuckDBPyConnection, session: str, rank: int, pid: int) -> int:
    """A new key for one process's rows in the keyed tables (each ingested process folder gets its own)."""
    (key,), = con.execute(f"""INSERT INTO {STORE}.proc_keys
        SELECT coalesce(max(proc), 0) + 1, ?, ?, ? FROM {STORE}.proc_keys RETURNING proc""",
                          [session, rank, pid]).fetchall()
    return int(key)


def insert_rows(con: duckdb.DuckDBPyConnection, table: str, rows: list[tuple]) -> None:
    """INSERT rows given as the view shows them (process columns first) into any kvtrace table; for a
    keyed table the process columns become its key. block_events' trailing `seq` may be left out: the
    rows are then numbered in the order given, after those stored. For tests and tools that write rows
    by hand."""
    if not rows:
        return
    if table not in KEYED_TABLES:
        # One statement for all rows: executemany runs one per row (~0.5-1 ms each in DuckDB).
        marks = "(" + ", ".join("?" * len(rows[0])) + ")"
        con.execute(f"INSERT INTO {table} VALUES " + ", ".join([marks] * len(rows)),
                    [value for row in rows for value in row])
        return
    names = _stage(con, table)[:len(rows[0])]
    con.executemany(f"INSERT INTO kvtrace_rows ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                    [list(r) for r in rows])
    _store_staged(con, table)


def insert_select(con: duckdb.DuckDBPyConnection, table: str, select: str) -> None:
    """INSERT the rows of a SELECT whose columns are the view's (as `insert_rows`) into any kvtrace table."""
    if table not in KEYED_TABLES:
        con.execute(f"INSERT INTO {table} {select}")
        return
    names = _stage(con, table)[:len(con.sql(select).columns)]
    con.execute(f"INSERT INTO kvtrace_rows ({', '.join(names)}) {select}")
    _store_staged(con, table)


def _stage(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    """An empty temp table `kvtrace_rows` with keyed `table`'s view columns; returns their names."""
    columns = view_columns(table)
    con.execute(f"CREATE OR REPLACE TEMP TABLE kvtrace_rows ({', '.join(columns)})")
    return [c.split()[0] for c in columns]


def _store_staged(con: duckdb.DuckDBPyConnection, table: str) -> None:
    if has_seq(table):  # not given: the order of the rows, after all others
        (first,), = con.execute(f"SELECT coalesce(max(seq), -1) + 1 FROM {STORE}.{table}").fetchall()
        con.execute(f"UPDATE kvtrace_rows SET seq = {int(first)} + rowid WHERE seq IS NULL")
    store_view_rows(con, table, "kvtrace_rows")
    con.execute("DROP TABLE kvtrace_rows")
    create_keyed_views(con)  # in case the rows brought new labels


def open_db(path: str | Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open a kvtrace DuckDB file; a one-line KvtraceError when it is not one."""
    path = Path(path)
    if path.is_dir():
        raise KvtraceError(f"{path}: is a directory, expected a DuckDB file")
    if read_only and not path.exists():
        raise KvtraceError(f"{path}: no such database")
    if not path.parent.is_dir():
        raise KvtraceError(f"{path}: directory {path.parent} does not exist")
    existed = path.exists() and path.stat().st_size > 0
    try:
        con = duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as exc:
        raise KvtraceError(f"{path}: not a DuckDB database ({str(exc).splitlines()[0][:120]})") from None
    if read_only or existed:
        tables = {r[0] for r in con.execute("select table_name from information_schema.tables").fetchall()}
        ours = "kvtrace_meta" in tables or "sessions" in tables or any(t.startswith("nsys_") for t in tables)
        if not ours and (read_only or tables):
            con.close()
            what = "refusing to add kvtrace tables to it" if not read_only else "no kvtrace tables"
            raise KvtraceError(f"{path}: a DuckDB database, but not one kvtrace wrote ({what})")
    return con


class Progress:
    """A one-line progress report on stderr for long ingests (quiet when not a terminal, except at end)."""

    def __init__(self, label: str, total: int, enabled: bool):
        import sys

        self.label, self.total, self.enabled, self.done, self.rows = label, total, enabled, 0, 0
        self.stream = sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = self.last = time.monotonic()
        self._shard_rows = 0

    def step(self, rows: int) -> None:
        """A shard done (its rows already counted by `add`, if any; `rows` beyond those are added)."""
        self.done += 1
        self.add(max(rows - self._shard_rows, 0))
        self._shard_rows = 0

    def add(self, rows: int) -> None:
        """Rows read so far of the shard in progress (big shards report before they end)."""
        self._shard_rows += rows
        self.rows += rows
        now = time.monotonic()
        if self.enabled and (now - self.last > (0.2 if self.tty else 5.0)):
            self.last = now
            self._print(end="\r" if self.tty else "\n")

    def _print(self, end: str) -> None:
        rate = self.rows / max(time.monotonic() - self.t0, 1e-9)
        print(f"{self.label}: {self.done}/{self.total} shards, {self.rows:,} rows, {rate:,.0f} rows/s",
              end=end, file=self.stream, flush=True)

    def finish(self) -> None:
        if self.enabled and time.monotonic() - self.t0 > 1.0:
            self._print(end="\n")


def ingest_session(con: duckdb.DuckDBPyConnection, session_dir: str | Path, progress: bool = False,
                   job_pattern: str | None = None, checkpoint: bool = True) -> dict[str, Any]:
    """Load one session directory into the open database; returns a report (rows, issues, status).

    With `checkpoint` (the default) the COMMIT writes the session into the database file, and the
    report's seconds include that. Without, DuckDB may keep the rows in its WAL until a later
    checkpoint: `ingest()` does so for every session of a call but the last, whose COMMIT then writes
    them all (one checkpoint per session made a 20-session ingest ~25% slower and its file ~25% larger,
    docs/performance.md)."""
    session_dir = Path(session_dir)
    manifest = read_manifest(session_dir)
    sid = str(manifest.get("session_id") or session_dir.name)
    job_pattern = job_pattern or manifest.get("options", {}).get("job_pattern")
    if job_pattern:
        _job_pattern_groups(job_pattern)  # a bad pattern fails here, before anything is loaded
    create_tables(con)
    procs = proc_dirs(session_dir)
    shards_by_proc = [(p, read_proc(p), list_shards(p)) for p in procs]
    total = sum(len(s) for _, _, s in shards_by_proc)
    bar = Progress(f"ingest {session_dir.name}", total, progress)
    rows: dict[str, int] = {t: 0 for t in schema.TABLES}
    issues: list[tuple[str, str, int]] = []
    incomplete = manifest.get("status") not in ("complete",)
    t0 = time.monotonic()
    restore = _ingest_settings(con, checkpoint)
    con.execute("BEGIN TRANSACTION")
    try:
        _delete_session(con, sid)  # in the transaction: a failed re-ingest keeps the rows it would replace
        keys = _SessionKeys(con, sid)
        # Keyed tables still empty get their columns' compression from their first chunk (compression.py).
        undecided = {t for t in KEYED_TABLES
                     if not con.execute(f"SELECT count(*) FROM {STORE}.{t}").fetchall()[0][0]}
        # Every process's key first: once the inserter runs, the connection is its thread's.
        consts = []
        for _proc_dir, proc, _shards in shards_by_proc:
            rank, pid = int(proc.get("rank", 0) or 0), int(proc.get("pid", 0) or 0)
            consts.append((sid, rank, pid, proc_key(con, sid, rank, pid)))
        # `requests` is derived from request_events alone: queued once the last process holding any
        # has them queued (below), it runs while the big tables are still being read.
        derive_after = max((i for i, (_, _, shards) in enumerate(shards_by_proc)
                            if any(s.table == "request_events" for s in shards)), default=None)
        inserter = _Inserter(con)
        try:
            for i, ((_proc_dir, proc, shards), proc_consts) in enumerate(zip(shards_by_proc, consts)):
                if proc.get("status") not in ("complete", "flushed"):
                    incomplete = True
                loader = _Gather(inserter, proc_consts, keys, undecided)
                # A process's small tables first: their INSERTs keep DuckDB busy while its first big
                # chunk is read, keyed and measured for compression (~30 ms at 1 M events, during which
                # the inserter had nothing to do).
                small = [s for s in shards if loads_into(s.table) not in KEYED_TABLES]
                big = [s for s in shards if loads_into(s.table) in KEYED_TABLES]
                if _load_shards(small, loader, bar, rows, issues):
                    incomplete = True
                if i == derive_after:
                    loader.flush()
                    inserter.submit(0, _derive_requests, sid, job_pattern)
                if _load_shards(big, loader, bar, rows, issues):
                    incomplete = True
                loader.flush()
                inserter.submit(0, _insert_proc, sid, proc)
            inserter.wait()
        finally:
            inserter.close(cancel=True)  # the connection is this thread's again (for the rest, or ROLLBACK)
        status = "incomplete" if incomplete else "complete"
        _insert_session(con, sid, session_dir, manifest, [proc for _, proc, _ in shards_by_proc], status, job_pattern)
        for path, problem, cut in issues:
            con.execute("INSERT INTO ingest_issues VALUES (?, ?, ?, ?)", [sid, path, problem, cut])
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    finally:
        restore()
    bar.finish()
    seconds = time.monotonic() - t0
    events = sum(rows.values())
    return {"session": sid, "status": status, "rows": rows, "events": events, "seconds": seconds,
            "events_per_s": events / seconds if seconds > 0 else 0.0, "issues": [p for _, p, _ in issues],
            "probes": _probe_report(con, sid)}


def _ingest_settings(con: duckdb.DuckDBPyConnection, checkpoint: bool = True):
    """Settings for the ingest's transaction; returns a function that puts the connection's back.

    - DuckDB's memory limit lowered to INGEST_MEMORY_LIMIT: it otherwise keeps the blocks it has
      written cached, up to 80% of RAM, so RSS would grow with the session.
    - With `checkpoint`, the checkpoint threshold at 1 byte, so that COMMIT checkpoints: DuckDB then
      writes the rows it held in memory (tables too small to fill a row group) straight into the file,
      as it does anyway past the default 16 MiB of WAL (bench_scale's 10 M-event session). Below that,
      it wrote them to the WAL, the CHECKPOINT after ingest wrote them again, and the session's rate
      left that out."""
    restore = []
    settings = [("memory_limit", f"{INGEST_MEMORY_LIMIT}B")] + ([("checkpoint_threshold", "1B")] if checkpoint else [])
    for name, value in settings:
        try:
            before = con.execute(f"SELECT current_setting('{name}')").fetchall()[0][0]
            if name == "memory_limit" and _bytes(before) <= INGEST_MEMORY_LIMIT:
                continue
            con.execute(f"SET {name} = '{value}'")
        except (duckdb.Error, ValueError, KeyError):
            continue
        restore.append((name, before))

    def put_back() -> None:
        for name, before in restore:
            con.execute(f"SET {name} = '{before}'")
    return put_back


def _bytes(setting: str) -> float:
    """A DuckDB size setting ('16.0 MiB') in bytes."""
    units = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    number, unit = str(setting).split()
    return float(number) * units[unit]


def _load_shards(shards: list, loader: _Gather, bar: Progress, rows: dict[str, int],
                 issues: list[tuple[str, str, int]]) -> bool:
    """Read one process's shards into `loader`; counts rows, notes issues; True if any shard was cut."""
    cut = False
    # batch_slots before kv_access: the access rows take their request id from it.
    for shard in sorted(shards, key=lambda s: (s.table != "batch_slots", s.path.name)):
        if not shard.open and not shard.path.exists():
            # Deleted since it was listed: a live session under --on-max-size drop-oldest (the
            # recorder counts its rows as lost). Shards created since listing are left for later.
            issues.append((str(shard.path), f"{shard.path}: deleted while the session was read", 0))
            cut = True
            continue
        res = ShardRead()
        table = loads_into(shard.table)  # a run table's rows are expanded into the table they stand for
        stored = 0
        for batch in read_shard(shard, res):
            # An older shard's missing trailing columns padded; decode runs made rows.
            batch = loaded_batch(shard.table, batch, shard.path)
            loader.add(table, batch)
            bar.add(batch.num_rows)
            stored += batch.num_rows
        rows[table] += stored
        for problem in res.problems:
            issues.append((str(shard.path), problem, res.bytes_cut))
            cut = True
        bar.step(stored)
    return cut


def _delete_session(con: duckdb.DuckDBPyConnection, sid: str) -> None:
    """Delete `sid`'s rows (a re-ingest replaces them). A session is stored whole or not at all (one
    transaction, which writes its `sessions` row and process keys), so when it has neither there is
    nothing to delete: one query instead of a DELETE per table (~10 ms on a first ingest)."""
    (stored,), = con.execute(f"""SELECT EXISTS (SELECT 1 FROM sessions WHERE session = $s)
        OR EXISTS (SELECT 1 FROM {STORE}.proc_keys WHERE session = $s)""", {"s": sid}).fetchall()
    if not stored:
        return
    for table in [*schema.TABLES, *SESSION_TABLES]:
        if table in KEYED_TABLES:
            con.execute(f"DELETE FROM {STORE}.{table} WHERE proc IN "
                        f"(SELECT proc FROM {STORE}.proc_keys WHERE session = ?)", [sid])
        else:
            con.execute(f"DELETE FROM {table} WHERE session = ?", [sid])
    con.execute(f"DELETE FROM {STORE}.proc_keys WHERE session = ?", [sid])
    con.execute(f"DELETE FROM {STORE}.request_keys WHERE session = ?", [sid])


class _SessionKeys:
    """Turns one session's request ids and labels into the keys the store holds, in bulk (Arrow
    compute, no Python per row), remembering the keys it gave; the new ones are inserted with the
    chunk that first uses them (`take_new`)."""

    def __init__(self, con: duckdb.DuckDBPyConnection, sid: str):
        self.sid = sid
        # The session's keys were deleted with its rows: its requests get keys after every other's.
        self.first_key = con.execute(f"SELECT coalesce(max(request_key), 0) + 1 FROM {STORE}.request_keys"
                                     ).fetchall()[0][0]
        self.request_ids: dict[str, None] = {}  # in key order: key = first_key + position
        self.known_ids = pa.array([], pa.string())
        self.new_ids: list[str] = []
        self.labels = dict(con.execute(f"SELECT text, label FROM {STORE}.labels").fetchall())
        self.known_labels = self._label_array()
        self.new_labels: list[tuple[int, str]] = []

    def _label_array(self) -> pa.Array:
        return pa.array([t for t, _ in sorted(self.labels.items(), key=lambda kv: kv[1])], pa.string())

    def encode(self, table: str, data: pa.Table) -> pa.Table:
        """`data` (shard columns) with the columns the store keeps as keys replaced by those keys."""
        if table in REQUEST_KEYED and "request_id" in data.column_names:
            i = data.column_names.index("request_id")
            data = data.set_column(i, "request_key", self._request_keys(data.column(i)))
        for name in LABEL_COLUMNS.get(table, ()):
            if name in data.column_names:
                i = data.column_names.index(name)
                data = data.set_column(i, name, self._label_codes(table, name, data.column(i)))
        return data

    def _request_keys(self, ids: pa.ChunkedArray) -> pa.ChunkedArray:
        pos = pc.index_in(ids, value_set=self.known_ids)
        if pos.null_count > ids.null_count:  # ids this session has not given a key yet
            for rid in pc.unique(ids).to_pylist():
                if rid is not None and rid not in self.request_ids:
                    self.request_ids[rid] = None
                    self.new_ids.append(rid)
            self.known_ids = pa.array(list(self.request_ids), pa.string())
            pos = pc.index_in(ids, value_set=self.known_ids)
        return pc.fill_null(pc.add(pos, pa.scalar(self.first_key, pa.int32())), NULL_REQUEST_KEY)

    def _label_codes(self, table: str, name: str, texts: pa.ChunkedArray) -> pa.ChunkedArray:
        pos = pc.index_in(texts, value_set=self.known_labels)
        if pos.null_count > texts.null_count:
            self.new_labels += _give_label_codes(self.labels, pc.unique(texts).to_pylist())
            self.known_labels = self._label_array()
            pos = pc.index_in(texts, value_set=self.known_labels)
        return pc.cast(pc.add(pos, pa.scalar(1, pa.int32())), pa.uint8())

    def take_new(self) -> tuple[list[str], list[tuple[int, str]], int]:
        """The request ids and labels given keys since the last call, and the first new request key."""
        first = self.first_key + len(self.request_ids) - len(self.new_ids)
        ids, labels = self.new_ids, self.new_labels
        self.new_ids, self.new_labels = [], []
        return ids, labels, first


class _Inserter:
    """Runs a session's INSERTs in order, in one helper thread, while the caller reads the next chunks.

    DuckDB lets go of the GIL while it inserts, so reading shards (main thread) and storing them
    (DuckDB's threads) overlap. The caller runs ahead across tables and processes until `QUEUE_ROWS`
    rows wait besides the chunk being inserted, so DuckDB is not left idle while the first chunk of the
    next table is read (with one chunk in flight and a wait before the next, as before, it was idle a
    quarter of the time); memory stays bounded by about two chunks. Counted in rows, not chunks, so
    the few-row chunks of small tables never hold the reader up. One transaction, hence one connection:
    it is the helper's until `wait()` returns; `wait()` and `submit()` re-raise an INSERT's error, after
    which the remaining work is skipped.
    """

    QUEUE_ROWS = 2 * INSERT_ROWS

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.con = con
        self.work: collections.deque = collections.deque()  # (rows, fn, args); None stops the helper
        self.queued_rows = 0
        self.busy = False
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.cancelled = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="kvtrace-insert")
        self.thread.start()

    def submit(self, rows: int, fn: Any, *args: Any) -> None:
        """Queue `fn(con, *args)`, which stores `rows` rows; blocks while too many rows wait."""
        with self.cond:
            while self.work and self.queued_rows + rows > self.QUEUE_ROWS and self.error is None:
                self.cond.wait()
            self._raise()
            self.work.append((rows, fn, args))
            self.queued_rows += rows
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.work:
                    self.cond.wait()
                item = self.work.popleft()
                if item is None:
                    return
                rows, fn, args = item
                self.queued_rows -= rows
                self.busy = True
                skip = self.error is not None or self.cancelled
                self.cond.notify_all()
            try:
                if not skip:
                    fn(self.con, *args)
            except BaseException as exc:  # handed to the caller by wait() / submit()
                with self.cond:
                    self.error = exc
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def wait(self) -> None:
        """Until everything queued is done; re-raises its error."""
        with self.cond:
            while (self.work or self.busy) and self.error is None:
                self.cond.wait()
            self._raise()

    def close(self, cancel: bool = False) -> None:
        """Stop the helper after the queued work (skipped with `cancel`); the connection is the caller's
        again when this returns."""
        with self.cond:
            self.cancelled = self.cancelled or cancel
            self.work.append(None)
            self.cond.notify_all()
        self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            self.cancelled = True
            raise error


class _SlotIndex:
    """One process's batch slots (step, slot, request key) in memory, for the request ids of its device
    access rows, which name only the step and the slot.

    batch_slots is read before kv_access (`_load_shards`), so the index is complete when the first
    access row arrives. Without it each kv_access chunk read its batch slots back from DuckDB (~0.3 s of
    a 10 M-event ingest). Bounded: past `MAX_ROWS` rows (16 bytes each) it is dropped and the access rows
    are matched against the database instead (`_access_request_keys`)."""

    MAX_ROWS = 16_000_000

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.rows = 0
        self.overflow = False

    def add(self, data: pa.Table) -> None:
        """Remember a chunk of encoded batch_slots rows (columns step, slot, request_key)."""
        if self.overflow:
            return
        self.rows += data.num_rows
        if self.rows > self.MAX_ROWS:
            self.overflow, self.parts = True, []
            return
        self.parts.append(_slot_columns(data))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(steps, slots, keys), sorted by (step, slot); None when the index overflowed."""
        if self.overflow:
            return None
        if not self.parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32)
        if len(self.parts) > 1:
            self.parts = [_sorted_slots(*(np.concatenate(c) for c in zip(*self.parts)))]
        return self.parts[0]


def _slot_columns(data: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps int64, slots int32, request keys int32) of batch_slots rows that have a slot, sorted."""
    slot = data.column("slot")
    if slot.null_count:  # rows without a slot never match an access row
        data = data.filter(pc.is_valid(slot))
    return _sorted_slots(pc.cast(data.column("step"), pa.int64()).to_numpy(),
                         pc.cast(data.column("slot"), pa.int32()).to_numpy(),
                         pc.cast(pc.fill_null(data.column("request_key"), NULL_REQUEST_KEY), pa.int32()).to_numpy())


def _sorted_slots(steps: np.ndarray, slots: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                                   np.ndarray]:
    """The batch slots in (step, slot) order (as recorded, usually: then nothing is copied)."""
    pairs = _step_slot(steps, slots)
    if not (pairs[1:] >= pairs[:-1]).all():
        order = np.argsort(pairs, kind="stable")
        steps, slots, keys = steps[order], slots[order], keys[order]
    return steps, slots, keys


class _Gather:
    """Gathers one process's batches of one table into big INSERTs (see the module docstring), and
    hands them to the session's `_Inserter`."""

    def __init__(self, inserter: _Inserter, consts: tuple, keys: _SessionKeys, undecided: set[str]):
        self.inserter, self.consts, self.keys = inserter, consts, keys
        self.undecided = undecided  # the session's keyed tables whose compression is not chosen yet
        self.seq = 0  # block_events' next `seq` (this process's calls, in recording order)
        self.slots = _SlotIndex()
        self.table: str | None = None
        self.batches: list[pa.RecordBatch] = []
        self.rows = self.nbytes = 0

    def add(self, table: str, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if table != self.table or (self.batches and not batch.schema.equals(self.batches[0].schema)):
            self.flush()
            self.table = table
        self.batches.append(batch)
        # Counted as stored: a block_events row per block (unnested in flush), not per call.
        self.rows += _block_count(batch, table) if table in UNNESTED else batch.num_rows
        self.nbytes += batch.get_total_buffer_size()  # `nbytes` costs 50 us a batch on slices
        if self.rows >= INSERT_ROWS or self.nbytes >= INSERT_BYTES:
            self.flush()

    def flush(self) -> None:
        """Queue the INSERT of what is gathered."""
        if not self.batches:
            return
        table = self.table
        data = pa.Table.from_batches(self.batches)
        self.batches, self.rows, self.nbytes = [], 0, 0
        if table in KEYED_TABLES:  # before the copy: the key columns are smaller than the text
            data = self.keys.encode(table, data)
        if table == "batch_slots":
            self.slots.add(data)
        if has_seq(table):
            data = data.append_column("seq", pa.array(np.arange(self.seq, self.seq + data.num_rows)))
            self.seq += data.num_rows
        if table in UNNESTED:
            data = _unnest_blocks(table, data)
        if table == "kv_access":
            have = self.slots.arrays()
            if have is not None:  # else _insert reads the batch slots back from the database
                data = data.append_column("request_key", _match_slots(*have, data))
        if table in self.undecided:  # the table's first chunk in this database
            self.undecided.discard(table)
            methods = compression.choose(data)
            if methods:
                self.inserter.submit(0, _set_compression, table, methods)
        # DuckDB pays per Arrow batch as well: copy the small batches into ones of a row group's size
        # (a third less CPU than scanning recorder-sized batches), still enough of them to scan in
        # parallel.
        data = data.combine_chunks()
        data = pa.Table.from_batches(data.to_batches(max_chunksize=ROW_GROUP))
        self.inserter.submit(data.num_rows, _insert_chunk, self.keys.sid, self.keys.take_new(), table, data,
                             self.consts)


def _block_count(batch: pa.RecordBatch, table: str) -> int:
    """The rows `batch` (shard rows of an UNNESTED table) will be once unnested: its block ids, or its
    calls where that is more (a call with no block still takes a slot in the chunk's accounting)."""
    ids = batch.column(UNNESTED[table][0])
    offsets = ids.offsets
    return max(batch.num_rows, offsets[len(ids)].as_py() - offsets[0].as_py()) if len(ids) else 0


def _unnest_blocks(table: str, data: pa.Table) -> pa.Table:
    """`data` (a chunk of shard rows, one per call) with its block lists unnested: one row per block,
    the store's columns in the store's order. Done here, in the reading thread, instead of by DuckDB's
    UNNEST in the INSERT: DuckDB's thread is the one every chunk waits for, and a flat chunk costs it
    ~15-25% less (docs/performance.md, ninth session).

    As DuckDB's `SELECT UNNEST(block_ids), UNNEST(block_hashes)` does: the two lists of a call side by
    side, the shorter padded with nulls (a call's hashes are usually its blocks' or none); a call whose
    lists are both empty or null gives no row."""
    list_col, hash_col, id_def, hash_def = UNNESTED[table]
    data = data.combine_chunks()
    ids, hashes = data.column(list_col).chunk(0), data.column(hash_col).chunk(0)
    n_ids, n_hashes = _list_lengths(ids), _list_lengths(hashes)
    n_rows = np.maximum(n_ids, n_hashes)
    cols = {}
    for name in data.column_names:
        if name == list_col:
            cols[id_def.split()[0]] = _padded(pc.list_flatten(ids), n_ids, n_rows)
        elif name == hash_col:
            cols[hash_def.split()[0]] = _padded(pc.list_flatten(hashes), n_hashes, n_rows)
        else:
            cols[name] = _repeated(data.column(name).chunk(0), n_rows)
    return pa.table(cols)


def _repeated(values: pa.Array, counts: np.ndarray) -> pa.Array:
    """Each value `counts` times (NumPy's repeat where it can: ~10x Arrow's take by index)."""
    if pa.types.is_integer(values.type) and not values.null_count:
        return pa.array(np.repeat(values.to_numpy(), counts))
    return values.take(pa.array(np.repeat(np.arange(len(values), dtype=np.int64), counts)))


def _list_lengths(lists: pa.Array) -> np.ndarray:
    """Values in each list (0 for a null list), as int64."""
    return pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _padded(values: pa.Array, lengths: np.ndarray, n_rows: np.ndarray) -> pa.Array:
    """The flattened `values` of lists of `lengths`, each list followed by nulls up to its `n_rows`."""
    if np.array_equal(lengths, n_rows):
        return values
    if pa.types.is_integer(values.type) and not values.null_count and ((lengths == 0) | (lengths == n_rows)).all():
        # The usual odd case: a call has a value for each of its rows (a cache, an evict) or none.
        has = np.repeat(lengths > 0, n_rows)
        out = np.zeros(len(has), values.type.to_pandas_dtype())
        out[has] = values.to_numpy()
        return pa.array(out, mask=~has)
    total = int(n_rows.sum())
    starts = np.repeat(np.cumsum(n_rows) - n_rows, n_rows)
    valid = (np.arange(total) - starts) < np.repeat(lengths, n_rows)
    index = np.zeros(total, np.int64)
    index[valid] = np.arange(len(values))
    return values.take(pa.array(index, mask=~valid))


def _set_compression(con: duckdb.DuckDBPyConnection, table: str, methods: dict[str, str]) -> None:
    """Make the (empty) stored `table` again with `methods` declared (in the inserter's thread)."""
    methods = {"proc": "rle", **methods}  # one process's rows at a time: one run a chunk
    con.execute(f"DROP TABLE {STORE}.{table}")
    con.execute(table_ddl(table, methods))


def _insert_chunk(con: duckdb.DuckDBPyConnection, sid: str, new_keys: tuple, table: str, data: pa.Table,
                  consts: tuple) -> None:
    """The keys a chunk is the first to use, then the chunk (in the inserter's thread)."""
    _insert_keys(con, sid, *new_keys)
    _insert(con, table, data, consts)


def _insert_keys(con: duckdb.DuckDBPyConnection, sid: str, request_ids: list[str],
                 labels: list[tuple[int, str]], first_key: int) -> None:
    """INSERT the request keys (consecutive from `first_key`) and labels a chunk is the first to use."""
    if request_ids:
        kvtrace_keys = pa.table({  # noqa: F841 - read by name (DuckDB's replacement scan, see _insert)
            "request_key": pa.array(range(first_key, first_key + len(request_ids)), pa.int32()),
            "request_id": pa.array(request_ids, pa.string())})
        con.execute(f"INSERT INTO {STORE}.request_keys SELECT request_key, '{_sql_str(sid)}', request_id "
                    "FROM kvtrace_keys")
    _insert_labels(con, labels)
    if labels:
        create_keyed_views(con)


def _insert(con: duckdb.DuckDBPyConnection, table: str, batch: pa.RecordBatch | pa.Table, consts: tuple) -> None:
    """INSERT one gathered chunk of `table`'s shard rows (a RecordBatch or a Table of many), keys
    given (`_SessionKeys.encode`)."""
    n = batch.num_rows
    if n == 0:
        return
    sid, rank, pid, key = consts
    data = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    if table == "kv_access" and "request_key" not in data.column_names:  # _SlotIndex overflowed
        data = data.append_column("request_key", _access_request_keys(con, key, data))
    # The statements read the chunk as `kvtrace_batch`, this local variable, through DuckDB's replacement
    # scan: bound for the one statement, no catalog entry. Not con.register(): a registered view is a
    # catalog entry, and a dropped one lives on, with the Arrow data it holds, until the transaction
    # ends (memory would grow with the session). Not `con.from_arrow(data).query(...)` either: the
    # relation and its view cost ~1.5 ms more a statement, ~10% of a 1 M-event ingest's INSERTs.
    kvtrace_batch = data  # noqa: F841 - read by name
    head = f"'{_sql_str(sid)}' AS session, {rank}::INTEGER AS rank, {pid}::INTEGER AS pid"
    if table in KEYED_TABLES:  # keyed, block lists unnested and numbered (`seq`) in _Gather.flush
        con.execute(f"INSERT INTO {STORE}.{table} SELECT {key}::INTEGER, * FROM kvtrace_batch")
    else:
        con.execute(f"INSERT INTO {table} SELECT {head}, * FROM kvtrace_batch")


def _access_request_keys(con: duckdb.DuckDBPyConnection, proc: int, data: pa.Table) -> pa.Array:
    """`_match_slots` against the process's batch slots stored in the database, those of the chunk's
    steps only (loaded in step order, so DuckDB's min/max per row group skips the rest). For processes
    with more batch slots than `_SlotIndex` keeps in memory."""
    steps = pc.fill_null(data.column("step"), -1).to_numpy()
    lo, hi = int(steps.min()), int(steps.max())
    have = con.sql(f"SELECT step, slot, request_key FROM {STORE}.batch_slots WHERE proc = {int(proc)} AND step "
                   f"BETWEEN {lo} AND {hi} AND slot IS NOT NULL").to_arrow_table()
    return _match_slots(*_slot_columns(have), data)


def _match_slots(have_steps: np.ndarray, have_slots: np.ndarray, keys: np.ndarray, data: pa.Table) -> pa.Array:
    """For each device access row of `data`, the request key of the batch slot with the same step and
    slot; NULL_REQUEST_KEY without one.

    `have_*`: batch slots sorted by (step, slot). In numpy rather than a SQL join, which cost as much and
    did not keep the rows' order (by step: stored out of order they compress 3x worse). A step's slots
    are consecutive rows, so a row's position is its step's first row plus its slot; checked, and
    searched where not."""
    steps = pc.fill_null(data.column("step"), -1).to_numpy()
    slots = pc.fill_null(data.column("slot"), -1).to_numpy()
    lo, hi = int(steps.min()), int(steps.max())
    a, b = np.searchsorted(have_steps, [lo, hi + 1])  # the chunk's steps only
    have_steps, have_slots, keys = have_steps[a:b], have_slots[a:b], keys[a:b]
    if not len(have_steps):
        return _int32_array(np.full(len(steps), NULL_REQUEST_KEY, np.int32))
    pairs = _step_slot(have_steps, have_slots)
    starts = np.flatnonzero(np.r_[True, have_steps[1:] != have_steps[:-1]])
    first_row = np.full(hi - lo + 1, -1, dtype=np.int64)
    first_row[have_steps[starts] - lo] = starts
    wanted = _step_slot(steps, slots)
    row = first_row[steps - lo]
    at = (row + slots - have_slots[row]).clip(0, len(pairs) - 1)
    off = pairs[at] != wanted
    if off.any():
        at[off] = np.searchsorted(pairs, wanted[off]).clip(0, len(pairs) - 1)
    return _int32_array(np.where(pairs[at] == wanted, keys[at], NULL_REQUEST_KEY).astype(np.int32, copy=False))


def _int32_array(values: np.ndarray) -> pa.Array:
    """An int32 NumPy array as an Arrow array, without a copy."""
    return pa.Array.from_buffers(pa.int32(), len(values), [None, pa.py_buffer(values)])


def _step_slot(steps: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """(step, slot) pairs as one sortable int64 (slots are rows of a batch: far below 2^31)."""
    return (steps.astype(np.int64) << 32) | (slots.astype(np.int64) & 0xFFFFFFFF)


def _sql_str(s: str) -> str:
    return s.replace("'", "''")


def _insert_proc(con: duckdb.DuckDBPyConnection, sid: str, proc: dict) -> None:
    pid, role = int(proc.get("pid", 0) or 0), str(proc.get("role", "proc"))
    con.execute("INSERT INTO procs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", [
        sid, pid, int(proc.get("rank", 0) or 0), role, proc.get("host"), proc.get("status"),
        json.dumps(proc.get("rows_written", {})), json.dumps(proc.get("dropped", {})),
        proc.get("stopped_reason")])
    insert_rows(con, "probes", [(sid, pid, role, name, st.get("status"), st.get("reason", ""))
                                for name, st in (proc.get("probes") or {}).items() if isinstance(st, dict)])


def _insert_session(con, sid, session_dir, manifest, procs, status, job_pattern) -> None:
    """The session's row; `procs` are the processes' proc.json as read already, `job_pattern` as
    ingest_session resolved it (the user's, else the manifest's)."""
    engine: dict[str, Any] = {}
    for p in procs:
        cfg = p.get("engine_config") or {}
        if cfg:
            engine = cfg
            break
    engine = manifest.get("engine_config") or engine
    clock = manifest.get("clock", {})
    command = manifest.get("command")
    con.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [
        sid, str(session_dir.resolve()), status, manifest.get("schema_version"),
        manifest.get("kvtrace_version"), manifest.get("vllm_version"),
        " ".join(command) if isinstance(command, list) else command,
        clock.get("start_utc_ns"), clock.get("start_monotonic_ns"), clock.get("end_monotonic_ns"),
        manifest.get("exit_code"), engine.get("block_size"), engine.get("num_kv_blocks"),
        engine.get("max_num_seqs"), engine.get("max_num_batched_tokens"),
        engine.get("enable_prefix_caching"), engine.get("enable_chunked_prefill"),
        engine.get("kv_connector"), engine.get("model"), job_pattern,
        json.dumps(manifest, default=str), time.time_ns()])


def _derive_requests(con: duckdb.DuckDBPyConnection, sid: str, job_pattern: str | None) -> None:
    """One row per request from its lifecycle events; job/turn parsed from the id when a pattern is given.

    The pattern is a regular expression with named groups `job` and `turn`, e.g.
    `job(?P<job>\\d+)-turn(?P<turn>\\d+)`; groups are passed to DuckDB by index (RE2 syntax).
    """
    job = turn = "NULL"
    if job_pattern:
        groups = _job_pattern_groups(job_pattern)
        pat = _sql_str(job_pattern)
        if "job" in groups:
            job = f"NULLIF(regexp_extract(request_id, '{pat}', {groups['job']}), '')"
        if "turn" in groups:
            turn = f"TRY_CAST(NULLIF(regexp_extract(request_id, '{pat}', {groups['turn']}), '') AS INTEGER)"
    con.execute(f"""
        INSERT INTO requests
        SELECT session, any_value(rank), request_id, {job}, {turn},
            min(ts_ns) FILTER (event = 'arrival'), min(ts_ns) FILTER (event = 'queued'),
            min(ts_ns) FILTER (event = 'scheduled'), min(ts_ns) FILTER (event = 'first_token'),
            max(ts_ns) FILTER (event = 'finished'), any_value(reason) FILTER (event = 'finished'),
            any_value(value) FILTER (event = 'arrival'), max(value) FILTER (event = 'finished'),
            any_value(value) FILTER (event = 'scheduled'),
            count(*) FILTER (event = 'preempted'), count(*) FILTER (event = 'resumed')
        FROM request_events WHERE session = ?
        GROUP BY session, request_id""", [sid])


def _job_pattern_groups(job_pattern: str) -> dict[str, int]:
    """The pattern's named groups; a one-line KvtraceError when it is not a regular expression."""
    import re

    try:
        return dict(re.compile(job_pattern).groupindex)
    except re.error as exc:
        raise KvtraceError(f"--job-pattern {job_pattern!r}: not a regular expression ({exc})") from None


def _probe_report(con: duckdb.DuckDBPyConnection, sid: str) -> list[str]:
    return [f"{probe} ({role} pid {pid}): {status}: {reason}" for pid, role, probe, status, reason in
            con.execute("SELECT pid, role, probe, status, reason FROM probes WHERE session = ? AND "
                        f"status NOT IN {schema.PROBE_FINE_SQL} ORDER BY probe, pid", [sid]).fetchall()]
