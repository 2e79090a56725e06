"""Shard files: a session's rows on disk, one Arrow IPC stream per table and process, written by the
recorder (`ShardWriter`) and read by ingest (`list_shards`, `read_shard`).

A shard is an Arrow IPC stream. While written it is `<table>.<seq>.arrows.partial`; closing writes the
end-of-stream marker and renames it `.arrows`. Every batch goes out whole (format/sealed_files.py, which
the KV record frame files share), so a killed process leaves whole batches and at most a detectable cut
tail.

Reading: a closed shard (`.arrows`) must read to its end-of-stream marker; a shard that was still open
(`.arrows.partial`, its process was killed or is still running) is read up to its last complete batch
and the bytes after it are reported as cut, never an error; an open shard is reported even when not cut
(`ShardRead.problems`, then `ingest_issues`), since rows its process had not flushed are missing, unless
the process said it flushed everything before it was stopped. Anything else that does not read (a
closed shard cut short or without its end-of-stream marker, flipped bits in the framing, values that are
not valid Arrow such as non-UTF-8 strings, another table's schema, not Arrow at all) is a
`KvtraceError` naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.errors import KvtraceError
from kvtrace.format import schema
from kvtrace.format.kv_frames import FRAME_SUFFIX, read_frames
from kvtrace.format.kv_frames import TABLE as FRAMES_TABLE
from kvtrace.format.kv_records import expand_kv_records, iter_kv_records
from kvtrace.format.sealed_files import OPEN_SUFFIX, SealedFileWriter
from kvtrace.format.session import read_proc, shown

EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # Arrow IPC end-of-stream marker, written when a shard closes


# ---- writing (in the recording processes) --------------------------------------------------------
SHARD_SUFFIX = ".arrows"


class ShardWriter(SealedFileWriter):
    """Appends RecordBatches of one table to rotating Arrow IPC stream files in one directory
    (sealed_files.SealedFileWriter: the files' life)."""

    suffix = SHARD_SUFFIX
    end_marker = EOS
    kind = "shard"

    def __init__(self, directory: Path, table: str, rotate_bytes: int, rotate_s: float):
        super().__init__(directory, table, rotate_bytes, rotate_s)
        self.schema = schema.arrow_schema(table)

    def header(self) -> bytes:
        """The stream's schema message (its end-of-stream marker cut off: batches follow)."""
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, self.schema):
            pass
        return sink.getvalue().to_pybytes()[: -len(EOS)]

    def write(self, batch: pa.RecordBatch) -> int:
        """Append one batch; returns the bytes written. Raises OSError on disk trouble."""
        # whole batches only: a kill leaves whole batches or a detectable tail
        return self._append([_batch_message(batch)], batch_rows(self.table, batch))


# Arrow's memory for the rows the recorder converts and the IPC bytes it writes: the C library's
# malloc, not Arrow's default pool (mimalloc). mimalloc hands a flush's buffers (~1 MB of
# step_requests every 0.5 s, as it flushed then) back to the OS and takes fresh pages at the next, which the kernel must
# zero, often as 2 MB huge pages (and compact memory for them first): perf measured ~0.8% of a
# scheduling step in that, and up to 30 ms of system time a round (bench_host_probes, 2026-11-24,
# docs/performance.md). malloc keeps and reuses them.
WRITE_POOL = pa.system_memory_pool()


def _batch_message(batch: pa.RecordBatch) -> pa.Buffer:
    """The IPC bytes of one record batch as it stands in a stream (encapsulated message), in Arrow's
    own buffer: written from there, not copied into a Python bytes first."""
    return batch.serialize(memory_pool=WRITE_POOL)


def rows_to_batch(table: str, rows: list[tuple]) -> pa.RecordBatch:
    """Transpose row tuples into a RecordBatch of `table`'s schema."""
    sch = schema.arrow_schema(table)
    cols = list(zip(*rows, strict=False)) if rows else [[] for _ in sch]
    arrays = [pa.array(col, type=field.type, memory_pool=WRITE_POOL) for col, field in zip(cols, sch, strict=False)]
    return pa.RecordBatch.from_arrays(arrays, schema=sch)


# ---- reading (in ingest) -------------------------------------------------------------------------
@dataclass
class Shard:
    path: Path
    table: str
    open: bool  # still being written when read (or its process was killed)
    # The writing process's proc.json status: "flushed" means it wrote everything it held when
    # `kvtrace record` asked, just before vLLM stopped it, so its open shards miss nothing.
    proc_status: str | None = None
    # A `.partial` of the same name lies beside this closed shard (a copy of a session taken while it
    # was closing): the same rows twice. The closed one is read, once, and ingest says so.
    beside_partial: bool = False


@dataclass
class ShardRead:
    """What reading one shard found, beside its batches."""

    rows: int = 0
    batches: int = 0
    bytes_cut: int = 0  # bytes after the last complete batch of an open shard
    problems: list[str] = field(default_factory=list)


def list_shards(proc_dir: Path, status: str | None = None) -> list[Shard]:
    """The shards of one process folder, in table then sequence order; unknown files are ignored.
    `status` is the process's proc.json status, read here when not given (format.session.ProcDir has it)."""
    shards = []
    if status is None:
        status = read_proc(proc_dir).get("status")
    names = set(os.listdir(proc_dir))
    for name in sorted(names):
        is_open = name.endswith((SHARD_SUFFIX + OPEN_SUFFIX, FRAME_SUFFIX + OPEN_SUFFIX))
        if not (is_open or name.endswith((SHARD_SUFFIX, FRAME_SUFFIX))):
            continue
        if is_open and name[: -len(OPEN_SUFFIX)] in names:
            continue  # the closed shard of the same name has these rows (and says so when read)
        table = name.split(".", 1)[0]
        if table not in schema.SHARD_TABLES:
            raise KvtraceError(f"{proc_dir / name}: shard of unknown table {table!r}")
        if FRAME_SUFFIX in name and table != FRAMES_TABLE:
            raise KvtraceError(f"{proc_dir / name}: a frame file of {table!r} (only {FRAMES_TABLE} is written "
                               f"as frames)")
        shards.append(Shard(proc_dir / name, table, is_open, status,
                            beside_partial=not is_open and name + OPEN_SUFFIX in names))
    return shards


def _take_closed(shard: Shard) -> None:
    """An open shard's file is gone: its process closed it (renamed .partial -> .arrows) since it was
    listed, and `shard` now names the closed file; or it vanished, which is an error."""
    path = shard.path
    closed = path.with_name(path.name[: -len(OPEN_SUFFIX)]) if shard.open else None
    if closed is None or not closed.exists():
        raise KvtraceError(f"{path}: shard vanished while the session was being read")
    shard.path, shard.open = closed, False


def read_shard(shard: Shard, result: ShardRead) -> Iterator[pa.RecordBatch]:
    """Yield the shard's batches, checked against its table's schema; fills `result` as it goes."""
    path = shard.path
    if shard.beside_partial:
        result.problems.append(f"{path}{OPEN_SUFFIX}: the same shard as {path.name}, not yet removed (a copy "
                               "of a session taken while it closed?): its rows were read once")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        _take_closed(shard)  # its process closed it between listing and reading
        yield from read_shard(shard, result)
        return
    except OSError as exc:
        raise KvtraceError(f"{path}: cannot read shard ({exc.strerror or exc})") from None
    if not path.is_file():
        raise KvtraceError(f"{path}: not a file (expected an Arrow IPC shard)")
    frames = FRAME_SUFFIX in path.name  # the KV access rings' drains (kv_frames.py), read as shard rows
    if size == 0:
        if shard.open:  # created, killed before the header was flushed
            if shard.proc_status != "flushed":
                result.problems.append(f"{path}: not closed and empty (its process stopped before writing to it)")
            return
        raise KvtraceError(f"{path}: empty {'frame' if frames else 'shard'} file")
    expected = schema.arrow_schema(shard.table)
    try:
        # A closed shard is mapped: its batches are read in place (zero-copy), which halves the cost of
        # reading a session. One still being written is read through a file, whose size may change.
        # Arrow takes paths as UTF-8: a name that is not (bytes Python keeps as surrogates) is read
        # through Python's file instead, as is a frame file (read a frame at a time).
        name = str(path)
        f = open(path, "rb") if frames or shard.open or shown(name) != name else pa.memory_map(name)
    except FileNotFoundError:
        _take_closed(shard)  # closed between the size check above and the open
        yield from read_shard(shard, result)
        return
    except OSError as exc:
        raise KvtraceError(f"{path}: cannot read shard ({exc.strerror or exc})") from None
    with f:
        if frames:
            ended = yield from read_frames(f, size, path, shard.open, result)
            if shard.open and not ended and not result.bytes_cut and shard.proc_status != "flushed":
                result.problems.append(f"{path}: not closed (its process was killed or is still running); read "
                                       f"to its last whole frame, {result.rows} records")
            return
        try:
            reader = pa.ipc.open_stream(f)
        except (pa.ArrowException, OSError) as exc:  # ArrowInvalid, or NotImplemented for flipped type ids
            if shard.open and size < 4096:
                result.bytes_cut = size
                result.problems.append(f"{path}: header cut ({size} bytes)")
                return
            raise KvtraceError(f"{path}: not an Arrow IPC stream ({_short(exc)})") from None
        try:
            _check_schema(path, reader.schema, shard.table, expected)
        except UnicodeDecodeError:
            raise KvtraceError(f"{path}: column names are not UTF-8; not a {shard.table} shard") from None
        good_end = f.tell()
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
                if shard.open:
                    result.bytes_cut = size - good_end
                    result.problems.append(
                        f"{path}: last batch cut ({result.bytes_cut} bytes after row {result.rows})")
                    return
                raise KvtraceError(f"{path}: corrupt shard after row {result.rows} ({_short(exc)})") from None
            try:
                # IPC reading checks the framing, not the values: bad offsets or non-UTF-8 strings
                # (flipped bits, another writer) would fail later inside DuckDB, or read out of bounds.
                batch.validate(full=True)
            except (pa.ArrowInvalid, pa.ArrowException) as exc:
                raise KvtraceError(f"{path}: invalid data in the batch after row {result.rows} "
                                   f"({_short(exc)})") from None
            good_end = f.tell()
            result.rows += batch.num_rows
            result.batches += 1
            yield batch
        f.seek(good_end)
        tail = f.read(len(EOS) + 1)
        if shard.open:
            if tail and tail != EOS:  # an open shard may end with the marker (closed, not yet renamed)
                result.bytes_cut = size - good_end
                result.problems.append(
                    f"{path}: last batch cut ({result.bytes_cut} bytes after row {result.rows})")
            elif not tail and shard.proc_status != "flushed":
                # Whole batches only, but never closed: its process was killed (or is still running), so
                # rows it had not flushed yet are missing. Said here, as nothing else in the files says it.
                result.problems.append(f"{path}: not closed (its process was killed or is still running); "
                                       f"read to its last whole batch, {result.rows} rows")
        elif tail != EOS:
            # Closing writes the end-of-stream marker; without it batches after row N may be missing (a
            # copy cut at a batch boundary); bytes after it were not written by kvtrace.
            what = ("no end-of-stream marker" if not tail else
                    f"{size - good_end - len(EOS)} unexpected bytes after the end-of-stream marker"
                    if tail.startswith(EOS) else f"{size - good_end} bytes that are not a batch")
            raise KvtraceError(f"{path}: corrupt shard: {what} after row {result.rows} (a closed shard "
                               f"was cut short or written to by something else)")


def loads_into(table: str) -> str:
    """The table a shard table's rows are stored in: itself, or for a run table (schema.RUN_TABLES) the
    table it expands into."""
    run = schema.RUN_TABLES.get(table)
    return run[0] if run is not None else table


# A run longer than this is not something kvtrace wrote (DecodeLog and SlotRuns hand their runs over at
# least every second, record/buffers.py FLUSH_NS), and expanding it would take that many rows' memory: refused as a damaged shard.
MAX_RUN_STEPS = 1 << 24

# Rows one batch of a run table may expand into (a flush's runs stand for a few million at most): bounds
# what a damaged shard can make ingest allocate.
MAX_EXPANDED_ROWS = 1 << 27


def _run_positions(batch: pa.RecordBatch, where: object, table: str, noun: str,
                   nullable: tuple[str, ...] = ()) -> tuple[np.ndarray, np.ndarray, int]:
    """For each row a run table's batch stands for: the run it is in and its place in that run, and how
    many rows in all; a batch kvtrace did not write (nulls outside `nullable`, a run of no steps or of
    more than MAX_RUN_STEPS, more rows than MAX_EXPANDED_ROWS) is refused in one line."""
    nulls = [f.name for f, c in zip(batch.schema, batch.columns) if c.null_count and f.name not in nullable]
    if nulls:  # the logs write none: a null would expand into rows of made-up values
        raise KvtraceError(f"{where}: {table} batch with nulls in {', '.join(nulls)}; not a shard kvtrace wrote")
    steps = batch.column("steps").to_numpy(zero_copy_only=False).astype(np.int64)
    if batch.num_rows and (steps.min() < 1 or steps.max() > MAX_RUN_STEPS):
        raise KvtraceError(f"{where}: {noun} of {int(steps.min() if steps.min() < 1 else steps.max())} steps; "
                           f"not a shard kvtrace wrote")
    total = int(steps.sum())
    if total > MAX_EXPANDED_ROWS:
        raise KvtraceError(f"{where}: {table} standing for {total} rows in one batch; not a shard kvtrace wrote")
    run = np.repeat(np.arange(batch.num_rows), steps)
    return run, np.arange(total) - np.repeat(np.cumsum(steps) - steps, steps), total


def expand_decode_runs(batch: pa.RecordBatch, where: object = "decode_runs") -> pa.RecordBatch:
    """The step_requests rows a decode_runs batch stands for (schema.RUN_TABLES): row i of a run is step
    `step + i`, `tokens` tokens, computed_before `computed_before + i * tokens`, new_blocks `new_blocks`
    for i = 0 and 0 after, phase decode, chunk_index -1, kind running. Runs come out in their order, each
    run's rows in step order. `where` names the shard in the error a damaged batch gets."""
    run, i, total = _run_positions(batch, where, "decode_runs", "decode run")

    def column(name: str) -> np.ndarray:
        return batch.column(name).to_numpy(zero_copy_only=False)[run]

    tokens = column("tokens").astype(np.int64)
    into = schema.arrow_schema("step_requests")
    try:
        arrays = {
            "step": pa.array(column("step") + i, pa.int64()),
            "request_id": batch.column("request_id").take(pa.array(run)),
            "tokens": pa.array(tokens, pa.int32()),
            "phase": pa.repeat("decode", total),
            "chunk_index": pa.array(np.full(total, -1, np.int32)),
            "computed_before": pa.array(column("computed_before").astype(np.int64) + i * tokens, pa.int32()),
            "new_blocks": pa.array(np.where(i == 0, column("new_blocks"), 0), pa.int32()),
            "kind": pa.repeat("running", total),
        }
    except (pa.ArrowException, OverflowError, ValueError) as exc:  # computed_before past int32: damaged
        raise KvtraceError(f"{where}: decode runs that do not expand ({_short(exc)}); not a shard kvtrace "
                           f"wrote") from None
    return pa.RecordBatch.from_arrays([arrays[f.name] for f in into], schema=into)


def expand_batch_slot_runs(batch: pa.RecordBatch, where: object = "batch_slot_runs") -> pa.RecordBatch:
    """The batch_slots rows a batch_slot_runs batch stands for (schema.RUN_TABLES): row i of a run is step
    `step + i` with the run's slot and request. Runs come out in their order, each run's rows in step
    order. `where` names the shard in the error a damaged batch gets."""
    # a request id may be null (an empty row), as in batch_slots
    run, i, _ = _run_positions(batch, where, "batch_slot_runs", "batch slot run", nullable=("request_id",))
    into = schema.arrow_schema("batch_slots")
    first = batch.column("step").to_numpy(zero_copy_only=False).astype(np.int64)
    return pa.RecordBatch.from_arrays(
        [pa.array(first[run] + i, pa.int64()), pa.array(batch.column("slot").to_numpy(zero_copy_only=False)[run], pa.int32()),
         batch.column("request_id").take(pa.array(run))], schema=into)


EXPAND = {"decode_runs": expand_decode_runs, "batch_slot_runs": expand_batch_slot_runs,
          "kv_access_records": expand_kv_records}
# How many rows a run table's batch stands for, without making them.
EXPANDED_ROWS = {"decode_runs": lambda batch: int(pc.sum(batch.column("steps")).as_py() or 0),
                 "batch_slot_runs": lambda batch: int(pc.sum(batch.column("steps")).as_py() or 0),
                 "kv_access_records": lambda batch: int(pc.sum(batch.column("records_count")).as_py() or 0)}


def batch_rows(table: str, batch: pa.RecordBatch) -> int:
    """Rows a shard batch stands for, as drops count them: a kv_access_records row as its records (the
    rows ingest makes of it); other tables' batches, run tables' included, as their rows."""
    if table == "kv_access_records":
        return EXPANDED_ROWS[table](batch)
    return batch.num_rows


def stored_rows(proc_dir: Path) -> dict[str, int]:
    """Rows per table that ingest would store from one process folder's shards (a run table's counted
    as the rows it expands into; block_events as calls, before unnesting)."""
    out: dict[str, int] = {}
    for shard in list_shards(proc_dir):
        count = EXPANDED_ROWS.get(shard.table, lambda batch: batch.num_rows)
        table = loads_into(shard.table)
        out[table] = out.get(table, 0) + sum(count(b) for b in read_shard(shard, ShardRead()))
    return out


def loaded_batch(table: str, batch: pa.RecordBatch, where: object = "") -> pa.RecordBatch:
    """A shard batch as the rows ingest stores: a run table's expanded, an older schema's padded."""
    expand = EXPAND.get(table)
    if expand is not None:
        return expand(batch, where or table)
    return pad_batch(batch, table)


def loaded_batches(table: str, batch: pa.RecordBatch, where: object = "") -> Iterator[pa.RecordBatch]:
    """`loaded_batch`'s rows in pieces: kv_access_records a row's records at a time (its layer copies
    can make many times the rows it holds)."""
    if table == "kv_access_records":
        yield from iter_kv_records(batch, where or table)
    else:
        yield loaded_batch(table, batch, where)


def _check_schema(path: Path, got: pa.Schema, table: str, expected: pa.Schema) -> None:
    meta = got.metadata or {}
    named = meta.get(b"kvtrace.table", b"").decode(errors="replace")
    if named and named != table:
        raise KvtraceError(f"{path}: holds table {named!r}, but its name says {table!r}")
    version = meta.get(b"kvtrace.schema_version", b"0").decode(errors="replace")
    if version.isdigit() and int(version) > schema.SCHEMA_VERSION:
        raise KvtraceError(f"{path}: schema_version {version} is newer than this kvtrace reads "
                           f"({schema.SCHEMA_VERSION}); upgrade kvtrace")
    # Older shards may lack trailing columns added since; every column they have must match.
    for i, fld in enumerate(got):
        if i >= len(expected) or expected[i].name != fld.name or not expected[i].type.equals(fld.type):
            raise KvtraceError(f"{path}: column {i} is {fld.name}:{fld.type}, not what table "
                               f"{table!r} has; not a {table} shard")


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:160] if str(exc) else exc.__class__.__name__


def pad_batch(batch: pa.RecordBatch, table: str) -> pa.RecordBatch:
    """A batch of an older schema version, padded with null trailing columns."""
    expected = schema.arrow_schema(table)
    if batch.num_columns == len(expected):
        return batch
    arrays = list(batch.columns) + [pa.nulls(batch.num_rows, f.type) for f in expected][batch.num_columns:]
    return pa.RecordBatch.from_arrays(arrays, schema=expected)
