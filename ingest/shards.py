"""Reading a session's shard files, robustly.

A shard is an Arrow IPC stream. A closed shard (`.arrows`) must read to its end-of-stream marker; a
shard that was still open (`.arrows.partial`, its process was killed or is still running) is read up to
its last complete batch and the bytes after it are reported as cut, never an error. Anything else that
does not read (a closed shard cut short, flipped bits, another table's schema, not Arrow at all) is a
`KvtraceError` naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from kvtrace import schema
from kvtrace.errors import KvtraceError
from kvtrace.recorder import OPEN_SUFFIX, SHARD_SUFFIX


@dataclass
class Shard:
    path: Path
    table: str
    open: bool  # still being written when read (or its process was killed)


@dataclass
class ShardRead:
    """What reading one shard found, beside its batches."""

    rows: int = 0
    batches: int = 0
    bytes_cut: int = 0  # bytes after the last complete batch of an open shard
    problems: list[str] = field(default_factory=list)


def list_shards(proc_dir: Path) -> list[Shard]:
    """The shards of one process folder, in table then sequence order; unknown files are ignored."""
    shards = []
    for name in sorted(os.listdir(proc_dir)):
        is_open = name.endswith(SHARD_SUFFIX + OPEN_SUFFIX)
        if not (is_open or name.endswith(SHARD_SUFFIX)):
            continue
        table = name.split(".", 1)[0]
        if table not in schema.TABLES:
            raise KvtraceError(f"{proc_dir / name}: shard of unknown table {table!r}")
        shards.append(Shard(proc_dir / name, table, is_open))
    return shards


def read_shard(shard: Shard, result: ShardRead) -> Iterator[pa.RecordBatch]:
    """Yield the shard's batches, checked against its table's schema; fills `result` as it goes."""
    path = shard.path
    size = path.stat().st_size
    if size == 0:
        if shard.open:  # created, killed before the header was flushed
            return
        raise KvtraceError(f"{path}: empty shard file")
    expected = schema.arrow_schema(shard.table)
    with open(path, "rb") as f:
        try:
            reader = pa.ipc.open_stream(f)
        except (pa.ArrowInvalid, OSError) as exc:
            if shard.open and size < 4096:
                result.bytes_cut = size
                result.problems.append(f"{path}: header cut ({size} bytes)")
                return
            raise KvtraceError(f"{path}: not an Arrow IPC stream ({_short(exc)})") from None
        _check_schema(path, reader.schema, shard.table, expected)
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
            good_end = f.tell()
            result.rows += batch.num_rows
            result.batches += 1
            yield batch
        if shard.open and good_end < size:
            result.bytes_cut = size - good_end


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
