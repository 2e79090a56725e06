"""bench/bench_flush_handovers.py on a real recorder."""

from __future__ import annotations

from tests.helpers.run import bench_module


def test_the_flush_handover_count_sees_a_real_flush():
    """bench_flush_handovers.py: a real recorder's flush of packed records beside the stand-in thread
    writes the records and reads a count for each figure."""
    bench = bench_module("bench_flush_handovers")
    out = bench.measure(records=20_000, drains=3, flushes=2)
    assert set(out) == {"stand-in waits", "stand-in waits, no flush", "writer waits", "flush ms"}
    assert all(len(v) == 2 for v in out.values()) and min(out["flush ms"]) > 0


def test_the_spool_variant_writes_each_drain_as_one_frame_and_flushes_the_timings():
    """--kv-to spool: the block records go to the spool as one frame a drain (header, copies, records),
    never to the shards; the flush beside it still runs and is counted."""
    bench = bench_module("bench_flush_handovers")
    out = bench.measure(records=20_000, drains=3, flushes=2, kv_to="spool")
    frame = bench.KvSpool.HEADER.size + 4 * len(bench.COPIES) + 20_000 * bench.device_records(1, 1).itemsize
    assert out["spool MB"] == [(3 * 2 + 0) * frame / 1e6]  # the warm-up's 2 drains went to the shards' flush
    assert all(len(out[k]) == 2 for k in ("stand-in waits", "writer waits", "flush ms"))
