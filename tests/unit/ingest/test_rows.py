"""Matching device KV access rows to the requests in their batch slots (ingest/rows.py)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pyarrow as pa

from kvtrace.ingest.rows import NULL_REQUEST_KEY, _match_slots


def access(steps: list[int], slots: list[int]) -> pa.Table:
    return pa.table({"step": pa.array(steps, pa.int64()), "slot": pa.array(slots, pa.int32())})


def test_rows_find_their_slots_request():
    have_steps, have_slots = np.array([1, 1, 2, 5]), np.array([0, 1, 0, 0])
    keys = np.array([10, 11, 12, 13], np.int32)
    got = _match_slots(have_steps, have_slots, keys, access([1, 1, 2, 5, 3, 2], [1, 0, 0, 0, 0, 7]))
    assert got.to_pylist() == [11, 10, 12, 13, NULL_REQUEST_KEY, NULL_REQUEST_KEY]


def test_a_huge_step_costs_memory_for_its_rows_not_its_value():
    """One access row at step 4e8 among steps 1-3: matched like the others, without a table over the
    4e8 steps between (3.2 GB) that dense steps use."""
    have_steps, have_slots = np.array([1, 2, 3, 400_000_000]), np.array([0, 0, 0, 0])
    keys = np.array([10, 11, 12, 13], np.int32)
    data = access([1, 2, 3, 400_000_000, 400_000_001], [0, 0, 0, 0, 0])
    tracemalloc.start()
    try:
        got = _match_slots(have_steps, have_slots, keys, data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got.to_pylist() == [10, 11, 12, 13, NULL_REQUEST_KEY]
    assert peak < 10 << 20, f"{peak:,} bytes"
