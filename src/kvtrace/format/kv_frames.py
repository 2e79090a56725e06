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
writes END_MAGIC and renames it `.kvframes`. Each frame goes out in one `writev` and a failed one is cut
back, so a killed process leaves whole frames and at most a detectable cut tail. The reader yields the same
`kv_access_records` batches a shard of them holds (the checks of their values stay with the decoding,
kv_records.iter_kv_records), each of at most BATCH_BYTES of records, whatever a frame claims.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

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

    @property
    def frames(self) -> int:
        """Frames written, all files (proc.json's rows_written: a drain each)."""
        return self.pieces

    def header(self) -> bytes:
        return FILE_HEADER.pack(FILE_MAGIC, VERSION, REC_DTYPE.itemsize)

    def write_frame(self, recs: np.ndarray, clock: tuple[int, int, float], copies: tuple[int, ...] = ()) -> int:
        """Append one drain's records (REC_DTYPE, any memory: written before this returns) with the clock
        mapping to decode their timestamps with and the layers recorded as copies ((layer, source) pairs,
        flattened). Returns the bytes written. Raises OSError on disk trouble."""
        body = memoryview(np.ascontiguousarray(recs)).cast("B")
        rows = len(body) // REC_DTYPE.itemsize
        head = FRAME_HEADER.pack(FRAME_MAGIC, len(copies), int(clock[0]), int(clock[1]), float(clock[2]),
                                 rows) + struct.pack(f"<{len(copies)}i", *copies)
        return self._append([head, body], rows)  # the GIL let go once, for the whole frame


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
