"""Ingest: session shards and Nsight Systems exports into one DuckDB database.

    from kvtrace.ingest import ingest
    report = ingest(["run1"], "run1.duckdb", nsys=["report.sqlite"])
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtrace.ingest.duckdb_load import create_tables, ingest_session, open_db, warm_up_pyarrow
from kvtrace.session import read_manifest


def ingest(sessions: list[str | Path], db_path: str | Path, nsys: list[str | Path] | None = None,
           progress: bool = False, job_pattern: str | None = None,
           on_report: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Load session directories (and Nsight SQLite exports) into the DuckDB file at `db_path`; returns
    a report per session and export, each also given to `on_report` as soon as it is made (so that a
    long list of sessions shows its progress).

    Each session's rows replace any earlier ingest of the same session. An export given with one
    session is aligned to that session's clock; given alone it is loaded unaligned. The last session's
    COMMIT writes every session of the call into the file (`ingest_session`'s `checkpoint`), so its
    report's seconds carry the writing of the sessions before it.
    """
    for session in sessions:  # all checked before anything is stored: a stray directory in runs/* fails at once
        read_manifest(session)
    warm_up_pyarrow()
    con = open_db(db_path)
    try:
        if not sessions:  # ingest_session makes them otherwise
            create_tables(con)
        reports = []

        def done(report: dict[str, Any]) -> None:
            reports.append(report)
            if on_report is not None:
                on_report(report)

        for i, s in enumerate(sessions):
            done(ingest_session(con, s, progress=progress, job_pattern=job_pattern,
                                checkpoint=i == len(sessions) - 1))
        for path in nsys or []:
            from kvtrace.ingest import nsys as nsys_mod

            session = reports[0]["session"] if len(reports) == 1 else None
            stats = nsys_mod.load_nsys(con, path, session=session)
            if session is not None:
                stats["alignment"] = nsys_mod.align_nsys(con, session)
            done({"nsys": str(path), **stats})
        con.execute("CHECKPOINT")
        return reports
    finally:
        con.close()
