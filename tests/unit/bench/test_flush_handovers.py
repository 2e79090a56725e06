"""bench/bench_flush_handovers.py on a real recorder."""

from __future__ import annotations

import pytest

from tests.helpers.run import bench_module


def test_the_flush_handover_count_sees_a_real_flush():
    """bench_flush_handovers.py: a real recorder's flush of packed records beside the stand-in thread
    writes the records and reads a count for each figure."""
    bench = bench_module("bench_flush_handovers")
    out = bench.measure(records=20_000, drains=3, flushes=2)
    assert set(out) == {"stand-in waits", "stand-in waits, no flush", "writer waits", "flush ms", "KV MB written"}
    assert all(len(v) == 2 for k, v in out.items() if k != "KV MB written") and min(out["flush ms"]) > 0


@pytest.mark.parametrize("kv_to", ["frames", "shards"])
def test_both_ways_of_writing_the_block_records_write_them_all(kv_to):
    """--kv-to frames (as recorded) and shards (Arrow batches at the flush, as before): every drain's
    records reach the files, the flush beside them is counted."""
    bench = bench_module("bench_flush_handovers")
    out = bench.measure(records=20_000, drains=3, flushes=2, kv_to=kv_to)
    records_mb = (2 * 2 + 3 * 2) * 20_000 * 32 / 1e6  # the two warm-up flushes' drains, then the measured
    assert records_mb < out["KV MB written"][0] < records_mb * 1.01
    assert all(len(out[k]) == 2 for k in ("stand-in waits", "writer waits", "flush ms"))
