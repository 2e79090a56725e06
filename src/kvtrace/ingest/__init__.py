"""Ingest: session shards and Nsight Systems exports into one DuckDB database.

    from kvtrace.ingest import ingest
    report = ingest(["run1"], "run1.duckdb", nsys=["report.sqlite"])

    load.py         one session, in one transaction (ingest_session)
    rows.py         the bulk path: shard batches gathered, keyed, unnested, inserted by a helper thread
    derive.py       requests, sessions, procs, probes: what ingest derives
    nsys.py         an Nsight Systems SQLite export into the nsys_* tables (nsys_read.py reads it)
    nsys_align.py   that export on the session clock
    arrow_setup.py  pyarrow's pandas check off the critical path

Reads sessions through kvtrace.format; writes the layout of kvtrace.store.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb

from kvtrace.errors import KvtraceError
from kvtrace.format.session import MANIFEST, SessionDir
from kvtrace.ingest.arrow_setup import warm_up_pyarrow
from kvtrace.ingest.derive import job_pattern_groups
from kvtrace.ingest.load import WriteRefused, ingest_session, write_refused
from kvtrace.store.db import open_db
from kvtrace.store.layout import create_tables


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
    # Every manifest read and checked before anything is stored: a stray directory in runs/* fails at once.
    opened = [SessionDir(s) for s in sessions]
    # Job patterns checked before the database is opened: a bad one leaves no file behind.
    if job_pattern:
        job_pattern_groups(job_pattern)
    else:  # each session's own, from `kvtrace record --job-pattern`
        for s in opened:
            pattern = s.manifest.get("options", {}).get("job_pattern")
            try:
                if pattern:
                    job_pattern_groups(pattern)
            except KvtraceError as exc:
                raise KvtraceError(f"{s.path / MANIFEST}: options.job_pattern: {exc}") from None
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

        for i, s in enumerate(opened):
            try:
                done(ingest_session(con, s, progress=progress, job_pattern=job_pattern,
                                    checkpoint=i == len(opened) - 1))
            except WriteRefused as exc:
                raise KvtraceError(refused_message(db_path, exc, [r["session"] for r in reports])) from None
        for path in nsys or []:
            from kvtrace.ingest import nsys as nsys_mod

            session = reports[0]["session"] if len(reports) == 1 else None
            try:
                stats = nsys_mod.load_nsys(con, path, session=session)
            except duckdb.Error as exc:
                if not write_refused(exc):
                    raise
                stored = ", ".join(r["session"] for r in reports if "session" in r) or "none"
                raise KvtraceError(f"{db_path}: the disk refused a write while loading {path}: the export was "
                                   f"not stored; sessions stored before it: {stored}") from None
            if session is not None:
                stats["alignment"] = nsys_mod.align_nsys(con, session)
            done({"nsys": str(path), **stats})
        con.execute("CHECKPOINT")
        return reports
    finally:
        con.close()


def refused_message(db_path: str | Path, exc: WriteRefused, stored: list[str]) -> str:
    """One line for a session the disk refused to store: what was kept, what was not."""
    reason = exc.reason.splitlines()[0]
    reason = reason.split("because of error: ")[-1].strip('"')[:160]
    name = Path(db_path).name
    kept = (f"; stored before it in this run: {', '.join(stored)} (partly in {name}.wal until DuckDB next writes "
            f"the file: keep it beside {name})" if stored else "")
    return (f"{db_path}: the disk refused a write ({reason}): session {exc.session} was not stored and the "
            f"database holds what it held before it{kept}; free space (or raise the limit) and ingest again")

