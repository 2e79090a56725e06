"""The ring's drain in C (`_drain.c`) keeps exactly the records the NumPy path keeps (`lap_ok`), in
memory of its own, and a ring drains the same rows and drops through either."""

from __future__ import annotations

import random
import shutil
import sysconfig

import numpy as np
import pytest

import kvtrace.probes.kv_access.ring as ring_module
from kvtrace.probes.kv_access.ring import LAP_MASK, REC_DTYPE, CPUKVAccessRing, lap_ok, set_laps
from kvtrace.record.recorder import MemoryRecorder
from tests.helpers.ring_metadata import expected_rows, make_metadata

native = ring_module.native_drain
native_only = pytest.mark.skipif(native is None, reason="the native drain (_drain.c) is not built here")


def test_the_native_drain_is_built_where_a_compiler_is():
    """Optional at install, so nothing else would notice a build that silently failed."""
    if not (shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which("cc")):
        pytest.skip("no C compiler here: the NumPy drain serves")
    import os

    if os.environ.get("KVTRACE_NATIVE") == "0":
        pytest.skip("native code switched off (KVTRACE_NATIVE=0)")
    assert native is not None


@native_only
def test_keeps_what_lap_ok_keeps_across_laps_and_damage():
    rng = np.random.default_rng(1)
    for _ in range(1500):
        log2cap = int(rng.integers(1, 12))
        n = int(rng.integers(0, 3 << log2cap))
        first = int(rng.integers(0, 1 << 40))
        recs = np.zeros(n, REC_DTYPE)
        recs["step"] = np.arange(n)  # tells the records apart
        set_laps(recs, first, log2cap)
        if n:
            hit = rng.integers(0, n, size=max(1, n // 5))
            recs["meta"][hit] = rng.integers(0, 1 << 32, size=hit.size, dtype=np.uint64).astype(np.uint32)
        kept = np.frombuffer(native.keep_intact(recs, first, log2cap), REC_DTYPE)
        assert kept.tobytes() == recs[lap_ok(recs, first, log2cap)].tobytes()


@native_only
def test_kept_records_own_their_memory_and_wrap_the_lap_counter():
    log2cap, first = 4, ((LAP_MASK << 4) | 10)  # the last lap before the 15-bit counter wraps to 0
    recs = np.zeros(20, REC_DTYPE)
    recs["block_id"] = np.arange(20)
    set_laps(recs, first, log2cap)
    kept = native.keep_intact(recs, first, log2cap)
    assert len(kept) == 20 * REC_DTYPE.itemsize
    recs["block_id"] = -1  # the source is reused (the ring's staging memory): the kept copy stays
    assert np.frombuffer(kept, REC_DTYPE)["block_id"].tolist() == list(range(20))
    assert len(native.keep_intact(recs, first + 16, log2cap)) == 0  # a lap later: every tag is stale


@native_only
def test_rejects_what_is_not_whole_records():
    with pytest.raises(ValueError, match="whole number"):
        native.keep_intact(b"x" * 33, 0, 4)
    with pytest.raises(ValueError, match="log2 capacity"):
        native.keep_intact(b"", 0, 0)


class PackedRecorder(MemoryRecorder):
    """A MemoryRecorder that takes block and timing records as they are, as the shard writer does."""

    def __init__(self):
        super().__init__()
        self.packed = []
        self.timings = []

    def append_kv_records(self, recs, clock, copies=(), owned=False):
        self.packed.append((np.array(recs), owned))

    def append_timing_records(self, recs, clock, owned=False):
        self.timings.append((np.array(recs), owned))


def drain_packed(monkeypatch, path):
    """A small ring overrun between drains, drained through `path`: (kept records without their
    timestamps, owned flags, drops, records made)."""
    monkeypatch.setattr(ring_module, "native_drain", native if path == "native" else None)
    rng = random.Random(5)
    rec = PackedRecorder()
    ring = CPUKVAccessRing(recorder=rec, capacity=64, timing_capacity=8, granularity="blocks", auto_drain=False)
    made = 0
    for step in range(3):
        ring.begin_step(step)
        for layer in range(12):
            meta = make_metadata(rng, num_reqs=rng.randrange(1, 3), max_blocks=3)
            ring.record_layer(layer, *meta)
            made += len(expected_rows(step, layer, meta, 16))
        ring.drain()
    ring.close()
    kept = np.concatenate([r for r, _ in rec.packed])
    kept["ts"] = 0
    timings = np.concatenate([r for r, _ in rec.timings])
    timings["ts"] = 0
    return (kept, timings), [owned for _, owned in rec.packed + rec.timings], rec.dropped, made


@native_only
def test_a_ring_drains_the_same_records_and_drops_either_way(monkeypatch):
    (kept, timings), owned, dropped, made = drain_packed(monkeypatch, "native")
    (ref, ref_timings), ref_owned, ref_dropped, ref_made = drain_packed(monkeypatch, "numpy")
    assert made == ref_made and dropped == ref_dropped and dropped["kv_access"]["ring-wrap"] > 0
    assert kept.size + dropped["kv_access"]["ring-wrap"] == made
    assert kept.tobytes() == ref.tobytes()
    # the timing records (a ring of 8 for 12 layer calls a step): the same kept and dropped either way
    assert timings.dtype == ring_module.TIM_DTYPE and timings.tobytes() == ref_timings.tobytes()
    assert timings.size == 3 * 8 and dropped["layer_timings"]["ring-wrap"] == 3 * (12 - 8)
    assert set(owned) == {True} and set(ref_owned) == {False}  # the native path's copy is the recorder's
