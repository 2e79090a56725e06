"""`--hook-times` of bench/profile_engine_thread.py: which of kvtrace's per-step calls it times, under which
name (a launch inside `begin_step` apart from the eager layers'), and the figures it reports."""

from __future__ import annotations

import time

import pytest

from tests.helpers.run import bench_module


@pytest.fixture(scope="module")
def profile():
    return bench_module("profile_engine_thread")


class FakeRing:
    """The calls of CudaKVAccessRing that the timer shadows: begin_step launches the state kernel and
    may drain (a snapshot), record_layer launches a layer's kernel."""

    def __init__(self):
        self.launches = 0

    def _launch_kernel(self, *args):
        self.launches += 1
        time.sleep(0.002)

    def _capturing(self):
        return False

    def _snapshot(self):
        return 0

    def drain(self):
        self._snapshot()

    def begin_step(self, step, record=True):
        if not self._capturing():
            self._launch_kernel(step)
        if step % 2 == 0:
            self.drain()

    def record_layer(self, layer_idx, *tables):
        self._launch_kernel(layer_idx)


def test_calls_are_timed_under_their_caller(profile, monkeypatch):
    ring = FakeRing()
    monkeypatch.setattr(profile, "kv_ring", lambda: ring)
    hooks = profile.HookTimes()  # no scheduler probe installed here: only the ring's calls
    for step in range(4):
        ring.begin_step(step)
        ring.record_layer(0)
        ring.record_layer(1)
    got = hooks.summary()
    assert ring.launches == 12  # the originals still ran
    assert {k: v["calls"] for k, v in got.items()} == {
        "begin_step": 4, "_capturing (begin_step)": 4, "_launch_kernel (begin_step)": 4,
        "drain (begin_step)": 2, "_snapshot (begin_step)": 2, "record_layer": 8, "_launch_kernel": 8}
    # each launch sleeps 2 ms: the timed calls read at least that, and a caller includes its callees
    assert got["_launch_kernel"]["p50_us"] >= 2000
    assert got["begin_step"]["total_us"] >= got["_launch_kernel (begin_step)"]["total_us"] >= 4 * 2000
    assert got["record_layer"]["p99_us"] >= got["record_layer"]["p50_us"] >= 2000


def test_the_report_gives_each_call_per_step_busiest_first(profile):
    hooks = {"begin_step": {"calls": 10, "total_us": 300.0, "p50_us": 25.0, "p90_us": 40.0, "p99_us": 90.0},
             "on_schedule": {"calls": 10, "total_us": 100.0, "p50_us": 9.0, "p90_us": 12.0, "p99_us": 20.0}}
    line = profile.hook_report(hooks, steps=10)
    assert line.index("begin_step 30.0 (10 calls: 25.0 / 40.0 / 90.0)") < line.index("on_schedule 10.0 (10 calls")
