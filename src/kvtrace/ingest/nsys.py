"""Nsight Systems SQLite exports into the kvtrace database: the `nsys_*` tables.

Runs in the `kvtrace ingest` process. `load_nsys` reads one export (nsys 2021.3 to 2026.2) with
`nsys_read`, resolves names through `StringIds` and decodes ids (copy kinds, pids and tids from
`globalTid = (vm << 48) | (pid << 24) | tid`, NVTX event types and domains) in DuckDB, and tags every row
with the export's file name and our session id. `align_nsys` (in `nsys_align`) puts it on our clock.

Times: `start_ns`/`end_ns` are the export's own (ns on nsys's clock); `t_start_ns`/`t_end_ns` are ours
(host CLOCK_MONOTONIC ns), NULL while the export is not aligned. Nothing from the profiled process's
environment is copied (`META_DATA_CAPTURE`, `TARGET_INFO_SYSTEM_ENV` are never read; `StringIds` values
that look like an environment block are dropped before names are resolved).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.ingest.nsys_align import align_nsys, mark_offset, utc_offset
from kvtrace.ingest.nsys_read import (
    INT,
    REAL,
    TEXT,
    Export,
    arrow_schema,
    mem_kind_names,
    open_export,
    read_strings,
    read_table,
    session_start,
    versions,
)
from kvtrace.store.nsys_tables import TABLES, TIMED_TABLES, create_nsys_tables

__all__ = ["load_nsys", "align_nsys"]



# CUPTI's memcpy kinds (stable across versions); memory kinds as nsys numbers them (the export's own
# ENUM_CUDA_MEM_KIND overrides these when it has that table).
COPY_KINDS = {0: "Unknown", 1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA",
              8: "DtoD", 9: "HtoH", 10: "PtoP", 11: "UVM HtoD", 12: "UVM DtoH", 13: "UVM DtoD"}
MEM_KINDS = {0: "Pageable", 1: "Pinned", 2: "Device", 3: "Array", 4: "Managed", 5: "Device Static",
             6: "Managed Static", 7: "Unknown"}

_T = 'r.start, r."end", r."end" - r.start, r.start + $offset, r."end" + $offset'
_PID = "(r.{0} >> 24) & 16777215"
_DEV = f"r.deviceId, r.streamId, r.correlationId, r.globalPid, {_PID.format('globalPid')}"
_L = "l.name, l.tid, l.start_ns, l.start_ns + $offset"
_LJOIN = "LEFT JOIN _nsys_launch l ON l.correlation_id = r.correlationId AND l.global_pid = r.globalPid"
_S = "LEFT JOIN _nsys_strings {0} ON {0}.id = r.{1}"
PART_ROWS = 1 << 21  # rows inserted into DuckDB at a time


@dataclass(frozen=True)
class Source:
    """One export table: what to read from it, and the SELECT that makes our rows of it (reading the
    export's rows as `_nsys_src r`, or NVTX's as `_nsys_nvtx r`)."""

    table: str
    target: str
    columns: tuple[tuple[str, str], ...]
    required: tuple[str, ...]
    select: str


def _ints(*names: str) -> tuple[tuple[str, str], ...]:
    return tuple((n, INT) for n in names)


_GPU_OP = ("start", "end", "deviceId", "streamId", "correlationId", "globalPid")
SOURCES = (
    # NVTX first: its marks give the offset the other timed tables are written with.
    Source("NVTX_EVENTS", "nsys_nvtx",
           (*_ints("start", "end", "eventType", "textId", "domainId", "category", "globalTid", "int64Value",
                   "int32Value", "uint32Value", "uint64Value"), ("text", TEXT), ("doubleValue", REAL),
            ("floatValue", REAL)),
           ("start", "eventType"), f"""
        SELECT $session, $file, {_T}, r.eventType,
               CASE r.eventType WHEN 34 THEN 'mark' WHEN 59 THEN 'push_pop' WHEN 60 THEN 'start_end'
                   WHEN 75 THEN 'domain_create' WHEN 76 THEN 'domain_destroy' WHEN 33 THEN 'category'
                   WHEN 39 THEN 'thread_name' ELSE concat('type ', r.eventType) END,
               r.label, r.domainId, coalesce(d.name, da.name), r.category, r.globalTid,
               {_PID.format('globalTid')}, r.globalTid & 16777215,
               coalesce(r.int64Value, r.int32Value, r.uint32Value),
               CAST(CASE WHEN r.uint64Value < 0 THEN CAST(r.uint64Value AS HUGEINT) + 18446744073709551616
                    ELSE r.uint64Value END AS UBIGINT),
               coalesce(r.doubleValue, r.floatValue)
        FROM _nsys_nvtx r
        LEFT JOIN _nsys_domains d ON d.domainId = r.domainId AND d.gpid = r.globalTid >> 24
        LEFT JOIN (SELECT domainId, any_value(name) AS name FROM _nsys_domains GROUP BY ALL) da
            ON da.domainId = r.domainId"""),
    # Runtime before the GPU ops: they take the launching call's name, thread and time from it.
    Source("CUPTI_ACTIVITY_KIND_RUNTIME", "nsys_runtime",
           _ints("start", "end", "eventClass", "globalTid", "correlationId", "nameId", "returnValue"),
           ("start", "end"), f"""
        SELECT $session, $file, {_T}, r.globalTid, {_PID.format('globalTid')}, r.globalTid & 16777215,
               r.correlationId, s.value, r.eventClass, r.returnValue
        FROM _nsys_src r {_S.format('s', 'nameId')}"""),
    Source("CUPTI_ACTIVITY_KIND_KERNEL", "nsys_kernels",
           _ints(*_GPU_OP, "contextId", "shortName", "demangledName", "mangledName", "gridX", "gridY", "gridZ",
                 "blockX", "blockY", "blockZ", "registersPerThread", "staticSharedMemory",
                 "dynamicSharedMemory", "graphNodeId"),
           ("start", "end"), f"""
        SELECT $session, $file, {_T}, {_DEV}, r.contextId, coalesce(sn.value, dn.value, mn.value),
               coalesce(dn.value, mn.value, sn.value), r.gridX, r.gridY, r.gridZ, r.blockX, r.blockY, r.blockZ,
               r.registersPerThread, r.staticSharedMemory, r.dynamicSharedMemory, r.graphNodeId, {_L}
        FROM _nsys_src r {_S.format('sn', 'shortName')} {_S.format('dn', 'demangledName')}
        {_S.format('mn', 'mangledName')} {_LJOIN}"""),
    Source("CUPTI_ACTIVITY_KIND_MEMCPY", "nsys_memcpy",
           _ints(*_GPU_OP, "bytes", "copyKind", "srcKind", "dstKind"), ("start", "end"), f"""
        SELECT $session, $file, {_T}, {_DEV}, r.bytes, coalesce(ck.name, concat('kind ', r.copyKind)),
               coalesce(sk.name, concat('kind ', r.srcKind)), coalesce(dk.name, concat('kind ', r.dstKind)), {_L}
        FROM _nsys_src r LEFT JOIN _nsys_copy_kinds ck ON ck.id = r.copyKind
        LEFT JOIN _nsys_mem_kinds sk ON sk.id = r.srcKind LEFT JOIN _nsys_mem_kinds dk ON dk.id = r.dstKind
        {_LJOIN}"""),
    Source("CUPTI_ACTIVITY_KIND_MEMSET", "nsys_memset",
           _ints(*_GPU_OP, "bytes", "value", "memKind"), ("start", "end"), f"""
        SELECT $session, $file, {_T}, {_DEV}, r.bytes, r.value, coalesce(mk.name, concat('kind ', r.memKind)), {_L}
        FROM _nsys_src r LEFT JOIN _nsys_mem_kinds mk ON mk.id = r.memKind {_LJOIN}"""),
    Source("ThreadNames", "nsys_threads", _ints("globalTid", "nameId", "priority"), ("globalTid",), f"""
        SELECT $session, $file, r.globalTid, {_PID.format('globalTid')}, r.globalTid & 16777215, s.value,
               r.priority
        FROM _nsys_src r {_S.format('s', 'nameId')}"""),
    Source("PROCESSES", "nsys_processes", (*_ints("globalPid", "pid"), ("name", TEXT)), ("globalPid",), f"""
        SELECT $session, $file, r.globalPid, coalesce(r.pid, {_PID.format('globalPid')}), r.name
        FROM _nsys_src r"""),
    Source("TARGET_INFO_GPU", "nsys_gpus",
           (*_ints("id", "cuDevice", "totalMemory", "memoryBandwidth", "clockRate", "smCount", "computeMajor",
                   "computeMinor"), ("name", TEXT), ("chipName", TEXT), ("busLocation", TEXT), ("uuid", TEXT)),
           ("id",), """
        SELECT $session, $file, r.id, r.cuDevice, trim(r.name), r.chipName, r.busLocation, r.uuid, r.totalMemory,
               r.memoryBandwidth, r.clockRate, r.smCount, concat(r.computeMajor, '.', r.computeMinor)
        FROM _nsys_src r"""),
)


def load_nsys(con: duckdb.DuckDBPyConnection, path: str | Path, session: str | None = None) -> dict:
    """Load one Nsight Systems SQLite export into the `nsys_*` tables of `con` (created when missing).

    Rows are tagged with `nsys_file` (the file's name) and `session` (NULL when the export is loaded on
    its own); loading the same file for the same session again replaces its rows. The export is aligned
    to our clock when it holds our NVTX marks, or when `session`'s `sessions` row is already loaded.
    Returns {nsys_file, session, nsys_version, schema_version, rows: {table: n}, alignment, offset_ns,
    reader, seconds}. Raises KvtraceError (one line, naming the file) for input it cannot use.
    """
    started = time.perf_counter()
    export = open_export(path)
    try:
        sources = _usable_sources(export)
        create_nsys_tables(con)
        for dedup in (False, True):
            con.begin()
            try:
                stats = _load(con, export, sources, session, dedup)
                con.commit()
                break
            except _DuplicateLaunches:  # rare: load again, matching each GPU op to one runtime call
                con.rollback()
            except (duckdb.OutOfRangeException, duckdb.ConversionException) as exc:
                # Timestamps near the ends of int64 (nsys writes nanoseconds since its session start)
                con.rollback()
                raise export.fail(f"values out of range for kvtrace's clock ({str(exc).splitlines()[0][:120]}); "
                                  "not an export nsys wrote") from None
            except BaseException:
                con.rollback()
                raise
    finally:
        export.close()
    return {**stats, "seconds": round(time.perf_counter() - started, 3)}




class _DuplicateLaunches(Exception):
    """A GPU op matched several CUDA runtime calls (one correlation id used twice in a process)."""


def _load(con: duckdb.DuckDBPyConnection, export: Export, sources: list[Source], session: str | None,
          dedup: bool) -> dict:
    key = {"session": session, "file": export.path.name}
    version, schema_version = versions(export)
    utc_epoch_ns, system_clock_ns = session_start(export)
    for table in TABLES:
        con.execute(f"DELETE FROM {table} WHERE nsys_file = $file AND session IS NOT DISTINCT FROM $session", key)
    _load_lookups(con, export)
    # Without NVTX only the UTC session starts can align the export; with NVTX, our marks may.
    alignment = _alignment(con, None, session, utc_epoch_ns, system_clock_ns)
    _build_launches(con, key, dedup)  # empty until the runtime calls are in; the GPU ops join it anyway
    counts, starts, ends = {}, [], []
    for src in sources:
        counts[src.target] = 0
        if src.target == "nsys_nvtx":  # read twice (domains, marks): gathered in a temp table first
            _create_temp(con, "_nsys_raw", arrow_schema(src.columns).empty_table())
        for part in _parts(export, src):
            counts[src.target] += part.num_rows
            if src.target in TIMED_TABLES and part.num_rows:
                starts.append(pc.min(part["start"]).as_py())
                ends.append(pc.max(pc.coalesce(part["end"], part["start"])).as_py())
            con.register("_nsys_src", part)
            if src.target == "nsys_nvtx":
                con.execute("INSERT INTO _nsys_raw SELECT * FROM _nsys_src")
            elif _insert(con, src, key, alignment[1]) != part.num_rows:
                raise _DuplicateLaunches
            con.unregister("_nsys_src")
        if src.target == "nsys_nvtx":
            _prepare_nvtx(con)
            alignment = _alignment(con, "(SELECT label, start AS start_ns FROM _nsys_nvtx)", session,
                                   utc_epoch_ns, system_clock_ns)
            _insert(con, src, key, alignment[1])
        if src.target == "nsys_runtime":
            _build_launches(con, key, dedup)
    reader = "+".join(sorted(export.readers_used)) or "none"
    con.execute("INSERT INTO nsys_exports VALUES ($session, $file, $path, $version, $schema, $utc, $sys, "
                "$start, $end, $method, $offset, $marks, $spread, $reader)",
                {**key, "path": str(export.path), "version": version, "schema": schema_version,
                 "utc": utc_epoch_ns, "sys": system_clock_ns, "start": min(starts, default=None),
                 "end": max(ends, default=None), "method": alignment[0], "offset": alignment[1],
                 "marks": alignment[2], "spread": alignment[3], "reader": reader})
    con.execute("DROP VIEW IF EXISTS _nsys_nvtx")
    for temp in ("_nsys_raw", "_nsys_domains", "_nsys_launch", "_nsys_strings", "_nsys_copy_kinds",
                 "_nsys_mem_kinds"):
        con.execute(f"DROP TABLE IF EXISTS {temp}")
    return {"nsys_file": key["file"], "session": session, "nsys_version": version,
            "schema_version": schema_version, "rows": counts, "alignment": alignment[0],
            "offset_ns": alignment[1], "reader": reader}


def _parts(export: Export, src: Source) -> Iterator[pa.Table]:
    """`src.table` in Arrow tables of up to PART_ROWS rows. DuckDB inserts from one registered table in
    ~60% of the CPU it needs to scan the same rows as a Python-fed stream or to stage them chunk by chunk;
    parts bound the memory (about 8 bytes x columns x PART_ROWS)."""
    pending, rows = [], 0
    for chunk in read_table(export, src.table, src.columns):
        pending.append(chunk)
        rows += chunk.num_rows
        if rows >= PART_ROWS:
            yield pa.concat_tables(pending)
            pending, rows = [], 0
    if pending:
        yield pa.concat_tables(pending)


def _insert(con: duckdb.DuckDBPyConnection, src: Source, key: dict, offset_ns: int | None) -> int:
    """Insert the rows of `src` (registered as `_nsys_src` or `_nsys_nvtx`); returns how many."""
    params = {**key, "offset": offset_ns}
    return con.execute(f"INSERT INTO {src.target} {src.select}",
                       {k: v for k, v in params.items() if f"${k}" in src.select}).fetchone()[0]


def _usable_sources(export: Export) -> list[Source]:
    """The sources present in the export; a one-line error when none is, or one lacks a core column."""
    present = [src for src in SOURCES if export.has(src.table)]
    for src in present:
        missing = [c for c in src.required if not export.has(src.table, c)]
        if missing:
            raise export.fail(f"table {src.table} has no column {missing[0]} (not a table nsys writes)")
    if not present:
        raise export.fail("an Nsight Systems export with nothing kvtrace can load (no kernel, memcpy, memset, "
                          "CUDA runtime, NVTX, thread, process or GPU table)")
    return present


def _load_lookups(con: duckdb.DuckDBPyConnection, export: Export) -> None:
    """Temp tables the inserts join: the export's strings and the kind names."""
    mem_kinds = {**MEM_KINDS, **mem_kind_names(export)}
    for name, table in (("_nsys_strings", read_strings(export)), ("_nsys_copy_kinds", _kinds(COPY_KINDS)),
                        ("_nsys_mem_kinds", _kinds(mem_kinds))):
        _create_temp(con, name, table)


def _kinds(names: dict[int, str]) -> pa.Table:
    return pa.table({"id": pa.array(list(names), pa.int64()), "name": pa.array(list(names.values()), pa.string())})


def _create_temp(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> None:
    con.register("_nsys_arrow", table)
    con.execute(f"CREATE OR REPLACE TEMP TABLE {name} AS SELECT * FROM _nsys_arrow")
    con.unregister("_nsys_arrow")


def _prepare_nvtx(con: duckdb.DuckDBPyConnection) -> None:
    """Staged NVTX rows with their label, and the domain names (from domain-create events, per process)."""
    con.execute("CREATE OR REPLACE TEMP VIEW _nsys_nvtx AS SELECT r.*, coalesce(r.text, s.value) AS label "
                "FROM _nsys_raw r LEFT JOIN _nsys_strings s ON s.id = r.textId")
    con.execute("CREATE OR REPLACE TEMP TABLE _nsys_domains AS SELECT domainId, globalTid >> 24 AS gpid, "
                "any_value(label) AS name FROM _nsys_nvtx WHERE eventType = 75 GROUP BY ALL")


def _alignment(con: duckdb.DuckDBPyConnection, marks_from: str | None, session: str | None,
               utc_epoch_ns: int | None, system_clock_ns: int | None) -> tuple[str, int | None, int, int | None]:
    """(method, offset_ns, marks, spread_ns): our NVTX marks in `marks_from` first, else the UTC starts."""
    marks = mark_offset(con, marks_from, {}) if marks_from else None
    if marks:
        return ("nvtx-mark", *marks)
    offset = utc_offset(con, session, utc_epoch_ns, system_clock_ns)
    return ("utc-approx" if offset is not None else "none", offset, 0, None)


def _build_launches(con: duckdb.DuckDBPyConnection, key: dict, dedup: bool) -> None:
    """The CUDA runtime calls of this export by (correlationId, globalPid), for the GPU ops to join.

    nsys writes a second row for a call whose backtrace it took (event classes 67-69, "CUDA backtrace"):
    those are left out. Otherwise a correlation id is one call per process, so no GROUP BY (a third of
    the CPU of loading the runtime calls) unless a load found a GPU op matching two calls (`dedup`)."""
    calls = """
        SELECT correlation_id, (global_tid >> 24) << 24 AS global_pid, name, tid, start_ns FROM nsys_runtime
        WHERE nsys_file = $file AND session IS NOT DISTINCT FROM $session AND correlation_id <> 0
            AND coalesce(event_class, 0) NOT IN (67, 68, 69)"""
    if dedup:
        calls = f"""SELECT correlation_id, global_pid, arg_min(name, start_ns) AS name, arg_min(tid, start_ns) AS tid,
                   min(start_ns) AS start_ns FROM ({calls}) GROUP BY ALL"""
    con.execute(f"CREATE OR REPLACE TEMP TABLE _nsys_launch AS {calls}", key)
