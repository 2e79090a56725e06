"""Opening a kvtrace database: only files kvtrace wrote, with one-line errors for anything else."""

from __future__ import annotations

from pathlib import Path

import duckdb

from kvtrace.errors import KvtraceError

# No connection of ours downloads or loads an extension behind the user's back: what kvtrace needs (json,
# parquet) is built into DuckDB's Python package, and a file it reads must never make it go online.
NO_NETWORK = {"autoinstall_known_extensions": False, "autoload_known_extensions": False}


def connect(path: str = ":memory:", read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """duckdb.connect with NO_NETWORK."""
    return duckdb.connect(path, read_only=read_only, config=dict(NO_NETWORK))


OLD_KVTRACE_TABLES = frozenset({"sessions", "procs", "steps", "request_events", "block_events"})


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
        con = connect(str(path), read_only=read_only)
    except duckdb.Error as exc:
        first = str(exc).splitlines()[0]
        if "Could not set lock on file" in first:  # DuckDB: one process may write a file at a time
            holder = first.split("Conflicting lock is held in", 1)[-1].strip() if "held in" in first else ""
            raise KvtraceError(f"{path}: in use by another process (DuckDB lets one process open a database "
                               f"for writing{'; held by ' + holder[:80] if holder else ''}): wait for it or "
                               "close it") from None
        raise KvtraceError(f"{path}: not a DuckDB database ({first[:120]})") from None
    if read_only or existed:
        tables = {r[0] for r in con.execute("select table_name from information_schema.tables").fetchall()}
        # Ours: kvtrace's marker table, or the core tables of a kvtrace database from before it (a table
        # called `sessions` alone is another tool's; so is an `nsys_` name without nsys_exports).
        ours = ("kvtrace_meta" in tables or OLD_KVTRACE_TABLES <= tables
                or ("nsys_exports" in tables and all(t.startswith("nsys_") for t in tables)))
        if not ours and (read_only or tables):
            con.close()
            what = "refusing to add kvtrace tables to it" if not read_only else "no kvtrace tables"
            raise KvtraceError(f"{path}: a DuckDB database, but not one kvtrace wrote ({what})")
    return con
