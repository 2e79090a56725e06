"""Frame files: a process's KV access ring drains on disk, written by the drain's own thread, read by ingest
as the `kv_access_records` rows they stand for.

A small model on a GPU drains ~100,000 block records (3.4 MB) every 100 ms. Made into Arrow batches and
serialized by the shard writer, each flush's records cost its thread ~10 calls that let the GIL go and
take it back per batch, each a wait for the engine's thread; written as they are, a drain is one
`writev` (bench/bench_flush_handovers.py: a fifth of the hand-overs and a sixth of the time a flush).

    file    = FILE_MAGIC, u32 version, u32 record size (32), frame*, [END_MAGIC]
    frame   = FRAME_MAGIC, u32 copies (ints), i64 device ref ns, i64 host ref ns, f64 slope,
              u64 records, i32 copies[], records (REC_DTYPE, little-endian)

Like a shard (format/sealed_files.py), a file being written is `<table>.<seq>.kvframes.partial`; closing
writes END_MAGIC and renames it `.kvframes`. A CUDA ring's drain loop, which runs without the GIL, writes
its frames itself through the writer's native sink (`FrameWriter.native_sink`, `_drain.FrameSink`: the same
frames, under the sink's lock); the files' life (open, header, rotation, seal) stays here. Each frame goes out in one `writev` and a failed one is cut
back, so a killed process leaves whole frames and at most a detectable cut tail. The reader yields the same
`kv_access_records` batches a shard of them holds (the checks of their values stay with the decoding,
kv_records.iter_kv_records), each of at most BATCH_BYTES of records, whatever a frame claims.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from kvtrace.errors import KvtraceError
from kvtrace.format import schema
from kvtrace.format.kv_records import BATCH_BYTES, MAX_COPIES, REC_DTYPE, PackedRecords, packed_batches
from kvtrace.format.sealed_files import SealedFileWriter

FRAME_SUFFIX = ".kvframes"
TABLE = "kv_access_records"
FILE_MAGIC = b"KVTRFRM\x00"
FILE_HEADER = struct.Struct("<8sII")  # magic, version, record size
VERSION = 1
FRAME_MAGIC = b"KVRF"
FRAME_HEADER = struct.Struct("<4sIqqdQ")  # magic, copies (ints), device ref ns, host ref ns, slope, records
END_MAGIC = b"KVRFEND\x00"


# ---- writing (on the drain's thread, in the recording processes) ------------------------------------
class FrameWriter(SealedFileWriter):
    """Appends drains' block records as frames to rotating frame files in one directory: the shard
    writer's counterpart for `kv_access_records` (sealed_files.SealedFileWriter: the same files' life),
    called from the drains' threads and the recorder's."""

    suffix = FRAME_SUFFIX
    end_marker = END_MAGIC
    kind = "frame file"

    def __init__(self, directory: Path, rotate_bytes: int, rotate_s: float):
        super().__init__(directory, TABLE, rotate_bytes, rotate_s)
        self._sink = None          # a _drain.FrameSink, once a drain loop asked for one (native_sink)
        self._sink_owns = False    # the sink writes the open file (every frame goes through it)

    @property
    def frames(self) -> int:
        """Frames written, all files (proc.json's rows_written: a drain each)."""
        return self.pieces + (self._sink.counts()["frames_total"] if self._sink is not None else 0)

    @property
    def bytes_total(self) -> int:
        return self._bytes_written + (self._sink.counts()["bytes_total"] if self._sink is not None else 0)

    @property
    def open_rows(self) -> int:
        if self._sink_owns:
            return self._rows + self._sink.counts()["file_records"]
        return super().open_rows

    def native_sink(self, make_sink: Any):
        """The sink a native drain loop writes its frames through, made once by `make_sink()` (the drain
        module's `FrameSink`, which the caller has), handed the open file (opened now if none is). Raises
        OSError when no file can be opened. From then on every frame of this writer goes through the sink,
        until `close`."""
        with self._lock:
            if self._sink is None:
                self._sink = make_sink()
            if not self._sink_owns:
                if self.broken:
                    raise OSError(f"{self._path}: {self.kind} left incomplete by an earlier write error")
                if self._fd is None:
                    self._open()
                self._sink.swap(self._fd, self._bytes)
                self._sink_owns = True
            return self._sink

    def sink_drops(self) -> tuple[int, str, int]:
        """(frames' records the sink counted lost since the last call, their cause, errno of a failed
        write or 0): the recorder's flush counts them."""
        return self._sink.take() if self._sink is not None else (0, "", 0)

    def stop_sink(self, cause: str) -> None:
        """The recorder stopped writing: the sink counts its frames' records lost under `cause`."""
        if self._sink is not None:
            self._sink.stop(cause)

    def rotate_if_old(self) -> None:
        """Also past `rotate_bytes` while the sink writes (its frames do not pass through `_append`)."""
        if not self._sink_owns:
            return super().rotate_if_old()
        with self._lock:
            if self._sink_owns and (time.monotonic() - self._opened_at >= self.rotate_s
                                    or self._sink.counts()["file_bytes"] >= self.rotate_bytes):
                self._rotate_sink()

    def roll(self) -> None:
        if not self._sink_owns:
            return super().roll()
        with self._lock:
            if self._sink_owns:
                self._rotate_sink()

    def close(self) -> None:
        with self._lock:
            if self._sink_owns:  # the sink gives the file back and writes no more (its frames: take())
                self._sink_owns = False
                self._seal_from_sink(self._sink.swap(-1, 0), self._path, self._rows)
                self._fd = None
            else:
                self._close()

    def _rotate_sink(self) -> None:
        """A new file for the sink, then the old one sealed (the sink never writes it again). Lock held."""
        old = (self._fd, self._path, self._bytes, self._rows, self._opened_at)
        self._fd = None
        try:
            self._open()
        except OSError:  # no room for a new file: the sink keeps writing the old one
            self._fd, self._path, self._bytes, self._rows, self._opened_at = old
            return
        given_back = self._sink.swap(self._fd, self._bytes)
        self._seal_from_sink(given_back, old[1], old[3])

    def _seal_from_sink(self, given_back: tuple, path: Path, rows: int) -> None:
        """Seal the file the sink gave back, (fd, bytes, frames, records, broken): `rows` written to it
        before the sink took it, and the sink's records."""
        fd, size, _frames, records, broken = given_back
        if fd >= 0:
            self._seal(fd, path, size, rows + records, bool(broken))

    def header(self) -> bytes:
        return FILE_HEADER.pack(FILE_MAGIC, VERSION, REC_DTYPE.itemsize)

    def write_frame(self, recs: np.ndarray, clock: tuple[int, int, float], copies: tuple[int, ...] = ()) -> int:
        """Append one drain's records (REC_DTYPE, any memory: written before this returns) with the clock
        mapping to decode their timestamps with and the layers recorded as copies ((layer, source) pairs,
        flattened). Returns the bytes written. Raises OSError on disk trouble."""
        body = memoryview(np.ascontiguousarray(recs)).cast("B")
        rows = len(body) // REC_DTYPE.itemsize
        with self._lock:  # the sink takes and gives back the file under this lock: one writer at a time
            if self._sink_owns:  # the sink writes the file (a write it cannot make it counts as lost)
                self._sink.write(body, int(clock[0]), int(clock[1]), float(clock[2]), copies)
                return len(body)
            head = FRAME_HEADER.pack(FRAME_MAGIC, len(copies), int(clock[0]), int(clock[1]), float(clock[2]),
                                     rows) + struct.pack(f"<{len(copies)}i", *copies)
            return self._append_locked([head, body], rows)  # the GIL let go once, for the whole frame


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
