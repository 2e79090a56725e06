"""Laying a database out: every kvtrace table and view, made once per kvtrace version (a digest of the
DDL in `kvtrace_meta` says whether this code made them), older layouts converted on the way.
"""

from __future__ import annotations

import json

import duckdb

from kvtrace.format import schema
from kvtrace.store import nsys_tables
from kvtrace.store.keyed import (
    create_keyed_views,
    give_label_codes,
    insert_labels,
    older_layout,
    store_view_rows,
)
from kvtrace.store.tables import (
    KEY_TABLES_DDL,
    KEYED_TABLES,
    KNOWN_LABELS,
    NULL_REQUEST_KEY,
    SESSION_TABLES,
    STORE,
    keyed_view_ddl,
    table_ddl,
)


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


    parts = [str(schema.SCHEMA_VERSION), *KEY_TABLES_DDL, *KNOWN_LABELS,
             *(table_ddl(t) for t in schema.TABLES), *(keyed_view_ddl(t, []) for t in KEYED_TABLES),
             *(f"{t} ({c})" for t, c in SESSION_TABLES.items()), *(f"{t} ({c})" for t, c in nsys_tables.TABLES.items()),
             *nsys_tables.NSYS_VIEWS, *nsys_tables.STEP_VIEWS]
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
        insert_labels(con, give_label_codes({}, list(KNOWN_LABELS)))
    existing = _catalog(con)
    for table in schema.TABLES:
        older = (older_layout(con, table) if table in KEYED_TABLES and existing & {f"main.{table}", f"{STORE}.{table}"}
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
    nsys_tables.create_nsys_tables(con)  # empty nsys_* tables and views: the nsys queries run on any database
    con.execute("INSERT OR REPLACE INTO kvtrace_meta VALUES ('schema_version', ?)",
                [str(schema.SCHEMA_VERSION)])
