"""The device ring's drain loop in C (`_drain.Drainer`, which never takes the GIL) and the frame sink it
writes through (`_drain.FrameSink`), on the CPU: a fake CUDA driver whose "device" is host memory
(test_kv_drain_native.FakeDriver). Every record is written once or counted as lost, by cause; frames are
read back as the rows they hold; the loop drains by itself, on request, and not while held."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvtrace.probes.kv_access.ring as ring_module
from kvtrace.format.kv_frames import FrameWriter
from kvtrace.format.kv_records import expand_kv_records
from kvtrace.probes.kv_access.ring import REC_DTYPE, TIM_DTYPE, set_laps
from kvtrace.record.recorder import Recorder
from tests.unit.format.test_kv_frames import read_all
from tests.unit.probes.test_kv_drain_native import FakeDriver

native = ring_module.native_drain
pytestmark = pytest.mark.skipif(native is None or not hasattr(native, "Drainer"),
                                reason="the native drain (_drain.c) is not built here")
NSNAP = 64
CLOCK = (1_000, 2_000_000, 1.0)


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class FakeRing:
    """A ring's device memory as the kernels leave it, in host memory: block and timing records with
    their laps, the state words (snapshot heads at 2 and 3, live heads at 5 and 6), the snapshot slots."""

    def __init__(self, cap=64, tcap=16):
        self.cap, self.tcap = cap, tcap
        self.ring, self.tring = np.zeros(cap, REC_DTYPE), np.zeros(tcap, TIM_DTYPE)
        self.stage, self.tstage = np.zeros(cap, REC_DTYPE), np.zeros(tcap, TIM_DTYPE)
        self.state, self.live = np.zeros(8, np.int64), np.zeros(8, np.int64)
        self.snaps = np.zeros((NSNAP + 1, 8), np.int64)
        self.made = []  # (position, step, block) of every block record made
        self.tmade = 0

    def step(self, step: int, blocks: int, timings: int = 1) -> None:
        """One step's records, then the heads a kv_set_state of the next step would snapshot."""
        for _ in range(blocks):
            p = int(self.state[5])
            rec = np.zeros(1, REC_DTYPE)
            rec["step"], rec["block_id"], rec["ts"] = step, p, 5_000 + p
            set_laps(rec, p, self.cap.bit_length() - 1)
            self.ring[p % self.cap] = rec[0]
            self.made.append((p, step))
            self.state[5] += 1
        for _ in range(timings):
            p = int(self.state[6])
            rec = np.zeros(1, TIM_DTYPE)
            rec["step"], rec["reads"], rec["ts"] = step, p, 7_000 + p
            set_laps(rec, p, self.tcap.bit_length() - 1)
            self.tring[p % self.tcap] = rec[0]
            self.tmade += 1
            self.state[6] += 1
        self.state[2], self.state[3] = self.state[5], self.state[6]

    def snapshot(self, slot: int) -> None:
        """An explicit drain's snapshot: the state words as the engine's stream has them now."""
        self.snaps[slot] = self.state

    def drainer(self, drv: FakeDriver, sink=None):
        d = native.Drainer(drv.fns, addr(self.snaps), NSNAP, 900, (2, 3), (5, 6),
                           (addr(self.ring), addr(self.stage), self.cap), (addr(self.tring), addr(self.tstage), self.tcap),
                           addr(self.state), addr(self.live), 77, 502, sink)
        d.set_clock(*CLOCK)
        return d


def drain_now(d, ring: FakeRing, slot: int = 0) -> None:
    """One requested drain, run by the loop on a thread of its own until a deadline, awaited."""
    ring.snapshot(slot)
    ticket = d.request(slot, 600 + slot)
    t = threading.Thread(target=d.run, args=(time.monotonic() + 0.2,))
    t.start()
    assert d.wait(ticket, 5.0)
    t.join()


def test_requested_drains_keep_every_record_once_and_count_what_the_ring_overwrote():
    """No sink: the block records wait for take(), with the clock and the copies they were drained
    under; a drain of more than the ring holds counts the overwritten records as ring-wrap."""
    ring, drv = FakeRing(cap=64, tcap=16), FakeDriver()
    d = ring.drainer(drv)
    d.set_policy(10.0, 0.001, 10.0, False)  # no timed drains
    d.set_copies((3, 1))
    ring.step(0, 40, timings=4)
    ring.snapshot(0)
    t0 = d.request(0, 600)
    ring.step(1, 100, timings=20)  # wraps both rings before the next drain
    ring.snapshot(1)
    t1 = d.request(1, 601)  # only the newest request waits: one drain up to slot 1's heads
    assert t1 == t0 + 1
    t = threading.Thread(target=d.run, args=(time.monotonic() + 5,))
    t.start()
    assert d.wait(t1, 5.0) and d.wait(t0, 0.0)
    d.stop()
    t.join()
    blocks, timings, counts, error = d.take()
    assert error is None and counts["drains"] == 1
    assert [(c, cp) for _, c, cp in blocks] == [(CLOCK, (3, 1))]
    kept = np.frombuffer(blocks[0][0], REC_DTYPE)
    assert kept["block_id"].tolist() == list(range(140 - 64, 140))  # the ring's last lap
    assert counts["kv_rows"] == 64 and counts["kv_wrap"] == 140 - 64 and counts["tail"] == 140
    tkept = np.frombuffer(timings[0][0], TIM_DTYPE)
    assert tkept["reads"].tolist() == list(range(24 - 16, 24)) and counts["timing_wrap"] == 24 - 16
    assert ("sync", 601) in drv.calls and ("sync", 600) not in drv.calls
    again = d.take()
    assert again[0] == [] and again[1] == [] and again[2]["drains"] == 0 and again[3] is None


def test_the_loop_drains_by_itself_when_due_and_writes_frames_through_the_sink(tmp_path):
    """Timed drains (the state words copied to the loop's own slot first) every few milliseconds, each
    a frame through a FrameWriter's sink: the frames read back as every record made, once."""
    ring, drv = FakeRing(cap=1 << 12, tcap=1 << 8), FakeDriver()
    w = FrameWriter(tmp_path, 1 << 30, 1e9)
    sink = w.native_sink(native.FrameSink)
    d = ring.drainer(drv, sink)
    d.set_policy(0.005, 0.001, 0.005, True)
    t = threading.Thread(target=d.run, args=(time.monotonic() + 30,))
    t.start()
    for step in range(40):
        ring.step(step, 10, timings=2)
        time.sleep(0.002)
    time.sleep(0.05)
    drain_now_ticket = (ring.snapshot(3), d.request(3, 603))[1]
    assert d.wait(drain_now_ticket, 5.0)
    d.stop()
    t.join()
    blocks, timings, counts, error = d.take()
    assert error is None and blocks == [] and counts["kv_wrap"] == 0 and counts["kv_rows"] == 400
    assert counts["drains"] > 3  # by itself, not only when asked
    assert ("copy", addr(ring.snaps[NSNAP]), addr(ring.state), 64, 77) in drv.calls  # the timed drains' snapshot
    assert sum(len(np.frombuffer(r, TIM_DTYPE)) for r, _, _ in timings) == 80
    frames = sink.counts()["frames_total"]
    assert 1 <= frames <= counts["drains"] and w.frames == frames  # a frame a drain that found records
    w.close()
    _, batches, _ = read_all(tmp_path, "complete")
    rows = [r for b in batches for r in zip(*expand_kv_records(b).to_pydict().values())]
    assert sorted((r[5], r[0]) for r in rows) == [(p, s) for p, s in ring.made]  # (block_id, step)


def test_a_held_loop_starts_no_drain_until_let_go():
    ring, drv = FakeRing(), FakeDriver()
    d = ring.drainer(drv)
    d.set_policy(0.002, 0.001, 0.002, True)
    assert d.hold(True) < 1.0
    t = threading.Thread(target=d.run, args=(time.monotonic() + 30,))
    t.start()
    ring.step(0, 5)
    time.sleep(0.1)
    assert d.take()[2]["drains"] == 0  # due many times over, held
    d.hold(False)
    deadline = time.monotonic() + 5
    while d.take()[2]["drains"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    d.stop()
    t.join()
    assert time.monotonic() < deadline


def test_a_hold_with_its_clock_paused_moves_the_next_drain_on_by_the_time_held():
    """hold(..., pause_clock=True): a drain that fell due while held is not made at the release; the next
    comes the rest of the interval later, as if the held time had not passed."""
    ring, drv = FakeRing(), FakeDriver()
    d = ring.drainer(drv)
    d.set_policy(1.0, 0.001, 1.0, True)  # the first timed drain 1 s from now
    d.hold(True)
    t = threading.Thread(target=d.run, args=(time.monotonic() + 30,))
    t.start()
    ring.step(0, 5)
    time.sleep(1.3)  # past due while held
    released = time.monotonic()
    d.hold(False, 5.0, True)
    time.sleep(0.3)
    assert d.take()[2]["drains"] == 0  # due ~1 s after the hold began, by the unheld clock
    while d.take()[2]["drains"] == 0 and time.monotonic() < released + 5:
        time.sleep(0.01)
    d.stop()
    t.join()
    assert time.monotonic() < released + 5


def test_run_returns_at_its_deadline_and_refuses_a_second_runner():
    ring, drv = FakeRing(), FakeDriver()
    d = ring.drainer(drv)
    d.set_policy(10.0, 0.001, 10.0, True)
    t0 = time.monotonic()
    assert d.run(t0 + 0.05) == "time"
    assert 0.04 <= time.monotonic() - t0 < 2.0
    t = threading.Thread(target=d.run, args=(time.monotonic() + 30,))
    t.start()
    time.sleep(0.05)
    with pytest.raises(RuntimeError, match="already running"):
        d.run(time.monotonic() + 1)
    d.stop()
    t.join()


def test_a_failed_drain_counts_its_window_once_the_heads_are_known():
    """The ring copy fails after the snapshot was read: every record of the window is counted as
    drain-error and the loop goes on past it; a snapshot that cannot be read counts nothing."""
    import ctypes

    ring, drv = FakeRing(), FakeDriver()
    fail = {"ring copy": True}

    def copy(dst, src, n, stream):
        if fail["ring copy"] and src in (addr(ring.ring), addr(ring.tring)):
            return 700
        ctypes.memmove(dst, src, n)
        return 0

    failing = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)(copy)
    drv.fns = (drv.fns[0], drv.fns[1], ctypes.cast(failing, ctypes.c_void_p).value)
    d = ring.drainer(drv)
    d.set_policy(10.0, 0.001, 10.0, False)
    ring.step(0, 7, timings=2)
    drain_now(d, ring)
    _, _, counts, error = d.take()
    assert error == (700, "copying the ring to pinned memory", 1)
    assert counts["kv_error"] == 7 and counts["timing_error"] == 2 and counts["kv_rows"] == 0
    fail["ring copy"] = False
    ring.step(1, 3, timings=1)
    drain_now(d, ring)
    blocks, _, counts, error = d.take()
    assert error is None and np.frombuffer(blocks[0][0], REC_DTYPE)["step"].tolist() == [1, 1, 1]

    drv2 = FakeDriver()
    drv2._sync = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda ev: 999)
    drv2.fns = (ctypes.cast(drv2._sync, ctypes.c_void_p).value, *drv2.fns[1:])
    ring2 = FakeRing()
    d2 = ring2.drainer(drv2)
    d2.set_policy(10.0, 0.001, 10.0, False)
    ring2.step(0, 4)
    drain_now(d2, ring2)
    _, _, counts, error = d2.take()
    assert error == (999, "waiting for the snapshot", 1) and counts["kv_error"] == 0 and counts["tail"] == 0


def test_the_sink_counts_a_frame_it_cannot_write_and_stops():
    """A full disk (/dev/full): the frame's records are counted lost as writer-error, the sink stops, the
    file cannot be cut back (broken: never sealed), and the error is reported once."""
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        sink = native.FrameSink()
        assert sink.write(np.zeros(3, REC_DTYPE), 0, 0, 1.0, ()) == 2  # no file yet
        assert sink.swap(fd, 0) == (-1, 0, 0, 0, 0)
        assert sink.write(np.zeros(3, REC_DTYPE), 0, 0, 1.0, ()) == 1
        assert sink.write(np.zeros(2, REC_DTYPE), 0, 0, 1.0, ()) == 1  # stopped: counted, not tried
        assert sink.take() == (5, "writer-error", errno.ENOSPC)
        assert sink.take() == (0, "writer-error", 0)  # the error once
        assert sink.counts()["frames_total"] == 0
        assert sink.swap(-1, 0) == (fd, 0, 0, 0, 1)  # /dev/full cannot be cut back: broken
    finally:
        os.close(fd)


def test_a_stopped_sink_counts_records_under_the_recorders_cause(tmp_path):
    rec = Recorder(tmp_path / "sess", role="worker", options={"flush_interval_s": 3600})
    try:
        sink = rec.kv_frame_sink(native.FrameSink)
        assert sink is not None
        assert sink.write(np.zeros(4, REC_DTYPE), 0, 0, 1.0, ()) == 0
        rec._stop_writing("max-size", "test")
        assert sink.write(np.zeros(6, REC_DTYPE), 0, 0, 1.0, ()) == 1
        rec.flush()
        assert rec.dropped["kv_access"] == {"max-size": 6}
        assert rec.writers["kv_access_records"].frames == 1
    finally:
        rec.close()


def test_the_writer_rotates_the_sinks_file_and_seals_each(tmp_path):
    """Past rotate_bytes the flush's rotation gives the sink a new file and seals the old one; the final
    close seals the last; every frame reads back once, from sealed files only."""
    w = FrameWriter(tmp_path, 5_000, 1e9)
    sink = w.native_sink(native.FrameSink)
    made = 0
    for _ in range(12):
        recs = np.zeros(50, REC_DTYPE)
        recs["block_id"] = np.arange(made, made + 50)
        made += 50
        assert sink.write(recs, *CLOCK, ()) == 0
        w.rotate_if_old()
    w.close()
    assert len(w.closed_shards) >= 3 and sum(rows for _, rows in w.closed_shards) == made
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]
    assert w.bytes_total == sum(os.path.getsize(p) for p, _ in w.closed_shards)
    _, batches, _ = read_all(tmp_path, "complete")
    ids = sorted(r for b in batches for r in expand_kv_records(b).column("block_id").to_pylist())
    assert ids == list(range(made))
    # after the close the sink has no file: a frame from Python goes to a file of its own
    w.write_frame(np.zeros(2, REC_DTYPE), CLOCK, ())
    assert sink.write(np.zeros(1, REC_DTYPE), *CLOCK, ()) == 2


def test_the_ring_hands_over_what_the_loop_left_and_counts_its_drops_in_rows():
    """`CudaKVAccessRing._take_native` (its host side only): block records the loop had no file for go to
    the recorder packed, timing records as they are, the ring-wrap drops count every layer a lost
    record stands for (its copies), and a failed drain is warned about once, with its count."""
    import ctypes

    from kvtrace.probes.kv_access.cuda_ring import CudaKVAccessRing
    from tests.unit.probes.test_kv_drain_native import PackedRecorder

    fake, drv = FakeRing(cap=16, tcap=16), FakeDriver()
    ring = object.__new__(CudaKVAccessRing)
    ring.recorder = rec = PackedRecorder()
    ring._append_records, ring._append_timings = rec.append_kv_records, rec.append_timing_records
    ring.stats = {"kv_rows": 0, "timing_rows": 0, "kv_dropped": 0, "timing_dropped": 0, "drain_s": 0.0}
    ring._take_lock = threading.Lock()
    ring._drop_units, ring._tail, ring._ttail = 3, 0, 0  # a recorded layer and its two copies
    ring._drainer = d = fake.drainer(drv)
    d.set_policy(10.0, 0.001, 10.0, False)
    d.set_copies((1, 0, 2, 0))
    fake.step(0, 20, timings=3)  # 20 block records into a ring of 16: 4 overwritten
    drain_now(d, fake)
    ring._take_native()
    assert [len(r) for r, _ in rec.packed] == [16] and [owned for _, owned in rec.packed] == [True]
    assert np.frombuffer(rec.timings[0][0], TIM_DTYPE)["reads"].tolist() == [0, 1, 2]
    assert rec.dropped == {"kv_access": {"ring-wrap": 4 * 3}}
    assert ring.stats["kv_rows"] == 16 and ring.stats["kv_dropped"] == 4 and ring.stats["drains"] == 1
    assert (ring._tail, ring._ttail) == (20, 3)

    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
    copy = proto(drv.fns[2])
    in_rings = [(addr(a), addr(a) + a.nbytes) for a in (fake.ring, fake.tring)]
    bad = proto(lambda dst, src, n, s: 700 if any(lo <= src < hi for lo, hi in in_rings) else copy(dst, src, n, s))
    drv.fns = (drv.fns[0], drv.fns[1], ctypes.cast(bad, ctypes.c_void_p).value)  # the ring copies fail
    ring._drainer = d2 = fake.drainer(drv)
    d2.set_policy(10.0, 0.001, 10.0, False)
    d2.set_tails(20, 3)
    warnings = []
    ring._warn = warnings.append
    fake.step(1, 2, timings=1)
    drain_now(d2, fake)
    ring._take_native()
    assert rec.dropped["kv_access"]["drain-error"] == 2 * 3 and rec.dropped["layer_timings"] == {"drain-error": 1}
    assert len(warnings) == 1 and "CUDA error 700 copying the ring" in warnings[0] and "(1 drain " in warnings[0]


def _spin_beside_the_loop(out_dir: str) -> dict:
    """The drain loop drains and writes 40 steps of records while this thread runs pure Python for 0.5 s:
    the voluntary context switches this thread made meanwhile, and what the loop did."""
    import resource

    ring = FakeRing(cap=1 << 12, tcap=1 << 8)
    for step in range(40):
        ring.step(step, 50, timings=2)
    w = FrameWriter(Path(out_dir), 1 << 30, 1e9)
    d = native.Drainer(native.host_driver(), addr(ring.snaps), NSNAP, 900, (2, 3), (5, 6),
                       (addr(ring.ring), addr(ring.stage), ring.cap), (addr(ring.tring), addr(ring.tstage), ring.tcap),
                       addr(ring.state), addr(ring.live), 77, 502, w.native_sink(native.FrameSink))
    d.set_policy(0.002, 0.001, 0.002, True)
    t = threading.Thread(target=d.run, args=(time.monotonic() + 30,))
    t.start()
    time.sleep(0.05)  # the thread is in the loop now: its first drains done
    threads = threading.active_count()
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    d0 = d.thread_cpu_s()
    t0, x = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.5:  # pure Python, no call that lets the GIL go
        x += 1
    switched = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
    drained_meanwhile = d.thread_cpu_s() > d0  # the loop's thread ran drains during the spin
    d.stop()
    t.join()
    blocks, _, counts, error = d.take()
    return {"threads": threads, "switched": switched, "drained_meanwhile": drained_meanwhile,
            "error": error, "blocks": len(blocks), "kv_rows": counts["kv_rows"], "drains": counts["drains"],
            "frames": w.frames}


def test_the_loop_drains_and_writes_without_ever_taking_the_gil(tmp_path):
    """On the driver's calls in C (`host_driver`: memcpy, events done at once), the loop drains and writes
    its frames while this thread runs Python the whole time: had the loop asked for the GIL even once,
    this thread would have been made to give it up and wait for it back (a voluntary context switch).
    In a fresh interpreter, so that no thread an earlier test left in this process (a Py4J gateway's,
    say) can be the one that asks."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from tests.unit.probes.test_kv_drain_loop import _spin_beside_the_loop as f; "
            "print(json.dumps(f(sys.argv[1])))")
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["threads"] == 2, got  # this one and the loop's: nothing else could ask for the GIL
    assert got["error"] is None and got["blocks"] == 0 and got["kv_rows"] == 40 * 50 and got["drains"] > 50
    assert got["drained_meanwhile"] and got["switched"] == 0, got
    assert got["frames"] == 1
