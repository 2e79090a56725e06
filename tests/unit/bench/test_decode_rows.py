"""bench/bench_decode_rows.py: the rows it times are the rows the log keeps, and a log that kept other
rows is refused (timings are not checked here)."""

from __future__ import annotations

import pytest

from kvtrace.record import buffers
from tests.helpers.run import bench_module

pytestmark = pytest.mark.skipif(buffers._columns is None, reason=f"native logs not built: {buffers.NATIVE_MISSING}")


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench_decode_rows")


@pytest.mark.parametrize("thrash_mb", [0, 1])
def test_a_measurement_keeps_every_row_it_added(bench, thrash_mb):
    ns, kept = bench.measure(requests=40, steps=60, thrash_mb=thrash_mb, block_size=16)
    assert ns > 0
    bench.check(kept, 40, 60, 16)  # exits on a wrong count
    # 40 requests x 60 steps at block size 16: each request opens a run at the first timed step and one
    # at each block it starts after it (3 or 4 in 59 steps)
    assert 40 * 4 <= kept["runs"] <= 40 * 5


def test_a_log_that_lost_rows_is_refused(bench):
    _, kept = bench.measure(requests=8, steps=20, thrash_mb=0, block_size=16)
    with pytest.raises(SystemExit, match="rows kept"):
        bench.check(kept, 9, 20, 16)
    with pytest.raises(SystemExit, match="runs kept"):
        bench.check(kept, 8, 20, 4)  # the same rows cut at other blocks: other runs
