"""KV access records as the rings store them, and their decoding into `kv_access` rows.

A ring (probes/kv_access) holds 32-byte records (REC_DTYPE). The recorder writes a drain's records as they
are, packed into one `kv_access_records` shard row with the clock mapping of that moment
(schema.RUN_TABLES), and ingest decodes them here: a step of a small model on a GPU produces ~10,000
block records, and decoding them into eight columns inside the engine's process took a share of the GIL
that the engine's own thread was waiting for. Decoded here, or by the ring for a recorder that keeps rows
in memory, the rows are the same.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from kvtrace.errors import KvtraceError
from kvtrace.format import schema

# One 32-byte record; mirrors the device layout in probes/kv_access/cuda_ring_kernels.cu.
REC_DTYPE = np.dtype(
    [("step", "<i8"), ("ts", "<u8"), ("block_id", "<i4"), ("slot", "<i4"), ("meta", "<u4"), ("tok", "<u4")]
)
# One 32-byte layer timing record (a layer call's start and the records it produced); the same layout
# ends in the same `meta` word (layer | lap << 17), so the drain's lap check serves both.
TIM_DTYPE = np.dtype(
    [("step", "<i8"), ("ts", "<u8"), ("reads", "<i4"), ("writes", "<i4"), ("meta", "<u4"), ("pad", "<u4")]
)
assert REC_DTYPE.itemsize == 32 and TIM_DTYPE.itemsize == 32
assert REC_DTYPE.fields["meta"][1] == TIM_DTYPE.fields["meta"][1]

# (device reference ns, host reference ns, host ns per device ns): the identity for host clocks.
IDENTITY_CLOCK = (0, 0, 1.0)


def to_host_ns(ts: np.ndarray, clock: tuple[int, int, float]) -> np.ndarray:
    """Timer values -> host CLOCK_MONOTONIC ns: host_ref + rint((ts - dev_ref) * slope)."""
    dev_ref, host_ref, slope = clock
    if clock == IDENTITY_CLOCK:
        return ts.astype(np.int64)
    d = ts.astype(np.int64) - np.int64(dev_ref)  # differences stay small: exact in float64
    return np.int64(host_ref) + np.rint(d * slope).astype(np.int64)


def unpack_records(recs: np.ndarray, ts_ns: np.ndarray) -> dict[str, np.ndarray]:
    """REC_DTYPE records -> kv_access columns (ts already mapped to host ns)."""
    meta, tok = recs["meta"], recs["tok"]
    return {
        "step": recs["step"].astype(np.int64),
        "layer": (meta & 0xFFFF).astype(np.uint16).view(np.int16),
        "ts_ns": ts_ns.astype(np.int64),
        "op": ((meta >> 16) & 1).astype(np.int8),
        "slot": recs["slot"].astype(np.int32),
        "block_id": recs["block_id"].astype(np.int32),
        "token_offset": (tok & 0xFFFF).astype(np.int32),
        "token_count": (tok >> 16).astype(np.int32),
    }


def unpack_timings(recs: np.ndarray, ts_ns: np.ndarray) -> dict[str, np.ndarray]:
    """TIM_DTYPE records -> layer_timings columns (ts already mapped to host ns)."""
    return {
        "step": recs["step"].astype(np.int64),
        "layer": (recs["meta"] & 0xFFFF).astype(np.uint16).view(np.int16),
        "ts_ns": ts_ns.astype(np.int64),
        "reads": recs["reads"].astype(np.int32),
        "writes": recs["writes"].astype(np.int32),
    }


class PackedTimings(NamedTuple):
    """One drain's layer timing records as the recorder holds them until its next flush, which decodes a
    flush's drains into `layer_timings` rows at once (`timing_columns`): a few records a layer and step,
    each drain's decoding was a dozen NumPy calls on the drain's thread, each one a GIL hand-over."""

    data: Any  # count * 32 bytes in memory of their own
    clock: tuple[int, int, float]
    count: int


def timing_columns(rows: list[PackedTimings]) -> dict[str, np.ndarray]:
    """`layer_timings` columns of these drains' records, in order: their timestamps mapped with each
    drain's clock (consecutive drains mostly share one: mapped together)."""
    recs, ts_ns = [], []
    for clock, group in itertools.groupby(rows, key=lambda r: r.clock):
        group = list(group)
        parts = [np.frombuffer(r.data, TIM_DTYPE) for r in group]
        for r, part in zip(group, parts):
            if part.size != r.count:
                raise ValueError(f"packed timings: {part.size} records for {r.count}")
        joined = parts[0] if len(parts) == 1 else np.concatenate(parts)
        recs.append(joined)
        ts_ns.append(to_host_ns(joined["ts"], clock))
    if not recs:
        return unpack_timings(np.zeros(0, TIM_DTYPE), np.zeros(0, np.int64))
    return unpack_timings(recs[0] if len(recs) == 1 else np.concatenate(recs),
                          ts_ns[0] if len(ts_ns) == 1 else np.concatenate(ts_ns))


class PackedRecords(NamedTuple):
    """One drain's block records as the recorder holds them until its next flush, where `packed_batches`
    makes them `kv_access_records` rows: nothing of Arrow is called on the drain's thread."""

    data: Any  # count * 32 bytes in memory of their own (a buffer: NumPy array, _drain.Records)
    clock: tuple[int, int, float]  # the clock mapping to decode their timestamps with
    copies: tuple[int, ...]  # (layer, source layer) pairs, flattened: the layers recorded as another
    count: int


def owned_copy(recs: np.ndarray) -> np.ndarray:
    """The records in memory of their own (the ring's staging memory is reused). NumPy copies with the
    GIL released, where bytes() (tobytes) holds it for the whole copy while the engine's thread waits
    for it (bench/bench_drain_gil.py)."""
    owned = np.empty(recs.shape, recs.dtype)
    np.copyto(owned, recs)
    return owned


# Bytes of records per kv_access_records batch at most, beyond one drain's (a batch's records are copied
# into one buffer). Kept under glibc's largest dynamic mmap threshold (32 MB), so that those buffers are
# reused from the heap rather than mapped, faulted in page by page and unmapped each time. A frame file's
# drain of more than this (all layers' block lists) is read as several rows of at most this size.
BATCH_BYTES = 4 << 20


def packed_batches(rows: list[PackedRecords], sch: pa.Schema, max_bytes: int | None = None) -> list[pa.RecordBatch]:
    """`kv_access_records` batches of these drains, in order: a row each (a drain of more than `max_bytes`
    of records as rows of at most that, with its clock and copies), consecutive drains joined into as few
    batches as `max_bytes` allows. Made by ingest from frame files (kv_frames.py), never in a recording
    process: Arrow's constructors let go of the GIL, and each time a background thread takes it back the
    engine's thread stops for two thread wake-ups (bench/bench_drain_gil.py, bench_flush_handovers.py)."""
    max_bytes = BATCH_BYTES if max_bytes is None else max_bytes
    per_row = max(1, max_bytes // REC_DTYPE.itemsize)
    out, group, size = [], [], 0
    for row in (*(piece for r in rows for piece in _slices(r, per_row)), None):
        if row is None or (group and size + row.count * REC_DTYPE.itemsize > max_bytes):
            if group:
                out.append(_packed_group(group, sch))
            group, size = [], 0
        if row is not None:
            group.append(row)
            size += row.count * REC_DTYPE.itemsize
    return out


def _slices(row: PackedRecords, per_row: int):
    """`row`, or its records in rows of at most `per_row` (views of its memory, no copy)."""
    if row.count <= per_row:
        yield row
        return
    data = _bytes_of(row)
    size = REC_DTYPE.itemsize
    for lo in range(0, row.count, per_row):
        n = min(per_row, row.count - lo)
        yield row._replace(data=data[lo * size:(lo + n) * size], count=n)


def _bytes_of(row: PackedRecords) -> np.ndarray:
    data = np.frombuffer(row.data, np.uint8)
    if data.size != row.count * REC_DTYPE.itemsize:
        raise ValueError(f"packed records: {data.size} bytes for {row.count} records")
    return data


def _packed_group(rows: list[PackedRecords], sch: pa.Schema) -> pa.RecordBatch:
    parts = [_bytes_of(r) for r in rows]
    data = parts[0] if len(parts) == 1 else np.concatenate(parts)  # one copy, the GIL let go
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([p.size for p in parts], out=offsets[1:])
    records = pa.Array.from_buffers(pa.large_binary(), len(rows), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    return pa.RecordBatch.from_arrays(
        [pa.array([int(r.clock[0]) for r in rows], pa.int64()), pa.array([int(r.clock[1]) for r in rows], pa.int64()),
         pa.array([float(r.clock[2]) for r in rows], pa.float64()), pa.array([r.count for r in rows], pa.int64()),
         records, pa.array([list(r.copies) for r in rows], pa.list_(pa.int32()))],
        schema=sch)


def packed_batch(recs: np.ndarray, clock: tuple[int, int, float], sch: pa.Schema,
                 copies: tuple[int, ...] = ()) -> pa.RecordBatch:
    """One `kv_access_records` row: the records' bytes, the clock mapping to decode their timestamps with,
    and the layers recorded as copies of another (`copies`: (layer, source layer) pairs, flattened)."""
    return packed_batches([PackedRecords(owned_copy(recs), clock, tuple(copies), len(recs))], sch)[0]


def copy_layers(cols: dict[str, np.ndarray], copies: tuple[int, ...] | list[int]) -> dict[str, np.ndarray]:
    """kv_access columns with each source layer's rows written again for the layers recorded as its
    copies (`copies`: (layer, source layer) pairs, flattened), after the recorded rows. A copy keeps its
    source's timestamp: the layer's own time is in layer_timings."""
    pieces = [cols, *copied_rows(cols, copies)]
    if len(pieces) == 1:
        return cols
    return {name: np.concatenate([p[name] for p in pieces]) for name in cols}


def copied_rows(cols: dict[str, np.ndarray], copies: tuple[int, ...] | list[int]):
    """For each (layer, source) pair of `copies` (flattened) whose source has rows in `cols`: those rows
    with the copy's layer number."""
    for copy, source in zip(copies[0::2], copies[1::2], strict=False):
        rows = np.flatnonzero(cols["layer"] == source)
        if rows.size:
            copied = {name: col[rows] for name, col in cols.items()}
            copied["layer"] = np.full(rows.size, copy, dtype=cols["layer"].dtype)
            yield copied


# Layers one row may name as copies (a model has a few hundred layers at most; bounds what a damaged shard
# can make ingest write).
MAX_COPIES = 512


def expand_kv_records(batch: pa.RecordBatch, where: object = "kv_access_records") -> pa.RecordBatch:
    """The kv_access rows a kv_access_records batch stands for, as one batch (`iter_kv_records`'s
    batches joined). `where` names the shard in the error a damaged batch gets."""
    sch = schema.arrow_schema("kv_access")
    table = pa.Table.from_batches(list(iter_kv_records(batch, where)), schema=sch).combine_chunks()
    if not table.num_rows:
        return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in sch], schema=sch)
    return table.to_batches()[0]


def iter_kv_records(batch: pa.RecordBatch, where: object = "kv_access_records"):
    """The kv_access rows a kv_access_records batch stands for: per row, its records in record order,
    then each layer recorded as a copy (layer_copies) as its own batch, so memory stays that of one
    row's records however many layers copy them."""
    nulls = [f.name for f, c in zip(batch.schema, batch.columns) if c.null_count and f.name != "layer_copies"]
    if nulls:
        raise KvtraceError(f"{where}: kv_access_records batch with nulls in {', '.join(nulls)}; not a shard "
                           f"kvtrace wrote")
    records = batch.column("records")
    counts = batch.column("records_count").to_numpy(zero_copy_only=False)
    slopes = batch.column("clock_slope").to_numpy(zero_copy_only=False)
    if batch.num_rows and not ((slopes > 0.5) & (slopes < 2.0)).all():  # a clock's rate is ~1 (NaN fails too)
        raise KvtraceError(f"{where}: kv_access_records clock slope outside (0.5, 2); not a shard kvtrace wrote")
    dev = batch.column("clock_ref_device_ns").to_numpy(zero_copy_only=False)
    host = batch.column("clock_ref_host_ns").to_numpy(zero_copy_only=False)
    # Shards of schema version 3 have no layer_copies: nothing was recorded as a copy then.
    copies = batch.column("layer_copies").to_pylist() if "layer_copies" in batch.schema.names else None
    sch = schema.arrow_schema("kv_access")
    pending: list[dict[str, np.ndarray]] = []  # pieces joined into batches of about CHUNK_ROWS rows
    held = 0
    for i in range(batch.num_rows):
        raw = records[i].as_buffer()
        size = raw.size if raw is not None else 0
        if counts[i] < 0 or size != counts[i] * REC_DTYPE.itemsize:
            raise KvtraceError(f"{where}: a kv_access_records row holds {size} bytes for {counts[i]} records of "
                               f"{REC_DTYPE.itemsize} bytes; not a shard kvtrace wrote")
        pairs = (copies[i] or []) if copies is not None else []
        if (len(pairs) % 2 or len(pairs) > 2 * MAX_COPIES or any(not 0 <= v <= 0x7FFF for v in pairs)
                or len(set(pairs[0::2])) != len(pairs) // 2):
            raise KvtraceError(f"{where}: a kv_access_records row's layer_copies is not (layer, source) pairs "
                               f"of distinct layers; not a shard kvtrace wrote")
        recs = np.frombuffer(raw, dtype=REC_DTYPE) if size else np.zeros(0, REC_DTYPE)
        clock = (int(dev[i]), int(host[i]), float(slopes[i]))
        if size and not _maps_in_range(recs["ts"], clock):
            raise KvtraceError(f"{where}: a kv_access_records row's clock mapping puts its timestamps outside "
                               f"64-bit nanoseconds; not a shard kvtrace wrote")
        cols = unpack_records(recs, to_host_ns(recs["ts"], clock))
        for piece in itertools.chain([cols], copied_rows(cols, pairs)):  # one copy made at a time
            pending.append(piece)
            held += piece["layer"].size
            if held >= CHUNK_ROWS:
                yield _batch(sch, pending)
                pending, held = [], 0
    if pending:
        yield _batch(sch, pending)


def _maps_in_range(ts: np.ndarray, clock: tuple[int, int, float]) -> bool:
    """Whether `to_host_ns` maps every one of these timer values into int64 (a damaged clock reference
    would wrap or overflow the cast; the recorder's own mappings are ~host_ref + seconds)."""
    dev_ref, host_ref, slope = clock
    lo, hi = int(ts.min()) - dev_ref, int(ts.max()) - dev_ref  # Python ints: no wrap
    return all(abs(host_ref + d * slope) < 2.0**62 for d in (lo, hi))


# Rows per batch iter_kv_records yields at most (beyond one piece): its memory, whatever the copies.
CHUNK_ROWS = 1 << 20


def _batch(sch: pa.Schema, pieces: list[dict[str, np.ndarray]]) -> pa.RecordBatch:
    cols = {name: np.concatenate([p[name] for p in pieces]) if len(pieces) > 1 else pieces[0][name]
            for name in sch.names}
    return pa.RecordBatch.from_arrays([pa.array(cols[f.name], type=f.type) for f in sch], schema=sch)
