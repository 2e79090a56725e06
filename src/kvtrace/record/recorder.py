"""The in-process recorder: columnar-ish buffers on the hot path, a background writer for the files.

Runs in every vLLM process that a probe fires in (front end, EngineCore, workers). Probes hand rows
over through one sink, in two shapes: row by row, `buffer(table).append(row)` (or `.extend(rows)`), a
tuple in the table's column order (kvtrace.format.schema), on a buffer the probe holds a reference to;
or whole columns, `append_columns(table, cols)` (NumPy arrays or a RecordBatch), for the logs that keep
their own columns and for decoded device records. `MemoryRecorder` and `NullRecorder` (at the end)
are the same sink for tests and for rings used without a session.

The hot path is a single `append(tuple)`: no lock, no I/O. The buffer is a
native `RowLog` (record/buffers.py) that stores the row's values in typed columns at once, so no tuple
outlives its append (nothing for the garbage collector to walk, nothing to convert later); where the
native module is not built it is a list of the tuples. A daemon thread wakes every `flush_interval_s`
(default 2 s, `FLUSH_INTERVAL_S`), takes the rows appended so far as Arrow RecordBatches and appends them to the
process's shard files (Arrow IPC streams, one file per table, rotated by size and age). A stream stays readable up to its
last complete batch if the process is killed, because every batch goes out whole (format/sealed_files.py).
A KV access ring's drained block records are the exception: `append_kv_records` writes them on the
drain's thread, one frame a drain, to frame files (format/kv_frames.py) that rotate and close the same way.

Nothing is lost silently: rows that cannot be written (disk full, read-only directory, size cap, a
backlog past `max_pending_rows`) are counted per table and cause, written to the `drops` table and to
the process file (`proc.json`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from itertools import chain, groupby
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from kvtrace.format import schema
from kvtrace.format.kv_frames import TABLE as FRAMES_TABLE
from kvtrace.format.kv_frames import FrameWriter
from kvtrace.format.kv_records import PackedTimings, owned_copy, timing_columns
from kvtrace.format.session import PROC_FILE, session_size_bytes, write_json_atomic
from kvtrace.format.shards import WRITE_POOL, ShardWriter, batch_rows, rows_to_batch
from kvtrace.record.buffers import row_log
from kvtrace.record.clocks import clock_pair

# Never deleted by --on-max-size drop-oldest: the record of what was lost, and the clock anchors that
# align everything else (both tiny).
KEEP_TABLES = ("drops", "clock_anchors")

# proc.json is rewritten at a flush only when something in it other than the row counts changed (a
# drop, a probe's status, a warning, the status) or this long after the last write (s): each write
# (JSON of the whole document, a temporary file, a rename) cost ~0.5 ms, when the writer flushed twice a
# second (bench_host_probes: ~0.25% of a scheduling step); at the default 2 s flush interval it is
# rewritten at every flush. The shards never wait for it: proc.json's counts may lag them by this much,
# never lead them.
PROC_REFRESH_S = 2.0

# How often the writer wakes and writes (s). A flush costs mostly per table and per column, not per row
# (each table's columns taken into Arrow, its batch serialised and written: ~0.5 ms a table on a slow
# 2-CPU machine), so the writer's CPU follows the number of flushes: at 0.5 s it took ~1.2% of a
# scheduling step (bench_host_steps; docs/performance.md, "Host probes"), at 2 s a quarter of
# that or less. A process killed outright (SIGKILL) loses at most this much of its rows, plus the last
# hand-over of the block and decode logs (record/buffers.py FLUSH_NS); `kvtrace record` asks every
# process to flush (SIGUSR2) before it passes a stop signal on. Perfetto writes its file every 5 s.
FLUSH_INTERVAL_S = 2.0








class Recorder:
    """One per process. Probes call `buffer(table)` once and append row tuples to the list it returns."""

    def __init__(self, session_dir: str | os.PathLike, role: str, options: dict[str, Any] | None = None):
        options = options or {}
        self.session_dir = Path(session_dir)
        self.role = role
        self.pid = os.getpid()
        self.rank = int(options.get("rank", 0))
        self.flush_interval_s = float(options.get("flush_interval_s", FLUSH_INTERVAL_S))
        self.rotate_bytes = int(options.get("rotate_bytes", 64 << 20))
        self.rotate_s = float(options.get("rotate_s", 300.0))
        self.max_pending_rows = int(options.get("max_pending_rows", 5_000_000))
        self.max_size_bytes = int(options.get("max_size_bytes", 0))  # 0 = no cap
        self.max_size_policy = options.get("max_size_policy", "stop")  # or "drop-oldest"
        self.batch_rows = 1 << 20  # rows per RecordBatch at most
        if self.max_size_policy not in ("stop", "drop-oldest"):
            self.max_size_policy = "stop"
        if self.max_size_bytes and self.max_size_policy == "drop-oldest":
            # Dropping works a closed shard at a time: keep shards small against the cap, so one drop
            # loses a small slice of the run and open shards cannot hold most of the budget.
            self.rotate_bytes = min(self.rotate_bytes, max(self.max_size_bytes // 64, 64 << 10))
            # Small batches, so shards can rotate inside one flush and the oldest go first, even when
            # a starved writer finds more than the whole cap waiting.
            self.batch_rows = 1024
        self.options = options
        # Batches handed over whole (append_columns), and row tuples where there is no RowLog.
        self.buffers: dict[str, list] = {t: [] for t in schema.SHARD_TABLES}
        # Row tuples, kept in C (staged row-major, made columns at the flush; None where the native logs
        # are not built). Not for `drops`: the recorder's own record of losses, held back as tuples
        # once writing has stopped.
        self.row_logs = {t: row_log(t, self.max_pending_rows) for t in schema.TABLES if t != "drops"}
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
        # kv_access_records: frame files, written by the drains' threads (format/kv_frames.py)
        self.writers = {t: FrameWriter(self.dir, self.rotate_bytes, self.rotate_s) if t == FRAMES_TABLE
                        else ShardWriter(self.dir, t, self.rotate_bytes, self.rotate_s) for t in schema.SHARD_TABLES}
        self.rows_written = {t: 0 for t in schema.SHARD_TABLES}
        self.dropped: dict[str, dict[str, int]] = {}
        self.info: dict[str, Any] = {"probes": {}, "engine_config": {}}
        self.stopped_reason: str | None = None  # set when writing stopped for good
        self._held_drops: dict[tuple[str, str], int] = {}  # losses counted after stopping, written at close
        self._bytes_checked = 0  # shard bytes written up to the last max-size check
        self.started_ns = time.monotonic_ns()
        self._lock = threading.Lock()  # serialises flushes (writer thread vs. close); never on the hot path
        self._closed = False
        self._stop = threading.Event()
        self.add_clock_anchor()
        self.status = "running"
        self._proc_written_at = 0.0  # monotonic s of the last proc.json write
        self.writer_cpu_s = 0.0  # CPU seconds of the writer thread (its own clock, read after each flush)
        self._proc_dirty = False  # something other than the row counts changed since then
        self._write_proc_file(status=self.status)
        self._thread = threading.Thread(target=self._run, name="kvtrace-writer", daemon=True)
        self._thread.start()
        self._install_flush_signal()

    def _install_flush_signal(self) -> None:
        """SIGUSR2 = "flush now": `kvtrace record` sends it to every recording process before it passes a
        SIGINT/SIGTERM on, because vLLM's front end force-kills its engine right after asking it to stop
        (shutdown timeout 0), which leaves no time for atexit. Only where nobody else handles SIGUSR2."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None):
                signal.signal(signal.SIGUSR2, self._on_flush_signal)
        except (ValueError, OSError, AttributeError):
            pass

    def _on_flush_signal(self, _signum, _frame) -> None:
        # Runs in the main thread between bytecodes; the writer thread may hold the lock for a moment.
        threading.Thread(target=self._flush_now, name="kvtrace-flush", daemon=True).start()

    def _flush_now(self) -> None:
        run_flush_hooks()  # the probes' pending step rows, device rings
        with self._lock:
            if not self._closed:
                self.status = "flushed"  # everything so far is on disk; the process may die any moment
                self._proc_dirty = True
                self._flush_locked()

    def _after_fork(self) -> None:
        """A forked child keeps the buffer lists (probes hold references to them) but not the parent's
        rows, files or writer thread."""
        for buf in self.buffers.values():
            del buf[:]
        for log in self.row_logs.values():
            if log is not None:
                log.clear()
        if self._closed:  # the parent had finished recording: the child does not start again
            return
        kept = {k: self.info[k] for k in ("probes", "probes_installed") if k in self.info}
        self._start()
        self.info.update(kept)

    # ---- hot path -------------------------------------------------------------------------
    def buffer(self, table: str) -> Any:
        """What probes append row tuples to (`.append(row)`, column order = kvtrace.format.schema.TABLES[table]):
        the table's RowLog, or a list."""
        log = self.row_logs.get(table)
        return log if log is not None else self.buffers[table]

    def take_rows(self, table: str) -> list[tuple]:
        """The rows of `table` appended so far, as tuples, taken as the writer would take them (they will
        not be written): for tests and tools that look at what probes append."""
        out: list[tuple] = []
        for r in self._take(table):
            if isinstance(r, pa.RecordBatch):
                out.extend(zip(*(col.to_pylist() for col in r.columns)))
            elif isinstance(r, PendingColumns):
                out.extend(zip(*(col.tolist() if isinstance(col, np.ndarray) else col for col in r.cols.values())))
            else:
                out.append(r)
        return out

    def append_columns(self, table: str, cols: dict[str, Any] | pa.RecordBatch) -> None:
        """Append rows given as whole columns (NumPy arrays, one per schema column, or a RecordBatch of
        the table's schema): the bulk path for the native logs' hand-overs and decoded device records,
        which would cost a Python tuple per row otherwise."""
        sch = schema.arrow_schema(table)
        if isinstance(cols, pa.RecordBatch) and cols.schema.equals(sch):  # a native log's take(): as it is
            self.buffers[table].append(cols)
            return
        pending = PendingColumns.of(sch, cols)
        if pending is not None:  # NumPy columns: converted at the flush, on the writer's thread
            self.buffers[table].append(pending)
            return
        # Arrow arrays are taken as they are, other columns converted; from_arrays checks their types.
        batch = pa.RecordBatch.from_arrays([col if isinstance(col, pa.Array) else pa.array(col, type=t, memory_pool=WRITE_POOL)
                                            for col, t in zip(map(cols.__getitem__, sch.names), _types(table))],
                                           schema=sch)
        self.buffers[table].append(batch)  # a whole batch in the row list; the flush tells them apart

    def append_kv_records(self, recs: Any, clock: tuple[int, int, float], copies: tuple[int, ...] = (),
                          owned: bool = False) -> None:
        """A KV access ring's drained records (REC_DTYPE), written as they are, on the caller's thread
        (the ring's drain), as one frame of this process's `kv_access_records` frame files
        (format/kv_frames.py; decoded by ingest, format/kv_records.py) before this returns, so the
        memory may be reused at once (`owned` is not needed). One `writev` that lets the GIL go once,
        where the shard writer's Arrow batches let it go and took it back ~10 times a batch.
        `copies`: (layer, source layer) pairs, flattened, of the layers recorded as their source."""
        n = len(recs)
        if self.stopped_reason is not None:
            self.count_drop("kv_access_records", n, self.stopped_reason)
            return
        writer = self.writers["kv_access_records"]
        try:
            writer.write_frame(recs, clock, tuple(copies))
            self.rows_written["kv_access_records"] = writer.frames  # counted under the writer's lock
            if self._closed:  # a drain after the recorder closed: its file sealed at once
                writer.close()
        except OSError as exc:
            self._stop_writing("writer-error", f"cannot write KV record frames in {self.dir}: {exc}")
            self.count_drop("kv_access_records", n, "writer-error")

    def kv_frame_sink(self, make_sink: Any) -> Any:
        """The sink a CUDA ring's native drain loop writes its frames through, without the GIL
        (`FrameWriter.native_sink`; `make_sink`: the drain module's FrameSink); None where no frame file can
        be opened (the loop then leaves its records for `append_kv_records`). Records it cannot write it
        counts as lost, and this recorder's flush reports them (`_take_sink_drops`)."""
        writer = self.writers[FRAMES_TABLE]
        try:
            sink = writer.native_sink(make_sink)
        except OSError as exc:
            self._stop_writing("writer-error", f"cannot write KV record frames in {self.dir}: {exc}")
            return None
        if sink is not None and self.stopped_reason is not None:
            sink.stop(self.stopped_reason)
        return sink

    def _take_sink_drops(self) -> None:
        """What the frame sink counted as lost since the last flush, and why."""
        n, cause, err = self.writers[FRAMES_TABLE].sink_drops()
        if err:
            self._stop_writing("writer-error", f"cannot write KV record frames in {self.dir}: {os.strerror(err)}")
        if n:
            self.count_drop(FRAMES_TABLE, n, cause or "writer-error")

    def append_timing_records(self, recs: Any, clock: tuple[int, int, float], owned: bool = False) -> None:
        """A KV access ring's drained layer timing records (format/kv_records.py TIM_DTYPE), held as they
        are until the flush decodes all of its drains' into `layer_timings` rows at once. `owned`: as for
        `append_kv_records`."""
        self.buffers["layer_timings"].append(PackedTimings(recs if owned else owned_copy(recs), clock, len(recs)))

    # ---- bookkeeping ------------------------------------------------------------------------
    def add_clock_anchor(self, device_ns: int | None = None, source: str = "host") -> None:
        # Into the table's RowLog where there is one: a list's tuples go through pa.array at the flush,
        # whose first call imports pandas (~0.4 s of CPU on the writer thread, under the GIL at times).
        mono_ns, wall_ns = clock_pair()
        self.buffer("clock_anchors").append((mono_ns, wall_ns, device_ns, source))

    def count_drop(self, table: str, n: int, cause: str) -> None:
        if n <= 0:
            return
        table = "kv_access" if table == "kv_access_records" else table  # packed kv_access rows: counted as such
        self._proc_dirty = True
        per = self.dropped.setdefault(table, {})
        per[cause] = per.get(cause, 0) + n
        self.buffers["drops"].append((time.monotonic_ns(), table, n, cause))

    def set_probe_status(self, name: str, status: str, reason: str = "") -> None:
        entry = {"status": status, "reason": reason}
        if self.info["probes"].get(name) != entry:  # a probe installed again as it was: nothing to rewrite
            self.info["probes"][name] = entry
            self._proc_dirty = True

    def set_info(self, key: str, value: Any) -> None:
        """A fact about this process for proc.json (written at the next flush)."""
        if self.info.get(key) != value:
            self.info[key] = value
            self._proc_dirty = True

    def warn(self, message: str) -> None:
        print(f"kvtrace: warning: {message} (pid {self.pid})", file=sys.stderr, flush=True)
        self.info.setdefault("warnings", []).append(message)
        self._proc_dirty = True

    # ---- writer thread ----------------------------------------------------------------------
    def _run(self) -> None:
        next_anchor = time.monotonic() + 10.0
        while not self._stop.wait(self.flush_interval_s):
            if time.monotonic() >= next_anchor:
                self.add_clock_anchor()
                next_anchor = time.monotonic() + 10.0
            self.flush()
            # this thread's CPU so far (proc.json's writer_cpu_s): what writing shards took from the process
            self.writer_cpu_s = time.thread_time()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _take(self, table: str) -> list:
        """The rows appended so far: the RowLog's as one batch first, then the list's batches and tuples."""
        rows = []
        log = self.row_logs.get(table)
        if log is not None:
            batch, bad, over = log.take()  # under the GIL: whole rows only
            if batch is not None:
                rows.append(batch)
            if bad:  # a probe produced a row that does not fit the schema: a kvtrace bug, never vLLM's
                self.warn(f"dropped {bad} {table} rows that do not fit the schema")
                self.count_drop(table, bad, "bad-row")
            self.count_drop(table, over, "buffer-cap")
        buf = self.buffers[table]
        n = len(buf)
        rows += buf[:n]
        del buf[:n]  # appends racing with us land after index n and stay for the next flush
        return rows

    def _flush_locked(self) -> None:
        self._take_sink_drops()
        for table in schema.SHARD_TABLES:
            rows = self._take(table)
            if not rows:
                continue
            if self.stopped_reason is not None:
                if table == "drops":
                    self._hold_drops(rows)  # written at close, so the drops table records the loss too
                else:
                    self.count_drop(table, _row_count(table, rows), self.stopped_reason)
                continue
            if len(rows) > self.max_pending_rows:  # the writer fell far behind: keep the newest
                self.count_drop(table, _row_count(table, rows[:-self.max_pending_rows]), "buffer-cap")
                rows = rows[-self.max_pending_rows:]  # (a RowLog stops at max_pending_rows itself)
            try:
                for batch in _batches(table, rows, self.batch_rows):
                    self.writers[table].write(batch)
                    self.rows_written[table] += batch.num_rows
            except OSError as exc:
                self._stop_writing("writer-error", f"cannot write shards in {self.dir}: {exc}")
                if table != "drops":
                    self.count_drop(table, _row_count(table, rows), "writer-error")
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                # A probe produced a row that does not fit the schema: a kvtrace bug, never vLLM's.
                self.warn(f"dropped {_row_count(table, rows)} {table} rows that do not fit the schema: {exc}")
                self.count_drop(table, _row_count(table, rows), "bad-row")
        for w in self.writers.values():
            try:
                w.rotate_if_old()
            except OSError:
                pass  # a rename that fails now is retried at the next flush or at close
        if self.max_size_bytes and self.stopped_reason is None:
            self._enforce_max_size()
        if self._proc_dirty or time.monotonic() - self._proc_written_at >= PROC_REFRESH_S:
            self._write_proc_file(status=self.status)

    def _stop_writing(self, cause: str, message: str) -> None:
        if self.stopped_reason is None:
            self.stopped_reason = cause
            self.writers[FRAMES_TABLE].stop_sink(cause)  # frames a drain loop writes are counted lost too
            self.warn(f"stopped recording: {message}; further rows are counted as lost")

    def _enforce_max_size(self) -> None:
        """Apply `max_size_bytes` (the whole session's size on disk, all processes) after a flush.

        stop: stop writing as soon as one more flush like the last would pass the cap, so the session
        stays under it while the event rate is steady; every row from then on is counted as lost
        (cause max-size). drop-oldest: delete this process's oldest closed shards until the session
        fits again, counting their rows as lost (cause max-size); the tables in `KEEP_TABLES` are never
        deleted. Either way the losses are in proc.json at once and in the drops table.
        """
        size = session_size_bytes(self.session_dir)
        written = sum(w.bytes_total for w in self.writers.values())
        last_flush, self._bytes_checked = written - self._bytes_checked, written
        if self.max_size_policy != "drop-oldest":
            if size + last_flush > self.max_size_bytes:
                self._stop_writing("max-size", f"session reached --max-size {self.max_size_bytes} bytes "
                                               f"({size} bytes on disk)")
            return
        if size <= self.max_size_bytes:
            return
        candidates = []
        for table, w in self.writers.items():
            if table in KEEP_TABLES:
                continue
            for path, rows in w.closed_shards:
                try:
                    candidates.append((path.stat().st_mtime_ns, path.name, path, rows, table))
                except OSError:
                    candidates.append((0, path.name, path, rows, table))  # gone: forget it below
        for _mtime, _name, path, rows, table in sorted(candidates):
            if size <= self.max_size_bytes:
                break
            try:
                n = path.stat().st_size
                path.unlink()
            except FileNotFoundError:  # deleted by hand: nothing to count, nothing to free
                self.writers[table].closed_shards.remove((path, rows))
                continue
            except OSError:
                continue
            size -= n
            self.writers[table].closed_shards.remove((path, rows))
            self.count_drop(table, rows, "max-size")
        if size > self.max_size_bytes:
            # What is left of ours is in open shards: close them, so the next flush can drop them.
            for table, w in self.writers.items():
                if table not in KEEP_TABLES and w.open_rows:
                    w.roll()

    def _hold_drops(self, rows: list) -> None:
        for _ts, table, n, cause in rows:
            self._held_drops[(table, cause)] = self._held_drops.get((table, cause), 0) + n

    def _write_held_drops(self) -> None:
        """At close: write the loss rows counted after writing stopped (and by the last max-size check)
        to the drops table, even past the cap: a few rows, and the record of what is missing."""
        self._hold_drops(self._take("drops"))
        if not self._held_drops:
            return
        now = time.monotonic_ns()
        batch = rows_to_batch("drops", [(now, t, n, c) for (t, c), n in sorted(self._held_drops.items())])
        try:
            self.writers["drops"].write(batch)
            self.rows_written["drops"] += batch.num_rows
            self._held_drops.clear()
        except OSError:
            pass  # proc.json still has the counts

    def _write_proc_file(self, status: str) -> None:
        self._proc_written_at, self._proc_dirty = time.monotonic(), False
        self.rows_written[FRAMES_TABLE] = self.writers[FRAMES_TABLE].frames  # the drains' threads write them
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
            write_json_atomic(self.dir / PROC_FILE, doc, indent=None)
        except OSError:
            pass  # the same disk trouble is already counted and warned about

    def close(self) -> None:
        """Flush everything and close the shards. Safe to call twice (atexit and explicit)."""
        if self._closed or os.getpid() != self.pid:
            return
        self._closed = True
        self._stop.set()
        with self._lock:
            try:  # first the frame file a drain loop writes: what the sink counted lost is then final
                self.writers[FRAMES_TABLE].close()
            except OSError:
                pass
            self._flush_locked()
            self._write_held_drops()
            for w in self.writers.values():
                try:
                    w.close()
                except OSError:
                    pass
            self.info["writer_cpu_s"] = round(self.writer_cpu_s, 6)
            self._write_proc_file(status="complete")


@functools.cache
def _types(table: str) -> tuple[pa.DataType, ...]:
    """The column types of `table`, read from its schema once (a field's `.type` is a new wrapper each time)."""
    return tuple(f.type for f in schema.arrow_schema(table))


def _row_count(table: str, rows: list) -> int:
    """Rows that `rows` (batches and tuples) stand for, as drops count them (shards.batch_rows): a
    drain's packed records as its records."""
    return sum(batch_rows(table, r) if isinstance(r, pa.RecordBatch)
               else r.count if isinstance(r, (PackedTimings, PendingColumns)) else 1 for r in rows)


class PendingColumns(NamedTuple):
    """Rows appended as whole NumPy columns (a ring's decoded rows), held as they are until the flush
    converts them to Arrow on the writer's thread, all of a flush's at once: Arrow converts with the GIL
    let go, and each time a background thread (the ring's drain) takes it back the engine's thread
    stops for two thread wake-ups (bench/bench_drain_gil.py)."""

    cols: dict[str, np.ndarray | list]  # schema column order
    count: int

    @staticmethod
    def of(sch: pa.Schema, cols: Any) -> PendingColumns | None:
        """`cols` held as they are when each of `sch`'s columns is a 1-D NumPy array of numbers, or a list
        for a string column, all of one length; None otherwise (converted at once). A missing column
        raises KeyError now, as always."""
        arrays = {name: cols[name] for name in sch.names}
        lengths = {a.shape[0] if isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype.kind in "iufb"
                   else len(a) if isinstance(a, list) and pa.types.is_string(sch.field(name).type) else -1
                   for name, a in arrays.items()}
        if len(lengths) != 1 or -1 in lengths:
            return None
        return PendingColumns(arrays, lengths.pop())


def _row_kind(row: Any) -> type:
    """What a held row is, for `_batches`: held columns, held timing records, a whole batch, or a row tuple."""
    for kind in (PendingColumns, PackedTimings, pa.RecordBatch):
        if isinstance(row, kind):
            return kind
    return tuple


def _converted(table: str, pending: list[PendingColumns] | list[PackedTimings]) -> pa.RecordBatch:
    """A run of held NumPy columns (or timing records, decoded) as one batch: each column joined, then
    converted once."""
    sch = schema.arrow_schema(table)
    if isinstance(pending[0], PackedTimings):
        cols = timing_columns(pending)
    else:
        cols = {name: _joined_column([p.cols[name] for p in pending]) for name in sch.names}
    return pa.RecordBatch.from_arrays([pa.array(cols[name], type=t, memory_pool=WRITE_POOL)
                                       for name, t in zip(sch.names, _types(table))], schema=sch)


def _joined_column(parts: list) -> Any:
    """One column's held parts as one: NumPy arrays concatenated, lists (of strings) chained."""
    if len(parts) == 1:
        return parts[0]
    return list(chain.from_iterable(parts)) if isinstance(parts[0], list) else np.concatenate(parts)


def _batches(table: str, rows: list, max_rows: int = 1 << 20) -> list[pa.RecordBatch]:
    """Row tuples, whole batches and held columns (from append_columns) as RecordBatches of at most
    `max_rows`, in order.
    Consecutive batches that fit in `max_rows` together are joined into one: the logs hand a table's rows
    over several times between two flushes, and each batch written costs an IPC message (its metadata
    per column) and a write() of its own."""
    out: list[pa.RecordBatch] = []
    for kind, group in groupby(rows, key=_row_kind):  # consecutive rows of one kind, in order
        group = list(group)
        if kind is tuple:
            out.extend(rows_to_batch(table, group[i:i + max_rows]) for i in range(0, len(group), max_rows))
        else:  # held NumPy columns or timing records, converted together; whole batches as they are
            batches = group if kind is pa.RecordBatch else [_converted(table, group)]
            out.extend(b.slice(i, max_rows) for b in batches for i in range(0, b.num_rows, max_rows))
    return _joined(out, max_rows) if len(out) > 1 else out


def _joined(batches: list[pa.RecordBatch], max_rows: int) -> list[pa.RecordBatch]:
    """`batches` with each run of consecutive ones of at most `max_rows` rows in all made one batch."""
    out: list[pa.RecordBatch] = []
    group: list[pa.RecordBatch] = []
    rows = 0
    for batch in (*batches, None):
        if batch is None or (group and rows + batch.num_rows > max_rows):
            if len(group) == 1:
                out.append(group[0])
            elif group:  # one copy of the rows, into memory from WRITE_POOL
                table = pa.Table.from_batches(group).combine_chunks(memory_pool=WRITE_POOL)
                out.extend(table.to_batches())
            group, rows = [], 0
        if batch is not None:
            group.append(batch)
            rows += batch.num_rows
    return out




# ---- the process-wide recorder -------------------------------------------------------------------
_recorder: Recorder | None = None
_recorder_lock = threading.Lock()
# Called on a "flush now" signal before the recorder writes: the probes register theirs
# (kvtrace.probes.lifecycle), so that rows they hold back (a step's pending rows, a device ring's
# records) are handed over first. The recorder knows nothing of probes.
_flush_hooks: list = []


def add_flush_hook(hook) -> None:
    """Have `hook()` run (once per registration, errors ignored) before a signalled flush."""
    if hook not in _flush_hooks:
        _flush_hooks.append(hook)


def run_flush_hooks() -> None:
    """Run the registered flush hooks; a hook's error never stops the others, nor the flush."""
    for hook in list(_flush_hooks):
        try:
            hook()
        except Exception:
            pass


def current_recorder() -> Recorder | None:
    """This process's recorder if one was made, without making one (a cheap check for hot paths)."""
    return _recorder


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


@contextlib.contextmanager
def as_process_recorder(rec: Recorder):
    """`rec` is this process's recorder meanwhile (what `get_recorder` returns, so code that reports
    through it, like a pinning scheduler's `kvtrace.probes.pins` calls, writes into `rec`): for sessions
    a process writes itself, such as a replay."""
    global _recorder
    with _recorder_lock:
        prev, _recorder = _recorder, rec
    try:
        yield rec
    finally:
        with _recorder_lock:
            _recorder = prev


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


# ---- stand-ins, for rings and probes used without a session (tests, benchmarks) --------------------
class MemoryRecorder:
    """A stand-in for `Recorder` that keeps rows in lists, as row tuples in schema column order
    (tests, benchmarks). The same sink as `Recorder`: `buffer(table).append(row)` for a row,
    `append_columns(table, cols)` for whole columns."""

    def __init__(self) -> None:
        self.buffers: dict[str, list] = {}
        self.dropped: dict[str, dict[str, int]] = {}
        self.warnings: list[str] = []
        self.status: dict[str, tuple[str, str]] = {}  # probe -> (status, detail), as a session's proc.json keeps it

    def buffer(self, table: str) -> list:
        return self.buffers.setdefault(table, [])

    def set_probe_status(self, probe: str, status: str, detail: str = "") -> None:
        self.status[probe] = (status, detail)

    def append_columns(self, table: str, cols: dict[str, Any] | pa.RecordBatch) -> None:
        """Whole columns, kept as row tuples in the table's column order."""
        if isinstance(cols, pa.RecordBatch):
            cols = {name: col.to_pylist() for name, col in zip(cols.schema.names, cols.columns)}
        names = [n for n in schema.column_names(table) if n in cols]
        values = [c.tolist() if hasattr(c, "tolist") else list(c) for c in map(cols.__getitem__, names)]
        self.buffer(table).extend(zip(*values, strict=True))

    def count_drop(self, table: str, n: int, cause: str) -> None:
        if n > 0:
            per = self.dropped.setdefault(table, {})
            per[cause] = per.get(cause, 0) + n

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        print(f"kvtrace: warning: {message}", file=sys.stderr, flush=True)


class NullRecorder(MemoryRecorder):
    """Counts and discards (no session active)."""

    def append_columns(self, table: str, cols: dict[str, Any] | pa.RecordBatch) -> None:
        pass

    def buffer(self, table: str) -> list:
        return []  # appended to and dropped
