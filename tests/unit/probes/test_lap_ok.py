"""`lap_ok` compares each drained record's lap tag with its position's lap run by run; it must give
what the position-by-position definition gives, across lap boundaries and for damaged tags."""

from __future__ import annotations

import numpy as np

from kvtrace.probes.kv_access.ring import LAP_MASK, REC_DTYPE, lap_ok, set_laps


def by_position(recs: np.ndarray, first_pos: int, log2cap: int) -> np.ndarray:
    pos = np.arange(first_pos, first_pos + recs.size, dtype=np.uint64)
    lap = ((pos >> np.uint64(log2cap)) & np.uint64(LAP_MASK)).astype(np.uint32)
    return (recs["meta"] >> np.uint32(17)) == lap


def test_matches_the_definition_across_laps_and_damage():
    rng = np.random.default_rng(0)
    for _ in range(1500):
        log2cap = int(rng.integers(1, 12))
        n = int(rng.integers(0, 3 << log2cap))  # windows longer than the ring too
        first = int(rng.integers(0, 1 << 40))
        recs = np.zeros(n, REC_DTYPE)
        set_laps(recs, first, log2cap)
        if n:
            hit = rng.integers(0, n, size=max(1, n // 5))
            recs["meta"][hit] = rng.integers(0, 1 << 32, size=hit.size, dtype=np.uint64).astype(np.uint32)
        assert (lap_ok(recs, first, log2cap) == by_position(recs, first, log2cap)).all()


def test_a_window_wrapping_the_lap_counter():
    log2cap, first = 4, ((LAP_MASK << 4) | 10)  # the last lap before the 15-bit counter wraps to 0
    recs = np.zeros(20, REC_DTYPE)
    set_laps(recs, first, log2cap)
    assert lap_ok(recs, first, log2cap).all()
    assert not lap_ok(recs, first + 16, log2cap).any()  # a lap later: every tag is stale
