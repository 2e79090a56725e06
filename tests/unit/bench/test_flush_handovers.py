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
