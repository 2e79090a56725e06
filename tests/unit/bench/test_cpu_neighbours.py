"""bench/bench_cpu_neighbours.py: a pinned Python thread timed beside a neighbour switched on and off."""

from __future__ import annotations

import os
import threading

import pytest

from tests.helpers.run import bench_module


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("kind,release_every", [("spin", 0), ("write", 0), ("recorder", 0), ("recorder", 50)])
def test_the_neighbour_runs_in_the_on_blocks_and_leaves_nothing_behind(tmp_path, kind, release_every):
    bench = bench_module("bench_cpu_neighbours")
    core, load_core = sorted(os.sched_getaffinity(0))[:2]
    out = {}

    def run():  # on a thread of its own: measure() pins the calling thread
        out["ratios"], out["share"] = bench.measure(core, kind, load_core, seconds=1.0, block_ms=50, n=500,
                                                    folder=str(tmp_path), records=2000, release_every=release_every)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    ratios = out["ratios"]
    assert len(ratios) >= 5 and all(r > 0 for r in ratios)
    mean, lo, hi = bench.paired_ci(ratios)
    assert lo <= mean <= hi
    if kind != "recorder":
        assert out["share"] is None
        assert list(tmp_path.iterdir()) == []  # the write kind's file is removed
        return
    # kvtrace's own work: frames of the drains' records written by a real recorder, its CPU counted
    assert 0 < out["share"] < 1
    procs = list((tmp_path / "session" / "procs").iterdir())
    frames = list(procs[0].glob("kv_access_records.*.kvframes"))
    assert len(procs) == 1 and frames and frames[0].stat().st_size > 2000 * 32


def test_the_released_loop_does_the_same_work_in_pieces():
    """--release-every: the measured chunk's turns, cut into pieces with the GIL let go between them."""
    bench = bench_module("bench_cpu_neighbours")
    from cpu_speed_probe import chunk

    assert bench.released_chunk(400, 100) == 4 * chunk(100)
    assert bench.released_chunk(10, 100) == chunk(100)  # at least one piece
