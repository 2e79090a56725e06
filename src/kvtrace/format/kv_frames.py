"""Frame files: a process's KV access ring drains on disk, written by the drain's own thread, read by ingest
as the `kv_access_records` rows they stand for.

A small model on a GPU drains ~100,000 block records (3.4 MB) every 100 ms. Made into Arrow batches and
serialized by the shard writer, each flush's records cost its thread ~10 calls that let the GIL go and
take it back per batch, each a wait for the engine's thread; written as they are, a drain is one
`writev` (bench/bench_flush_handovers.py: a fifth of the hand-overs and a sixth of the time a flush).

    file    = FILE_MAGIC, u32 version, u32 record size (32), frame*, [END_MAGIC]
    frame   = FRAME_MAGIC, u32 copies (ints), i64 device ref ns, i64 host ref ns, f64 slope,
              u64 records, i32 copies[], records (REC_DTYPE, little-endian)

Like a shard, a file being written is `<table>.<seq>.kvframes.partial`; closing writes END_MAGIC and
renames it `.kvframes`. Each frame goes out in one `writev` and a failed one is cut back, so a killed
process leaves whole frames and at most a detectable cut tail. The reader yields the same
`kv_access_records` batches a shard of them holds (the checks of their values stay with the decoding,
kv_records.iter_kv_records), each of at most BATCH_BYTES of records, whatever a frame claims.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from kvtrace.errors import KvtraceError
from kvtrace.format import schema
from kvtrace.format.kv_records import BATCH_BYTES, MAX_COPIES, REC_DTYPE, PackedRecords, packed_batches

FRAME_SUFFIX = ".kvframes"
TABLE = "kv_access_records"
FILE_MAGIC = b"KVTRFRM\x00"
FILE_HEADER = struct.Struct("<8sII")  # magic, version, record size
VERSION = 1
FRAME_MAGIC = b"KVRF"
FRAME_HEADER = struct.Struct("<4sIqqdQ")  # magic, copies (ints), device ref ns, host ref ns, slope, records
END_MAGIC = b"KVRFEND\x00"


# ---- writing (on the drain's thread, in the recording processes) ------------------------------------
class FrameWriter:
    """Appends drains' block records as frames to rotating frame files in one directory: the shard
    writer's counterpart for `kv_access_records` (the same `closed_shards`, `bytes_total`, `open_rows`,
    `rotate_if_old` and `close`), called from the drains' threads and the recorder's, hence its lock."""

    def __init__(self, directory: Path, rotate_bytes: int, rotate_s: float):
        self.directory = directory
        self.table = TABLE
        self.rotate_bytes = rotate_bytes
        self.rotate_s = rotate_s
        self.seq = 0
        self.closed_shards: list[tuple[Path, int]] = []  # (path, records), oldest first
        self.broken = False
        self.bytes_total = 0  # bytes written, all files (for the max-size forecast)
        self.frames = 0  # frames written, all files (proc.json's rows_written: a drain each)
        self._fd: int | None = None
        self._path: Path | None = None
        self._bytes = 0
        self._rows = 0
        self._opened_at = 0.0
        self._lock = threading.Lock()

    @property
    def open_rows(self) -> int:
        """Records in the file being written (0 when none is open)."""
        return self._rows if self._fd is not None else 0

    def write_frame(self, recs: np.ndarray, clock: tuple[int, int, float], copies: tuple[int, ...] = ()) -> int:
        """Append one drain's records (REC_DTYPE, any memory: written before this returns) with the clock
        mapping to decode their timestamps with and the layers recorded as copies ((layer, source) pairs,
        flattened). Returns the bytes written. Raises OSError on disk trouble."""
        body = memoryview(np.ascontiguousarray(recs)).cast("B")
        head = FRAME_HEADER.pack(FRAME_MAGIC, len(copies), int(clock[0]), int(clock[1]), float(clock[2]),
                                 len(body) // REC_DTYPE.itemsize) + struct.pack(f"<{len(copies)}i", *copies)
        with self._lock:
            if self._fd is None:
                self._open()
            if self.broken:
                raise OSError(f"{self._path}: frame file left incomplete by an earlier write error")
            self._write_all([head, body])  # the GIL let go once, for the whole frame
            size = len(head) + len(body)
            self._bytes += size
            self.bytes_total += size
            self._rows += len(body) // REC_DTYPE.itemsize
            self.frames += 1
            if self._bytes >= self.rotate_bytes or time.monotonic() - self._opened_at >= self.rotate_s:
                self._close()
        return size

    def rotate_if_old(self) -> None:
        """Close the open file once it is `rotate_s` old, so that a quiet ring leaves no `.partial` open."""
        with self._lock:
            if self._fd is not None and time.monotonic() - self._opened_at >= self.rotate_s:
                self._close()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _open(self) -> None:
        self._path = self.directory / f"{TABLE}.{self.seq:05d}{FRAME_SUFFIX}.partial"
        self.seq += 1
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._bytes = 0
        header = FILE_HEADER.pack(FILE_MAGIC, VERSION, REC_DTYPE.itemsize)
        try:
            self._write_all([header])
        except OSError:  # no room for the header: no file, so that no frame follows a missing one
            os.close(self._fd)
            self._fd = None
            self._path.unlink(missing_ok=True)
            raise
        self._bytes, self._rows, self._opened_at = len(header), 0, time.monotonic()
        self.bytes_total += len(header)

    def _write_all(self, parts: list) -> None:
        """Write all of `parts` or nothing: on an error (disk full) cut the file back to where it was."""
        views = [memoryview(p).cast("B") for p in parts]
        try:
            while views:
                done = os.writev(self._fd, views)
                while views and done >= len(views[0]):
                    done -= len(views[0])
                    views.pop(0)
                if views:
                    views[0] = views[0][done:]
        except OSError:
            try:
                os.ftruncate(self._fd, self._bytes)
                os.lseek(self._fd, self._bytes, os.SEEK_SET)
            except OSError:
                self.broken = True  # a cut tail stays: close() leaves the file `.partial`
            raise

    def _close(self) -> None:
        if self._fd is None:
            return
        try:
            if self.broken:  # never seal a file with a torn frame in it: readers stop at its last whole one
                return
            try:
                self._write_all([END_MAGIC])
            except OSError:  # no room for the marker: the file stays `.partial`, whole up to its last frame
                return
            self.bytes_total += len(END_MAGIC)
            final = self._path.with_name(self._path.name[: -len(".partial")])
            os.replace(self._path, final)
            self.closed_shards.append((final, self._rows))
        finally:
            os.close(self._fd)
            self._fd = None


# ---- reading (in ingest) -----------------------------------------------------------------------------
def read_frames(f: BinaryIO, size: int, path: Path, is_open: bool, result) -> Iterator[pa.RecordBatch]:
    """Yield the `kv_access_records` batches of the first `size` bytes of a frame file open as `f`,
    filling `result` (shards.ShardRead: rows = records, batches, bytes_cut, problems); returns whether
    the end marker was read. A file still being written (`is_open`) is read to its last whole frame and a
    cut tail is reported; in a closed one, anything but whole frames and the end marker is a
    KvtraceError naming the file and the offset."""
    sch = schema.arrow_schema(TABLE)
    per_batch = BATCH_BYTES // REC_DTYPE.itemsize

    def cut(at: int, what: str) -> None:
        if not is_open:
            raise KvtraceError(f"{path}: corrupt frame file: {what} (a closed file was cut short or written to "
                               f"by something else)")
        result.bytes_cut = size - at
        result.problems.append(f"{path}: last frame cut ({result.bytes_cut} bytes after record {result.rows})")

    head = f.read(min(FILE_HEADER.size, size))
    if len(head) < FILE_HEADER.size:
        if is_open:
            result.bytes_cut = len(head)
            result.problems.append(f"{path}: header cut ({len(head)} bytes)")
            return False
        raise KvtraceError(f"{path}: not a kvtrace frame file ({len(head)} bytes)")
    magic, version, rec_size = FILE_HEADER.unpack(head)
    if magic != FILE_MAGIC:
        raise KvtraceError(f"{path}: not a kvtrace frame file (it starts {magic!r})")
    if version != VERSION or rec_size != REC_DTYPE.itemsize:
        raise KvtraceError(f"{path}: frame file version {version} with {rec_size}-byte records; this kvtrace "
                           f"reads version {VERSION} with {REC_DTYPE.itemsize}-byte records")
    at = FILE_HEADER.size
    while True:
        raw = f.read(min(len(END_MAGIC), size - at))  # the end marker, or a frame header's first bytes
        if not raw:
            if not is_open:
                raise KvtraceError(f"{path}: corrupt frame file: no end marker after record {result.rows} (a "
                                   f"closed file was cut short)")
            return False
        if raw == END_MAGIC:
            break
        if len(raw) == len(END_MAGIC) and raw[:len(FRAME_MAGIC)] != FRAME_MAGIC:
            raise KvtraceError(f"{path}: corrupt frame file: {raw!r} where a frame starts, at byte {at}")
        raw += f.read(min(FRAME_HEADER.size - len(raw), size - at - len(raw)))
        if len(raw) < FRAME_HEADER.size:
            cut(at, f"the frame header at byte {at} is cut")
            return False
        _, n_copies, dev_ref, host_ref, slope, count = FRAME_HEADER.unpack(raw)
        if n_copies > 2 * MAX_COPIES or n_copies % 2:
            raise KvtraceError(f"{path}: corrupt frame file: a frame names {n_copies} copy ints at byte {at} "
                               f"(at most {2 * MAX_COPIES}, in pairs)")
        body_bytes = 4 * n_copies + count * REC_DTYPE.itemsize
        if at + FRAME_HEADER.size + body_bytes > size:
            cut(at, f"the frame at byte {at} ({count} records) runs past the end of the file")
            return False
        copies = tuple(struct.unpack(f"<{n_copies}i", f.read(4 * n_copies)))
        clock = (dev_ref, host_ref, slope)
        left = count
        while left:  # a batch of at most BATCH_BYTES at a time, whatever the frame's size
            n = min(left, per_batch)
            data = np.frombuffer(f.read(n * REC_DTYPE.itemsize), np.uint8)
            if data.size != n * REC_DTYPE.itemsize:  # the file shrank while it was read
                raise KvtraceError(f"{path}: frame file changed while it was read (at byte {at})")
            yield from packed_batches([PackedRecords(data, clock, copies, n)], sch)
            result.rows += n
            result.batches += 1
            left -= n
        at += FRAME_HEADER.size + body_bytes
    if at + len(END_MAGIC) != size:
        raise KvtraceError(f"{path}: corrupt frame file: {size - at - len(END_MAGIC)} unexpected bytes after the "
                           f"end marker")
    return True
