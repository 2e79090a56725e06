"""The CPU KV access ring against a plain-Python reference: exact records on random vLLM-shaped metadata
(mixed prefill/decode, chunked prefill, padding), exact drop counts when the ring wraps, sampling and
granularity. The GPU ring is checked against this CPU ring in tests/gpu/test_device_ring.py."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch

from kvtrace.probes.kv_access import make_ring
from kvtrace.probes.kv_access import ring as kv_ring
from kvtrace.probes.kv_access.ring import CPUKVAccessRing
from kvtrace.record.recorder import MemoryRecorder
from tests.helpers.ring_metadata import (
    chaotic_metadata,
    expected_rows,
    kv_rows,
    make_metadata,
    reference_records,
    strip_ts,
)


# ---- tests ---------------------------------------------------------------------------------------------
def record_three_steps(ring, rng, bs, slot_dtype=None):
    """Three steps of 4 layers on one metadata per step, the ring closed; (expected kv rows, expected
    timing rows) per layer as the reference computes them."""
    expected, expected_t = [], []
    for step in range(3):
        kw = {"slot_dtype": slot_dtype} if slot_dtype is not None else {}
        meta = make_metadata(rng, num_reqs=rng.randrange(1, 20), block_size=bs, **kw)
        ring.begin_step(step)
        for layer in range(4):
            ring.record_layer(layer, *meta)
            exp = expected_rows(step, layer, meta, bs)
            expected += exp
            expected_t.append((step, layer, sum(r[2] == 0 for r in exp), sum(r[2] == 1 for r in exp)))
    ring.close()
    return expected, expected_t


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_cpu_ring_matches_reference(seed, slot_dtype):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16, 32])
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=1 << 16, block_size=bs, granularity="blocks", layers="all", recorder=rec,
                           share_layers=False)
    expected, expected_t = record_three_steps(ring, rng, bs, slot_dtype)
    assert sorted(strip_ts(kv_rows(rec))) == sorted(expected)
    assert strip_ts(kv_rows(rec)) == expected  # the CPU ring is deterministic: writes, then reads
    assert [(r[0], r[1], r[3], r[4]) for r in rec.buffers["layer_timings"]] == expected_t
    assert rec.dropped == {}
    assert ring.stats["kv_rows"] == len(expected) and ring.stats["kv_dropped"] == 0


@pytest.mark.parametrize("seed", range(4))
def test_layers_sharing_a_block_table_are_recorded_once_and_copied(seed):
    """layers "all" (share_layers, the default): the layers after the first that read the same block
    table in a forward pass record only their timing; their rows are the first layer's, copied, so the
    rows equal every layer's own (timestamps aside) at 1/4 of the records, and a lost record counts
    for its copies too."""
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16, 32])
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=1 << 16, block_size=bs, granularity="blocks", layers="all", recorder=rec)
    expected, expected_t = record_three_steps(ring, rng, bs)
    assert sorted(strip_ts(kv_rows(rec))) == sorted(expected)
    assert [(r[0], r[1], r[3], r[4]) for r in rec.buffers["layer_timings"]] == expected_t
    assert ring.layer_copies == {1: 0, 2: 0, 3: 0} and ring._drop_units == 4
    assert ring.stats["kv_rows"] * 4 == len(expected)


def test_copies_end_where_a_layer_reads_its_own_table():
    """Two KV-cache groups (two block tables): each group's first layer is recorded, the others copy
    their own group's; with groups of unequal size a lost record counts as one row."""
    rng = random.Random(5)
    a, b = make_metadata(rng, num_reqs=3, block_size=4), make_metadata(rng, num_reqs=3, block_size=4)
    ring = CPUKVAccessRing(capacity=1 << 12, block_size=4, granularity="blocks", layers="all",
                           recorder=MemoryRecorder())
    ring.begin_step(0)
    for layer, meta in enumerate((a, b, a, b, a)):
        ring.record_layer(layer, *meta)
    assert ring.layer_copies == {2: 0, 3: 1, 4: 0} and ring._copies == (2, 0, 3, 1, 4, 0)
    assert ring._drop_units == 1  # 3 layers on a's table, 2 on b's
    ring.close()


@pytest.mark.parametrize("seed", range(200))
def test_run_rules_on_arbitrary_slots(seed):
    rng = random.Random(1000 + seed)
    meta = chaotic_metadata(rng)
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=1 << 10, block_size=4, granularity="blocks", recorder=rec)
    ring.begin_step(7)
    ring.record_layer(3, *meta)
    ring.flush()
    assert sorted(strip_ts(kv_rows(rec))) == sorted(expected_rows(7, 3, meta, 4))
    reads, writes = kv_ring.layer_counts(*meta, 4)
    assert rec.buffers["layer_timings"][0][3:] == (reads, writes)


def test_without_query_start_loc_writes_have_no_slot():
    sm, bt, sl, _ = make_metadata(random.Random(5))
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=1 << 12, granularity="blocks", recorder=rec)
    ring.begin_step(0)
    ring.record_layer(0, sm, bt, sl, None)
    ring.flush()
    rows = strip_ts(kv_rows(rec))
    assert sorted(rows) == sorted(expected_rows(0, 0, (sm, bt, sl, None), 16))
    assert all(r[3] == -1 for r in rows if r[2] == 1)


def test_timing_granularity_records_blocks_once_per_kv_group():
    rng = random.Random(3)
    group_a = make_metadata(rng)
    group_b = make_metadata(rng)  # a second KV-cache group: its own block table
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=1 << 14, recorder=rec)  # granularity "timing", layers "auto"
    for step in range(2):
        ring.begin_step(step)
        for layer in range(6):
            ring.record_layer(layer, *(group_a if layer % 3 else group_b))
    ring.close()
    layers = sorted({(r[0], r[1]) for r in kv_rows(rec)})
    assert layers == [(0, 0), (0, 1), (1, 0), (1, 1)]  # first layer of each group, each step
    exp = sorted(expected_rows(0, 0, group_b, 16) + expected_rows(0, 1, group_a, 16)
                 + expected_rows(1, 0, group_b, 16) + expected_rows(1, 1, group_a, 16))
    assert sorted(strip_ts(kv_rows(rec))) == exp
    timings = rec.buffers["layer_timings"]
    assert len(timings) == 12  # every layer call, with the counts it would have produced
    for _step, layer, _, reads, writes in timings:
        meta = group_a if layer % 3 else group_b
        assert (reads, writes) == kv_ring.layer_counts(*meta, 16)


def test_explicit_layers_and_none():
    meta = make_metadata(random.Random(4))
    for spec, want in (("0,2", {0, 2}), ([1], {1}), ("none", set()), ("all", {0, 1, 2, 3})):
        rec = MemoryRecorder()
        ring = CPUKVAccessRing(capacity=1 << 14, granularity="blocks", layers=spec, recorder=rec)
        ring.begin_step(0)
        for layer in range(4):
            ring.record_layer(layer, *meta)
        ring.close()
        assert {r[1] for r in kv_rows(rec)} == want
        assert len(rec.buffers["layer_timings"]) == 4


def test_sampling():
    meta = make_metadata(random.Random(6))
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=1 << 14, granularity="blocks", sample_every=3, recorder=rec)
    for step in range(8):
        ring.begin_step(step)
        ring.record_layer(0, *meta)
    ring.begin_step(9, record=False)  # the caller can also switch a step off
    ring.record_layer(0, *meta)
    ring.close()
    assert {r[0] for r in kv_rows(rec)} == {0, 3, 6}
    assert [r[0] for r in rec.buffers["layer_timings"]] == [0, 3, 6]
    assert rec.dropped == {}  # sampled-out steps are not drops


def test_wrap_drops_exact_and_keeps_newest():
    rng = random.Random(8)
    cap = 16
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=cap, timing_capacity=2, granularity="blocks", recorder=rec,
                           auto_drain=False)
    expected = []
    ring.begin_step(0)
    for layer in range(5):
        meta = make_metadata(rng, num_reqs=rng.randrange(1, 4), max_blocks=4)
        ring.record_layer(layer, *meta)
        expected += expected_rows(0, layer, meta, 16)
    assert len(expected) > cap
    ring.drain()
    assert strip_ts(kv_rows(rec)) == expected[-cap:]
    assert rec.dropped["kv_access"] == {"ring-wrap": len(expected) - cap}
    assert rec.dropped["layer_timings"] == {"ring-wrap": 5 - 2}
    assert [r[1] for r in rec.buffers["layer_timings"]] == [3, 4]
    # after a wrap the ring goes on exactly: nothing lost when drained in time
    ring.begin_step(1)
    meta = make_metadata(rng, num_reqs=1, max_blocks=2)
    ring.record_layer(0, *meta)
    ring.drain()
    assert strip_ts(kv_rows(rec))[cap:] == expected_rows(1, 0, meta, 16)
    assert ring.stats["kv_dropped"] == len(expected) - cap


def test_one_call_larger_than_the_ring():
    meta = make_metadata(random.Random(9), num_reqs=10)
    exp = expected_rows(0, 0, meta, 16)
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=8, granularity="blocks", recorder=rec)
    ring.begin_step(0)
    ring.record_layer(0, *meta)
    ring.flush()
    assert strip_ts(kv_rows(rec)) == exp[-8:]
    assert rec.dropped["kv_access"]["ring-wrap"] == len(exp) - 8


def test_lap_tags_reject_stale_slots():
    """A slot holding an older lap's record (as a torn or racing device write would leave it) is counted
    as dropped, never emitted as if it were the record expected there."""
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=4, granularity="blocks", recorder=rec, auto_drain=False)
    ring.begin_step(0)
    sm = torch.tensor([0, 16, 32, 48, 64, 80], dtype=torch.int64)  # six single-token writes
    ring.record_layer(0, sm, torch.zeros((0, 1), dtype=torch.int32), torch.zeros(0, dtype=torch.int32), None)
    stale = ring._ring[1].copy()
    kv_ring.set_laps(stale.reshape(1), 1, ring.log2cap)  # lap 0 where lap 1 (position 5) belongs
    ring._ring[1] = stale
    ring.drain()
    assert [r[5] for r in kv_rows(rec)] == [2, 3, 4]  # positions 2, 3, 4; position 5 rejected
    assert rec.dropped["kv_access"]["ring-wrap"] == 3


def test_timestamps_are_host_monotonic():
    meta = make_metadata(random.Random(10))
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=1 << 14, granularity="blocks", recorder=rec)
    t0 = time.monotonic_ns()
    ring.begin_step(0)
    ring.record_layer(0, *meta)
    t1 = time.monotonic_ns()
    ring.close()
    assert all(t0 <= r[2] <= t1 for r in kv_rows(rec) + rec.buffers["layer_timings"])


def test_rows_fit_the_schema(tmp_path):
    """Rows go through the real recorder with kvtrace.format.schema types: block records packed, written
    by the drain as frames that read as kv_access_records rows, which ingest's expansion turns into
    exactly the rows the ring decodes for a recorder that keeps rows in memory, and timing records as
    they are, which the flush decodes into exactly those rows too."""
    from kvtrace.format import schema
    from kvtrace.format.shards import ShardRead, list_shards, loaded_batch, read_shard
    from kvtrace.record.recorder import Recorder, _batches

    meta = make_metadata(random.Random(11))
    memory = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=1 << 14, granularity="blocks", recorder=memory)
    for step in range(3):  # a drain a step
        ring.begin_step(step)
        for layer in range(4):
            ring.record_layer(layer, *meta)
        ring.drain()
    ring.close()
    rec = Recorder(tmp_path, "worker", {"flush_interval_s": 3600})
    try:
        t0 = time.monotonic_ns()
        ring = CPUKVAccessRing(capacity=1 << 14, granularity="blocks", recorder=rec)
        for step in range(3):
            ring.begin_step(step)
            for layer in range(4):
                ring.record_layer(layer, *meta)
            ring.drain()
        ring.close()
        t1 = time.monotonic_ns()
        assert rec._take("kv_access") == []  # block records go packed
        for table in ("kv_access_records", "layer_timings"):
            if table == "kv_access_records":  # written by the drains: read from their frame file
                assert rec._take(table) == []
                rows = [b for shard in list_shards(rec.dir, "running") if shard.table == table
                        for b in read_shard(shard, ShardRead())]
            else:  # row tuples, whole RecordBatches or a drain's packed timings, as the writer makes batches of them
                held = rec._take(table)
                rows = _batches(table, held)
            assert rows and all(b.schema.equals(schema.arrow_schema(table)) for b in rows)
            if table == "kv_access_records":
                expanded = [loaded_batch(table, b).to_pylist() for b in rows]
                got = [r for part in expanded for r in part]
                assert all(t0 <= r["ts_ns"] <= t1 for r in got)
                names = [n for n in kv_ring.KV_COLUMNS if n != "ts_ns"]
                want = [tuple(r[kv_ring.KV_COLUMNS.index(n)] for n in names) for r in kv_rows(memory)]
                assert [tuple(r[n] for n in names) for r in got] == want and want
            else:  # three drains' timing records, held as they are and decoded together at the flush
                assert [type(h).__name__ for h in held] == ["PackedTimings"] * 3
                got = [r for b in rows for r in b.to_pylist()]
                assert all(t0 <= r["ts_ns"] <= t1 for r in got)
                assert [(r["step"], r["layer"], r["reads"], r["writes"]) for r in got] == \
                    [(r[0], r[1], r[3], r[4]) for r in memory.buffers["layer_timings"]]
                assert len(got) == 12
    finally:
        rec.close()


def test_memory_recorder_keeps_row_tuples():
    """The ring hands whole columns to its sink; MemoryRecorder keeps them as row tuples of ints."""
    meta = make_metadata(random.Random(12))
    rec = MemoryRecorder()
    ring = CPUKVAccessRing(capacity=1 << 14, granularity="blocks", recorder=rec)
    ring.begin_step(0)
    ring.record_layer(0, *meta)
    ring.close()
    row = kv_rows(rec)[0]
    assert isinstance(row, tuple) and len(row) == 8 and all(isinstance(x, int) for x in row)


def test_record_layout_matches_the_device():
    """The byte layout the CUDA kernels write (device_ring_kernels.cu) and the ctypes argument struct."""
    from kvtrace.probes.kv_access import cuda_ring as device_ring

    assert [kv_ring.REC_DTYPE.fields[n][1] for n in ("step", "ts", "block_id", "slot", "meta", "tok")] == \
        [0, 8, 16, 20, 24, 28]
    assert [kv_ring.TIM_DTYPE.fields[n][1] for n in ("step", "ts", "reads", "writes", "meta")] == \
        [0, 8, 16, 20, 24]
    src = device_ring.KERNEL_SOURCE.read_text()
    for name, value in (("THREADS", device_ring.THREADS), ("SMEM_QSL", device_ring.SMEM_QSL),
                        ("ST_REC_HEAD", device_ring.ST_REC_HEAD),
                        ("ST_TIM_HEAD", device_ring.ST_TIM_HEAD), ("ST_STEP", device_ring.ST_STEP),
                        ("ST_SNAP_REC", device_ring.ST_SNAP_REC), ("ST_SNAP_TIM", device_ring.ST_SNAP_TIM)):
        assert f"#define {name} {value}" in src
    struct = src.split("struct RecordArgs {")[1].split("};")[0]
    code = [line.split("//")[0] for line in struct.splitlines()]
    names = [line.split(";")[0].split()[-1].lstrip("*") for line in code if ";" in line]
    assert names == [f[0] for f in device_ring._RecordArgs._fields_]


def test_make_ring_and_validation():
    assert isinstance(make_ring("cpu", recorder=MemoryRecorder()), CPUKVAccessRing)
    assert isinstance(make_ring(torch.device("cpu"), recorder=MemoryRecorder()), CPUKVAccessRing)
    assert isinstance(make_ring(torch.zeros(1), recorder=MemoryRecorder()), CPUKVAccessRing)
    for bad in ({"capacity": 100}, {"granularity": "bytes"}, {"sample_every": 0}, {"block_size": 0}):
        with pytest.raises(ValueError):
            CPUKVAccessRing(recorder=MemoryRecorder(), **bad)


def test_cuda_without_cupy_says_why():
    from kvtrace.probes.kv_access import cuda_ring as device_ring

    ok, why = device_ring.cupy_available()
    if ok:
        pytest.skip("cupy is installed here")
    with pytest.raises(RuntimeError, match="CuPy"):
        make_ring("cuda:0", recorder=MemoryRecorder())


def test_vectorised_semantics_equal_reference_on_large_batches():
    rng = random.Random(13)
    meta = make_metadata(rng, num_reqs=200, max_blocks=64)
    recs = kv_ring.layer_records(5, 2, 0, *meta, 16)
    got = sorted(zip((recs["meta"] >> 16 & 1).tolist(), recs["slot"].tolist(), recs["block_id"].tolist(),
                     (recs["tok"] & 0xFFFF).tolist(), (recs["tok"] >> 16).tolist(), strict=True))
    assert got == sorted(reference_records(*meta, 16))
    assert np.all(recs["step"] == 5)
