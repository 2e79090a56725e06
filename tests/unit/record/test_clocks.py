"""clock_pair: a pause between the wall and monotonic reads does not reach the pair."""

import time

from kvtrace.record.clocks import TIGHT_NS, clock_pair


def scripted(values):
    it = iter(values)
    return lambda: next(it)


def test_a_pause_between_the_reads_is_retried_and_the_tight_try_kept():
    # try 1: 5 ms pass between the wall reads (the thread lost the GIL); try 2: 1 us
    wall = scripted([1_000_000_000, 1_005_000_000, 2_000_000_000, 2_000_001_000])
    mono = scripted([10, 20])
    assert clock_pair(mono, wall) == (20, 2_000_000_500)


def test_with_every_try_paused_the_least_paused_is_kept():
    walls, monos = [], []
    for i, gap in enumerate((9_000_000, 3 * TIGHT_NS, 7_000_000, 5_000_000)):
        walls += [i * 10**9, i * 10**9 + gap]
        monos.append(i)
    assert clock_pair(scripted(monos), scripted(walls)) == (1, 10**9 + 3 * TIGHT_NS // 2)


def test_a_wall_clock_stepped_back_mid_pair_is_not_kept_over_a_sane_one():
    wall = scripted([5_000, 1_000, 7_000, 8_000])
    assert clock_pair(scripted([1, 2]), wall) == (2, 7_500)


def test_the_real_clocks_agree_with_reads_taken_beside_them():
    before = time.time_ns()
    mono_ns, wall_ns = clock_pair()
    assert before <= wall_ns <= time.time_ns()
    assert abs(mono_ns - time.monotonic_ns()) < 10**9
