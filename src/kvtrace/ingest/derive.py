"""What ingest derives from a session besides its shard rows: `requests`, `sessions`, `procs`, `probes`."""

from __future__ import annotations

import functools
import json
import time

import duckdb

from kvtrace.errors import KvtraceError
from kvtrace.format import schema
from kvtrace.format.session import shown
from kvtrace.store.keyed import insert_rows
from kvtrace.store.tables import sql_str


def insert_proc(con: duckdb.DuckDBPyConnection, sid: str, proc: dict) -> None:
    pid, role = int(proc.get("pid", 0) or 0), str(proc.get("role", "proc"))
    con.execute("INSERT INTO procs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", [
        sid, pid, int(proc.get("rank", 0) or 0), role, proc.get("host"), proc.get("status"),
        json.dumps(proc.get("rows_written", {})), json.dumps(proc.get("dropped", {})),
        proc.get("stopped_reason")])
    insert_rows(con, "probes", [(sid, pid, role, name, st.get("status"), st.get("reason", ""))
                                for name, st in (proc.get("probes") or {}).items() if isinstance(st, dict)])


def insert_session(con, sid, session_dir, manifest, engine, status, job_pattern) -> None:
    """The session's row; `engine` is its engine configuration (format.session.engine_config),
    `job_pattern` as ingest_session resolved it (the user's, else the manifest's), `sid` as it made it
    printable (`shown`). Values of another type than the column's (a hand-edited manifest) are stored
    as null rather than refused."""
    clock = manifest.get("clock", {})
    command = manifest.get("command")

    def num(v):
        return v if isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 63 else None

    def text(v):
        return shown(v) if isinstance(v, str) else None

    def flag(v):
        return v if isinstance(v, bool) else None

    con.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [
        sid, shown(str(session_dir.resolve())), status, num(manifest.get("schema_version")),
        text(manifest.get("kvtrace_version")), text(manifest.get("vllm_version")),
        shown(" ".join(map(str, command))) if isinstance(command, list) else text(command),
        num(clock.get("start_utc_ns")), num(clock.get("start_monotonic_ns")), num(clock.get("end_monotonic_ns")),
        num(manifest.get("exit_code")), num(engine.get("block_size")), num(engine.get("num_kv_blocks")),
        num(engine.get("max_num_seqs")), num(engine.get("max_num_batched_tokens")),
        flag(engine.get("enable_prefix_caching")), flag(engine.get("enable_chunked_prefill")),
        text(engine.get("kv_connector")), text(engine.get("model")), job_pattern,
        json.dumps(manifest, default=str), time.time_ns()])


def derive_requests(con: duckdb.DuckDBPyConnection, sid: str, job_pattern: str | None) -> None:
    """One row per request from its lifecycle events; job/turn parsed from the id when a pattern is given.

    The pattern is a regular expression with named groups `job` and `turn`, e.g.
    `job(?P<job>\\d+)-turn(?P<turn>\\d+)`; groups are passed to DuckDB by index (RE2 syntax).
    """
    job = turn = "NULL"
    if job_pattern:
        groups = job_pattern_groups(job_pattern)
        pat = sql_str(job_pattern)
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
            -- token counts: a value no INTEGER holds (a damaged shard) is unknown, not an error
            TRY_CAST(any_value(value) FILTER (event = 'arrival') AS INTEGER),
            TRY_CAST(max(value) FILTER (event = 'finished') AS INTEGER),
            TRY_CAST(any_value(value) FILTER (event = 'scheduled') AS INTEGER),
            count(*) FILTER (event = 'preempted'), count(*) FILTER (event = 'resumed')
        FROM request_events WHERE session = ?
        GROUP BY session, request_id""", [sid])


def job_pattern_groups(job_pattern: str) -> dict[str, int]:
    """The pattern's named groups; a one-line KvtraceError when it is not a regular expression, or one
    that DuckDB's engine (RE2: no lookarounds, no backreferences), which applies it, refuses."""
    if not isinstance(job_pattern, str):
        raise KvtraceError(f"job pattern {job_pattern!r}: not a string")
    return dict(_checked_groups(job_pattern))


@functools.lru_cache(maxsize=32)  # asked before the database opens, per session, and when requests are derived
def _checked_groups(job_pattern: str) -> tuple[tuple[str, int], ...]:
    import re

    from kvtrace.store.db import connect

    try:
        groups = tuple(re.compile(job_pattern).groupindex.items())
    except re.error as exc:
        raise KvtraceError(f"--job-pattern {job_pattern!r}: not a regular expression ({exc})") from None
    con = connect()
    try:
        con.execute("SELECT regexp_matches('', $p)", {"p": job_pattern})
    except duckdb.Error as exc:
        why = str(exc).splitlines()[0].removeprefix("Invalid Input Error: ")
        raise KvtraceError(f"--job-pattern {job_pattern!r}: DuckDB's regular expressions (RE2) refuse it "
                           f"({why})") from None
    finally:
        con.close()
    return groups


def probe_report(con: duckdb.DuckDBPyConnection, sid: str) -> list[str]:
    return [f"{probe} ({role} pid {pid}): {status}: {reason}" for pid, role, probe, status, reason in
            con.execute("SELECT pid, role, probe, status, reason FROM probes WHERE session = ? AND "
                        f"status NOT IN {schema.PROBE_FINE_SQL} ORDER BY probe, pid", [sid]).fetchall()]
