"""How often the device ring's background thread drains (decided on the host, no GPU needed): every 100 ms,
or sooner when the records per second seen by the last two drains would fill a quarter of either ring
before the next one; never more often than once a millisecond."""

from __future__ import annotations

import pytest

from kvtrace.probes.kv_access.cuda_ring import CudaKVAccessRing


def policy(capacity=1 << 20, timing_capacity=1 << 14) -> CudaKVAccessRing:
    ring = object.__new__(CudaKVAccessRing)  # the host-side decision only: no device, no CuPy
    ring.capacity, ring.timing_capacity = capacity, timing_capacity
    ring._fill_s, ring._rate_mark = CudaKVAccessRing.FIRST_DRAIN_S, None
    return ring


def test_soon_until_two_drains_have_measured_the_rate():
    ring = policy()
    assert ring._drain_interval_s() == CudaKVAccessRing.FIRST_DRAIN_S == 0.01
    ring._learn_rate((5_000, 160), 100.0)  # a first drain has nothing to compare with
    assert ring._drain_interval_s() == 0.01


def test_a_light_ring_waits_for_the_interval():
    ring = policy()
    ring._learn_rate((0, 0), 100.0)
    ring._learn_rate((100_000, 160), 100.1)  # 1 M records a second: a quarter (262,144) in 0.26 s
    assert ring._fill_s == pytest.approx(0.262144)
    assert ring._drain_interval_s() == CudaKVAccessRing.DRAIN_EVERY_S == 0.1


def test_a_fast_ring_drains_before_a_quarter_fills():
    ring = policy()
    ring._learn_rate((0, 0), 100.0)
    ring._learn_rate((1_000_000, 160), 100.1)  # 10 M records a second
    assert ring._drain_interval_s() == pytest.approx(0.0262144)
    ring = policy(timing_capacity=64)  # the timing ring is the one that fills
    ring._learn_rate((0, 0), 100.0)
    ring._learn_rate((40, 1_600), 100.1)  # 16,000 timing records a second: 16 fill a quarter in 1 ms
    assert ring._drain_interval_s() == pytest.approx(0.001)


def test_never_more_often_than_the_floor():
    ring = policy(capacity=256)
    ring._learn_rate((0, 0), 100.0)
    ring._learn_rate((1_000_000, 4), 100.1)
    assert ring._fill_s < CudaKVAccessRing.MIN_DRAIN_S
    assert ring._drain_interval_s() == CudaKVAccessRing.MIN_DRAIN_S == 0.001
    ring.DRAIN_EVERY_S = 0.0  # as {"kv_drain_interval_s": 0} sets it
    assert ring._drain_interval_s() == 0.001


def test_no_records_means_the_interval_alone():
    ring = policy()
    ring._learn_rate((7, 3), 100.0)
    ring._learn_rate((7, 3), 100.5)
    assert ring._fill_s == float("inf")
    assert ring._drain_interval_s() == 0.1
    ring.DRAIN_EVERY_S = 30.0  # {"kv_drain_interval_s": 30}: rare drains
    assert ring._drain_interval_s() == 30.0


def test_time_going_nowhere_learns_nothing():
    ring = policy()
    ring._learn_rate((0, 0), 100.0)
    ring._learn_rate((1_000, 0), 100.0)
    assert ring._drain_interval_s() == 0.01
