"""The step-block A/B of bench/profile_engine_thread.py (`--ab-blocks`): which steps each block of a pair
keeps, which pairs it leaves out, and the ratio it reads from them."""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
import types

import pytest

from tests.helpers.run import bench_module


@pytest.fixture(scope="module")
def profile():
    return bench_module("profile_engine_thread")


def calls_of(profile, block_ms: list[list[float]], size: int) -> list[tuple]:
    """(block, recording, position, ns) per step, blocks recording as the worker alternates them."""
    out = []
    for block, steps in enumerate(block_ms):
        recording = profile.block_records(block)
        assert len(steps) == size
        out += [(block, recording, pos, int(ms * 1e6)) for pos, ms in enumerate(steps)]
    return out


def test_pairs_read_the_recording_blocks_against_their_neighbours(profile):
    size = 6
    blocks = []
    for block in range(8):
        recording = profile.block_records(block)
        speed = 1.0 + 0.5 * (block // 2)  # drift between pairs, none inside one
        # the first AB_SKIP steps of a block carry the other mode's step: left out
        blocks.append([50.0] * profile.AB_SKIP + [speed * (10.2 if recording else 10.0)] * (size - profile.AB_SKIP))
    blocks[5][4] = 60.0  # a prefill step in the third pair: that pair is left out
    text = profile.ab_blocks_report("default", {"block_steps": size, "calls": calls_of(profile, blocks, size),
                                                "wall_s": 1.0, "rows": 10, "threads_cpu_s": 0.01})
    pairs, left_out, ratio = re.search(r"paired over (\d+) pairs of blocks \((\d+) pairs.*?\): (\d\.\d+)", text).groups()
    assert (int(pairs), int(left_out)) == (3, 1)
    assert float(ratio) == pytest.approx(10.0 / 10.2, abs=1e-4)  # the drift between pairs cancels


def test_pooling_reads_one_interval_over_the_pairs_of_several_processes(profile, tmp_path):
    size = 4
    paths = []
    for gpu, cost in enumerate((1.01, 1.03)):  # two processes, recording costing 1% and 3% of a step
        blocks = [[50.0] * profile.AB_SKIP + [10.0 * (cost if profile.block_records(b) else 1.0)] * (size - profile.AB_SKIP)
                  for b in range(6)]
        # --ab-calls: a method taking 100 us a step, plus 2 (first process) or 4 us (second) with kvtrace on
        call_times = {"Scheduler.schedule": {str(b): [size * 1000 * (100 + (2 + 2 * gpu) * profile.block_records(b)), size]
                                             for b in range(6)}}
        path = tmp_path / f"gpu{gpu}.txt"
        path.write_text(json.dumps({"block_steps": size, "calls": calls_of(profile, blocks, size), "paused": "all",
                                    "call_times": call_times}))
        paths.append(str(path))
    text = profile.pooled_report(paths)
    pairs, ratio = re.search(r"processes, (\d+) pairs: (\d\.\d+)", text).groups()
    assert int(pairs) == 6 and float(ratio) == pytest.approx((1 / 1.01 / 1.03) ** 0.5, abs=1e-4)
    assert f"{paths[0]}: 0.9901" in text and f"{paths[1]}: 0.9709" in text
    # the method's pairs pooled too: three at +2 us, three at +4
    assert "Scheduler.schedule: 1.00 calls a step; 103.0 us a step kvtrace on, 100.0 kvtrace off: difference +3.0 us" in text
    other = json.loads((tmp_path / "gpu1.txt").read_text())
    (tmp_path / "records.txt").write_text(json.dumps({**other, "paused": "records"}))
    with pytest.raises(SystemExit, match="records.txt: compares recording / paused, the others kvtrace on / kvtrace off"):
        profile.pooled_report([paths[0], str(tmp_path / "records.txt")])
    (tmp_path / "bad.txt").write_text("{")
    with pytest.raises(SystemExit, match="bad.txt: not an --ab-blocks result"):
        profile.pooled_report([paths[0], str(tmp_path / "bad.txt")])


def test_the_recording_flag_alternates_its_order_between_pairs(profile):
    assert [profile.block_records(b) for b in range(8)] == [True, False, False, True, True, False, False, True]
    assert profile.steady([10, 11, 9, 19]) and not profile.steady([10, 11, 9, 25]) and not profile.steady([10, 10, 4])


def fake_llm(steps: int, on_step):
    """An `LLM` whose generate() runs `steps` engine steps, each calling `on_step` (what ab_blocks_worker drives)."""

    class Engine:
        def step(self):
            on_step()

    class LLM:
        llm_engine = Engine()

        def generate(self, prompts, params, use_tqdm=False):
            for _ in range(steps):
                self.llm_engine.step()

    return LLM()


class FakeProbe:
    def __init__(self, name: str, enabled: bool = True):
        self.name, self.enabled, self.faults = name, enabled, 0


class FakeRing:
    def __init__(self):
        self.step, self.calls = 41, []

    def begin_step(self, step, record=True):
        self.calls.append((step, record))


def test_pausing_all_of_kvtrace_switches_every_probe_and_clears_the_device_flag_once(profile, monkeypatch):
    from kvtrace.probes import lifecycle

    probes = [FakeProbe("scheduler"), FakeProbe("kv_blocks"), FakeProbe("connector", enabled=False)]
    ring = FakeRing()
    monkeypatch.setattr(lifecycle, "installed", lambda: probes)
    pause = profile.KvtracePause(ring)
    assert [p.name for p in pause.probes] == ["scheduler", "kv_blocks"]  # a probe already off stays off
    pause.set(True)
    assert ring.calls == [] and all(p.enabled for p in pause.probes)
    pause.set(False)
    pause.set(False)
    # the graph-captured record kernels read the flag: cleared once, at the switch, for the ring's last step
    assert ring.calls == [(41, False)]
    assert not any(p.enabled for p in probes)
    pause.set(True)
    assert [p.enabled for p in probes] == [True, True, False] and ring.calls == [(41, False)]
    assert pause.faults() == {}
    probes[0].faults = 2
    assert pause.faults() == {"scheduler": 2}


def test_the_report_names_the_blocks_by_what_was_paused_and_says_when_a_probe_failed(profile):
    size = 4
    blocks = [[10.0] * size for _ in range(4)]
    r = {"block_steps": size, "calls": calls_of(profile, blocks, size), "wall_s": 1.0, "rows": 0,
         "threads_cpu_s": 0.0, "paused": "all", "probe_faults": {}}
    text = profile.ab_blocks_report("default", r)
    assert "kvtrace on / kvtrace off, paired over 2 pairs" in text and "FAILED" not in text
    text = profile.ab_blocks_report("default", {**r, "probe_faults": {"scheduler": 1}})
    assert "PROBES FAILED during the run" in text and "scheduler (1)" in text
    assert "A / A again" in profile.ab_blocks_report("default", {**r, "paused": "none"})
    assert "recording / paused" in profile.ab_blocks_report("default", {k: v for k, v in r.items() if k != "paused"})


def test_the_methods_timed_by_block_say_what_kvtrace_adds_inside_each(profile):
    """--ab-calls: a method's us per step in the kvtrace-on blocks against the off blocks of the same
    pairs, with a bootstrap interval, and its calls per step; pairs the step ratio left out are left out."""
    size = 4
    blocks = [[10.0] * size for _ in range(6)]
    blocks[5][3] = 60.0  # the third pair holds a prefill: left out here too
    times = {}
    for block in range(6):
        on = profile.block_records(block)
        # 2 calls a step, 30 us each on, 25 off (the third pair's would read +1000 us: it must not count)
        per_call = 30_000 if on else 25_000
        if block in (4, 5) and on:
            per_call = 1_000_000
        times[str(block)] = [2 * size * per_call, 2 * size]
    r = {"block_steps": size, "calls": calls_of(profile, blocks, size), "wall_s": 1.0, "rows": 0,
         "threads_cpu_s": 0.0, "paused": "all", "probe_faults": {}, "call_times": {"BlockPool.get_new_blocks": times}}
    text = profile.ab_blocks_report("default", r)
    line = next(x for x in text.splitlines() if "BlockPool.get_new_blocks" in x)
    assert "2.00 calls a step; 60.0 us a step kvtrace on, 50.0 kvtrace off: difference +10.0 us [+10.0, +10.0]" in line, line
    aa = profile.ab_blocks_report("default", {**r, "paused": "none"})  # an A/A names its blocks A and A again
    assert "60.0 us a step A, 50.0 A again: difference +10.0 us" in aa, aa
    # no call times: no such lines
    assert "--ab-calls" not in profile.ab_blocks_report("default", {**r, "call_times": None})


def test_block_call_times_wrap_vllms_methods_and_put_them_back(profile):
    """On vLLM's real classes (the CPU build): each loaded method of AB_CALLS wrapped, its calls counted
    in the block that was current, and the class attributes restored after."""
    pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool

    before = BlockPool.__dict__["get_new_blocks"]
    block = [3]
    times = profile.BlockCallTimes(block)
    try:
        assert "BlockPool.get_new_blocks" in times.ns and BlockPool.__dict__["get_new_blocks"] is not before
        pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=16)
        pool.get_new_blocks(2)
        block[0] = 4
        pool.get_new_blocks(1)
        pool.get_new_blocks(1)
        counts = {b: calls for b, (ns, calls) in times.ns["BlockPool.get_new_blocks"].items()}
        assert counts == {3: 1, 4: 2}
    finally:
        times.remove()
    assert BlockPool.__dict__["get_new_blocks"] is before


def test_the_state_comparison_moves_the_rings_state_launch_by_block_and_puts_it_back(profile, monkeypatch, tmp_path):
    """--ab-pause state: both blocks record; one defers the ring's per-step state launch, the other makes it in
    begin_step (the flag is read at the step's begin_step, inside the engine's step)."""
    ring = types.SimpleNamespace(defer_state=True, sample_every=1, stats={})
    monkeypatch.setattr(profile, "kv_ring", lambda: ring)
    seen = []

    llm = fake_llm(8, lambda: seen.append(ring.defer_state))
    args = types.SimpleNamespace(ab_blocks=2, ab_pause="state", ab_calls=False, reps=1, pin=None, skip_kv_writes=None,
                                 result=str(tmp_path / "r.json"))
    profile.ab_blocks_worker(args, llm, None, lambda rep: [])
    assert seen == [profile.block_records(n // 2) for n in range(8)] == [True, True, False, False, False, False, True, True]
    assert ring.defer_state is True  # as it was, after the run
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["paused"] == "state" and len(r["calls"]) == 8
    blocks = [[10.0] * 4 for _ in range(4)]
    report = profile.ab_blocks_report("default", {**r, "block_steps": 4, "calls": calls_of(profile, blocks, 4)})
    assert "state launch deferred / state launch in begin_step, paired over 2 pairs" in report, report
    args.ab_pause, ring = "state", None
    with pytest.raises(SystemExit, match="no CUDA KV ring"):
        profile.ab_blocks_worker(args, llm, None, lambda rep: [])


def test_thread_hold_keeps_new_work_waiting_and_waits_for_work_under_way(profile):
    """--ab-pause all-threads: a held method does not start until the hold ends; a hold waits for calls
    under way; `remove` puts the class's method back."""
    entered, release = threading.Event(), threading.Event()
    calls = []

    class Recorder:
        def flush(self):
            calls.append(threading.current_thread().name)
            entered.set()
            release.wait(5)

    rec = Recorder()
    hold = profile.ThreadHold(None, rec)
    assert hold.names == ["Recorder.flush"]
    first = threading.Thread(target=rec.flush, name="under-way")
    first.start()
    assert entered.wait(5)
    holding = threading.Thread(target=hold.set, args=(False,))
    holding.start()
    holding.join(0.2)
    assert holding.is_alive()  # the flush under way is waited for
    release.set()
    holding.join(5)
    first.join(5)
    assert not holding.is_alive() and hold.waited_s >= 0.15
    second = threading.Thread(target=rec.flush, name="held")
    second.start()
    second.join(0.2)
    assert second.is_alive() and calls == ["under-way"]  # held: not started
    hold.set(True)
    second.join(5)
    assert calls == ["under-way", "held"]
    hold.remove()
    assert "flush" not in vars(rec) and hold.names == ["Recorder.flush"]


def _writer_flushes(profile, on_time: bool, seconds: float = 2.0, block_s: float = 0.05,
                    interval_s: float = 0.2) -> tuple[int, float, int]:
    """A writer-like thread (flush every interval_s, as Recorder._run) under a ThreadHold that holds it
    every other block_s: (its flushes, the unheld seconds, flushes another thread made meanwhile)."""
    flushes, stop = [], threading.Event()

    class Recorder:
        flush_interval_s = interval_s

        def flush(self):
            flushes.append(threading.current_thread() is self._thread)

        def _run(self):
            while not stop.wait(self.flush_interval_s):
                self.flush()

    rec = Recorder()
    rec._thread = threading.Thread(target=rec._run, name="kvtrace-writer")
    hold = profile.ThreadHold(None, rec, on_time)
    rec._thread.start()
    end, run, u0 = time.perf_counter() + seconds, True, hold.unheld_s()
    while time.perf_counter() < end:
        hold.set(run)
        if run:
            rec.flush()  # not the writer's own: never put off
        time.sleep(block_s)
        run = not run
    hold.set(True)
    unheld = hold.unheld_s() - u0
    hold.remove()
    stop.set()
    rec._thread.join(5)
    return sum(flushes), unheld, len(flushes) - sum(flushes)


def test_thread_hold_stops_the_writers_clock_while_it_is_held(profile):
    """ThreadHold(on_time=True): the writer's flushes come once per flush_interval_s of unheld time; with
    wall clocks (all-threads-wall) every flush that fell due while held runs at the release, about twice as
    many here (held half the time). Flushes from other threads are never put off."""
    timed, unheld, others = _writer_flushes(profile, True)
    walled, _, _ = _writer_flushes(profile, False)
    assert 0.8 <= unheld <= 1.2 and others >= 10
    assert 2 <= timed <= unheld / 0.2 + 2, (timed, unheld)  # ~6: at once, then one a 0.2 s of unheld time
    assert walled >= 1.4 * timed, (walled, timed)  # ~8: one a 0.2 s of wall time, at the next release


def test_thread_hold_skips_the_drain_loops_hand_overs_until_due_by_its_unheld_clock(profile):
    """ThreadHold(on_time=True): the drain loop's thread comes back to hand over every HANDOVER_S of wall
    time; a call before HANDOVER_S of unheld time has passed returns at once (the next takes what it left),
    so the hand-overs come at their real rate per unheld second. Other threads' calls always go through."""
    taken, stop = [], threading.Event()

    class Ring:
        HANDOVER_S = 0.2

        def _take_native(self):
            taken.append(threading.current_thread() is self._thread)

        def _loop(self):
            while not stop.wait(0.02):
                self._take_native()

    ring = Ring()
    ring._thread = threading.Thread(target=ring._loop)
    hold = profile.ThreadHold(ring, None)
    assert hold.names == ["Ring._take_native"]
    ring._thread.start()
    time.sleep(1.0)
    ring._take_native()
    stop.set()
    ring._thread.join(5)
    hold.remove()
    assert taken.count(False) == 1 and 3 <= taken.count(True) <= 7, taken  # ~6 of ~50 calls
    assert hold.deferred["hand-over"] >= 20 and "_take_native" not in vars(ring)
    assert profile.ThreadHold(ring, None, on_time=False).names == []  # wall clocks: the hand-overs as they come


def test_all_threads_holds_them_outside_the_on_blocks_timed_steps(profile, monkeypatch, tmp_path):
    """The worker pauses kvtrace as `all` does and runs its threads only from the AB_SKIP-th step of an on
    block; afterwards nothing is held or shadowed, and the report says where the threads worked."""
    from kvtrace.probes import lifecycle
    from kvtrace.record import recorder as recorder_module

    probes = [FakeProbe("scheduler")]

    class Ring(FakeRing):
        sample_every = 1
        stats: dict = {}

        def _drain_native(self):
            return None

    ring = Ring()

    def flush():
        return None

    rec = types.SimpleNamespace(flush=flush, writer_cpu_s=0.0)
    holds = []

    class Hold(profile.ThreadHold):
        def __init__(self, *args):
            super().__init__(*args)
            holds.append(self)

    monkeypatch.setattr(lifecycle, "installed", lambda: probes)
    monkeypatch.setattr(profile, "kv_ring", lambda: ring)
    monkeypatch.setattr(profile, "ThreadHold", Hold)
    monkeypatch.setattr(recorder_module, "current_recorder", lambda: rec)
    seen = []

    llm = fake_llm(16, lambda: seen.append((probes[0].enabled, holds[0]._run)))
    args = types.SimpleNamespace(ab_blocks=4, ab_pause="all-threads", ab_calls=False, reps=1, pin=None, skip_kv_writes=None,
                                 result=str(tmp_path / "r.json"))
    profile.ab_blocks_worker(args, llm, None, lambda rep: [])
    expected = [(profile.block_records(n // 4), profile.block_records(n // 4) and n % 4 >= profile.AB_SKIP)
                for n in range(16)]
    assert seen == expected and expected[:4] == [(True, False), (True, False), (True, True), (True, True)]
    assert "_drain_native" not in vars(ring) and rec.flush is flush and holds[0]._run  # as they were
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["paused"] == "all-threads" and r["held"]["methods"] == ["Ring._drain_native", "SimpleNamespace.flush"]
    report = profile.ab_blocks_report("default", {**r, "calls": calls_of(profile, [[10.0] * 4] * 4, 4)})
    assert "kvtrace on with its threads' work / kvtrace off, its threads held, paired over 2 pairs" in report, report
    assert "held in the off blocks, inside the on blocks: Ring._drain_native, SimpleNamespace.flush" in report
    for mode, held in (("all-drain", ["Ring._drain_native"]), ("all-writer", ["SimpleNamespace.flush"])):
        holds.clear()  # only the one thread's methods held; the comparison named for it
        profile.ab_blocks_worker(types.SimpleNamespace(**{**vars(args), "ab_pause": mode}), llm, None, lambda rep: [])
        r = json.loads((tmp_path / "r.json").read_text())
        assert r["paused"] == mode and r["held"]["methods"] == held and holds[0]._run
        assert profile.PAUSE_NAMES[mode][1].endswith("thread held")


def test_the_engine_threads_clock_and_switches_tell_waiting_from_working(profile, monkeypatch, tmp_path):
    """--ab-calls with the steps' own clock: a step that sleeps 2 ms more (as one waiting for the GIL does)
    reads as time off the CPU with a voluntary switch, not as CPU time; the figures pool across processes."""
    ring = types.SimpleNamespace(sample_every=1, stats={})
    monkeypatch.setattr(profile, "kv_ring", lambda: ring)
    current = {"n": 0}

    def step():  # 1 ms of CPU every step; the recording blocks also sleep 2 ms
        n = current["n"]
        current["n"] += 1
        t = time.thread_time()
        while time.thread_time() - t < 0.001:
            pass
        if profile.block_records(n // 4):
            time.sleep(0.002)

    args = types.SimpleNamespace(ab_blocks=4, ab_pause="records", ab_calls=True, reps=1, pin=None, skip_kv_writes=None,
                                 result=str(tmp_path / "r.json"))
    profile.ab_blocks_worker(args, fake_llm(32, step), None, lambda rep: [])
    r = json.loads((tmp_path / "r.json").read_text())
    assert sum(steps for _, steps in r["thread_usage"]["voluntary switches"].values()) == 32
    _, _, _, _, _, kept = profile.ab_block_pairs(r)
    figures = profile.usage_diffs(r, kept)
    off_cpu = statistics.fmean(figures["off the CPU, us"][0])
    cpu = statistics.fmean(figures["CPU time, us"][0])
    switches = statistics.fmean(figures["voluntary switches"][0])
    assert off_cpu > 1500 and abs(cpu) < 500 and switches >= 0.9, (off_cpu, cpu, switches)
    text = profile.ab_blocks_report("default", r)
    assert "the engine thread over its steps" in text and "voluntary switches: " in text, text
    pooled = profile.pooled_report([str(tmp_path / "r.json"), str(tmp_path / "r.json")])
    line = next(x for x in pooled.splitlines() if "off the CPU, us" in x)
    assert "difference +" in line and "calls a step" not in pooled, pooled



def run_in_thread(fn):
    """fn() on a thread of its own (pinning pins the calling thread: never pytest's), its result or error."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="pinning apart needs two CPUs")
def test_pinning_puts_the_engine_thread_on_one_cpu_and_kvtraces_threads_off_its_core(profile):
    import os

    stop = threading.Event()
    writer = threading.Thread(target=stop.wait, name="kvtrace-writer")
    other = threading.Thread(target=stop.wait, name="vllm-other")
    writer.start()
    other.start()
    before = os.sched_getaffinity(other.native_id)
    try:
        def pin():
            return profile.pin_threads("far"), os.sched_getaffinity(0)

        pinned, engine_cpus = run_in_thread(pin)
        core = set(pinned["engine_core"])
        assert engine_cpus == {pinned["engine_cpu"]} and pinned["engine_cpu"] in core
        assert "kvtrace-writer" in pinned["threads"] and "vllm-other" not in pinned["threads"]
        assert os.sched_getaffinity(writer.native_id) == set(pinned["kvtrace_cpus"]) and not core & set(pinned["kvtrace_cpus"])
        assert os.sched_getaffinity(other.native_id) == before  # only kvtrace's threads are moved
        only_engine = run_in_thread(lambda: profile.pin_threads("engine"))
        assert only_engine["kvtrace_cpus"] is None
        report = profile.setup_note({"pinned": pinned, "skip_kv_writes": "all"})
        assert f"the engine thread on CPU {pinned['engine_cpu']}" in report and "kvtrace-writer on CPUs" in report
        assert "KV record frames not written (all)" in report
        if len(core) == 1:  # a machine that shows one hardware thread a core has no near placement
            with pytest.raises(SystemExit, match="no other hardware thread"):
                run_in_thread(lambda: profile.pin_threads("near"))
    finally:
        stop.set()
        writer.join()
        other.join()


def test_skipping_the_kv_record_writes_leaves_the_other_tables_written(profile, tmp_path):
    """--skip-kv-writes all: a drain's frame is built and counted, nothing of it reaches its file; the
    other tables are written as usual."""
    import numpy as np

    from kvtrace.format.kv_records import REC_DTYPE
    from kvtrace.record.recorder import Recorder

    rec = Recorder(tmp_path / "s", "test", {"flush_interval_s": 3600})
    try:
        profile.skip_kv_writes(rec, "all")
        rec.append_kv_records(np.zeros(1000, REC_DTYPE), (0, 0, 1.0))
        rec.buffer("clock_anchors").append((1, 2, None, "host"))
        rec.flush()
        assert rec.rows_written["kv_access_records"] == 1
        assert all(p.stat().st_size == 0 for p in rec.dir.glob("kv_access_records.*"))
        assert rec.rows_written["clock_anchors"] >= 2 and rec.writers["clock_anchors"].bytes_total > 0
    finally:
        rec.close()
    with pytest.raises(SystemExit, match="not one of all"):
        profile.skip_kv_writes(rec, "spool")


def test_skipping_the_records_hands_none_to_the_recorder(profile, tmp_path):
    """--skip-kv-writes records: neither a drain's block records nor its timing records reach the recorder
    (no frame, no layer_timings row, none counted), from the recorder's methods or from a ring made before
    the skip (which took those methods when it was made); the host probes' tables are written as usual."""
    import numpy as np

    from kvtrace.format.kv_records import REC_DTYPE, TIM_DTYPE
    from kvtrace.probes.kv_access.ring import CPUKVAccessRing
    from kvtrace.record.recorder import Recorder

    rec = Recorder(tmp_path / "s", "test", {"flush_interval_s": 3600})
    try:
        ring = CPUKVAccessRing(capacity=1 << 12, block_size=4, granularity="blocks", layers="all", recorder=rec)
        profile.skip_kv_writes(rec, "records", ring)
        rec.append_kv_records(np.zeros(1000, REC_DTYPE), (0, 0, 1.0))
        rec.append_timing_records(np.zeros(10, TIM_DTYPE), (0, 0, 1.0))
        ring._emit_window(np.zeros(500, REC_DTYPE), 0, 500, timing=False, owned=True)
        ring._emit_window(np.zeros(8, TIM_DTYPE), 0, 8, timing=True, owned=True)
        assert ring.stats["kv_rows"] == 500 and ring.stats["timing_rows"] == 8  # drained, then handed to nothing
        rec.buffer("clock_anchors").append((1, 2, None, "host"))
        rec.flush()
        assert rec.rows_written["kv_access_records"] == 0 and rec.rows_written["layer_timings"] == 0
        assert not rec.buffers["layer_timings"]
        assert rec.rows_written["clock_anchors"] >= 2
        assert "no KV block or timing record handed to the recorder (records)" in profile.setup_note(
            {"skip_kv_writes": "records"})
    finally:
        rec.close()
    assert not list(rec.dir.glob("kv_access_records.*")) and not list(rec.dir.glob("layer_timings.*"))


@pytest.mark.parametrize("where,churn,handovers", [("thread", False, 0), ("process", False, 0), ("thread", True, 12)])
def test_the_synthetic_load_writes_only_while_switched_on(profile, tmp_path, monkeypatch, where, churn, handovers):
    """--ab-pause load-thread|load-process: the load copies and writes its batches while on (with its GIL
    hand-overs after each), nothing while held, and on stop says its CPU time and leaves no scratch file."""
    sleep, zero_sleeps = time.sleep, []

    def counted(seconds):
        if seconds == 0:
            zero_sleeps.append(threading.current_thread().name)
        sleep(seconds)

    monkeypatch.setattr(profile.time, "sleep", counted)
    load = profile.SyntheticLoad(where, str(tmp_path), mb_s=200.0, churn=churn, handovers=handovers)
    scratch = tmp_path / f"kvtrace-load-{os.getpid()}.scratch"
    try:
        deadline = time.monotonic() + 30
        while not scratch.exists() and time.monotonic() < deadline:  # the child opens it as it starts
            time.sleep(0.05)
        load.set(True)
        while scratch.stat().st_size < 3 * profile.LOAD_BATCH_BYTES and time.monotonic() < deadline:
            time.sleep(0.02)
        load.set(False)
        time.sleep(0.3)  # a batch under way finishes
        held = scratch.stat().st_size
        time.sleep(0.5)
        assert held >= 3 * profile.LOAD_BATCH_BYTES and scratch.stat().st_size == held
    finally:
        cpu_s = load.stop()
    assert cpu_s > 0 and not scratch.exists()
    if where == "thread":  # a load that fails says so at the end instead of reading as no cost
        broken = profile.SyntheticLoad(where, str(tmp_path / "missing"), mb_s=200.0)
        with pytest.raises(SystemExit, match="the load thread failed"):
            broken.stop()
    batches = held // profile.LOAD_BATCH_BYTES
    assert zero_sleeps.count("kvtrace-bench-load") == handovers * batches


def test_the_load_comparison_switches_the_load_by_block_and_reports_it(profile, monkeypatch, tmp_path):
    loads = []

    class Load:
        def __init__(self, where, directory, mb_s, churn, handovers):
            self.where, self.states, self.churn = where, [], churn
            loads.append(self)

        def set(self, on):
            self.states.append(on)

        def stop(self):
            return 0.25

    monkeypatch.setattr(profile, "SyntheticLoad", Load)
    monkeypatch.setattr(profile, "kv_ring", lambda: None)
    args = types.SimpleNamespace(ab_blocks=2, ab_pause="load-process", ab_calls=False, reps=1, pin=None,
                                 skip_kv_writes=None, load_mb_s=33.0, load_churn=True, load_handovers=12,
                                 result=str(tmp_path / "r.json"))
    monkeypatch.setattr(profile, "tlb_shootdowns", iter(range(0, 100, 3)).__next__)  # 3 between reads
    profile.ab_blocks_worker(args, fake_llm(8, lambda: None), None, lambda rep: [])
    assert loads[0].where == "process" and loads[0].churn
    assert loads[0].states == [profile.block_records(n // 2) for n in range(8)]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["load"] == {"where": "process", "mb_s": 33.0, "cpu_s": 0.25, "churn": True, "handovers": 12}
    assert r["tlb_shootdowns"] == {"on": 6, "off": 6}  # read at each of the 4 blocks' first step and at the end
    report = profile.ab_blocks_report("default", {**r, "wall_s": 10.0, "calls": calls_of(profile, [[10.0] * 4] * 4, 4)})
    assert "a writer-like load in a process of its own / the load held" in report
    assert ("the load: 33 MB/s in the on blocks on a process of its own, each batch in memory of its own, 12 GIL "
            "hand-overs a batch, its CPU 2.50% of the window (its start and imports too)") in report
    assert "TLB shootdowns (all CPUs) 0.75 a step a writer-like load in a process of its own, 0.75 the load held" in report


def test_the_timeline_tells_the_steps_during_the_threads_work_from_the_others(profile):
    """--ab-calls: each on-block step is grouped by what kvtrace's threads did during it, and read against
    its pair's off block: here the steps during a drain's hand-over are 20% slower, a flush's 50%, the
    others 1%, and the report says so, group by group."""
    size, ms = 8, 1_000_000
    calls, starts, emits, flushes, drains, t = [], [], [], [], [], 0
    for block in range(40):
        recording = profile.block_records(block)
        for pos in range(size):
            excess = 0.0
            if recording and pos >= profile.AB_SKIP:
                excess = 0.01
                if pos == 3:  # a drain, copy then hand-over, inside the step: it counts as a hand-over's
                    drains.append((t + ms // 10, t + ms * 9 // 10))
                    emits.append((t + ms, t + 2 * ms))
                    excess = 0.20
                elif pos == 5 and block % 4 == 0:
                    flushes.append((t + 3 * ms, t + 9 * ms))
                    excess = 0.50
            ns = int(10 * ms * (1 + excess))
            calls.append((block, recording, pos, ns))
            starts.append(t)
            t += ns
    r = {"block_steps": size, "calls": calls, "wall_s": t / 1e9, "rows": 1, "threads_cpu_s": 0.1,
         "step_starts_ns": starts, "thread_work": {"drain": drains, "emit": emits, "flush": flushes}}
    _, _, _, _, _, kept = profile.ab_block_pairs(r)
    groups = profile.timeline_steps(r, kept)
    assert len(groups["emit"]) == 20 and len(groups["flush"]) == 10 and not groups["drain"]
    assert statistics.fmean(groups["emit"]) == pytest.approx(0.20, abs=1e-6)
    assert statistics.fmean(groups["flush"]) == pytest.approx(0.50, abs=1e-6)
    assert statistics.fmean(groups["quiet"]) == pytest.approx(0.01, abs=1e-6)
    assert statistics.fmean(groups["off"]) == pytest.approx(0.0, abs=1e-9)
    text = profile.ab_blocks_report("default", r)
    assert re.search(r"with none of the threads' work: 90 steps, \+1\.00%", text)
    assert re.search(r"during a hand-over of records: 20 steps, \+20\.00%", text)
    assert re.search(r"during a flush: 10 steps, \+50\.00%", text)
    assert "drain 20 calls, 16 ms, emit 20 calls, 20 ms, flush 10 calls, 60 ms" in text
    assert "by what kvtrace's threads did" not in profile.ab_blocks_report("default", {**r, "thread_work": None})


def test_thread_work_times_the_work_under_the_hold(profile):
    """ThreadWork's spans time the calls themselves; the hold, installed after it, wraps them, and both
    come off again, leaving the objects as they were."""

    class Ring:
        def _drain_native(self):
            time.sleep(0.002)

        def _emit_native(self):
            return "emitted"

    class Rec:
        def flush(self):
            return None

    ring, rec = Ring(), Rec()
    work = profile.ThreadWork(ring, rec)
    hold = profile.ThreadHold(ring, rec)
    ring._drain_native()
    assert ring._emit_native() == "emitted"
    rec.flush()
    hold.remove()
    work.remove()
    assert not vars(ring) and not vars(rec)
    assert [len(work.spans[k]) for k in ("drain", "emit", "flush")] == [1, 1, 1]
    (a, b), = work.spans["drain"]
    assert b - a >= 2_000_000


def test_ring_lines_read_each_ring_from_a_real_session(profile, tmp_path):
    """The A/B report's ring lines come from the proc.json a real Recorder writes (the ring's facts as
    CudaKVAccessRing.close sets them); an unreadable proc.json is said, not skipped."""
    from kvtrace.record.recorder import Recorder

    rec = Recorder(tmp_path, role="worker")
    rec.set_info("kv_ring_cuda:0", {"kv_rows": 12, "kv_dropped": 1, "drains": 3, "step_tickets": 40,
                                    "step_tickets_lost": 2, "state_missed_steps": 0, "drain_s": 0.5})
    rec.close()
    assert profile.ring_lines(tmp_path) == [
        "  kv_ring_cuda:0: kv_rows 12, kv_dropped 1, drains 3, step_tickets 40, step_tickets_lost 2, "
        "state_missed_steps 0"]
    (proc,) = tmp_path.glob("procs/*/proc.json")
    proc.write_text("{not json")
    (line,) = profile.ring_lines(tmp_path)
    assert line.startswith("  KV rings: the session's proc.json unreadable (")
