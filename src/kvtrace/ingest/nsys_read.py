"""Reading an Nsight Systems SQLite export into Arrow: file checks, table discovery, parallel column reads.

Runs in the `kvtrace ingest` process. DuckDB's `sqlite` extension is downloaded at run time (not possible
offline), so the export is read from Python: with ADBC's SQLite driver (C, Arrow-native: 3x the rows/s
of stdlib `sqlite3` and 4x `sqlite-utils`, see bench/bench_nsys.py), falling back to stdlib `sqlite3`
when ADBC is not installed or fails on a chunk. Large tables are read in rowid ranges by a small thread
pool (ADBC releases the GIL while SQLite decodes rows).

Two ADBC behaviours shape the SQL (both seen on the real exports):
- it infers each column's type from the first batch, so a TEXT column whose first rows are NULL comes
  back as int64 and the first string fails the read; every query therefore starts with one typed
  sentinel row (`SELECT 0, 0.0, X'' UNION ALL ...`) that is sliced off afterwards;
- it hands TEXT over unchecked, and exports hold non-UTF-8 bytes and embedded NULs: text is read as
  BLOB and decoded here (NULs removed, invalid bytes replaced by U+FFFD).
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.errors import KvtraceError

# adbc_driver_sqlite's DB-API module, imported on first read (`_adbc()`): importing it pulls in pandas
# and pyarrow.dataset, ~0.5 s that every ingest paid, nsys export or not. None: not installed (it is
# optional at run time: stdlib sqlite3 reads the same queries, slower).
_NOT_YET = object()
adbc: Any = _NOT_YET


def _adbc() -> Any:
    global adbc
    if adbc is _NOT_YET:
        try:
            import adbc_driver_sqlite.dbapi as module
        except ImportError:
            module = None
        adbc = module
    return adbc

SQLITE_MAGIC = b"SQLite format 3\x00"
INT, REAL, TEXT = "INTEGER", "REAL", "TEXT"
_ARROW = {INT: pa.int64(), REAL: pa.float64(), TEXT: pa.string()}
_CAST = {INT: "INTEGER", REAL: "REAL", TEXT: "BLOB"}
_SENTINEL = {INT: "0", REAL: "0.0", TEXT: "X''"}
CHUNK_ROWS = 1 << 18  # rowids per read task: big enough to amortise a query, small enough to overlap
# Read threads: the CPUs this process may use (its affinity, not the machine's count), at most 4.
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
WORKERS = max(1, min(4, _CPUS))
# Tables whose presence says "this SQLite file was written by nsys export".
NSYS_MARKERS = ("TARGET_INFO_SESSION_START_TIME", "ANALYSIS_DETAILS", "META_DATA_EXPORT",
                "EXPORT_META_DATA", "ThreadNames")


@dataclass
class Export:
    """An opened export: where it is and which tables and columns it has."""

    path: Path
    uri: str
    con: sqlite3.Connection
    tables: dict[str, set[str]] = field(default_factory=dict)
    readers_used: set[str] = field(default_factory=set)

    def has(self, table: str, column: str | None = None) -> bool:
        return table in self.tables and (column is None or column in self.tables[table])

    def fail(self, what: str) -> KvtraceError:
        """A one-line error naming the file."""
        return KvtraceError(f"{self.path}: {' '.join(what.split())}")

    def close(self) -> None:
        self.con.close()


def open_export(path: str | Path) -> Export:
    """Check that `path` is a readable SQLite file written by `nsys export`, and list its tables."""
    path = Path(path)
    if not path.exists():
        raise KvtraceError(f"{path}: no such file")
    if path.is_dir():
        raise KvtraceError(f"{path}: is a directory, expected an Nsight Systems SQLite export")
    size = path.stat().st_size
    if size == 0:
        raise KvtraceError(f"{path}: empty file, expected an Nsight Systems SQLite export")
    with open(path, "rb") as f:
        header = f.read(100)
    if not header.startswith(SQLITE_MAGIC):
        raise KvtraceError(f"{path}: not an SQLite database (a .nsys-rep report must first be converted "
                           f"with `nsys export --type sqlite`)")
    expected = _expected_size(header)
    if len(header) < 100 or (expected and size < expected):
        raise KvtraceError(f"{path}: truncated SQLite file ({size} of {expected or '>= 100'} bytes)")
    # immutable=1: no locks and no journal lookups, so read-only folders and copies being read work.
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro&immutable=1"
    export = Export(path, uri, sqlite3.connect(uri, uri=True))
    try:
        names = [r[0] for r in export.con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for name in names:
            cols = export.con.execute(f"PRAGMA table_info({_q(name)})").fetchall()
            export.tables[name] = {c[1] for c in cols}
    except (sqlite3.DatabaseError, UnicodeDecodeError) as exc:
        # UnicodeDecodeError: sqlite3 cannot decode SQLite's own message when it quotes a non-UTF-8 name
        export.close()
        raise export.fail(f"unreadable SQLite database ({str(exc)[:160]})") from None
    if not export.has("StringIds", "value") or not any(t in export.tables for t in NSYS_MARKERS):
        export.close()
        raise export.fail("an SQLite database but not an Nsight Systems export "
                          "(no StringIds and TARGET_INFO_SESSION_START_TIME tables)")
    return export


def _expected_size(header: bytes) -> int:
    """File size (bytes) the SQLite header promises, or 0 when the header's page count is not valid."""
    if len(header) < 100:
        return 0
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # The in-header page count is valid only when "version-valid-for" equals the change counter.
    if header[92:96] != header[24:28]:
        return 0
    return page_size * pages


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# A column to read: (name, INT|REAL|TEXT), or (name, kind, SQL expression computing it in SQLite).
Column = tuple


def arrow_schema(columns: Sequence[Column]) -> pa.Schema:
    """The Arrow schema `read_table` returns for `columns`."""
    return pa.schema([(c[0], _ARROW[c[1]]) for c in columns])


def select_sql(export: Export, table: str, columns: Sequence[Column], where: str = "") -> str:
    """SELECT of `columns`, each cast to its one type; columns the table lacks read as NULL."""
    have = export.tables[table]
    first = ", ".join(f"{_SENTINEL[c[1]]} AS {_q(c[0])}" for c in columns)
    rest = ", ".join(f"CAST({c[2] if len(c) > 2 else _q(c[0])} AS {_CAST[c[1]]})" if c[0] in have else "NULL"
                     for c in columns)
    return f"SELECT {first} UNION ALL SELECT {rest} FROM {_q(table)}{where}"


def _rowid_ranges(export: Export, table: str, lo: int, hi: int) -> list[tuple[int, int]]:
    """Rowid ranges of about CHUNK_ROWS rows each. nsys numbers rows densely, so fixed-width ranges
    over [lo, hi] do; a file whose rowids are sparse (a row at 2^62 among a few hundred) is walked row
    by row instead, so the number of ranges follows the rows present, not the rowid values."""
    (n,) = export.con.execute(f"SELECT count(*) FROM {_q(table)}").fetchone()
    if hi - lo < 4 * n + CHUNK_ROWS:
        return [(a, min(a + CHUNK_ROWS, hi + 1) - 1) for a in range(lo, hi + 1, CHUNK_ROWS)]
    out, a = [], lo
    while a is not None:
        (b,) = export.con.execute(f"SELECT max(rowid) FROM (SELECT rowid FROM {_q(table)} WHERE rowid >= ? "
                                  f"ORDER BY rowid LIMIT {CHUNK_ROWS})", [a]).fetchone()
        out.append((a, b))
        (a,) = export.con.execute(f"SELECT min(rowid) FROM {_q(table)} WHERE rowid > ?", [b]).fetchone()
    return out


def read_table(export: Export, table: str, columns: Sequence[Column]) -> Iterator[pa.Table]:
    """The table's rows as Arrow tables (one per rowid range, read in parallel), typed as `columns` says."""
    try:
        lo, hi = export.con.execute(f"SELECT min(rowid), max(rowid) FROM {_q(table)}").fetchone()
    except sqlite3.DatabaseError as exc:
        raise export.fail(f"cannot read {table} ({exc})") from None
    if lo is None:
        return
    ranges = _rowid_ranges(export, table, lo, hi)
    queries = [select_sql(export, table, columns, f" WHERE rowid BETWEEN {a} AND {b}") for a, b in ranges]
    if len(queries) == 1:
        yield _read(export, table, queries[0], columns)
        return
    with ThreadPoolExecutor(WORKERS) as pool:
        pending: deque = deque()
        for sql in queries:
            pending.append(pool.submit(_read, export, table, sql, columns))
            if len(pending) > WORKERS:  # bounded read-ahead: memory stays at a few chunks
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def read_all(export: Export, table: str, columns: Sequence[Column]) -> pa.Table:
    """A small table in one piece (metadata, strings, threads)."""
    return pa.concat_tables([arrow_schema(columns).empty_table(), *read_table(export, table, columns)])


def _read(export: Export, table: str, sql: str, columns: Sequence[Column]) -> pa.Table:
    """One query's rows (runs on a pool thread, with a connection of its own)."""
    raw = None
    if _adbc() is not None:
        try:
            raw = _read_adbc(export.uri, sql)
            export.readers_used.add("adbc")
        except Exception:  # any driver trouble: the stdlib path reads it or names the real error
            raw = None
    if raw is None:
        try:
            raw = _read_sqlite3(export.uri, sql, columns)
            export.readers_used.add("sqlite3")
        except sqlite3.DatabaseError as exc:
            raise export.fail(f"cannot read {table} ({exc})") from None
    raw = raw.slice(1)  # the typed sentinel row
    arrays = [_text(raw.column(i)) if c[1] == TEXT else raw.column(i).cast(_ARROW[c[1]])
              for i, c in enumerate(columns)]
    return pa.table(arrays, names=[c[0] for c in columns])


def _read_adbc(uri: str, sql: str) -> pa.Table:
    with _adbc().connect(uri, autocommit=True) as con, con.cursor() as cur:
        cur.execute(sql)
        return cur.fetch_arrow_table()


def _read_sqlite3(uri: str, sql: str, columns: Sequence[Column]) -> pa.Table:
    con = sqlite3.connect(uri, uri=True)
    con.text_factory = bytes
    try:
        cur = con.execute(sql)
        schema = pa.schema([(c[0], pa.binary() if c[1] == TEXT else _ARROW[c[1]]) for c in columns])
        batches = []
        while found := cur.fetchmany(65536):
            values = zip(*found, strict=True)  # row tuples -> column tuples
            batches.append(pa.record_batch([pa.array(v, t) for v, t in zip(values, schema.types, strict=True)],
                                           schema=schema))
        return pa.Table.from_batches(batches, schema)
    finally:
        con.close()


def _text(arr: pa.ChunkedArray) -> pa.ChunkedArray:
    """SQLite TEXT read as bytes -> UTF-8 strings, NULs removed, invalid bytes replaced (U+FFFD)."""
    arr = pc.replace_substring(arr, b"\x00", b"")
    try:
        return arr.cast(pa.string())  # validates UTF-8 in C++; the Python loop is only for bad bytes
    except pa.ArrowInvalid:
        return pa.chunked_array([pa.array([None if b is None else b.decode("utf-8", "replace")
                                           for b in arr.to_pylist()], pa.string())])


def read_strings(export: Export) -> pa.Table:
    """StringIds (id, value) with environment blocks (NUL-separated NAME=value pairs: a profiled
    process's environment, which nsys captures) replaced by NULL, so no name can resolve to one."""
    env = "instr(CAST(value AS BLOB), X'00') > 0 AND value GLOB '[A-Za-z_]*=*'"
    return read_all(export, "StringIds", [("id", INT), ("value", TEXT, f"CASE WHEN {env} THEN NULL ELSE value END")])


def versions(export: Export) -> tuple[str | None, str | None]:
    """(nsys version, export schema version); both None for 2021 exports, which carry no metadata table."""
    table = next((t for t in ("META_DATA_EXPORT", "EXPORT_META_DATA") if export.has(t, "value")), None)
    if table is None:
        return None, None
    meta = dict(rows(export, f"SELECT name, value FROM {table} "
                             "WHERE name IN ('EXPORT_PRODUCT_VERSION', 'EXPORT_SCHEMA_VERSION')"))
    return meta.get("EXPORT_PRODUCT_VERSION"), meta.get("EXPORT_SCHEMA_VERSION")


def session_start(export: Export) -> tuple[int | None, int | None]:
    """(utcEpochNs, systemClockNs): UTC (ns) at nsys time systemClockNs (a column since 2026; 0 before)."""
    table = "TARGET_INFO_SESSION_START_TIME"
    if not export.has(table, "utcEpochNs"):
        return None, None
    clock = "CAST(systemClockNs AS INTEGER)" if export.has(table, "systemClockNs") else "NULL"
    found = rows(export, f"SELECT CAST(utcEpochNs AS INTEGER), {clock} FROM {table} LIMIT 1")
    return found[0] if found else (None, None)


def mem_kind_names(export: Export) -> dict[int, str]:
    """nsys's memory-kind labels (ENUM_CUDA_MEM_KIND) when the export has them."""
    if not export.has("ENUM_CUDA_MEM_KIND", "label"):
        return {}
    return dict(rows(export, "SELECT CAST(id AS INTEGER), label FROM ENUM_CUDA_MEM_KIND"))


def rows(export: Export, sql: str) -> list[tuple]:
    """A small metadata query through stdlib sqlite3 (text decoded with replacement)."""
    export.con.text_factory = lambda b: b.replace(b"\x00", b"").decode("utf-8", "replace")
    try:
        return export.con.execute(sql).fetchall()
    except sqlite3.DatabaseError as exc:
        raise export.fail(f"cannot read ({exc})") from None
