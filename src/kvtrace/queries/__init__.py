"""Canned SQL queries: one `.sql` file per query in this folder, each opening with a header.

    -- name: summary
    -- description: what question it answers, in one line
    -- params: session: restrict to one session id (default: all)
    -- columns: steps (count), ...

Parameters are DuckDB named parameters (`$session`); a parameter that is not given is NULL, and every
query treats NULL as "no restriction" or its documented default.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import duckdb

from kvtrace.errors import KvtraceError

HEADER = re.compile(r"^--\s*(name|description|params|columns|empty):\s*(.*)$")


@dataclass
class CannedQuery:
    name: str
    description: str
    sql: str
    params: dict[str, str] = field(default_factory=dict)  # name -> meaning
    columns: str = ""
    empty: str = ""  # why the result can have no rows, for people (`-- empty:`); printed with none


def _parse(text: str, filename: str) -> CannedQuery:
    meta: dict[str, str] = {}
    for line in text.splitlines():
        m = HEADER.match(line.strip())
        if m:
            meta[m.group(1)] = (meta.get(m.group(1), "") + " " + m.group(2)).strip()
        elif line.strip() and not line.strip().startswith("--"):
            break
    if "name" not in meta or "description" not in meta:
        raise KvtraceError(f"{filename}: canned query without a '-- name:' and '-- description:' header")
    params: dict[str, str] = {}
    raw = meta.get("params", "")
    if raw and raw.strip() not in ("(none)", "none"):
        for part in raw.split(";"):
            key, _, meaning = part.partition(":")
            if key.strip():
                params[key.strip()] = meaning.strip()
    return CannedQuery(meta["name"], meta["description"], text, params, meta.get("columns", ""),
                       meta.get("empty", ""))


def all_queries() -> dict[str, CannedQuery]:
    out = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            q = _parse(entry.read_text(), entry.name)
            out[q.name] = q
    return out


def get_query(name: str) -> CannedQuery:
    queries = all_queries()
    if name not in queries:
        raise KvtraceError(f"no canned query named {name!r} (kvtrace query --list shows them)")
    return queries[name]


def run_sql(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any] | None = None,
            declared: dict[str, str] | None = None) -> tuple[list[str], list[tuple]]:
    """Run SQL with named parameters; returns (column names, rows). Errors become one-line KvtraceErrors."""
    columns, chunks = iter_sql(con, sql, params, declared, chunk_rows=None)
    return columns, [row for chunk in chunks for row in chunk]


def iter_sql(con: duckdb.DuckDBPyConnection, sql: str, params: dict[str, Any] | None = None,
             declared: dict[str, str] | None = None, chunk_rows: int | None = 50_000
             ) -> tuple[list[str], Iterator[list[tuple]]]:
    """Like `run_sql`, but the rows come in lists of at most `chunk_rows` (None: one list of all), so a
    caller can write a large result out without holding it all; the connection must stay open while
    the chunks are read."""
    params = dict(params or {})
    unknown = [p for p in params if declared is not None and p not in declared]
    if unknown:
        raise KvtraceError(f"unknown parameter(s) {', '.join(unknown)}; this query takes "
                           f"{', '.join(declared) or 'none'}")
    for p in declared or {}:
        params.setdefault(p, None)
    used = {p: v for p, v in params.items() if re.search(rf"\${re.escape(p)}\b", sql)}
    try:
        cur = con.execute(sql, used) if used else con.execute(sql)
    except duckdb.Error as exc:
        raise KvtraceError(f"query failed: {str(exc).splitlines()[0]}") from None
    if cur.description is None:
        return [], iter(())

    def chunks() -> Iterator[list[tuple]]:
        try:
            if chunk_rows is None:
                yield cur.fetchall()
                return
            while True:
                rows = cur.fetchmany(chunk_rows)
                if not rows:
                    return
                yield rows
        except duckdb.Error as exc:
            raise KvtraceError(f"query failed: {str(exc).splitlines()[0]}") from None

    return [d[0] for d in cur.description], chunks()


def run_query(con: duckdb.DuckDBPyConnection, name: str, params: dict[str, Any] | None = None):
    q = get_query(name)
    return run_sql(con, q.sql, params, q.params)
