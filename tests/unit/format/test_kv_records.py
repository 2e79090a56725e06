"""Packed KV access records (the `kv_access_records` shard table): what the recorder writes for a ring's
drain is what ingest turns back into kv_access rows, timestamps mapped with the drain's clock fit."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvtrace.errors import KvtraceError
from kvtrace.format import kv_records, schema
from kvtrace.format.kv_records import (
    IDENTITY_CLOCK,
    REC_DTYPE,
    PackedRecords,
    expand_kv_records,
    packed_batch,
    packed_batches,
)

SCHEMA = schema.arrow_schema("kv_access_records")


def records(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    recs = np.zeros(n, REC_DTYPE)
    recs["step"] = rng.integers(0, 1 << 40, n)
    recs["ts"] = rng.integers(10**12, 2 * 10**12, n).astype(np.uint64)
    recs["block_id"] = rng.integers(-1, 1 << 20, n)
    recs["slot"] = rng.integers(-1, 512, n)
    recs["meta"] = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)  # layer, op, lap bits
    recs["tok"] = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    return recs


def test_packed_records_expand_to_the_decoded_rows():
    """Two drains, one with a device clock fit (offset and rate) and one on the host clock: every field
    as the ring's own decoding gives it, the device timestamps mapped exactly as the ring maps them."""
    a, b = records(1000, 1), records(7, 2)
    fit = (1_500_000_000_000, 9_000_000_000_000, 1.0000123)
    batch = pa.Table.from_batches([packed_batch(a, fit, SCHEMA), packed_batch(b, IDENTITY_CLOCK, SCHEMA)]
                                  ).combine_chunks().to_batches()[0]
    rows = expand_kv_records(batch)
    assert rows.schema.equals(schema.arrow_schema("kv_access"), check_metadata=False)
    got = rows.to_pydict()
    both = np.concatenate([a, b])
    d = a["ts"].astype(np.int64) - fit[0]
    ts = np.concatenate([fit[1] + np.rint(d * fit[2]).astype(np.int64), b["ts"].astype(np.int64)])
    assert got["ts_ns"] == ts.tolist()
    assert got["step"] == both["step"].tolist() and got["block_id"] == both["block_id"].tolist()
    assert got["slot"] == both["slot"].tolist()
    assert got["layer"] == (both["meta"] & 0xFFFF).astype(np.uint16).view(np.int16).tolist()
    assert got["op"] == ((both["meta"] >> 16) & 1).tolist()
    assert got["token_offset"] == (both["tok"] & 0xFFFF).tolist()
    assert got["token_count"] == (both["tok"] >> 16).tolist()


def test_a_flush_joins_drains_into_batches_of_bounded_size():
    """The writer makes a flush's drains into as few batches as the byte bound allows, in order; a drain
    larger than the bound is written as rows of at most the bound (slices of its memory), each with the
    drain's clock and copies. Ingest makes the same rows of them as of one batch a drain."""
    drains = [records(n, seed) for seed, n in enumerate((5, 40, 0, 300, 2, 9))]
    drains[3]["meta"][::3] &= np.uint32(0xFFFF0000)  # a third of the large drain in layer 0, which layer 3 copies
    clocks = [(i * 1000, i * 7000, 1.0 + i * 1e-6) for i in range(len(drains))]
    rows = [PackedRecords(kv_records.owned_copy(d), c, (i, 0) if i else (), len(d))
            for i, (d, c) in enumerate(zip(drains, clocks))]
    bound = 100 * REC_DTYPE.itemsize
    batches = packed_batches(rows, SCHEMA, max_bytes=bound)
    assert [b.num_rows for b in batches] == [3, 1, 1, 1, 2]  # 5 + 40 + 0 fit; 300 as 3 x 100; 2 + 9
    assert [b.column("records_count").to_pylist() for b in batches] == [[5, 40, 0], [100], [100], [100], [2, 9]]
    assert {b.column("clock_slope")[0].as_py() for b in batches[1:4]} == {clocks[3][2]}
    assert {tuple(b.column("layer_copies")[0].as_py()) for b in batches[1:4]} == {(3, 0)}
    assert all(b.get_total_buffer_size() < 2 * bound for b in batches)
    alone = [packed_batch(d, c, SCHEMA, r.copies) for d, c, r in zip(drains, clocks, rows)]
    expanded = [sorted(pa.Table.from_batches([expand_kv_records(b) for b in bs]).to_pylist(), key=lambda r: tuple(r.values()))
                for bs in (batches, alone)]  # (a slice's copies follow the slice)
    assert expanded[0] == expanded[1] and len(expanded[0]) >= 356 + 100  # with layer 3's copies of layer 0
    rows[1] = rows[1]._replace(count=41)
    with pytest.raises(ValueError, match="bytes for 41 records"):
        packed_batches(rows, SCHEMA)


def test_an_empty_drain_expands_to_no_rows():
    assert expand_kv_records(packed_batch(records(0), IDENTITY_CLOCK, SCHEMA)).num_rows == 0


@pytest.mark.parametrize("column, value, words", [
    ("records_count", 3, "holds 64 bytes for 3 records"),
    ("records_count", -1, "holds 64 bytes for -1 records"),
    ("clock_slope", float("nan"), "clock slope outside"),
    ("clock_slope", 0.0, "clock slope outside"),
    ("records", None, "nulls in records"),
    ("clock_ref_host_ns", 1 << 62, "outside 64-bit nanoseconds"),
    ("clock_ref_device_ns", -(1 << 62), "outside 64-bit nanoseconds"),
])
def test_damaged_rows_are_refused_in_one_line(column, value, words):
    good = packed_batch(records(2), IDENTITY_CLOCK, SCHEMA)
    cols = [pa.array([value], f.type) if f.name == column else good.column(i) for i, f in enumerate(SCHEMA)]
    with pytest.raises(KvtraceError, match=f"shard7: .*{words}") as err:
        expand_kv_records(pa.RecordBatch.from_arrays(cols, schema=SCHEMA), "shard7")
    assert "\n" not in str(err.value)


def test_layer_copies_write_the_source_rows_again_in_bounded_batches(monkeypatch):
    """A drain row naming layers as copies of a recorded layer gives that layer's rows once more per
    copy (the copy's layer number, everything else the source's), in batches of at most CHUNK_ROWS
    rows beyond one piece; the decoded path (`copy_layers`) gives the same rows."""
    from kvtrace.format import kv_records

    recs = records(600, 3)
    layer = np.arange(600) % 3  # layers 0, 1, 2; 0 and 2 have copies
    recs["meta"] = (recs["meta"] & np.uint32(0xFFFF0000)) | layer.astype(np.uint32)
    copies = (3, 0, 4, 0, 5, 2)
    monkeypatch.setattr(kv_records, "CHUNK_ROWS", 250)
    parts = list(kv_records.iter_kv_records(packed_batch(recs, IDENTITY_CLOCK, SCHEMA, copies)))
    assert all(p.num_rows <= 250 + 600 for p in parts) and len(parts) > 1
    got = pa.Table.from_batches(parts).to_pydict()
    base = expand_kv_records(packed_batch(recs, IDENTITY_CLOCK, SCHEMA)).to_pydict()
    counts = {lay: got["layer"].count(lay) for lay in range(6)}
    assert counts == {0: 200, 1: 200, 2: 200, 3: 200, 4: 200, 5: 200}
    src = [i for i, lay in enumerate(base["layer"]) if lay == 0]
    as3 = [i for i, lay in enumerate(got["layer"]) if lay == 3]
    for name in ("step", "ts_ns", "op", "slot", "block_id", "token_offset", "token_count"):
        assert [got[name][i] for i in as3] == [base[name][i] for i in src]
    decoded = kv_records.copy_layers(kv_records.unpack_records(recs, recs["ts"].astype(np.int64)), copies)
    assert sorted(zip(decoded["layer"].tolist(), decoded["block_id"].tolist())) == \
        sorted(zip(got["layer"], got["block_id"]))


@pytest.mark.parametrize("copies", [[1, 0, 2], [1, 0, 1, 2], [70000, 0], [-1, 0]])
def test_damaged_layer_copies_are_refused(copies):
    batch = packed_batch(records(2), IDENTITY_CLOCK, SCHEMA, tuple(copies))
    with pytest.raises(KvtraceError, match="layer_copies"):
        expand_kv_records(batch)


def test_a_shard_of_schema_3_has_no_copies():
    old = pa.schema(list(SCHEMA)[:5])
    batch = packed_batch(records(5), IDENTITY_CLOCK, SCHEMA)
    assert expand_kv_records(pa.RecordBatch.from_arrays(batch.columns[:5], schema=old)).num_rows == 5


def test_timing_records_of_a_flush_decode_together_each_with_its_drains_clock():
    """The flush decodes its drains' timing records at once (layer_timings rows), each drain's timestamps
    mapped with the clock fit it came with, exactly as decoding each drain alone does."""
    rng = np.random.default_rng(5)
    drains = []
    for n in (4, 0, 7, 3):
        recs = np.zeros(n, kv_records.TIM_DTYPE)
        recs["step"] = rng.integers(0, 1 << 40, n)
        recs["ts"] = rng.integers(10**12, 2 * 10**12, n).astype(np.uint64)
        recs["reads"], recs["writes"] = rng.integers(0, 1000, n), rng.integers(0, 1000, n)
        recs["meta"] = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        drains.append(recs)
    fit = (1_500_000_000_000, 9_000_000_000_000, 1.0000123)
    clocks = [fit, fit, IDENTITY_CLOCK, fit]  # consecutive drains share a fit; the host clock between
    rows = [kv_records.PackedTimings(kv_records.owned_copy(d), c, len(d)) for d, c in zip(drains, clocks)]
    got = kv_records.timing_columns(rows)
    alone = [kv_records.unpack_timings(d, kv_records.to_host_ns(d["ts"], c)) for d, c in zip(drains, clocks)]
    for name in ("step", "layer", "ts_ns", "reads", "writes"):
        assert got[name].tolist() == [x for cols in alone for x in cols[name].tolist()], name
        assert got[name].dtype == alone[0][name].dtype
    assert len(got["step"]) == 14 and kv_records.timing_columns([])["step"].size == 0
    with pytest.raises(ValueError, match="7 records for 8"):
        kv_records.timing_columns([rows[2]._replace(count=8)])
