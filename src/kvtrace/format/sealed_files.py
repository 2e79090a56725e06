"""What the two kinds of file a recording process writes share: a table's rows appended to rotating files
in one directory, each piece written whole or cut back, the file sealed with its format's end marker and
renamed when it closes (shards.ShardWriter: Arrow IPC streams; kv_frames.FrameWriter: KV record frames).

A file being written is `<table>.<seq><suffix>.partial`; closing writes the end marker and renames it
`<table>.<seq><suffix>`. Each piece (an Arrow batch, a frame) goes out in `writev` calls that let the GIL
go once for the whole piece, and a failed one is cut back to where the file was, so a killed process
leaves whole pieces and at most a detectable cut tail. A file whose header did not fit is removed, so that
no piece follows a missing header; one whose cut could not be undone (`broken`) is never sealed: readers
stop at its last whole piece.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

OPEN_SUFFIX = ".partial"  # a file still being written; the suffix goes when it is sealed


class SealedFileWriter:
    """Appends whole pieces of one table to rotating files in `directory`. A format gives its `suffix`,
    `end_marker`, what it calls its files (`kind`, for errors) and its `header()`. Safe to call from
    several threads (its lock): the KV ring's drains and the recorder's writer share one."""

    suffix = ""
    end_marker = b""
    kind = "file"

    def __init__(self, directory: Path, table: str, rotate_bytes: int, rotate_s: float):
        self.directory = directory
        self.table = table
        self.rotate_bytes = rotate_bytes
        self.rotate_s = rotate_s
        self.seq = 0
        self.closed_shards: list[tuple[Path, int]] = []  # (path, rows), oldest first
        self.broken = False
        self._bytes_written = 0  # bytes this object wrote, all files (bytes_total adds a native sink's)
        self.pieces = 0  # pieces written, all files
        self._fd: int | None = None
        self._path: Path | None = None
        self._bytes = 0
        self._rows = 0
        self._opened_at = 0.0
        self._lock = threading.Lock()

    def header(self) -> bytes:
        """The bytes a file starts with."""
        raise NotImplementedError

    @property
    def bytes_total(self) -> int:
        """Bytes written, all files (for the max-size forecast)."""
        return self._bytes_written

    @property
    def open_rows(self) -> int:
        """Rows in the file being written (0 when none is open)."""
        return self._rows if self._fd is not None else 0

    def _append(self, parts: list, rows: int) -> int:
        """Write one piece (`parts`, bytes-like, written back to back) holding `rows` rows; returns its
        bytes. Rotates past `rotate_bytes` or `rotate_s`. Raises OSError on disk trouble."""
        with self._lock:
            return self._append_locked(parts, rows)

    def _append_locked(self, parts: list, rows: int) -> int:
        """`_append` with the lock held."""
        if self._fd is None:
            self._open()
        if self.broken:
            raise OSError(f"{self._path}: {self.kind} left incomplete by an earlier write error")
        self._write_all(parts)
        size = sum(memoryview(p).nbytes for p in parts)
        self._bytes += size
        self._bytes_written += size
        self._rows += rows
        self.pieces += 1
        if self._bytes >= self.rotate_bytes or time.monotonic() - self._opened_at >= self.rotate_s:
            self._close()
        return size

    def rotate_if_old(self) -> None:
        """Close the open file once it is `rotate_s` old even when no piece comes to trigger it, so that a
        quiet table does not keep one `.partial` file open for the whole run."""
        with self._lock:
            if self._fd is not None and time.monotonic() - self._opened_at >= self.rotate_s:
                self._close()

    def close(self) -> None:
        with self._lock:
            self._close()

    def roll(self) -> None:
        """Seal the open file now (max-size's drop-oldest: the next piece starts a new one)."""
        self.close()

    def _open(self) -> None:
        self._path = self.directory / f"{self.table}.{self.seq:05d}{self.suffix}{OPEN_SUFFIX}"
        self.seq += 1
        self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._bytes = 0
        header = self.header()
        try:
            self._write_all([header])
        except OSError:  # no room for the header: no file, so that no piece follows a missing one
            os.close(self._fd)
            self._fd = None
            self._path.unlink(missing_ok=True)
            raise
        self._bytes, self._rows, self._opened_at = len(header), 0, time.monotonic()
        self._bytes_written += len(header)

    def _write_all(self, parts: list, fd: int | None = None, size: int | None = None) -> None:
        """Write all of `parts` or nothing to `fd` (the open file's by default), whose `size` bytes so far
        (the open file's) are where an error (disk full) cuts it back to."""
        fd = self._fd if fd is None else fd
        size = self._bytes if size is None else size
        views = [memoryview(p).cast("B") for p in parts]
        try:
            while views:
                done = os.writev(fd, views)
                while views and done >= len(views[0]):
                    done -= len(views[0])
                    views.pop(0)
                if views:
                    views[0] = views[0][done:]
        except OSError:
            try:
                os.ftruncate(fd, size)
                os.lseek(fd, size, os.SEEK_SET)
            except OSError:
                self.broken = True  # a cut tail stays: the file is left `.partial`
            raise

    def _close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        self._seal(fd, self._path, self._bytes, self._rows, self.broken)

    def _seal(self, fd: int, path: Path, size: int, rows: int, broken: bool) -> None:
        """Write the end marker after the file's `size` bytes and rename `path` to its sealed name, unless
        the file is `broken` (then it stays `.partial`, whole up to its last piece); close `fd` either way."""
        try:
            if broken:  # never seal a file with a torn piece in it: readers stop at its last whole one
                return
            try:
                self._write_all([self.end_marker], fd, size)
            except OSError:  # no room for the marker: the file stays `.partial`, whole up to its last piece
                return
            self._bytes_written += len(self.end_marker)
            final = path.with_name(path.name[: -len(OPEN_SUFFIX)])
            os.replace(path, final)
            self.closed_shards.append((final, rows))
        finally:
            os.close(fd)
