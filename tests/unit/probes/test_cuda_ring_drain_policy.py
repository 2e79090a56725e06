"""When the device ring drains (decided on the host, no GPU needed): every 100 ms, or sooner when the
records per step seen by the last drains could fill a quarter of either ring before the next one."""

from __future__ import annotations

import time

import numpy as np

from kvtrace.probes.kv_access.cuda_ring import ST_SNAP_REC, ST_SNAP_TIM, ST_STEP, CudaKVAccessRing


def policy(capacity=1 << 20, timing_capacity=1 << 14) -> CudaKVAccessRing:
    ring = object.__new__(CudaKVAccessRing)  # the host-side decision only: no device, no CuPy
    ring.capacity, ring.timing_capacity = capacity, timing_capacity
    ring._steps_since_drain, ring._drain_steps, ring._drained_at = 0, 1, time.monotonic()
    ring._rate_mark = None
    return ring


def snap(step: int, head: int, thead: int) -> np.ndarray:
    s = np.zeros(8, np.int64)
    s[ST_STEP], s[ST_SNAP_REC], s[ST_SNAP_TIM] = step, head, thead
    return s


def drained(ring: CudaKVAccessRing) -> None:
    ring._steps_since_drain, ring._drained_at = 0, time.monotonic()


def test_every_step_until_a_drain_has_measured_the_rate():
    ring = policy()
    assert ring._drain_due()
    ring._learn_rate(snap(10, 5_000, 160), (5_000, 160))  # a first drain has nothing to compare with
    assert ring._drain_steps == 1


def test_a_light_ring_waits_for_the_interval():
    ring = policy()
    ring._learn_rate(snap(10, 0, 0), (0, 0))
    ring._learn_rate(snap(20, 100_000, 160), (100_000, 160))  # 10,000 records and 16 timings a step
    assert ring._drain_steps == (1 << 20) // 4 // 10_000  # 26 steps fill a quarter of the record ring
    drained(ring)
    assert not any(ring._drain_due() for _ in range(ring._drain_steps - 1))
    assert ring._drain_due()
    drained(ring)
    ring._drained_at -= ring.DRAIN_EVERY_S  # 100 ms later: due whatever the count
    assert ring._drain_due()


def test_a_full_ring_or_a_small_one_drains_every_step():
    ring = policy(capacity=256)
    ring._learn_rate(snap(1, 0, 0), (0, 0))
    ring._learn_rate(snap(2, 1_000, 4), (1_000, 4))
    assert ring._drain_steps == 1
    ring = policy(timing_capacity=64)  # the timing ring is the one that fills
    ring._learn_rate(snap(1, 0, 0), (0, 0))
    ring._learn_rate(snap(5, 40, 128), (40, 128))  # 32 timing records a step: 16 fill a quarter
    assert ring._drain_steps == 1


def test_no_records_means_the_interval_alone():
    ring = policy()
    ring._learn_rate(snap(1, 0, 0), (0, 0))
    ring._learn_rate(snap(9, 0, 0), (0, 0))
    assert ring._drain_steps == 1 << 20



def test_an_interval_of_zero_drains_every_step():
    assert CudaKVAccessRing.DRAIN_EVERY_S == 0.1
    ring = policy()
    ring.DRAIN_EVERY_S = 0.0  # as {"kv_drain_interval_s": 0} sets it
    ring._drain_steps = 1 << 20
    assert all(ring._drain_due() for _ in range(5))
