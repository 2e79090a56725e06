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


class FakeDriver:
    """The four CUDA driver calls `_drain.c` makes, as ctypes callbacks on host memory: a "device" address
    is a host one here, an event a number, and every call is logged (name, arguments)."""

    def __init__(self):
        import ctypes

        self.calls = []
        self.launch_rc = 0
        u64, ptr, cint = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
        self._sync = ctypes.CFUNCTYPE(cint, ptr)(lambda ev: self.calls.append(("sync", ev)) or 0)
        self._record = ctypes.CFUNCTYPE(cint, ptr, ptr)(lambda ev, s: self.calls.append(("record", ev, s)) or 0)

        def copy(dst, src, n, stream):
            self.calls.append(("copy", dst, src, n, stream))
            ctypes.memmove(dst, src, n)
            return 0

        self._copy = ctypes.CFUNCTYPE(cint, ptr, u64, ctypes.c_size_t, ptr)(copy)
        uint = ctypes.c_uint

        def launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            self.calls.append(("launch", f, gx, gy, gz, bx, by, bz, smem, stream, params, extra))
            return self.launch_rc

        self._launch = ctypes.CFUNCTYPE(cint, ptr, uint, uint, uint, uint, uint, uint, uint, ptr, ptr, ptr)(launch)
        self.fns = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (self._sync, self._record, self._copy))
        self.launch_addr = ctypes.cast(self._launch, ctypes.c_void_p).value


@native_only
def test_launch_passes_cupys_arguments_to_the_driver_and_says_its_errors():
    drv = FakeDriver()
    native.set_launcher(drv.launch_addr)
    native.launch(11, 1, 2, 3, 32, 1, 1, 2048, 0xABC, 0x1000, 0)
    assert drv.calls == [("launch", 11, 1, 2, 3, 32, 1, 1, 2048, 0xABC, 0x1000, None)]
    drv.launch_rc = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUresult 700"):
        native.launch(11, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0)
    with pytest.raises(TypeError, match="11 integers"):
        native.launch(11, 1)
    with pytest.raises(OverflowError):
        native.launch(-1, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0)


@native_only
def test_state_launch_writes_the_step_into_the_struct_then_launches_the_state_kernel():
    """begin_step's one native call: the ring's StateArgs (as cuda_ring lays it out) gets the step, the
    sampling flag and set=1, and kv_set_state is launched with one thread on the stream, params as given."""
    import ctypes

    from kvtrace.probes.kv_access.cuda_ring import _Launch, _StateArgs

    drv = FakeDriver()
    native.set_launcher(drv.launch_addr)
    args = _StateArgs(state=0xD000, step=0, active=0, set=0)
    launch = _Launch(args, 1)
    native.state_launch(21, 0xABC, launch.params_addr, ctypes.addressof(args), 123456789012, True)
    assert (args.state, args.step, args.active, args.set) == (0xD000, 123456789012, 1, 1)
    assert drv.calls == [("launch", 21, 1, 1, 1, 32, 1, 1, 0, 0xABC, launch.params_addr, None)]
    native.state_launch(21, 0xABC, launch.params_addr, ctypes.addressof(args), -1, False)
    assert (args.step, args.active, args.set) == (-1, 0, 1)
    drv.launch_rc = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match="CUresult 1"):
        native.state_launch(21, 0, launch.params_addr, ctypes.addressof(args), 5, True)
    with pytest.raises(ValueError, match="no argument struct"):
        native.state_launch(21, 0, launch.params_addr, 0, 5, True)
    with pytest.raises(TypeError, match="state_launch"):
        native.state_launch(21, 0)


@native_only
@pytest.mark.parametrize("take_snapshot", [False, True])
def test_a_drain_that_takes_its_own_snapshot_reads_the_state_words_first(take_snapshot):
    """The background thread's timed drains (take_snapshot): the state words are copied to the snapshot
    slot and its event recorded on the drain's stream, before the wait and the ring copies; an explicit
    drain's snapshot (copied by the engine's thread) is read as it is."""
    cap, log2cap = 64, 6
    ring = np.zeros(cap, REC_DTYPE)
    ring["block_id"] = np.arange(cap)
    set_laps(ring[:40], 0, log2cap)  # positions 0..39 written
    tring = np.zeros(8, ring_module.TIM_DTYPE)
    state = np.zeros(8, np.int64)
    state[2], state[5] = 40, 40  # ST_SNAP_REC, ST_REC_HEAD: 40 records, all complete
    snap = np.zeros(8, np.int64)  # the slot: zeros unless the drain copies the state in
    stage, tstage, live = np.zeros(cap, REC_DTYPE), np.zeros(8, ring_module.TIM_DTYPE), np.zeros(8, np.int64)
    drv = FakeDriver()
    addr = lambda a: a.__array_interface__["data"][0]  # noqa: E731
    err, where, heads, windows, lives, kept = native.drain_device(
        drv.fns, 501, addr(snap), (2, 3), (5, 6), (addr(ring), addr(stage), 0, cap), (addr(tring), addr(tstage), 0, 8),
        addr(state), addr(live), 77, 502, log2cap, take_snapshot)
    assert err == 0 and where == ""
    if take_snapshot:
        assert drv.calls[:3] == [("copy", addr(snap), addr(state), 64, 77), ("record", 501, 77), ("sync", 501)]
        assert heads == (40, 0) and windows == (0, 40, 0, 0) and lives == (40, 0)
        assert np.frombuffer(kept, REC_DTYPE)["block_id"].tolist() == list(range(40))
    else:
        assert drv.calls == [("sync", 501)]  # the engine's copy is awaited, and says nothing new
        assert heads == (0, 0) and kept is None
