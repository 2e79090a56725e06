"""The keyed store behind the big tables (tables.py says why): keys for processes, requests and labels,
the views that join them back, rows written by hand, and databases of older kvtrace versions converted.
"""

from __future__ import annotations

import duckdb

from kvtrace.errors import KvtraceError
from kvtrace.store.tables import (
    KEYED_TABLES,
    LABEL_COLUMNS,
    NULL_REQUEST_KEY,
    REQUEST_KEYED,
    STORE,
    has_seq,
    keyed_view_ddl,
    stored_columns,
    view_columns,
)


def create_keyed_views(con: duckdb.DuckDBPyConnection) -> None:
    labels = [t for t, in con.execute(f"SELECT text FROM {STORE}.labels ORDER BY label").fetchall()]
    for table in KEYED_TABLES:
        con.execute(keyed_view_ddl(table, labels))


def older_layout(con: duckdb.DuckDBPyConnection, table: str) -> tuple[str, str] | None:
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
    stored = column_types(con, STORE, table)
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
            insert_labels(con, give_label_codes(known, [r[0] for r in con.execute(
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


def give_label_codes(labels: dict[str, int], texts: list) -> list[tuple[int, str]]:
    """Give the `texts` not in `labels` (text -> code, updated) the next codes; returns them as
    (code, text). Codes are dense from 1: the views index a list of the texts by them."""
    new = [t for t in dict.fromkeys(texts) if t is not None and t not in labels]
    _check_label_count(len(labels) + len(new))
    for text in new:
        labels[text] = len(labels) + 1
    return [(labels[t], t) for t in new]


def insert_labels(con: duckdb.DuckDBPyConnection, labels: list[tuple[int, str]]) -> None:
    """INSERT (code, text) labels; the views need making again after (create_keyed_views)."""
    for label, text in labels:
        con.execute(f"INSERT INTO {STORE}.labels VALUES (?, ?)", [label, text])


def column_types(con: duckdb.DuckDBPyConnection, schema_name: str, table: str) -> dict[str, str]:
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
