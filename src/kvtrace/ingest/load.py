"""Loading one session into DuckDB (`ingest_session`), in one transaction.

Every shard table is loaded into the database table of the same name (store/tables.py has the layout;
rows.py the bulk path that gathers, keys and inserts them), then ingest derives `requests` and the
session-level tables (derive.py). Re-ingesting a session replaces its rows, so ingest is idempotent; a
failed ingest leaves the database as it was. A database written by an older kvtrace is converted on its
next ingest (store/layout.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import duckdb

from kvtrace.format import schema
from kvtrace.format.session import (
    CLOSED_STATUSES,
    SessionDir,
    engine_config,
    linked_proc_dirs,
    shown,
    verdict,
)
from kvtrace.format.shards import ShardRead, list_shards, loaded_batches, loads_into, read_shard
from kvtrace.ingest.derive import (
    derive_requests,
    insert_proc,
    insert_session,
    job_pattern_groups,
    probe_report,
)
from kvtrace.ingest.rows import Gather, Inserter, SessionKeys
from kvtrace.store.keyed import proc_key
from kvtrace.store.layout import create_tables
from kvtrace.store.tables import KEYED_TABLES, SESSION_TABLES, STORE

INGEST_MEMORY_LIMIT = 1 << 30  # bytes DuckDB may keep during an ingest (it spills past it)


























































class Progress:
    """A one-line progress report on stderr for long ingests (quiet when not a terminal, except at end)."""

    def __init__(self, label: str, total: int, enabled: bool):
        import sys

        self.label, self.total, self.enabled, self.done, self.rows = label, total, enabled, 0, 0
        self.stream = sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = self.last = time.monotonic()
        self._shard_rows = 0

    def step(self, rows: int) -> None:
        """A shard done (its rows already counted by `add`, if any; `rows` beyond those are added)."""
        self.done += 1
        self.add(max(rows - self._shard_rows, 0))
        self._shard_rows = 0

    def add(self, rows: int) -> None:
        """Rows read so far of the shard in progress (big shards report before they end)."""
        self._shard_rows += rows
        self.rows += rows
        now = time.monotonic()
        if self.enabled and (now - self.last > (0.2 if self.tty else 5.0)):
            self.last = now
            self._print(end="\r" if self.tty else "\n")

    def _print(self, end: str) -> None:
        rate = self.rows / max(time.monotonic() - self.t0, 1e-9)
        print(f"{self.label}: {self.done}/{self.total} shards, {self.rows:,} rows, {rate:,.0f} rows/s",
              end=end, file=self.stream, flush=True)

    def finish(self) -> None:
        if self.enabled and time.monotonic() - self.t0 > 1.0:
            self._print(end="\n")


def ingest_session(con: duckdb.DuckDBPyConnection, session: str | Path | SessionDir, progress: bool = False,
                   job_pattern: str | None = None, checkpoint: bool = True) -> dict[str, Any]:
    """Load one session directory (a path, or a SessionDir read already) into the open database;
    returns a report (rows, issues, status).

    With `checkpoint` (the default) the COMMIT writes the session into the database file, and the
    report's seconds include that. Without, DuckDB may keep the rows in its WAL until a later
    checkpoint: `ingest()` does so for every session of a call but the last, whose COMMIT then writes
    them all (one checkpoint per session made a 20-session ingest ~25% slower and its file ~25% larger,
    docs/performance.md)."""
    session = session if isinstance(session, SessionDir) else SessionDir(session)
    session_dir, manifest = session.path, session.manifest
    sid = shown(str(manifest.get("session_id") or session_dir.name))
    job_pattern = job_pattern or manifest.get("options", {}).get("job_pattern")
    if job_pattern:
        job_pattern_groups(job_pattern)  # a bad pattern fails here, before anything is loaded
    create_tables(con)
    shards_by_proc = [(p.path, p.doc, list_shards(p.path, p.status)) for p in session.procs]
    # Links are never followed (a process folder read through one could count twice); one that leads
    # outside the session's own process folders leaves its rows out, which the verdict says.
    # (realpath, not Path.resolve: a link loop is an answer there, not an error)
    own = {os.path.realpath(p.path) for p in session.procs}
    links = linked_proc_dirs(session_dir)
    unread = [p for p in links if os.path.realpath(p) not in own]
    issues: list[tuple[str, str, int]] = [
        (str(p), f"{p}: a link, not read (kvtrace makes none; "
                 + ("its target is read as its own folder)" if p not in unread else
                    "it leads outside the session's process folders: its rows are not in the database)"), 0)
        for p in links]
    shards_by_proc = _without_copies(shards_by_proc, issues)
    total = sum(len(s) for _, _, s in shards_by_proc)
    bar = Progress(f"ingest {session_dir.name}", total, progress)
    rows: dict[str, int] = {t: 0 for t in schema.TABLES}
    # `kvtrace record` said the command ended cleanly and every process closed (whatever was missing).
    incomplete = manifest.get("status") not in CLOSED_STATUSES
    t0 = time.monotonic()
    restore = _ingest_settings(con, checkpoint)
    con.execute("BEGIN TRANSACTION")
    try:
        _delete_session(con, sid)  # in the transaction: a failed re-ingest keeps the rows it would replace
        keys = SessionKeys(con, sid)
        # Keyed tables still empty get their columns' compression from their first chunk (compression.py).
        undecided = {t for t in KEYED_TABLES
                     if not con.execute(f"SELECT count(*) FROM {STORE}.{t}").fetchall()[0][0]}
        # Every process's key first: once the inserter runs, the connection is its thread's.
        consts = []
        for _proc_dir, proc, _shards in shards_by_proc:
            rank, pid = int(proc.get("rank", 0) or 0), int(proc.get("pid", 0) or 0)
            consts.append((sid, rank, pid, proc_key(con, sid, rank, pid)))
        # `requests` is derived from request_events alone: queued once the last process holding any
        # has them queued (below), it runs while the big tables are still being read.
        derive_after = max((i for i, (_, _, shards) in enumerate(shards_by_proc)
                            if any(s.table == "request_events" for s in shards)), default=None)
        inserter = Inserter(con)
        # Each process's proc.json with the rows actually read from its shards: what the session's
        # verdict is made of (a killed process's own counts lag, or are missing).
        loaded: list[dict[str, Any]] = []
        try:
            for i, ((_proc_dir, proc, shards), proc_consts) in enumerate(zip(shards_by_proc, consts)):
                proc_rows = {t: 0 for t in schema.TABLES}
                if proc.get("status") not in ("complete", "flushed"):
                    incomplete = True
                loader = Gather(inserter, proc_consts, keys, undecided)
                # A process's small tables first: their INSERTs keep DuckDB busy while its first big
                # chunk is read, keyed and measured for compression (~30 ms at 1 M events, during which
                # the inserter had nothing to do).
                small = [s for s in shards if loads_into(s.table) not in KEYED_TABLES]
                big = [s for s in shards if loads_into(s.table) in KEYED_TABLES]
                if _load_shards(small, loader, bar, proc_rows, issues):
                    incomplete = True
                if i == derive_after:
                    loader.flush()
                    inserter.submit(0, derive_requests, sid, job_pattern)
                if _load_shards(big, loader, bar, proc_rows, issues):
                    incomplete = True
                loader.flush()
                inserter.submit(0, insert_proc, sid, proc)
                for table, n in proc_rows.items():
                    rows[table] += n
                loaded.append({**proc, "rows_written": proc_rows})
            inserter.wait()
        finally:
            inserter.close(cancel=True)  # the connection is this thread's again (for the rest, or ROLLBACK)
        engine = engine_config(manifest, [proc for _, proc, _ in shards_by_proc])
        status, problems = verdict(not incomplete, loaded, engine)
        if unread:
            problems.append(f"{len(unread)} process folder(s) behind links not read: {', '.join(p.name for p in unread)}")
            status = "degraded" if status == "complete" else status
        insert_session(con, sid, session_dir, manifest, engine, status, job_pattern)
        # The session's own problems (file ''), then each shard's.
        for path, problem, cut in [*(("", problem, 0) for problem in problems), *issues]:
            con.execute("INSERT INTO ingest_issues VALUES (?, ?, ?, ?)", [sid, shown(path), shown(problem), cut])
        con.execute("COMMIT")
    except BaseException as exc:
        try:
            con.execute("ROLLBACK")
            restore()
        except duckdb.Error:  # the write failed so badly that DuckDB closed the database: nothing to undo
            pass
        if isinstance(exc, duckdb.Error) and write_refused(exc):
            raise WriteRefused(sid, str(exc)) from None
        raise
    restore()
    bar.finish()
    seconds = time.monotonic() - t0
    events = sum(rows.values())
    return {"session": sid, "status": status, "rows": rows, "events": events, "seconds": seconds,
            "events_per_s": events / seconds if seconds > 0 else 0.0, "issues": [p for _, p, _ in issues],
            "problems": problems, "probes": probe_report(con, sid)}


def _without_copies(shards_by_proc: list[tuple], issues: list[tuple[str, str, int]]) -> list[tuple]:
    """The shards with byte-for-byte copies of another left out (reported in `issues`): a shard copied
    under another number, or a process folder copied under another name, would count its rows twice.
    Two processes never write the same bytes of a table whose rows carry a time, so equal bytes are a
    copy there. Rows without a time can be equal in two processes (tensor-parallel workers write the
    same batch_slots): such a shard is a copy when another in its folder has its bytes, or when its
    folder is a copy (every timed shard in it is). Only shards of equal table and size are read to
    compare, so this costs nothing in a real session."""
    timed = [(d, [sh for sh in shards if _timed(sh.table)]) for d, _, shards in shards_by_proc]
    copies = _copies([(sh, ()) for _, shards in timed for sh in shards], issues)
    untimed = []
    for (d, _, shards), (_, timed_here) in zip(shards_by_proc, timed):
        folder_copied = bool(timed_here) and all(sh.path in copies for sh in timed_here)
        # where a folder has no timed shard to tell, untimed shards are compared across folders
        scope = (str(d),) if timed_here and not folder_copied else ()
        for sh in shards:
            if _timed(sh.table):
                continue
            if folder_copied:
                copies.add(sh.path)
                issues.append((str(sh.path), f"{sh.path}: in a copied process folder, not read (its rows "
                                             "would count twice)", 0))
            else:
                untimed.append((sh, scope))
    copies |= _copies(untimed, issues)
    if not copies:
        return shards_by_proc
    return [(d, doc, [sh for sh in shards if sh.path not in copies]) for d, doc, shards in shards_by_proc]


def _copies(shards: list[tuple], issues: list[tuple[str, str, int]]) -> set[Path]:
    """Paths of the shards whose bytes equal an earlier one's of the same table and scope."""
    import hashlib

    by_size: dict[tuple, list[Path]] = {}
    for sh, scope in shards:
        try:
            by_size.setdefault((sh.table, sh.path.stat().st_size, *scope), []).append(sh.path)
        except OSError:
            continue  # read (and reported) as it is
    copies: set[Path] = set()
    for (_, size, *_), paths in by_size.items():
        if len(paths) < 2 or size == 0:
            continue
        first: dict[str, Path] = {}
        for path in paths:
            digest = hashlib.blake2b()
            try:
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        digest.update(chunk)
            except OSError:
                continue
            original = first.setdefault(digest.hexdigest(), path)
            if original != path:
                copies.add(path)
                issues.append((str(path), f"{path}: the same bytes as {original}: a copy, not read "
                                          "(its rows would count twice)", 0))
    return copies


def _timed(table: str) -> bool:
    """Whether every row of a shard table carries a time (a column in ns); a table this kvtrace does not
    know is taken as timed. A run table by its own columns: batch_slot_runs, like batch_slots, has none."""
    cols = schema.SHARD_TABLES.get(table)
    return cols is None or any(c.name.endswith("_ns") for c in cols)


class WriteRefused(Exception):
    """The disk refused to store a session (full, or a file-size limit): nothing of it was stored."""

    def __init__(self, session: str, reason: str):
        super().__init__(reason)
        self.session, self.reason = session, reason


def write_refused(exc: BaseException) -> bool:
    """Whether a DuckDB error is the file system refusing a write (no space, a file-size limit)."""
    text = str(exc)
    return "Could not write file" in text or "No space left" in text or "File too large" in text


def _ingest_settings(con: duckdb.DuckDBPyConnection, checkpoint: bool = True):
    """Settings for the ingest's transaction; returns a function that puts the connection's back.

    - DuckDB's memory limit lowered to INGEST_MEMORY_LIMIT: it otherwise keeps the blocks it has
      written cached, up to 80% of RAM, so RSS would grow with the session.
    - With `checkpoint`, the checkpoint threshold at 1 byte, so that COMMIT checkpoints: DuckDB then
      writes the rows it held in memory (tables too small to fill a row group) straight into the file,
      as it does anyway past the default 16 MiB of WAL (bench_scale's 10 M-event session). Below that,
      it wrote them to the WAL, the CHECKPOINT after ingest wrote them again, and the session's rate
      left that out."""
    restore = []
    settings = [("memory_limit", f"{INGEST_MEMORY_LIMIT}B")] + ([("checkpoint_threshold", "1B")] if checkpoint else [])
    for name, value in settings:
        try:
            before = con.execute(f"SELECT current_setting('{name}')").fetchall()[0][0]
            if name == "memory_limit" and _bytes(before) <= INGEST_MEMORY_LIMIT:
                continue
            con.execute(f"SET {name} = '{value}'")
        except (duckdb.Error, ValueError, KeyError):
            continue
        restore.append((name, before))

    def put_back() -> None:
        for name, before in restore:
            con.execute(f"SET {name} = '{before}'")
    return put_back


def _bytes(setting: str) -> float:
    """A DuckDB size setting ('16.0 MiB') in bytes."""
    units = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "PiB": 1 << 50,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    number, unit = str(setting).split()
    return float(number) * units[unit]


def _load_shards(shards: list, loader: Gather, bar: Progress, rows: dict[str, int],
                 issues: list[tuple[str, str, int]]) -> bool:
    """Read one process's shards into `loader`; counts rows, notes issues; True if any shard was cut."""
    cut = False
    # batch_slots (and the runs that stand for its rows) before kv_access: the access rows take their
    # request id from it.
    for shard in sorted(shards, key=lambda s: (loads_into(s.table) != "batch_slots", s.path.name)):
        if not shard.open and not shard.path.exists():
            # Deleted since it was listed: a live session under --on-max-size drop-oldest (the
            # recorder counts its rows as lost). Shards created since listing are left for later.
            issues.append((str(shard.path), f"{shard.path}: deleted while the session was read", 0))
            cut = True
            continue
        res = ShardRead()
        table = loads_into(shard.table)  # a run table's rows are expanded into the table they stand for
        stored = 0
        for raw in read_shard(shard, res):
            # An older shard's missing trailing columns padded; decode runs and KV records made rows.
            for batch in loaded_batches(shard.table, raw, shard.path):
                loader.add(table, batch)
                bar.add(batch.num_rows)
                stored += batch.num_rows
        rows[table] += stored
        for problem in res.problems:
            issues.append((str(shard.path), problem, res.bytes_cut))
            cut = True
        bar.step(stored)
    return cut


def _delete_session(con: duckdb.DuckDBPyConnection, sid: str) -> None:
    """Delete `sid`'s rows (a re-ingest replaces them). A session is stored whole or not at all (one
    transaction, which writes its `sessions` row and process keys), so when it has neither there is
    nothing to delete: one query instead of a DELETE per table (~10 ms on a first ingest)."""
    (stored,), = con.execute(f"""SELECT EXISTS (SELECT 1 FROM sessions WHERE session = $s)
        OR EXISTS (SELECT 1 FROM {STORE}.proc_keys WHERE session = $s)""", {"s": sid}).fetchall()
    if not stored:
        return
    for table in [*schema.TABLES, *SESSION_TABLES]:
        if table in KEYED_TABLES:
            con.execute(f"DELETE FROM {STORE}.{table} WHERE proc IN "
                        f"(SELECT proc FROM {STORE}.proc_keys WHERE session = ?)", [sid])
        else:
            con.execute(f"DELETE FROM {table} WHERE session = ?", [sid])
    con.execute(f"DELETE FROM {STORE}.proc_keys WHERE session = ?", [sid])
    con.execute(f"DELETE FROM {STORE}.request_keys WHERE session = ?", [sid])


















































