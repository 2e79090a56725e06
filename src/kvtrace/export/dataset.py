"""Many sessions as one Parquet dataset, for DuckDB here and distributed engines (Spark) elsewhere.

    DIR/_kvtrace_dataset.json                      schema_version, tables and their columns, sessions
    DIR/table=<table>/session=<id>/part-0.parquet  one folder per table and session (zstd)

`export_parquet` writes it from kvtrace DuckDB files and/or session directories (ingested first, into a
scratch database); exporting a session that is already in the dataset replaces it, other sessions stay.
`open_dataset` returns a DuckDB connection with one view per table over the Parquet files, with
`session` as a column, so every canned query runs unchanged over all sessions at once. docs/dataset.md
describes the layout; the columns are those of the DuckDB tables (docs/schema.md).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb

from kvtrace.errors import KvtraceError
from kvtrace.format import schema
from kvtrace.format.session import read_small_file
from kvtrace.version import __version__

META = "_kvtrace_dataset.json"
FORMAT = "kvtrace-dataset"
# The partition that rows without a session (an Nsight export loaded on its own) land in; readers
# (DuckDB, Spark, Hive) read it back as NULL.
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"


def export_parquet(sources: list[str], out_dir: str | Path, progress: bool = False) -> dict[str, int]:
    """Write the sessions of `sources` (kvtrace DuckDB files or session directories) into the dataset at
    `out_dir` (created, or updated: their sessions are replaced, other sessions are kept).

    Returns {"sessions": sessions written, "files": Parquet files in the dataset, "bytes": their size}.
    """
    if not sources:
        raise KvtraceError("nothing to export: give DuckDB files and/or session directories")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise KvtraceError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / META).exists():
        raise KvtraceError(f"{out}: a directory that is not a kvtrace dataset (no {META}); "
                           "choose an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)
    meta = _read_meta(out) if (out / META).exists() else _new_meta()
    dbs = [Path(s) for s in sources if not Path(s).is_dir()]
    session_dirs = [Path(s) for s in sources if Path(s).is_dir()]
    written = 0
    with tempfile.TemporaryDirectory(prefix=".kvtrace-export-", dir=out) as scratch:
        if session_dirs:
            from kvtrace.ingest import ingest

            db = Path(scratch) / "sessions.duckdb"
            ingest([str(s) for s in session_dirs], db, progress=progress)
            dbs.append(db)
        for db in dbs:
            written += _export_db(db, out, Path(scratch), meta, from_dirs=db.parent == Path(scratch))
    meta["updated_utc_ns"] = time.time_ns()
    _write_meta(out, meta)
    files = list(out.glob("table=*/*/*.parquet"))
    return {"sessions": written, "files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def _export_db(db: Path, out: Path, scratch: Path, meta: dict[str, Any], from_dirs: bool) -> int:
    """Export every session of one database into the dataset; returns how many."""
    from kvtrace.store.db import open_db

    label = "the session directories" if from_dirs else str(db)
    con = open_db(db, read_only=True)
    try:
        tables = _session_tables(con)
        sessions = con.execute("SELECT session, session_dir FROM sessions ORDER BY session").fetchall() \
            if "sessions" in tables else []
        staging = scratch / f"stage-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        for table, columns in tables.items():
            meta["tables"].setdefault(table, {})["columns"] = _merge_columns(
                meta["tables"].get(table, {}).get("columns", []), columns)
            # One pass per table; DuckDB escapes the session id into the folder name (a%2Fb for a/b).
            con.execute(f"""COPY (SELECT * FROM {table}) TO '{_sql_path(staging / f"table={table}")}'
                (FORMAT parquet, COMPRESSION zstd, PARTITION_BY (session), FILENAME_PATTERN 'part-{{i}}',
                 OVERWRITE_OR_IGNORE)""")
    except duckdb.Error as exc:
        raise KvtraceError(f"{label}: export failed ({str(exc).splitlines()[0][:200]})") from None
    finally:
        con.close()
    # Replace each exported session's folders in every table (also tables it no longer has rows in),
    # then move the new ones in: a rename per folder, so readers never see half a session.
    names = {p.name for p in staging.glob("table=*/session=*")}
    for old in out.glob("table=*/session=*"):
        if old.name in names:
            shutil.rmtree(old)
    for new in sorted(staging.glob("table=*/session=*")):
        dest = out / new.parent.name / new.name
        dest.parent.mkdir(exist_ok=True)
        new.rename(dest)
    for sid, session_dir in sessions:
        meta["sessions"][sid] = {"source": session_dir if from_dirs else str(db.resolve()),
                                 "exported_utc_ns": time.time_ns()}
    return len(sessions)


def _session_tables(con: duckdb.DuckDBPyConnection) -> dict[str, list[list[str]]]:
    """The database's tables that have a `session` column, with their columns ([name, type]). Views
    (the Nsight ones derived from tables) are not exported: `open_dataset` makes them again; the views
    of the keyed tables (`kvtrace.store.tables.KEYED_TABLES`) are, as they are how those tables are read."""
    from kvtrace.store.tables import KEYED_TABLES

    rows = con.execute("""SELECT c.table_name, c.column_name, c.data_type FROM information_schema.columns c
        JOIN information_schema.tables t USING (table_catalog, table_schema, table_name)
        WHERE c.table_schema = 'main' AND (t.table_type = 'BASE TABLE' OR list_contains(?::VARCHAR[], c.table_name))
        ORDER BY c.table_name, c.ordinal_position""", [list(KEYED_TABLES)]).fetchall()
    tables: dict[str, list[list[str]]] = {}
    for table, column, type_ in rows:
        tables.setdefault(table, []).append([column, type_])
    return {t: cols for t, cols in tables.items() if any(c[0] == "session" for c in cols)}


def _merge_columns(old: list[list[str]], new: list[list[str]]) -> list[list[str]]:
    """The union of two column lists (older exports may lack trailing columns), order kept."""
    have = {c[0] for c in old}
    return [*old, *(c for c in new if c[0] not in have)] if old else new


def _new_meta() -> dict[str, Any]:
    return {"format": FORMAT, "schema_version": schema.SCHEMA_VERSION, "kvtrace_version": __version__,
            "layout": "table=<table>/session=<session>/part-<n>.parquet", "compression": "zstd",
            "created_utc_ns": time.time_ns(), "tables": _default_tables(), "sessions": {}}


def _default_tables() -> dict[str, Any]:
    """Every table a kvtrace database can hold, so a view exists (empty) even when no session has rows
    in it: the canned queries then run on any dataset."""
    from kvtrace.store.db import connect

    con = connect()
    try:
        from kvtrace.store.layout import create_tables

        create_tables(con)
        try:
            from kvtrace.store.nsys_tables import TABLES as NSYS_TABLES

            for table, columns in NSYS_TABLES.items():
                con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({columns})")
        except ImportError:  # pragma: no cover - the Nsight loader is optional
            pass
        return {t: {"columns": cols} for t, cols in _session_tables(con).items()}
    finally:
        con.close()


def _read_meta(root: Path) -> dict[str, Any]:
    path = root / META
    if not path.exists():
        raise KvtraceError(f"{root}: not a kvtrace dataset (no {META}; write one with "
                           "kvtrace export ... --format parquet -o DIR)")
    try:
        meta = json.loads(read_small_file(path))  # a regular file of bounded size (not a FIFO, /dev/zero)
    except (OSError, ValueError, RecursionError) as exc:
        raise KvtraceError(f"{path}: unreadable ({str(exc)[:200]})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "schema_version" not in meta:
        raise KvtraceError(f"{path}: not a kvtrace dataset description")
    version = meta["schema_version"]
    if not isinstance(version, int) or version > schema.SCHEMA_VERSION:
        raise KvtraceError(f"{path}: schema_version {version!r} is newer than this kvtrace reads "
                           f"({schema.SCHEMA_VERSION}); upgrade kvtrace")
    if version < schema.OLDEST_READABLE_SCHEMA_VERSION:
        raise KvtraceError(f"{path}: schema_version {version} is too old for this kvtrace")
    meta.setdefault("tables", {})
    meta.setdefault("sessions", {})
    return meta


def _write_meta(root: Path, meta: dict[str, Any]) -> None:
    from kvtrace.format.session import write_json_atomic

    write_json_atomic(root / META, meta)


def read_meta(root: str | Path) -> dict[str, Any]:
    """The dataset's description (_kvtrace_dataset.json), checked."""
    return _read_meta(Path(root))


def open_dataset(root: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with one view per table of the dataset at `root`, over its
    Parquet files (`session` comes from the folder names). Tables without files are empty views."""
    root = Path(root)
    if not root.is_dir():
        raise KvtraceError(f"{root}: no such dataset directory")
    meta = _read_meta(root)
    _check_tables(root, meta["tables"])
    from kvtrace.store.db import connect

    con = connect()
    try:
        for table, info in sorted(meta["tables"].items()):
            con.execute(f"CREATE VIEW {table} AS {_view_sql(con, root, table, info.get('columns', []))}")
        try:
            from kvtrace.store.nsys_tables import create_views
        except ImportError:  # pragma: no cover - the Nsight loader is optional
            create_views = None
        if create_views is not None and "nsys_kernels" in meta["tables"]:
            create_views(con)  # the views the Nsight queries read, over the dataset's views
    except duckdb.Error as exc:
        con.close()
        raise KvtraceError(f"{root}: cannot read the dataset ({str(exc).splitlines()[0][:200]})") from None
    return con


# What a dataset description may name: the description is read from disk, and its names and types go
# into SQL (CREATE VIEW name ..., CAST(NULL AS type)), so anything else is refused, never quoted around.
TABLE_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
COLUMN_TYPE = re.compile(r"[A-Z][A-Z0-9 ]{0,40}(\(\d{1,3}(, ?\d{1,3})?\))?(\[\])*")


def _check_tables(root: Path, tables: Any) -> None:
    """Every table name and column type of the description is a plain identifier / type name."""
    where = root / META
    if not isinstance(tables, dict):
        raise KvtraceError(f"{where}: 'tables' is not an object")
    for table, info in tables.items():
        if not isinstance(table, str) or not TABLE_NAME.fullmatch(table):
            raise KvtraceError(f"{where}: table name {str(table)[:60]!r} is not a plain identifier")
        columns = info.get("columns", []) if isinstance(info, dict) else None
        if not isinstance(columns, list):
            raise KvtraceError(f"{where}: table {table}: 'columns' is not a list")
        for col in columns:
            if (not isinstance(col, list) or len(col) != 2 or not all(isinstance(x, str) for x in col)
                    or len(col[0]) > 200):
                raise KvtraceError(f"{where}: table {table}: a column is not [name, type]")
            if not COLUMN_TYPE.fullmatch(col[1]):
                raise KvtraceError(f"{where}: table {table}, column {col[0][:60]!r}: type {col[1][:60]!r} "
                                   "is not a DuckDB type name")


def _view_sql(con: duckdb.DuckDBPyConnection, root: Path, table: str, columns: list[list[str]]) -> str:
    files = root / f"table={table}"
    if not any(files.glob("session=*/*.parquet")):
        return "SELECT " + ", ".join(f"CAST(NULL AS {t}) AS {_ident(c)}" for c, t in columns) + " WHERE false"
    scan = (f"read_parquet('{_sql_path(files)}/session=*/*.parquet', hive_partitioning = true, "
            f"union_by_name = true, hive_types = {{'session': VARCHAR, 'table': VARCHAR}})")
    present = {r[0] for r in con.execute(f"DESCRIBE SELECT * FROM {scan}").fetchall()}
    # The table's columns in the database's order, `session` first; a column no file has is NULL.
    cols = [_ident(c) if c in present else f"CAST(NULL AS {t}) AS {_ident(c)}" for c, t in columns]
    return f"SELECT {', '.join(cols)} FROM {scan}"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _sql_path(path: Path) -> str:
    return str(path.resolve()).replace("'", "''")
