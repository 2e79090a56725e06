"""The in-process recorder: columnar-ish buffers on the hot path, a background writer for the files.

Runs in every vLLM process that a probe fires in (front end, EngineCore, workers). The hot path is a
single `list.append(tuple)` on a buffer a probe holds a reference to: no lock, no I/O, no per-event
allocation beyond the row itself. A daemon thread wakes every `flush_interval_s` (default 0.5 s), takes
the rows appended so far, turns them into Arrow RecordBatches and appends them to the process's shard
files (Arrow IPC streams, one file per table, rotated by size and age). A stream stays readable up to its
last complete batch if the process is killed, because every batch goes out in one `write()`.

Nothing is lost silently: rows that cannot be written (disk full, read-only directory, size cap, a
backlog past `max_pending_rows`) are counted per table and cause, written to the `drops` table and to
the process file (`proc.json`).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from kvtrace import schema
from kvtrace.session import PROC_FILE, session_size_bytes, write_json_atomic

OPEN_SUFFIX = ".partial"  # a shard still being written; renamed to `.arrows` when closed
SHARD_SUFFIX = ".arrows"


class ShardWriter:
    """Appends RecordBatches of one table to rotating Arrow IPC stream files in one directory."""

    def __init__(self, directory: Path, table: str, rotate_bytes: int, rotate_s: float):
        self.directory = directory
        self.table = table
        self.schema = schema.arrow_schema(table)
        self.rotate_bytes = rotate_bytes
        self.rotate_s = rotate_s
        self.seq = 0
        self.closed_shards: list[tuple[Path, int]] = []  # (path, rows), oldest first
        self._file = None
        self._path: Path | None = None
        self._bytes = 0
        self._rows = 0
        self._opened_at = 0.0

    def _open(self) -> None:
        self._path = self.directory / f"{self.table}.{self.seq:05d}{SHARD_SUFFIX}{OPEN_SUFFIX}"
        self.seq += 1
        self._file = open(self._path, "wb")
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, self.schema):
            pass  # only the schema message; the end-of-stream marker is cut off below
        header = sink.getvalue().to_pybytes()[:-8]
        self._file.write(header)
        self._file.flush()
        self._bytes, self._rows, self._opened_at = len(header), 0, time.monotonic()

    def write(self, batch: pa.RecordBatch) -> int:
        """Append one batch; returns the bytes written. Raises OSError on disk trouble."""
        if self._file is None:
            self._open()
        payload = _batch_message(batch)
        self._file.write(payload)  # one write: a kill leaves whole batches or a detectable tail
        self._file.flush()
        self._bytes += len(payload)
        self._rows += batch.num_rows
        if self._bytes >= self.rotate_bytes or time.monotonic() - self._opened_at >= self.rotate_s:
            self.close()
        return len(payload)

    def close(self) -> None:
        if self._file is None:
            return
        self._file.write(b"\xff\xff\xff\xff\x00\x00\x00\x00")  # Arrow end-of-stream marker
        self._file.close()
        final = self._path.with_name(self._path.name[: -len(OPEN_SUFFIX)])
        os.replace(self._path, final)
        self.closed_shards.append((final, self._rows))
        self._file = None


def _batch_message(batch: pa.RecordBatch) -> bytes:
    """The IPC bytes of one record batch as it stands in a stream (encapsulated message)."""
    return batch.serialize().to_pybytes()


class Recorder:
    """One per process. Probes call `buffer(table)` once and append row tuples to the list it returns."""

    def __init__(self, session_dir: str | os.PathLike, role: str, options: dict[str, Any] | None = None):
        options = options or {}
        self.session_dir = Path(session_dir)
        self.role = role
        self.pid = os.getpid()
        self.rank = int(options.get("rank", 0))
        self.flush_interval_s = float(options.get("flush_interval_s", 0.5))
        self.rotate_bytes = int(options.get("rotate_bytes", 64 << 20))
        self.rotate_s = float(options.get("rotate_s", 300.0))
        self.max_pending_rows = int(options.get("max_pending_rows", 5_000_000))
        self.max_size_bytes = int(options.get("max_size_bytes", 0))  # 0 = no cap
        self.max_size_policy = options.get("max_size_policy", "stop")  # or "drop-oldest"
        self.options = options
        self.buffers: dict[str, list] = {t: [] for t in schema.TABLES}
        self._start()
        atexit.register(self.close)
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._after_fork)

    def _start(self) -> None:
        """Open this process's folder and start the writer (at creation, and again in a forked child)."""
        self.pid = os.getpid()
        # The role is not known until a probe fires (plugins load before vLLM says which process
        # this is), so the folder is named by host and pid and the role lives in proc.json.
        self.dir = self.session_dir / "procs" / f"{socket.gethostname()}-{self.pid}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writers = {t: ShardWriter(self.dir, t, self.rotate_bytes, self.rotate_s) for t in schema.TABLES}
        self.rows_written = {t: 0 for t in schema.TABLES}
        self.dropped: dict[str, dict[str, int]] = {}
        self.info: dict[str, Any] = {"probes": {}, "engine_config": {}}
        self.stopped_reason: str | None = None  # set when writing stopped for good
        self.started_ns = time.monotonic_ns()
        self._lock = threading.Lock()  # serialises flushes (writer thread vs. close); never on the hot path
        self._closed = False
        self._stop = threading.Event()
        self.add_clock_anchor()
        self._write_proc_file(status="running")
        self._thread = threading.Thread(target=self._run, name="kvtrace-writer", daemon=True)
        self._thread.start()

    def _after_fork(self) -> None:
        """A forked child keeps the buffer lists (probes hold references to them) but not the parent's
        rows, files or writer thread."""
        for buf in self.buffers.values():
            del buf[:]
        probes = dict(self.info.get("probes", {}))
        self._start()
        self.info["probes"] = probes

    # ---- hot path -------------------------------------------------------------------------
    def buffer(self, table: str) -> list:
        """The list probes append row tuples to (column order = kvtrace.schema.TABLES[table])."""
        return self.buffers[table]

    # ---- bookkeeping ------------------------------------------------------------------------
    def add_clock_anchor(self, device_ns: int | None = None, source: str = "host") -> None:
        self.buffers["clock_anchors"].append((time.monotonic_ns(), time.time_ns(), device_ns, source))

    def count_drop(self, table: str, n: int, cause: str) -> None:
        if n <= 0:
            return
        per = self.dropped.setdefault(table, {})
        per[cause] = per.get(cause, 0) + n
        self.buffers["drops"].append((time.monotonic_ns(), table, n, cause))

    def set_probe_status(self, name: str, status: str, reason: str = "") -> None:
        self.info["probes"][name] = {"status": status, "reason": reason}

    def warn(self, message: str) -> None:
        print(f"kvtrace: warning: {message} (pid {self.pid})", file=sys.stderr, flush=True)
        self.info.setdefault("warnings", []).append(message)

    # ---- writer thread ----------------------------------------------------------------------
    def _run(self) -> None:
        next_anchor = time.monotonic() + 10.0
        while not self._stop.wait(self.flush_interval_s):
            if time.monotonic() >= next_anchor:
                self.add_clock_anchor()
                next_anchor = time.monotonic() + 10.0
            self.flush()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _take(self, table: str) -> list:
        buf = self.buffers[table]
        n = len(buf)
        rows = buf[:n]
        del buf[:n]  # appends racing with us land after index n and stay for the next flush
        return rows

    def _flush_locked(self) -> None:
        for table in schema.TABLES:
            rows = self._take(table)
            if not rows:
                continue
            if self.stopped_reason is not None:
                if table != "drops":
                    self.count_drop(table, len(rows), self.stopped_reason)
                continue
            if len(rows) > self.max_pending_rows:  # the writer fell far behind: keep the newest
                self.count_drop(table, len(rows) - self.max_pending_rows, "buffer-cap")
                rows = rows[-self.max_pending_rows:]
            try:
                batch = rows_to_batch(table, rows)
                self.writers[table].write(batch)
                self.rows_written[table] += len(rows)
            except OSError as exc:
                self._stop_writing(f"writer-error", f"cannot write shards in {self.dir}: {exc}")
                if table != "drops":
                    self.count_drop(table, len(rows), "writer-error")
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                # A probe produced a row that does not fit the schema: a kvtrace bug, never vLLM's.
                self.warn(f"dropped {len(rows)} {table} rows that do not fit the schema: {exc}")
                self.count_drop(table, len(rows), "bad-row")
        if self.max_size_bytes and self.stopped_reason is None:
            self._enforce_max_size()
        self._write_proc_file(status="running")

    def _stop_writing(self, cause: str, message: str) -> None:
        if self.stopped_reason is None:
            self.stopped_reason = cause
            self.warn(f"stopped recording: {message}; further rows are counted as lost")

    def _enforce_max_size(self) -> None:
        if session_size_bytes(self.session_dir) <= self.max_size_bytes:
            return
        if self.max_size_policy == "drop-oldest":
            # Delete this process's oldest closed shards until the session fits again.
            shards = sorted(
                ((p, rows, w.table) for w in self.writers.values() for p, rows in w.closed_shards),
                key=lambda x: x[0].stat().st_mtime if x[0].exists() else 0,
            )
            for path, rows, table in shards:
                if session_size_bytes(self.session_dir) <= self.max_size_bytes:
                    break
                try:
                    path.unlink()
                except OSError:
                    continue
                self.writers[table].closed_shards.remove((path, rows))
                self.count_drop(table, rows, "max-size")
            if session_size_bytes(self.session_dir) > self.max_size_bytes:
                for w in self.writers.values():
                    w.close()  # open shards become closed shards, dropped at the next flush
        else:
            self._stop_writing("max-size", f"session reached --max-size {self.max_size_bytes} bytes")

    def _write_proc_file(self, status: str) -> None:
        doc = {
            "schema_version": schema.SCHEMA_VERSION,
            "role": self.role,
            "pid": self.pid,
            "host": socket.gethostname(),
            "rank": self.rank,
            "status": status,
            "started_ns": self.started_ns,
            "last_flush_ns": time.monotonic_ns(),
            "rows_written": self.rows_written,
            "dropped": self.dropped,
            "stopped_reason": self.stopped_reason,
            **self.info,
        }
        try:
            write_json_atomic(self.dir / PROC_FILE, doc)
        except OSError:
            pass  # the same disk trouble is already counted and warned about

    def close(self) -> None:
        """Flush everything and close the shards. Safe to call twice (atexit and explicit)."""
        if self._closed or os.getpid() != self.pid:
            return
        self._closed = True
        self._stop.set()
        with self._lock:
            self._flush_locked()
            for w in self.writers.values():
                try:
                    w.close()
                except OSError:
                    pass
            self._write_proc_file(status="complete")


def rows_to_batch(table: str, rows: list[tuple]) -> pa.RecordBatch:
    """Transpose row tuples into a RecordBatch of `table`'s schema."""
    sch = schema.arrow_schema(table)
    cols = list(zip(*rows)) if rows else [[] for _ in sch]
    arrays = [pa.array(col, type=field.type) for col, field in zip(cols, sch)]
    return pa.RecordBatch.from_arrays(arrays, schema=sch)


# ---- the process-wide recorder -------------------------------------------------------------------
_recorder: Recorder | None = None
_recorder_lock = threading.Lock()


def get_recorder(role: str | None = None) -> Recorder | None:
    """This process's recorder, created on first use when a session is active (KVTRACE_SESSION).

    A forked child keeps the same object, re-opened for its own pid by the at-fork handler.
    """
    global _recorder
    if _recorder is not None:
        if role and _recorder.role == "proc":
            _recorder.role = role
        return _recorder
    session_dir = os.environ.get("KVTRACE_SESSION")
    if not session_dir:
        return None
    with _recorder_lock:
        if _recorder is None:
            _recorder = Recorder(session_dir, role or _guess_role(), session_options())
    return _recorder


def session_options() -> dict[str, Any]:
    """The recording options `kvtrace record` passed down (KVTRACE_OPTIONS, JSON)."""
    try:
        options = json.loads(os.environ.get("KVTRACE_OPTIONS", "{}") or "{}")
    except json.JSONDecodeError:
        return {}
    return options if isinstance(options, dict) else {}


def _guess_role() -> str:
    name = ""
    try:
        import setproctitle  # vLLM names its processes (EngineCore_DP0, VllmWorker-0, APIServer)

        name = setproctitle.getproctitle()
    except Exception:
        pass
    name = name or (sys.argv[0] if sys.argv else "python")
    for key, role in (("EngineCore", "engine"), ("Worker", "worker"), ("APIServer", "api")):
        if key in name:
            return role
    return "proc"
