"""Where the engine thread's time goes, plain and under `kvtrace record`: a profile of one process.

The GPU throughput benchmark (bench_gpu_throughput.py) measures what recording costs a host-bound
model; this one says where. Each variant runs in its own process with vLLM's engine core in process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the scheduler, the host probes and the model runner on the one
thread that calls `LLM.generate`), the same offline workload as the throughput benchmark (random token
ids, `ignore_eos`, random weights), warmed up once, then `--reps` repetitions under cProfile. For each
variant it prints the wall time per engine step, the profiled thread's own time in kvtrace's code
(functions in files under `kvtrace/`, their self time: what the probes cost on the engine thread
directly) and the functions that take the most self time. Python 3.12's cProfile sees every thread,
so the recorder's background threads (ring drain, shard writer) are in those figures too; what they
make the engine thread wait (GIL hand-overs) is not, and shows only in its wall time.

    python bench/profile_engine_thread.py --shape 1b --variants plain,default --out DIR   # on the GPU machine

cProfile slows Python code by itself (every call is counted), so the figures compare variants with each
other, not with the throughput benchmark. `--threads` runs without it and reports, per engine step, the
wall time and CPU time: the engine thread's (its own clock), kvtrace's ring drain and shard writer
threads' (each reads its own clock at every turn of its loop) and the rest of the process's (vLLM's and CUDA's
other threads). A variant's extra wall time is then work on the engine thread itself, or time that
thread waits (for the GIL while kvtrace's threads run, or for the GPU). `--rounds N` runs the variants'
processes N times in turns. `--py-spy PATH` adds, over the same window, which thread holds the GIL
(py-spy sampling at 200 Hz without pausing the process): what the engine thread waits for is the time
others hold it.

`--ab` measures the KV records' cost inside one recorded process (a variant with the ring: default or
all-layers), where the machine's drift between processes and minutes cannot reach: its repetitions
alternate between the ring recording and the ring paused (its sampling set so that no step records:
the record kernels still run and exit at once, the drain finds nothing, the host probes record as
usual), in pairs whose order alternates, 2.5 s apart so that the drain and the shard writer finish one
repetition's rows before the next starts (their CPU after the window is printed: the part of the cost
the window misses). It prints the paired throughput ratio (recording / paused) with a bootstrap interval
over the pairs, and the rows each recording repetition drained.

`--ab-blocks N` does the same at a finer grain: over `--reps` repetitions, blocks of N engine steps with
the ring recording and paused in turns (one block of each pair records, the first in even pairs, the
second in odd ones), each step's wall time kept; pairs whose blocks mix phases (a prefill, a
repetition's tail) are left out. It reads what recording a step adds to it, on the engine thread and
the GPU; what the ring does every step whether it records or not (the per-step hooks, the record
kernels, which exit at once when paused, the drains) and the drain and writer threads' work, spread
over both kinds of block, are outside it. `--threads` and `--ab-blocks` also print the machine's busy
and stolen CPU shares over the window.

`--ab-pause all` (with `--ab-blocks`) pauses all of kvtrace in the other block instead: every probe
switched off (its wrappers stay in place and return through their first line, as in
count_instructions.py's "disabled" mode) and the ring's device flag cleared, so that record kernels in
CUDA graphs exit at once. It reads what kvtrace costs the engine thread directly, including what its
code does to vLLM's (caches, the GIL hand-overs it causes), as a paired ratio of thousands of steps in
one process: the way to read ~1% on a host-bound engine whose speed moves by 10-60% between 100 ms
windows (bench/cpu_speed_probe.py). Outside it: the off-block's residue (a wrapper's call, the exiting
kernels) and the background threads' work (the GIL they hold: `--threads --py-spy`), spread over both
kinds of block. `--ab-pause all-threads` brings that work in: as `all`, and kvtrace's background threads
(the KV ring's drain, the shard writer) start nothing while held, in the off blocks and the first steps of
the on blocks (left out of the figures), so that their drains and flushes run during the on blocks' timed
steps (`ThreadHold`; the engine thread waits, untimed, for one under way at a hold), their clocks stopped
while held so that their timed work comes as often per unheld second as in a real run
(`all-threads-wall`: wall clocks, which brings what fell due while held into the on blocks, about twice
the real rate of flushes and more drains); `all-drain` and
`all-writer` hold only the one thread (the other's work stays spread over both kinds of block), which
tells the two apart. `--ab-pause
none` switches nothing (an A/A: the noise and bias of the pairing itself). `--ab-pause state` records in both
blocks and moves the ring's per-step state launch: deferred to just before the step's first graph replay
or layer in one block (the default), made in `begin_step` at the top of the step in the other
(`defer_state`): what deferring it gains the step, side by side in one process. A probe that fails during the
run (switched off for good) spoils the comparison: the report says so.

`--ab-calls` (with `--ab-blocks`) also times vLLM's own methods on the engine thread per call, each call
in its block (AB_CALLS: the scheduler's `schedule` and `update_from_output`, the KV-cache manager's
`allocate_slots`, the block pool's methods, the model runner's `execute_model` and the parts of its step:
the inputs' preparation, the graph's replay, the sampling, the wait for its tokens): kvtrace's patches are
in place in both kinds of block, so a method's time with kvtrace on minus off, over the same pairs, is
what kvtrace adds inside it (its wrapper's handlers, its block-pool hooks, the worker's per-step hook),
with an interval over the pairs; the timers' own cost (~0.3 us a call) is the same in both. It also reads
the engine thread's own clock and context switches around each step (`StepUsage`): on minus off, extra
time off the CPU with extra voluntary switches is waiting (for the GIL that a background thread holds),
extra CPU time is work on the thread or the same work made slower (caches shared with other threads).

Two more switches change kvtrace's background work in such an A/B, to tell what of it costs:
`--ab-calls` also times each call of the background threads' work (`ThreadWork`: the ring's drains and
hand-overs, the recorder's flushes) and each step's start, and reads the on blocks' steps by what the
threads did during them (`timeline_report`): whether the steps that meet their work are the slow ones,
or every step of an on block is.
`--skip-kv-writes all` builds the drains' KV record frames but does not write them (`records`: hands no
block or timing record to the recorder; read with `--ab-pause all-threads`, which counts the drain
thread's work), and `--pin far|near|engine` pins the
engine thread to one CPU and kvtrace's threads to other cores, to its core's other hardware thread, or
nowhere.
`--ab-pause load-thread|load-process` switches a load shaped like the writer's KV record work instead
(copies of 3.36 MB and their write() into the page cache, `--load-mb-s`), on a thread of the engine's
process or in a process of its own, kvtrace recording the same in both kinds of block: whether that work
costs the engine thread through the process it shares or through the machine. `--load-churn` copies each
batch into fresh memory (freed 20 at a time, as the drain's copies are at a flush); `--load-handovers N`
adds N GIL hand-overs after each batch, the writer's without its work. The report also gives the TLB
shootdowns a step (all CPUs) in each kind of block, and `--ab-calls` the engine thread's minor page faults.

`--hook-times` (with `--threads`) times kvtrace's per-step calls on the engine thread over the same
window, each wrapped in a `perf_counter_ns` pair (~0.2 us a call of its own): the KV ring's
`begin_step`, its per-step launch (`_launch_state`, deferred to just before the step's first graph
replay or layer), `record_layer` and `drain`, and inside them its kernel launches (the eager layers'),
CUDA stream-capture queries and head snapshots; the scheduler probe's `on_schedule`
and `after_update`, and for the steps that only decode their C twins `StepRows.decode` and `.end`. It prints each one's us per engine step and the distribution of a call (median, 90th
and 99th percentiles): what a call costs beside a running engine, where a microbenchmark on an idle GPU
(bench_begin_step.py) sees only the best case.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_throughput as bgt  # noqa: E402  (its shapes, variants and model folders)


def kvtrace_threads_cpu_s() -> tuple[float, float]:
    """CPU seconds so far of this process's KV ring drain thread and shard writer thread (0 when not
    recording). Each reads its own clock at every turn of its loop (every drain, every flush), so a
    window's difference is exact to one turn at each end."""
    from kvtrace.record.recorder import current_recorder

    rec = current_recorder()
    ring = kv_ring()
    drainer = getattr(ring, "_drainer", None)  # the drain loop in C reads its clock at every drain
    return (drainer.thread_cpu_s() if drainer is not None else ring.stats.get("thread_cpu_s", 0.0) if ring is not None
            else 0.0,
            rec.writer_cpu_s if rec is not None else 0.0)


# A sampling interval no step reaches in a run (steps are counted from 1): the ring records nothing.
PAUSED = 1 << 62
# Seconds between repetitions: past the recorder's flush interval (2 s) and a few drains (every 0.1 s).
SETTLE_S = 2.5


def kv_ring() -> object | None:
    from kvtrace.probes import lifecycle

    return next((p.ring for p in lifecycle.installed() if getattr(p, "ring", None) is not None), None)


class HookTimes:
    """Wall time of kvtrace's per-step calls on the engine thread (`--hook-times`): instance attributes
    that shadow the ring's and the scheduler probe's methods, each call timed with `perf_counter_ns`."""

    RING = ("begin_step", "_launch_state", "record_layer", "drain", "_launch_kernel", "_capturing", "_snapshot")
    SCHEDULER = ("on_schedule", "after_update")

    def __init__(self) -> None:
        from kvtrace.probes import lifecycle

        self.ns: dict[str, list[int]] = {}
        self.in_begin = False
        ring = kv_ring()
        for name in self.RING if ring is not None else ():
            self._wrap(ring, name)
        sched = next((p for p in lifecycle.installed() if p.name == "scheduler"), None)
        for name in self.SCHEDULER if sched is not None else ():
            self._wrap(sched, name)
        self._wrap_step_rows()

    def _wrap_step_rows(self) -> None:
        """A step that only decodes goes through the scheduler probe's StepRows (in C) instead of
        on_schedule and after_update: it is a name in the wrappers' globals, replaced there by a timed
        stand-in (`StepRows.decode`, `StepRows.end`)."""
        try:
            from vllm.v1.core.sched.scheduler import Scheduler
        except Exception:
            return
        envs = [getattr(fn, "__globals__", {}) for fn in (Scheduler.schedule, Scheduler.update_from_output)]
        rows = envs[0].get("rows")
        if rows is None or not hasattr(rows, "decode"):
            return
        stand_in = types.SimpleNamespace(decode=rows.decode, end=rows.end)
        for name in ("decode", "end"):
            self._wrap(stand_in, name, f"StepRows.{name}")
        for env in envs:  # each wrapper has its own globals
            env["rows"] = stand_in

    def _wrap(self, obj: object, name: str, key_name: str | None = None) -> None:
        fn = getattr(obj, name, None)
        if fn is None:  # the CPU ring has no launches, capture queries or snapshots
            return
        clock = time.perf_counter_ns
        outer = name == "begin_step"
        label = key_name or name

        def timed(*args, **kwargs):
            key = f"{label} (begin_step)" if self.in_begin else label
            if outer:
                self.in_begin = True
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ns.setdefault(key, []).append(clock() - t)
                if outer:
                    self.in_begin = False
        setattr(obj, name, timed)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per call name: calls, total us, median / p90 / p99 us of a call."""
        out = {}
        for name, xs in self.ns.items():
            xs = sorted(xs)
            out[name] = {"calls": len(xs), "total_us": sum(xs) / 1e3,
                         **{f"p{q}_us": xs[min(len(xs) - 1, len(xs) * q // 100)] / 1e3 for q in (50, 90, 99)}}
        return out


class DriverProbe:
    """`--driver-probe` (with `--hook-times`, a variant with the CUDA ring): after each `begin_step`, three
    more CUDA calls on the same stream, each timed: a `kv_set_state` launch with the argument struct as it
    is (the last launch's step and flag; the ring's own launch for this step, deferred to just before the
    first graph replay or layer, comes after it and sets this step's), a 16-byte host-to-device copy from
    pinned memory, and an event record, in an order that turns every step. What each costs at the top of
    a step beside the running engine, next to the deferred launch (`_launch_state`): whether a call is slow
    because it is the step's first (cold) or because any call waits there (the driver's lock)."""

    OPS = ("state launch", "16 B copy to the device", "event record")

    def __init__(self, ring, launch, ns: dict[str, list[int]]) -> None:
        import cupy

        rt = cupy.cuda.runtime
        self.ring, self.launch, self.ns, self.rt, self.turn = ring, launch, ns, rt, 0
        self.src = cupy.cuda.alloc_pinned_memory(16)
        self.dst = cupy.cuda.alloc(16)
        self.event = rt.eventCreateWithFlags(2)  # cudaEventDisableTiming
        inner = ring.begin_step

        def begin_step(step, record=True):
            inner(step, record)
            self.after_begin_step()
        ring.begin_step = begin_step

    def after_begin_step(self) -> None:
        ring, rt, clock = self.ring, self.rt, time.perf_counter_ns
        stream = ring._current_stream()
        ops = {
            "state launch": lambda: self.launch(ring._f_state, 1, 1, 1, 32, 1, 1, 0, stream,
                                                      ring._state_launch.params_addr, 0),
            "16 B copy to the device": lambda: rt.memcpyAsync(self.dst.ptr, self.src.ptr, 16, 1, stream),
            "event record": lambda: rt.eventRecord(self.event, stream),
        }
        order = self.OPS[self.turn % 3:] + self.OPS[:self.turn % 3]
        self.turn += 1
        for name in order:
            t = clock()
            ops[name]()
            self.ns.setdefault(f"driver: {name}", []).append(clock() - t)


def hook_report(hooks: dict[str, dict[str, float]], steps: int) -> str:
    """One line: each timed call's us per engine step, and a call's median / p90 / p99 in us."""
    parts = [f"{name} {h['total_us'] / max(steps, 1):.1f} ({h['calls']} calls: {h['p50_us']:.1f} / "
             f"{h['p90_us']:.1f} / {h['p99_us']:.1f})" for name, h in sorted(hooks.items(), key=lambda kv: -kv[1]["total_us"])]
    return "kvtrace calls on the engine thread, us a step (calls: a call's median / p90 / p99 us): " + "; ".join(parts)


def drained_rows(ring) -> int:
    """Rows the ring's drain has handed to the recorder so far (the drain runs every 100 ms: a
    repetition's count includes the tail of the one before); 0 without a ring."""
    if ring is None:
        return 0
    return int(ring.stats.get("kv_rows", 0)) + int(ring.stats.get("timing_rows", 0))


def ab_worker(args, llm, params, prompts) -> None:
    """Repetitions in pairs, the ring recording in one and paused in the other, the order alternating."""
    ring = kv_ring()
    if ring is None:
        raise SystemExit("profile --ab: no KV ring in this process (run a variant that records KV accesses)")
    reps = []
    for pair in range(args.reps):
        for recording in ((True, False) if pair % 2 == 0 else (False, True)):
            ring.sample_every = 1 if recording else PAUSED
            rows0, cpu0 = drained_rows(ring), sum(kvtrace_threads_cpu_s())
            steps0, t0 = bgt.engine_steps(llm), time.perf_counter()
            llm.generate(prompts(len(reps)), params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            steps, cpu1 = (bgt.engine_steps(llm) or 0) - (steps0 or 0), sum(kvtrace_threads_cpu_s())
            # Untimed: the drain and the writer finish this repetition's rows before the next one starts
            # (what they do now is outside the window: reported, as `settle_cpu_s`).
            time.sleep(SETTLE_S)
            reps.append({"pair": pair, "recording": recording, "seconds": seconds,
                         "output_tokens": args.num_prompts * args.output_len, "steps": steps,
                         "rows": drained_rows(ring) - rows0, "window_cpu_s": cpu1 - cpu0,
                         "settle_cpu_s": sum(kvtrace_threads_cpu_s()) - cpu1})
    ring.sample_every = 1
    Path(args.result).write_text(json.dumps(reps))


def block_records(block: int) -> bool:
    """Whether the ring records in this block of steps: one block of each pair (blocks 2k, 2k + 1) does,
    the first in even pairs and the second in odd ones, so that a drift inside pairs cancels too."""
    return (block % 2 == 0) == ((block // 2) % 2 == 0)


class KvtracePause:
    """Switches all of kvtrace in this process on and off between engine steps (`--ab-pause all`): every
    probe's `enabled` (the block-pool hooks in C follow it), and the ring's device flag, which the record
    kernels captured in CUDA graphs read (begin_step is not called while the attention probe is off)."""

    def __init__(self, ring) -> None:
        from kvtrace.probes import lifecycle

        self.probes = [p for p in lifecycle.installed() if p.enabled]
        self.ring = ring  # None in a variant without the attention probe (host-only)
        self.on = True

    def set(self, on: bool) -> None:
        if on == self.on:
            return
        self.on = on
        for p in self.probes:
            p.enabled = on
        if not on and self.ring is not None:
            self.ring.begin_step(self.ring.step, record=False)  # before this step's forward pass, in stream order

    def faults(self) -> dict[str, int]:
        """Probes that raised during the run (each switched itself off: the blocks then compare less)."""
        return {p.name: p.faults for p in self.probes if p.faults}


_NONE = object()


class _Gate:
    """A thread's work that comes every `every_s` (ThreadHold with on_time): `last` = the unheld clock at
    its last call; `skip`: a call not due returns at once (else it waits until due)."""

    def __init__(self, kind: str, thread, every_s: float, skip: bool) -> None:
        self.kind, self.thread, self.every_s, self.skip, self.last = kind, thread, float(every_s), skip, -1e18


class ThreadHold:
    """`--ab-pause all-threads`: kvtrace's background threads start no new work while held: the KV ring's
    drain thread (its drains, the GPU-side wait and copy, and handing the records over) and the shard writer
    (its flushes). `set(False)` waits, outside any timed step, for work under way to finish. The worker
    holds them in the off blocks and in the first AB_SKIP steps of the on blocks (left out of the figures),
    so that everything they do lands in the on blocks' timed steps, where `--ab-pause all` leaves it spread
    over both kinds of block (and so outside the comparison). Each method is shadowed by an instance
    attribute that `remove` takes away again.

    `on_time` (the default; `all-threads-wall` turns it off): the threads' clocks stop while they are held,
    so that work they time (the writer's flush every `flush_interval_s`, the drain loop's drain every
    ~0.1 s and its hand-over every HANDOVER_S) comes as often per second of unheld time as it comes per
    second of a real run. With wall clocks, what fell due while held all runs as soon as the hold ends: a
    flush every 2 s of wall time is then one every ~1 s of the on blocks (about half the run is held), a
    drain at the start of every on block besides those on time, and the comparison counts that work about
    twice; the hand-overs, not held, fall in both kinds of block and half of them outside the comparison.
    The records are the same either way (made only in the on blocks): each flush or drain then carries
    fewer of them. The Python drain path (`_drain_to`, `_drain_native` called by the ring's own thread)
    keeps wall clocks."""

    WAIT_S = 5.0  # never blocks a thread longer (an engine-thread flush, should one come, goes on after it)

    def __init__(self, ring, recorder, on_time: bool = True) -> None:
        self._cv = threading.Condition()
        self._run, self._busy, self._removed = True, 0, False
        self.on_time = on_time
        self.waited_s = 0.0  # the engine thread's wait for work under way at the holds (untimed)
        self.held_s, self._held_at = 0.0, None  # seconds held so far; when the hold under way began
        self.deferred = {"flush": 0, "hand-over": 0}  # timed calls put off or skipped until due by unheld time
        self._shadowed: list[tuple[object, str, object]] = []  # (object, method, its own attribute before)
        # Work its thread does every so many seconds, gated on the unheld clock when on_time (calls from
        # other threads never are): the writer's flush waits until due (its thread does nothing else); the
        # drain loop's hand-over of timing records and counts (every HANDOVER_S) is skipped until due, the
        # next one taking what it left, since waiting would stop that thread's drains too.
        gates = {}
        if on_time and recorder is not None and getattr(recorder, "_thread", None) is not None:
            gates[(id(recorder), "flush")] = _Gate("flush", recorder._thread, recorder.flush_interval_s, False)
        if on_time and ring is not None and getattr(ring, "_thread", None) is not None \
                and callable(getattr(ring, "_take_native", None)):
            gates[(id(ring), "_take_native")] = _Gate("hand-over", ring._thread, ring.HANDOVER_S, True)
        for obj, names in ((ring, ("_drain_native", "_emit_native", "_drain_to", "_take_native")),
                           (recorder, ("flush",))):
            for name in names if obj is not None else ():
                if name == "_take_native" and (id(obj), name) not in gates:
                    continue  # with wall clocks the hand-overs run as they come (as before on_time existed)
                if callable(getattr(obj, name, None)):
                    self._shadow(obj, name, gates.get((id(obj), name)))
        self.names = [f"{type(obj).__name__}.{name}" for obj, name, _ in self._shadowed]  # what was held
        # the ring's drain loop in C (no Python method to shadow): held by its own switch
        self._drainer = getattr(ring, "_drainer", None) if ring is not None else None
        if self._drainer is not None:
            self.names.append("Drainer (native loop)")

    def unheld_s(self) -> float:
        """Seconds of `perf_counter` not held so far (its origin arbitrary): the threads' clock when on_time."""
        now = time.perf_counter()
        return now - self.held_s - (now - self._held_at if self._held_at is not None else 0.0)

    def _shadow(self, obj: object, name: str, gate: _Gate | None) -> None:
        orig = getattr(obj, name)

        def held(*args, **kwargs):
            with self._cv:  # the check and the count under one lock: a hold cannot slip between them
                while True:
                    self._cv.wait_for(lambda: self._run or self._removed, timeout=self.WAIT_S)
                    mine = gate is not None and not self._removed and threading.current_thread() is gate.thread
                    due = gate.last + gate.every_s - self.unheld_s() if mine else 0.0
                    if due <= 0.0 or not self._run:  # due, or held past WAIT_S: run it
                        break
                    self.deferred[gate.kind] += 1
                    if gate.skip:
                        return None
                    self._cv.wait(timeout=due)  # not due yet (a hold or its release wakes it)
                if mine:
                    gate.last = self.unheld_s()
                self._busy += 1
            try:
                return orig(*args, **kwargs)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

        self._shadowed.append((obj, name, vars(obj).get(name, _NONE)))
        setattr(obj, name, held)

    def set(self, run: bool) -> None:
        with self._cv:
            if run == self._run:
                return
            self._run = run
            now = time.perf_counter()
            if run and self._held_at is not None:
                self.held_s += now - self._held_at
                self._held_at = None
            elif not run:
                self._held_at = now
            if self._drainer is not None:  # held: waits for a drain under way, as below
                self.waited_s += self._drainer.hold(not run, self.WAIT_S, self.on_time)
            self._cv.notify_all()  # a deferred flush re-reads its clock
            if run:
                return
            t0 = time.perf_counter()
            self._cv.wait_for(lambda: self._busy == 0, timeout=self.WAIT_S)
            self.waited_s += time.perf_counter() - t0

    def remove(self) -> None:
        self.set(True)
        with self._cv:
            self._removed = True
            self._cv.notify_all()
        for obj, name, own in self._shadowed:
            if own is _NONE:
                vars(obj).pop(name, None)
            else:
                setattr(obj, name, own)
        self._shadowed.clear()


class ThreadWork:
    """`--ab-calls`: when kvtrace's background threads worked, as (start, end) `perf_counter_ns` spans of
    each call of the ring's drain methods (`drain`: the GPU-side wait and copy; `emit`: handing the records
    over and writing them) and of the recorder's flush (`flush`), so that the report can line the on
    blocks' steps up with them (`timeline_report`): whether the steps during such work are the slow ones,
    or every step of the block is. Installed under ThreadHold's shadows (it times the work, not the hold)."""

    KINDS = (("drain", "ring", ("_drain_native", "_drain_to")), ("emit", "ring", ("_emit_native",)),
             ("flush", "recorder", ("flush",)))

    def __init__(self, ring, recorder) -> None:
        self.spans: dict[str, list[tuple[int, int]]] = {kind: [] for kind, _, _ in self.KINDS}
        self._shadowed: list[tuple[object, str]] = []
        objs = {"ring": ring, "recorder": recorder}
        # the ring's drain loop in C keeps its own spans (each drain: wait, copy, frame write, whole)
        self._drainer = getattr(ring, "_drainer", None) if ring is not None else None
        if self._drainer is not None:
            self._drainer.spans(True)
        for kind, owner, names in self.KINDS:
            obj = objs[owner]
            for name in names if obj is not None else ():
                if callable(getattr(obj, name, None)) and name not in vars(obj):
                    self._shadow(obj, name, self.spans[kind])

    def _shadow(self, obj: object, name: str, spans: list) -> None:
        orig, clock = getattr(obj, name), time.perf_counter_ns

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return orig(*args, **kwargs)
            finally:
                spans.append((t0, clock()))  # list.append: atomic under the GIL, from any thread

        self._shadowed.append((obj, name))
        setattr(obj, name, timed)

    def remove(self) -> None:
        for obj, name in self._shadowed:
            vars(obj).pop(name, None)
        self._shadowed.clear()
        if self._drainer is not None:
            self.spans["drain"] += self._drainer.spans(False)
            self._drainer = None


# --pin: where the engine thread and kvtrace's background threads run, to tell apart two ways the writer's
# work could slow the engine thread's code (its extra CPU time a step with the writer's work in the block):
# a hardware thread of the same core (its execution units and L1/L2 shared) or only the machine's shared
# last-level cache and memory. The engine thread is pinned to one CPU; kvtrace's threads to its core's
# other hardware thread(s) (near), to CPUs of other cores (far), or left where the scheduler puts them
# (engine).
PINS = ("near", "far", "engine")
KVTRACE_THREADS = ("kvtrace-writer", "kvtrace-kv-ring")


def core_siblings(cpu: int) -> set[int]:
    """The CPUs that share `cpu`'s core (itself included), as the kernel sees the machine's topology."""
    text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def pin_threads(placement: str) -> dict:
    """Pin this (the engine) thread and kvtrace's threads for `placement` (PINS); what was pinned where."""
    allowed = sorted(os.sched_getaffinity(0))
    engine = allowed[min(2, len(allowed) - 1)]  # not CPU 0, which takes most interrupts
    siblings = core_siblings(engine)
    if placement == "near":
        cpus = sorted(siblings - {engine})
        if not cpus:
            raise SystemExit(f"profile --pin near: CPU {engine} has no other hardware thread on its core "
                             "(this machine shows one thread a core: lscpu)")
    else:
        cpus = [c for c in allowed if c not in siblings]
    os.sched_setaffinity(0, {engine})  # 0: the calling thread (Linux affinity is per thread)
    threads = [t for t in threading.enumerate() if t.name in KVTRACE_THREADS]
    if placement != "engine":
        for t in threads:
            os.sched_setaffinity(t.native_id, set(cpus))
    return {"placement": placement, "engine_cpu": engine, "engine_core": sorted(siblings),
            "kvtrace_cpus": cpus if placement != "engine" else None, "threads": sorted(t.name for t in threads)}


SKIP_KV_WRITES = ("all", "records")
SCRATCH_FILE_BYTES = 1 << 30  # a load's scratch file starts again from its beginning past this


def pwrite_all(fd: int, data, offset: int) -> None:
    """All of `data` written at `offset` (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        offset += n
        view = view[n:]


def skip_kv_writes(recorder, what: str, ring=None) -> None:
    """`--skip-kv-writes all`: the drains' KV block records are not written to their frame files (the
    frame built, not written); `records`: neither they nor the layer timing records are handed to the
    recorder at all (the drain thread then does only the native drain: its CUDA copies and lap check; the
    writer's flushes only the host probes' tables). So an A/B with the drain thread's work in it
    (all-threads) tells what writing, and handing over, the records costs the engine thread. The rows are
    counted as written (all) or not at all (records); the session then lacks them (a benchmark's session
    is thrown away). `ring`: the process's KV ring, made before this, which took the recorder's two
    methods when it was made."""
    if what not in SKIP_KV_WRITES:
        raise SystemExit(f"profile --skip-kv-writes: {what!r} is not one of {', '.join(SKIP_KV_WRITES)}")
    if what == "records":
        def nothing(*a, **k):
            return None
        recorder.append_kv_records = recorder.append_timing_records = nothing
        if ring is not None:
            ring._append_records = ring._append_timings = nothing
        return
    writer = recorder.writers["kv_access_records"]
    writer._write_all = lambda parts, *where: None
    from kvtrace.probes.kv_access.ring import native_drain

    if native_drain is not None and hasattr(native_drain, "FrameSink"):
        # the ring's drain loop writes its frames itself, through a sink: to /dev/null (built, not kept)
        null_sink = native_drain.FrameSink()
        null_sink.swap(os.open(os.devnull, os.O_WRONLY), 0)
        writer.native_sink = lambda make_sink: null_sink


# --ab-pause load-thread / load-process: a load shaped like the shard writer's KV record work (a copy of each
# batch's bytes, then its write() into the page cache, at the rate the writer writes them in the on blocks of
# an all-writer A/B) switched on in the on blocks and held in the off ones, with kvtrace recording the same in
# both. Run on a thread of the engine's process or in a process of its own, it tells whether what the
# writer's work costs the engine thread comes with sharing its process (the GIL it barely takes, the memory
# map, the file table) or with any such work on the machine.
LOADS = {"load-thread": "thread", "load-process": "process"}
LOAD_BATCH_BYTES = 3_360_000  # one ~100 ms drain of the 1B default's records
LOAD_FLUSH_BATCHES = 20  # --load-churn: batches freed together (a flush of 2 s of drains)


def load_loop(control: int, path: str, mb_s: float, churn: bool = False, handovers: int = 0) -> float:
    """Copies and writes LOAD_BATCH_BYTES at `mb_s` MB/s to `path` while switched on: reads b"1" (on), b"0"
    (held, blocking) or b"q"/EOF (stop) from the `control` pipe. Returns its thread's CPU seconds. `churn`:
    each batch copied into memory of its own, kept until LOAD_FLUSH_BATCHES of them are freed together (as
    the drain's record copies are, at the writer's flush), instead of into one buffer reused. `handovers`:
    after each batch, that many calls that let the GIL go and take it back (`time.sleep(0)`) with next to no
    Python between them: the GIL hand-overs without the work (the shard writer makes ~12 a batch of
    records, bench_flush_handovers.py)."""
    src = np.random.default_rng(0).integers(0, 256, LOAD_BATCH_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    period_s = LOAD_BATCH_BYTES / (mb_s * 1e6)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    on, due, offset, kept = False, 0.0, 0, []
    try:
        while True:
            wait = max(0.0, due - time.monotonic()) if on else None
            if select.select([control], [], [], wait)[0]:
                cmd = os.read(control, 1)
                if cmd in (b"", b"q"):
                    return time.thread_time()
                on, due = cmd == b"1", time.monotonic()
                continue
            if churn:
                if len(kept) >= LOAD_FLUSH_BATCHES:
                    kept.clear()
                dst = np.empty_like(src)
                kept.append(dst)
            np.copyto(dst, src)  # the serialization's copy (the GIL let go)
            if offset + dst.size > SCRATCH_FILE_BYTES:
                offset = 0
            pwrite_all(fd, dst, offset)
            offset += dst.size
            for _ in range(handovers):
                time.sleep(0)  # lets the GIL go and takes it back
            due = max(due + period_s, time.monotonic() - period_s)  # no burst to catch up after a slow write
    finally:
        os.close(fd)
        os.unlink(path)


class SyntheticLoad:
    """`load_loop` on a thread of this process or in a child process, switched by `set`; `stop` ends it
    and returns its CPU seconds."""

    def __init__(self, where: str, directory: str, mb_s: float, churn: bool = False, handovers: int = 0) -> None:
        self.where, self.on = where, False
        read_fd, self.control = os.pipe()
        path = os.path.join(directory, f"kvtrace-load-{os.getpid()}.scratch")
        if where == "thread":
            self.cpu_s = 0.0

            self.error: BaseException | None = None

            def run():
                try:
                    self.cpu_s = load_loop(read_fd, path, mb_s, churn, handovers)
                except BaseException as exc:  # said by stop(): a load that failed spoils the comparison
                    self.error = exc

            self.worker = threading.Thread(target=run, name="kvtrace-bench-load", daemon=True)
            self.worker.start()
        else:
            code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                    f"import profile_engine_thread as p; p.load_loop({read_fd}, {path!r}, {mb_s!r}, {churn!r}, {handovers!r})")
            self.child = subprocess.Popen([sys.executable, "-c", code], pass_fds=(read_fd,))
            os.close(read_fd)

    def set(self, on: bool) -> None:
        if on != self.on:
            self.on = on
            os.write(self.control, b"1" if on else b"0")

    def stop(self) -> float:
        os.write(self.control, b"q")
        os.close(self.control)
        if self.where == "thread":
            self.worker.join(timeout=30)
            if self.error is not None or self.worker.is_alive():
                raise SystemExit(f"profile --ab-pause {self.where}: the load thread failed: {self.error or 'still running'}")
            return self.cpu_s
        _, status, usage = os.wait4(self.child.pid, 0)
        self.child.returncode = os.waitstatus_to_exitcode(status)
        if self.child.returncode:
            raise SystemExit(f"profile --ab-pause {self.where}: the load process failed (exit {self.child.returncode})")
        return usage.ru_utime + usage.ru_stime


# --ab-calls: vLLM's own methods on the engine thread, each call timed in its block of --ab-blocks. kvtrace's
# patches stay in place in both kinds of block (switched off in one), so a method's time on minus off is
# what kvtrace adds inside it: its wrapper's handlers (schedule, update_from_output), its block-pool hooks
# (the BlockPool methods; allocate_slots holds most of their calls), the worker's per-step hook (execute_model:
# the ring's begin_step and batch slots).
AB_CALLS = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "allocate_slots"),
    ("vllm.v1.core.block_pool", "BlockPool", "get_new_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool", "cache_full_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool", "free_blocks"),
    ("vllm.v1.core.block_pool", "BlockPool", "touch"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    # execute_model's parts, to tell which of them kvtrace slows: the pure-Python bookkeeping, the inputs'
    # host-to-device copies, the graph's replay (where the ring's deferred launch is made), the sampling's
    # launches (sample_tokens: outside execute_model), and the wait for the GPU's sampled tokens (async
    # scheduling's output: a blocking event). Model runner V2 (vLLM's default on CUDA), then V1.
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "update_requests"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_attn"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", "run_fullgraph"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu.async_utils", "AsyncOutput", "get_output"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner", "AsyncGPUModelRunnerOutput", "get_output"),
)


class BlockCallTimes:
    """`--ab-calls`: each of AB_CALLS that this process has loaded, wrapped (a class attribute over
    kvtrace's patch, a `perf_counter_ns` pair a call, ~0.3 us of its own, the same in both kinds of
    block), its calls' ns summed per block of steps (`block[0]`, set by the step loop)."""

    def __init__(self, block: list[int]) -> None:
        self.block = block
        self.ns: dict[str, dict[int, list[int]]] = {}  # method -> block -> [ns, calls]
        self._restore: list[tuple[type, str, object]] = []
        for module, cls_name, meth in AB_CALLS:
            cls = getattr(sys.modules.get(module), cls_name, None)
            if cls is None or meth not in cls.__dict__:
                continue
            name = f"{cls_name}.{meth}" + (" (runner V2)" if module.startswith("vllm.v1.worker.gpu.") else "")
            self._wrap(cls, meth, name)

    def _wrap(self, cls: type, meth: str, name: str) -> None:
        fn = cls.__dict__[meth]  # vLLM's function, kvtrace's wrapper of it, or its C hook
        sums = self.ns.setdefault(name, {})
        block, clock = self.block, time.perf_counter_ns

        def timed(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t
                cur = sums.get(block[0])
                if cur is None:
                    sums[block[0]] = [dt, 1]
                else:
                    cur[0] += dt
                    cur[1] += 1
        self._restore.append((cls, meth, fn))
        setattr(cls, meth, timed)

    def remove(self) -> None:
        for cls, meth, fn in reversed(self._restore):
            setattr(cls, meth, fn)
        self._restore.clear()


def ab_call_diffs(r: dict, pairs: list[tuple[int, int, int, int]], key: str = "call_times",
                  scales: dict[str, float] | None = None) -> dict[str, tuple[list, list, list, list]]:
    """Per method of `--ab-calls` (or per figure of another [sum, count]-by-block record, `key`), over the
    pairs of blocks (`pairs`: (on block, off block, its steps each)) that the step ratio used: (on minus
    off, on, off: the sum a step, times its scale (`scales`, by name; ns to us where none); calls a step
    on) per pair."""
    out = {}
    for name, by_block in sorted((r.get(key) or {}).items()):
        scale = (scales or {}).get(name, 1e-3)
        by_block = {int(b): v for b, v in by_block.items()}  # JSON made the block numbers strings
        diffs, on_us, off_us, on_calls = [], [], [], []
        for on_b, off_b, on_steps, off_steps in pairs:
            on, off = by_block.get(on_b, [0, 0]), by_block.get(off_b, [0, 0])
            on_us.append(on[0] * scale / on_steps)
            off_us.append(off[0] * scale / off_steps)
            on_calls.append(on[1] / on_steps)
            diffs.append(on_us[-1] - off_us[-1])
        if diffs and any(on_calls):
            out[name] = (diffs, on_us, off_us, on_calls)
    return out


# --ab-calls also reads the engine thread's own clock and context switches around each step (outside its
# timed span; ~2 us of syscalls a step, the same in both kinds of block): extra wall time with no extra
# CPU and extra voluntary switches is time spent waiting (for the GIL, held by a background thread); extra
# CPU is work on the thread itself, or the same work made slower (caches shared with the other threads).
# It also counts the garbage collector's passes that ran during the step (any thread's: a pass holds the
# GIL) and their wall time: kvtrace's objects (rows held until a hand-over, the lists it copies) bring
# vLLM's collections sooner and make each longer, inside vLLM's own code wherever it allocates.
USAGE = (("CPU time, us", 1e-3), ("off the CPU, us", 1e-3), ("voluntary switches", 1.0),
         ("involuntary switches", 1.0), ("minor page faults", 1.0), ("GC passes", 1.0),
         ("GC passes of the oldest generation", 1.0), ("GC time, us", 1e-3))


class StepUsage:
    """The engine thread's CPU time, time off the CPU and context switches over each engine step, summed
    per block of steps (as BlockCallTimes, name -> block -> [sum, steps]; ns and counts)."""

    def __init__(self) -> None:
        import resource

        self._usage = lambda: resource.getrusage(resource.RUSAGE_THREAD)
        self.sums: dict[str, dict[int, list[int]]] = {name: {} for name, _ in USAGE}
        self.gc = [0, 0, 0]  # passes, passes of generation 2, ns in them (all since the start)
        self._gc_start = 0
        gc.callbacks.append(self._gc_pass)

    def _gc_pass(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter_ns()
            return
        self.gc[0] += 1
        self.gc[1] += info.get("generation") == 2
        self.gc[2] += time.perf_counter_ns() - self._gc_start

    def remove(self) -> None:
        if self._gc_pass in gc.callbacks:
            gc.callbacks.remove(self._gc_pass)

    def before(self) -> tuple:
        ru = self._usage()
        return ru.ru_nvcsw, ru.ru_nivcsw, time.thread_time_ns(), ru.ru_minflt, *self.gc

    def after(self, block: int, start: tuple, wall_ns: int) -> None:
        cpu_ns = time.thread_time_ns() - start[2]
        ru = self._usage()
        gc_now = self.gc
        for (name, _), value in zip(USAGE, (cpu_ns, wall_ns - cpu_ns, ru.ru_nvcsw - start[0],
                                            ru.ru_nivcsw - start[1], ru.ru_minflt - start[3],
                                            gc_now[0] - start[4], gc_now[1] - start[5], gc_now[2] - start[6])):
            cur = self.sums[name].setdefault(block, [0, 0])
            cur[0] += value
            cur[1] += 1


def usage_diffs(r: dict, pairs: list[tuple[int, int, int, int]]) -> dict[str, tuple[list, list, list, list]]:
    """ab_call_diffs of a result's StepUsage figures, each in its unit (USAGE)."""
    return ab_call_diffs(r, pairs, "thread_usage", dict(USAGE))


def usage_report(per_figure: dict[str, tuple[list, list, list, list]], names: tuple[str, str]) -> list[str]:
    """StepUsage's figures a step with kvtrace on and off, and on minus off with a 95% bootstrap interval
    over the pairs of blocks that the step ratio used."""
    lines = []
    for name, scale in USAGE:
        if name not in per_figure:
            continue
        diffs, on, off, _ = per_figure[name]
        mean, lo, hi = bgt.mean_ci(diffs)
        digits = 1 if scale != 1.0 else 3  # us to a tenth, switches to a thousandth
        lines.append(f"  {name}: {statistics.fmean(on):.{digits}f} a step {names[0]}, {statistics.fmean(off):.{digits}f} "
                     f"{names[1]}: difference {mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]")
    return ["  the engine thread over its steps (--ab-calls; its own clock, getrusage):"] + lines if lines else []


def ab_calls_report(per_method: dict[str, tuple[list, list, list, list]], names: tuple[str, str]) -> list[str]:
    """Per method of `--ab-calls` (ab_call_diffs' figures): its us per engine step with kvtrace on and off,
    and on minus off with a 95% bootstrap interval over the pairs of blocks that the step ratio used;
    `names`: what the two kinds of block are called (PAUSE_NAMES)."""
    lines = []
    for name, (diffs, on_us, off_us, on_calls) in per_method.items():
        mean, lo, hi = bgt.mean_ci(diffs)
        lines.append(f"  {name}: {statistics.fmean(on_calls):.2f} calls a step; {statistics.fmean(on_us):.1f} us a step "
                     f"{names[0]}, {statistics.fmean(off_us):.1f} {names[1]}: difference {mean:+.1f} us [{lo:+.1f}, {hi:+.1f}]")
    return (["  vLLM's methods timed in the same blocks (--ab-calls; nested: schedule's time holds allocate_slots', "
             "which holds the block pool's):"] + lines
            if lines else [])


def ab_blocks_worker(args, llm, params, prompts) -> None:
    """Engine steps in blocks of `--ab-blocks`, the ring recording in one block of each pair and paused in
    the other (the order alternating between pairs), over `--reps` repetitions of the workload; every
    engine step's wall time, with its block. The machine's drift over seconds, which repetitions cannot
    escape, is the same for the two blocks of a pair, ~0.1-0.3 s apart. `--ab-pause all`: kvtrace as a
    whole on and off instead of the ring's records; `none`: the same flag in both blocks (an A/A)."""
    ring = kv_ring()
    if ring is None and args.ab_pause == "records":
        raise SystemExit("profile --ab-blocks: no KV ring in this process (run a variant that records KV accesses)")
    if args.ab_pause == "state" and not hasattr(ring, "defer_state"):
        raise SystemExit("profile --ab-pause state: no CUDA KV ring in this process (run a variant that records KV "
                         "accesses, on a GPU)")
    pause = KvtracePause(ring) if args.ab_pause in ("all", *HELD) else None
    if pause is not None and not pause.probes:
        raise SystemExit(f"profile --ab-pause {args.ab_pause}: no kvtrace probe in this process (run a recorded variant)")
    from kvtrace.record.recorder import current_recorder

    # before the hold, whose shadows then wrap these: the spans time the work, not a wait at a hold
    work = ThreadWork(ring, current_recorder()) if args.ab_calls else None
    hold = None
    if args.ab_pause in HELD:
        drain, writer, on_time = HELD[args.ab_pause]
        hold = ThreadHold(ring if drain else None, current_recorder() if writer else None, on_time)
    if args.skip_kv_writes:
        if current_recorder() is None:
            raise SystemExit("profile --skip-kv-writes: no recorder in this process (run a recorded variant)")
        skip_kv_writes(current_recorder(), args.skip_kv_writes, ring)
    pinned = pin_threads(args.pin) if args.pin else None
    load = None
    if args.ab_pause in LOADS:
        writer = getattr(current_recorder(), "writers", {}).get("kv_access_records")
        where = str(writer.directory) if writer is not None else tempfile.gettempdir()  # beside the shards
        load = SyntheticLoad(LOADS[args.ab_pause], where, args.load_mb_s, args.load_churn, args.load_handovers)
    engine, size = llm.llm_engine, args.ab_blocks
    original, calls, count, starts = engine.step, [], [0], []
    current = [-1]  # the block of the step running now (--ab-calls)
    methods = BlockCallTimes(current) if args.ab_calls else None
    usage = StepUsage() if args.ab_calls else None

    tlb = {True: 0, False: 0}  # shootdowns in the on and off blocks (read at each block's first step)
    tlb_last = [tlb_shootdowns()]

    def count_tlb(recording: bool) -> None:
        if tlb_last[0] is not None:
            now = tlb_shootdowns()
            tlb[recording] += now - tlb_last[0]
            tlb_last[0] = now

    def timed_step():
        n = count[0]
        count[0] += 1
        block = current[0] = n // size
        recording = block_records(block)
        if n % size == 0 and n:
            count_tlb(block_records(block - 1))
        if hold is not None:  # the threads' work inside the on block's timed steps (waits outside any)
            hold.set(recording and n % size >= AB_SKIP)
        if pause is not None:
            pause.set(recording)
        elif args.ab_pause == "records":
            # the flag is read at the step's begin_step, inside this call (the step it schedules)
            ring.sample_every = 1 if recording else PAUSED
        elif args.ab_pause == "state":  # read at the step's begin_step too
            ring.defer_state = recording
        elif load is not None:
            load.set(recording)
        start = usage.before() if usage is not None else None
        t0 = time.perf_counter_ns()
        out = original()
        ns = time.perf_counter_ns() - t0
        if usage is not None:
            usage.after(block, start, ns)
        calls.append((block, recording, n % size, ns))
        starts.append(t0)
        return out

    engine.step = timed_step
    rows0, cpu0, t0, cpus0 = drained_rows(ring), sum(kvtrace_threads_cpu_s()), time.perf_counter(), machine_cpu()
    for rep in range(args.reps):
        llm.generate(prompts(rep), params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    count_tlb(block_records(current[0]))
    engine.step = original
    if methods is not None:
        methods.remove()
    if usage is not None:
        usage.remove()
    if pause is not None:
        pause.set(True)
    if hold is not None:
        hold.remove()
    if work is not None:
        work.remove()
    load_cpu_s = load.stop() if load is not None else None
    if ring is not None:
        ring.sample_every = 1
        if args.ab_pause == "state":
            ring.defer_state = True
    Path(args.result).write_text(json.dumps({"block_steps": size, "calls": calls, "wall_s": seconds,
                                             "paused": args.ab_pause,
                                             "rows": drained_rows(ring) - rows0,
                                             "threads_cpu_s": sum(kvtrace_threads_cpu_s()) - cpu0,
                                             "probe_faults": pause.faults() if pause is not None else {},
                                             "held": {"methods": hold.names, "waited_s": hold.waited_s,
                                                      "on_time": hold.on_time, "held_s": hold.held_s,
                                                      "deferred": hold.deferred}
                                             if hold is not None else None,
                                             "call_times": methods.ns if methods is not None else None,
                                             "thread_usage": usage.sums if usage is not None else None,
                                             "step_starts_ns": starts if work is not None else None,
                                             "thread_work": work.spans if work is not None else None,
                                             "pinned": pinned, "skip_kv_writes": args.skip_kv_writes,
                                             "load": {"where": load.where, "mb_s": args.load_mb_s, "cpu_s": load_cpu_s,
                                                      "churn": args.load_churn, "handovers": args.load_handovers}
                                             if load is not None else None,
                                             "machine_cpu": machine_cpu_delta(cpus0),
                                             "tlb_shootdowns": {"on": tlb[True], "off": tlb[False]}
                                             if tlb_last[0] is not None else None}))


def steady(ns: list[int]) -> bool:
    """A block of one phase: no step under half or over twice its median (a block with a repetition's
    prefill steps, ~6x a decode step, or its last steps would weigh its pair by which half it fell in)."""
    mid = statistics.median(ns)
    return 0.5 * mid <= min(ns) and max(ns) <= 2 * mid


# Steps left out at the start of each block: with async scheduling a step's call waits for the previous
# step's GPU work, so the first call after a switch still carries the other mode's step.
AB_SKIP = 2


def ab_block_pairs(r: dict) -> tuple[list[float], list[float], list[float], list[float], int, list[tuple]]:
    """An --ab-blocks result's kept pairs: (ratios off / on of the blocks' mean step, the same of their
    median step, on blocks' mean ms, off blocks' mean ms, pairs left out as mixed, kept blocks)."""
    blocks: dict[int, tuple[bool, list[int]]] = {}
    steps_in: dict[int, int] = {}  # block -> its steps, the first AB_SKIP too (--ab-calls times them all)
    for block, recording, pos, ns in r["calls"]:
        steps_in[block] = steps_in.get(block, 0) + 1
        if pos >= AB_SKIP:
            blocks.setdefault(block, (recording, []))[1].append(ns)
    ratios, med_ratios, on_ms, off_ms, mixed, kept = [], [], [], [], 0, []
    for pair in range(0, max(blocks, default=-1) + 1, 2):
        a, b = blocks.get(pair), blocks.get(pair + 1)
        if not a or not b or not a[1] or not b[1] or a[0] == b[0]:
            continue
        if not (steady(a[1]) and steady(b[1])):
            mixed += 1
            continue
        on, off = (a, b) if a[0] else (b, a)
        on_b, off_b = (pair, pair + 1) if a[0] else (pair + 1, pair)
        kept.append((on_b, off_b, steps_in[on_b], steps_in[off_b]))
        on_mean, off_mean = statistics.fmean(on[1]) / 1e6, statistics.fmean(off[1]) / 1e6
        ratios.append(off_mean / on_mean)  # throughput recording / paused: time paused over time recording
        med_ratios.append(statistics.median(off[1]) / statistics.median(on[1]))
        on_ms.append(on_mean)
        off_ms.append(off_mean)
    return ratios, med_ratios, on_ms, off_ms, mixed, kept


def ab_blocks_report(variant: str, r: dict) -> str:
    ratios, med_ratios, on_ms, off_ms, mixed, kept = ab_block_pairs(r)
    if not ratios:
        return f"{variant}: --ab-blocks: no complete pair of blocks"
    mean, lo, hi = bgt.paired_ci(ratios)
    med, med_lo, med_hi = bgt.paired_ci(med_ratios)
    steps = len(r["calls"])
    on_name, off_name = PAUSE_NAMES[r.get("paused", "records")]
    faults = r.get("probe_faults") or {}
    spoilt = (f"; PROBES FAILED during the run, switched off in both kinds of block: "
              f"{', '.join(f'{k} ({v})' for k, v in sorted(faults.items()))}") if faults else ""
    return (f"{variant}: step blocks of {r['block_steps']}, {on_name} / {off_name}, paired over {len(ratios)} pairs of "
            f"blocks ({mixed} pairs with a prefill or tail left out): {mean:.4f} [{lo:.4f}, {hi:.4f}] (by each block's "
            f"median step instead of its mean: {med:.4f} [{med_lo:.4f}, {med_hi:.4f}]); mean step "
            f"{statistics.fmean(on_ms):.3f} ms {on_name}, {statistics.fmean(off_ms):.3f} ms {off_name}; {steps} steps "
            f"in {r['wall_s']:.1f} s; rows drained {r['rows']}; kvtrace threads' CPU "
            f"{100 * r['threads_cpu_s'] / r['wall_s']:.2f}% of the window ({threads_where(r)})"
            + machine_note(r) + tlb_note(r) + spoilt + setup_note(r)
            + "".join("\n" + line for line in ab_calls_report(ab_call_diffs(r, kept), (on_name, off_name))
                      + usage_report(usage_diffs(r, kept), (on_name, off_name)) + timeline_report(r, kept)))


def overlapping(start: int, end: int, spans: list[tuple[int, int]], i: int) -> tuple[bool, int]:
    """Whether [start, end) meets one of `spans` (sorted by start), looking from index i on; and the index
    to look from for a later step (the first span that has not ended before `start`)."""
    while i < len(spans) and spans[i][1] <= start:
        i += 1
    return i < len(spans) and spans[i][0] < end, i


def timeline_steps(r: dict, kept: list[tuple[int, int, int, int]]) -> dict[str, list[float]]:
    """An --ab-calls result's timed steps of the kept pairs, each as its excess over its pair's off block
    (step / the off block's mean step - 1), grouped by what kvtrace's background threads did during it:
    `off` (the off blocks' own steps: 0 on average), and for the on blocks' steps `quiet` (none of their
    work), `drain` (a drain's GPU-side wait and copy, no hand-over), `emit` (records handed over and
    written) and `flush` (a flush of the recorder; a step with both an emit and a flush counts as a flush)."""
    starts, work = r.get("step_starts_ns"), r.get("thread_work")
    if not starts or work is None:
        return {}
    spans = {kind: sorted(map(tuple, work.get(kind, []))) for kind in ("drain", "emit", "flush")}
    steps: dict[int, list[tuple[int, int, int]]] = {}  # block -> [(position, start, ns)]
    for (block, _, pos, ns), t0 in zip(r["calls"], starts):
        if pos >= AB_SKIP:
            steps.setdefault(block, []).append((pos, t0, ns))
    out: dict[str, list[float]] = {k: [] for k in ("off", "quiet", "drain", "emit", "flush")}
    at = {kind: 0 for kind in spans}
    for on_b, off_b, _, _ in sorted(kept, key=lambda k: min(k[0], k[1])):
        off_mean = statistics.fmean(ns for _, _, ns in steps[off_b])
        out["off"] += [ns / off_mean - 1 for _, _, ns in steps[off_b]]
        for _, t0, ns in steps[on_b]:
            met = {}
            for kind in spans:
                met[kind], at[kind] = overlapping(t0, t0 + ns, spans[kind], at[kind])
            kind = next((k for k in ("flush", "emit", "drain") if met[k]), "quiet")
            out[kind].append(ns / off_mean - 1)
    return out


def mean_ci_np(xs: list[float], n_boot: int = 2000) -> tuple[float, float, float]:
    """bench_gpu_throughput.mean_ci with NumPy (thousands of steps: Python's loop would take seconds)."""
    import numpy as np

    a = np.asarray(xs, dtype=float)
    boots = np.sort(a[np.random.default_rng(0).integers(0, len(a), (n_boot, len(a)))].mean(axis=1))
    return float(a.mean()), float(boots[int(0.025 * n_boot)]), float(boots[int(0.975 * n_boot) - 1])


def timeline_report(r: dict, kept: list[tuple[int, int, int, int]]) -> list[str]:
    """One line: the on blocks' steps by what kvtrace's threads did during them, each group's mean excess
    over the off block of its pair (timeline_steps)."""
    groups = timeline_steps(r, kept)
    if not groups:
        return []
    parts = []
    for kind, label in (("quiet", "with none of the threads' work"), ("drain", "during a drain's GPU wait and copy"),
                        ("emit", "during a hand-over of records"), ("flush", "during a flush"),
                        ("off", "the off blocks' own")):
        xs = groups[kind]
        if xs:
            mean, lo, hi = mean_ci_np([100 * x for x in xs])
            parts.append(f"{label}: {len(xs)} steps, {mean:+.2f}% [{lo:+.2f}, {hi:+.2f}]")
    spans = r["thread_work"]
    busy = ", ".join(f"{k} {len(spans[k])} calls, {sum(b - a for a, b in spans[k]) / 1e6:.0f} ms"
                     for k in ("drain", "emit", "flush") if spans.get(k))
    return ["  the on blocks' steps by what kvtrace's threads did during them (--ab-calls; a step's excess over the "
            "mean step of its pair's off block): " + "; ".join(parts) + (f" (the threads' calls: {busy})" if busy else "")]


def setup_note(r: dict) -> str:
    """An --ab-blocks result's --pin and --skip-kv-writes, as the report says them."""
    pinned, skipped = r.get("pinned"), r.get("skip_kv_writes")
    out = ""
    if pinned:
        where = (f"{', '.join(pinned['threads']) or 'no kvtrace thread'} on CPUs {pinned['kvtrace_cpus']}"
                 if pinned["kvtrace_cpus"] is not None else "kvtrace's threads unpinned")
        out += (f"; pinned ({pinned['placement']}): the engine thread on CPU {pinned['engine_cpu']} (its core: CPUs "
                f"{pinned['engine_core']}), {where}")
    if skipped:
        out += ("; KV record frames not written (all)" if skipped == "all"
                else f"; no KV block or timing record handed to the recorder ({skipped})")
    load = r.get("load")
    if load:
        out += (f"; the load: {load['mb_s']:g} MB/s in the on blocks on a {load['where']} of its own"
                f"{', each batch in memory of its own' if load.get('churn') else ''}"
                f"{f', {h} GIL hand-overs a batch' if (h := load.get('handovers')) else ''}, its CPU "
                f"{100 * load['cpu_s'] / r['wall_s']:.2f}% of the window"
                f"{' (its start and imports too)' if load['where'] == 'process' else ''}")
    return out


def threads_where(r: dict) -> str:
    """Where an --ab-blocks result's background threads did their work, as the report says it."""
    held = r.get("held")
    if not held:
        return "spread over both kinds of block"
    clocks = ("" if "on_time" not in held else
              f"; their clocks {'stopped' if held['on_time'] else 'running'} while held ({held['held_s']:.1f} s held"
              + (f"; put off to their unheld time: {held['deferred']['flush']} flushes, "
                 f"{held['deferred']['hand-over']} of the drain loop's hand-overs skipped)" if held["on_time"] else ")"))
    return (f"held in the off blocks, inside the on blocks: {', '.join(held['methods'])}; the engine thread waited "
            f"{held['waited_s']:.2f} s in all, untimed, for work under way at the holds{clocks}")


def pooled_report(paths: list[str]) -> str:
    """One interval over the pairs of several --ab-blocks results (the same variant in processes on
    different GPUs or machines): each process's pairs are its own A/B, so their union is a larger sample
    of the same comparison; each process's own figure is printed beside it, and vLLM's methods (--ab-calls)
    pooled the same way."""
    lines, pooled, methods, paused = [], [], {}, None
    for path in paths:
        try:
            r = json.loads(Path(path).read_text())
            ratios, _, on_ms, off_ms, _, kept = ab_block_pairs(r)
            names = PAUSE_NAMES[r.get("paused", "records")]
            calls = {**ab_call_diffs(r, kept), **usage_diffs(r, kept)}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"profile: --pool: {path}: not an --ab-blocks result ({exc})") from None
        if paused not in (None, names):  # pairs of different comparisons (--ab-pause) are not one sample
            raise SystemExit(f"profile: --pool: {path}: compares {' / '.join(names)}, the others {' / '.join(paused)}")
        paused = names
        if not ratios:
            raise SystemExit(f"profile: --pool: {path}: no complete pair of blocks")
        mean, lo, hi = bgt.paired_ci(ratios)
        lines.append(f"  {path}: {mean:.4f} [{lo:.4f}, {hi:.4f}], {len(ratios)} pairs, "
                     f"{statistics.fmean(on_ms):.3f} -> {statistics.fmean(off_ms):.3f} ms a step")
        pooled += ratios
        for name, figures in calls.items():
            into = methods.setdefault(name, ([], [], [], []))
            for acc, part in zip(into, figures):
                acc += part
    mean, lo, hi = bgt.paired_ci(pooled)
    usage = {name: methods.pop(name) for name, _ in USAGE if name in methods}
    return "\n".join([f"pooled over {len(paths)} processes, {len(pooled)} pairs: {mean:.4f} [{lo:.4f}, {hi:.4f}]",
                      *lines, *ab_calls_report(dict(sorted(methods.items())), paused), *usage_report(usage, paused)])


# --ab-pause modes that hold background threads (ThreadHold): (the KV ring's drain thread, the shard writer,
# their clocks stopped while held); `all-threads-wall`: wall clocks, their timed work counted about twice
HELD = {"all-threads": (True, True, True), "all-drain": (True, False, True), "all-writer": (False, True, True),
        "all-threads-wall": (True, True, False)}
# --ab-pause: what the two blocks of a pair are called (the first is the one `block_records` picks)
PAUSE_NAMES = {"records": ("recording", "paused"), "all": ("kvtrace on", "kvtrace off"), "none": ("A", "A again"),
               "all-threads": ("kvtrace on with its threads' work", "kvtrace off, its threads held"),
               "all-threads-wall": ("kvtrace on with its threads' work by wall clocks",
                                    "kvtrace off, its threads held"),
               "all-drain": ("kvtrace on with its drain thread's work", "kvtrace off, its drain thread held"),
               "all-writer": ("kvtrace on with its writer thread's work", "kvtrace off, its writer thread held"),
               "state": ("state launch deferred", "state launch in begin_step"),
               "load-thread": ("a writer-like load on a thread of the engine's process", "the load held"),
               "load-process": ("a writer-like load in a process of its own", "the load held")}


def ab_report(variant: str, reps: list[dict]) -> str:
    by_pair: dict[int, dict[bool, dict]] = {}
    for r in reps:
        by_pair.setdefault(r["pair"], {})[r["recording"]] = r
    ratios = [bgt.throughput(p[True]) / bgt.throughput(p[False]) for p in by_pair.values()]
    mean, lo, hi = bgt.paired_ci(ratios)
    on = [r for r in reps if r["recording"]]
    off = [r for r in reps if not r["recording"]]
    per_step = [1e3 * sum(r["seconds"] for r in rs) / max(1, sum(r["steps"] for r in rs)) for rs in (on, off)]
    window, settle = sum(r["window_cpu_s"] for r in on), sum(r["settle_cpu_s"] for r in on)
    return (f"{variant}: recording / paused, paired over {len(ratios)} pairs: {mean:.4f} [{lo:.4f}, {hi:.4f}]; "
            f"per pair {', '.join(f'{x:.3f}' for x in ratios)}; wall per step {per_step[0]:.3f} vs "
            f"{per_step[1]:.3f} ms; rows drained per recording repetition {sum(r['rows'] for r in on) // max(1, len(on))}, "
            f"per paused one {sum(r['rows'] for r in off) // max(1, len(off))}; kvtrace threads' CPU per recording "
            f"repetition {window / max(1, len(on)):.3f} s in its window, {settle / max(1, len(on)):.3f} s after it")


GIL_RATE_HZ = int(os.environ.get("KVTRACE_GIL_RATE_HZ", "200"))  # py-spy's samples a second (--py-spy)


class GilSampler:
    """py-spy sampling this process over the timed window, recording which thread holds the GIL
    (`--gil`: a sample is taken only when one does; `--nonblocking`: the process is never paused)."""

    def __init__(self, py_spy: str | None, out: str):
        self.proc = None
        if not py_spy:
            return
        import ctypes

        # Let a child read this process (Yama ptrace_scope 1 allows only ancestors otherwise).
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY
        # KVTRACE_PY_SPY_NATIVE=1: C frames too (kvtrace's and vLLM's native code, the CUDA driver's), which
        # py-spy reads only by pausing the process at each sample: the timings are then slower than real
        how = ["--native"] if os.environ.get("KVTRACE_PY_SPY_NATIVE") == "1" else ["--nonblocking"]
        self.proc = subprocess.Popen([py_spy, "record", "--pid", str(os.getpid()), "--gil", "--threads", *how,
                                      "--full-filenames", "--rate", str(GIL_RATE_HZ),
                                      "--format", "raw", "--output", out],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # attached before the window opens
        if self.proc.poll() is not None:
            raise SystemExit(f"profile: py-spy could not sample this process: {self.proc.stderr.read()[-500:]}")

    def stop(self) -> None:
        if self.proc is not None:
            import signal

            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)


def gil_summary(raw: Path, seconds: float, call_lines: dict[str, list[int]] | None = None) -> str:
    """Shares of the window's GIL by holder: kvtrace's two threads, the engine thread (in kvtrace's code or
    not), vLLM's other threads, and nobody (every thread off the GIL).

    `call_lines`: each kvtrace wrapper's lines that call vLLM's original (kvtrace.probes.base
    WRAPPER_CALL_LINES, from the recorded process). A sample there is the original's frame being torn
    down after it returned, its locals freed (py-spy shows the caller's line once the callee's frame is
    gone: measured with a wrapper around a function that frees 300 objects, a quarter of the samples):
    vLLM's time, which a plain run spends too."""
    call_lines = call_lines or {}
    by: dict[str, int] = {}
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        head, _, frames = stack.partition(";")
        name = head.split(": ", 1)[-1]
        if name in ("kvtrace-kv-ring", "kvtrace-writer"):
            key = name
        elif name == "MainThread":
            # by the innermost frame (C calls show as their Python caller): kvtrace's wrappers are on
            # most of the thread's stacks, around vLLM's code
            leaf = frames.rpartition(";")[2]
            ours = f"{os.sep}kvtrace{os.sep}" in leaf or "kvtrace wrapper" in leaf
            where, _, at = leaf.rpartition(" (")[2].rstrip(")").rpartition(":")
            if ours and at.isdigit() and int(at) in call_lines.get(where, ()):
                key = "engine thread, vLLM's call returning through a kvtrace wrapper"
            else:
                key = "engine thread, in kvtrace code" if ours else "engine thread, other"
        else:
            key = "other threads"
        by[key] = by.get(key, 0) + int(n)
    ticks = max(1.0, seconds * GIL_RATE_HZ)
    by["nobody"] = max(0, int(ticks) - sum(by.values()))
    return "GIL held by: " + ", ".join(f"{k} {100 * v / ticks:.2f}%" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def worker(args) -> None:
    """The timed repetitions under cProfile (a report), or with `--threads` without it (wall, and the CPU
    of the engine thread, kvtrace's two threads and the whole process over them, as JSON), or `--ab`."""
    llm, params, prompts = bgt.warm_engine(args.model, args.input_len, args.output_len, args.num_prompts)
    if args.ab_blocks:
        return ab_blocks_worker(args, llm, params, prompts)
    if args.ab:
        return ab_worker(args, llm, params, prompts)
    sampler = GilSampler(args.py_spy, args.result + ".gil") if args.threads else None
    if sampler is not None and sampler.proc is not None:
        from kvtrace.probes.base import WRAPPER_CALL_LINES  # the probes are installed by now (engine built)

        Path(args.result + ".calls.json").write_text(json.dumps(WRAPPER_CALL_LINES))
    batches = [prompts(rep) for rep in range(args.reps)]
    ring = kv_ring()
    launch = getattr(ring, "_launch_kernel", None)  # the ring's own, before --hook-times wraps it
    hooks = HookTimes() if args.threads and args.hook_times else None
    if hooks is not None and args.driver_probe and launch is not None:
        DriverProbe(ring, launch, hooks.ns)
    prof = None if args.threads else cProfile.Profile()
    steps0, t0 = bgt.engine_steps(llm), time.perf_counter()
    main0, proc0, ours0, cpus0 = time.thread_time(), time.process_time(), kvtrace_threads_cpu_s(), machine_cpu()
    if prof is not None:
        prof.enable()
    for batch in batches:
        llm.generate(batch, params, use_tqdm=False)
    if prof is not None:
        prof.disable()
    seconds = time.perf_counter() - t0
    if sampler is not None:
        sampler.stop()
    main_s, proc_s = time.thread_time() - main0, time.process_time() - proc0
    ring_s, writer_s = (b - a for a, b in zip(ours0, kvtrace_threads_cpu_s()))
    steps = (bgt.engine_steps(llm) or 0) - (steps0 or 0)
    if prof is None:
        ring = kv_ring()
        Path(args.result).write_text(json.dumps({"steps": max(steps, 1), "wall_s": seconds, "engine_thread_cpu_s": main_s,
                                                 "ring_cpu_s": ring_s, "writer_cpu_s": writer_s,
                                                 "process_cpu_s": proc_s, "machine_cpu": machine_cpu_delta(cpus0),
                                                 "drains": ring.stats.get("drains", 0) if ring is not None else 0,
                                                 "native_drain": ring.stats.get("native_drain") if ring is not None else None,
                                                 "hooks": hooks.summary() if hooks is not None else None}))
        return
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # self time of every function
    # kvtrace's Python functions (its generated wrappers too), and its C ones (the native row logs' methods
    # name their type's module)
    ours = {k: v for k, v in stats.stats.items()
            if f"{os.sep}kvtrace{os.sep}" in k[0] or "kvtrace" in k[2] or k[0].startswith("<kvtrace wrapper")}
    ours_s = sum(v[2] for v in ours.values())
    lines = [f"wall {seconds:.3f} s for {steps} engine steps: {1e3 * seconds / max(steps, 1):.3f} ms a step; "
             f"profiled self time {total:.3f} s, of which kvtrace's functions {ours_s:.3f} s "
             f"({1e3 * ours_s / max(steps, 1):.3f} ms a step)",
             "kvtrace functions by self time (s, calls, file:line function):"]
    for (path, line, name), v in sorted(ours.items(), key=lambda kv: -kv[1][2])[:25]:
        lines.append(f"  {v[2]:8.3f} {v[1]:9d}  {path.split(os.sep + 'kvtrace' + os.sep)[-1]}:{line} {name}")
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(30)
    lines += ["all functions by self time:", out.getvalue()[-12000:]]
    Path(args.result).write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="1b", choices=sorted(bgt.SHAPES))
    ap.add_argument("--variants", default="plain,default", help=f"comma-separated, of {', '.join(bgt.VARIANTS)}")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", action="store_true", help="no profiler: wall and CPU time per step by thread")
    ap.add_argument("--rounds", type=int, default=1, help="processes per variant, in turns (--threads)")
    ap.add_argument("--py-spy", metavar="PATH", help="with --threads: py-spy samples which thread holds the GIL "
                    "over the timed repetitions (its path)")
    ap.add_argument("--hook-times", action="store_true",
                    help="with --threads: time kvtrace's per-step calls on the engine thread (begin_step, its deferred "
                    "launch, record_layer, drain, the scheduler probe's handlers)")
    ap.add_argument("--driver-probe", action="store_true",
                    help="with --hook-times: after each begin_step, time three more CUDA calls on its stream ("
                    "a state launch, a 16-byte copy to the device, an event record)")
    ap.add_argument("--ab", action="store_true",
                    help="in one recorded process, --reps pairs of repetitions: the ring recording vs paused")
    ap.add_argument("--ab-blocks", type=int, default=0, metavar="STEPS",
                    help="in one recorded process, over --reps repetitions: blocks of STEPS engine steps, the "
                    "ring recording and paused in turns (a paired ratio of step times)")
    ap.add_argument("--ab-pause", choices=sorted(PAUSE_NAMES), default="records",
                    help="with --ab-blocks, what the paused block switches off: the ring's records (records), "
                    "all of kvtrace (all), all of it with its background threads held so that their work lands in "
                    "the on blocks (all-threads; all-drain, all-writer: only the KV ring's drain thread or the shard "
                    "writer held; all-threads-wall: their clocks running while held), the state launch's deferral (state), a writer-like load on a thread of the "
                    "engine's process or in a process of its own, kvtrace recording the same in both (load-thread, "
                    "load-process), or nothing, an A/A (none)")
    ap.add_argument("--load-mb-s", type=float, default=33.0,
                    help="with --ab-pause load-thread|load-process: the load's copy-and-write rate in the on blocks, "
                    "MB/s (33: the 1B default's KV records in an all-writer A/B's on blocks)")
    ap.add_argument("--load-churn", action="store_true",
                    help="with --ab-pause load-thread|load-process: each batch copied into memory of its own, freed "
                    "20 at a time (as the drain's record copies at a flush), not into one buffer reused")
    ap.add_argument("--load-handovers", type=int, default=0, metavar="N",
                    help="with --ab-pause load-thread|load-process: after each batch, N calls that let the GIL go and "
                    "take it back (the shard writer makes ~12 a batch of records)")
    ap.add_argument("--ab-calls", action="store_true",
                    help="with --ab-blocks: also time vLLM's scheduler, KV-cache manager, block-pool and model-runner "
                    "methods per call in each block (what kvtrace adds inside each, on minus off)")
    ap.add_argument("--pin", choices=PINS,
                    help="with --ab-blocks: pin the engine thread to one CPU and kvtrace's threads to its core's other "
                    "hardware thread (near) or to other cores (far), or pin only the engine thread (engine)")
    ap.add_argument("--skip-kv-writes", choices=SKIP_KV_WRITES,
                    help="with --ab-blocks: the drains' KV record frames are built but not written (all), or no record "
                    "is handed to the recorder (records: block or timing); the session lacks them")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per process")
    ap.add_argument("--out", default="profile-engine-thread", help="folder for the reports")
    ap.add_argument("--pool", nargs="+", metavar="RESULT",
                    help="report, and run nothing: one interval over the pairs of these --ab-blocks results "
                    "(their SHAPE-VARIANT.txt files)")
    args = ap.parse_args()
    if args.pool:
        print(pooled_report(args.pool))
        return None
    if args.worker:
        return worker(args)
    variants = [v for v in args.variants.split(",") if v]
    if [v for v in variants if v not in bgt.VARIANTS]:
        raise SystemExit(f"profile: unknown variant in {variants}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtrace-profile-") as scratch:
        model = bgt.write_model(Path(scratch) / "model", args.shape)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        runs = [v for _ in range(args.rounds) for v in variants]
        for i, v in enumerate(runs):
            # a variant named more than once (default,default: more processes of one A/B) keeps each result
            again = runs[:i].count(v)
            result = out / f"{args.shape}-{v}{f'-{again + 1}' if again else ''}.txt"
            session = Path(scratch) / f"session-{v}-{i}"
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", str(model), "--result",
                   str(result), "--reps", str(args.reps), "--num-prompts", str(args.num_prompts),
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   *(["--threads"] if args.threads else []), *(["--ab"] if args.ab else []),
                   *(["--hook-times"] if args.hook_times else []),
                   *(["--driver-probe"] if args.driver_probe else []),
                   *(["--ab-blocks", str(args.ab_blocks), "--ab-pause", args.ab_pause] if args.ab_blocks else []),
                   *(["--ab-calls"] if args.ab_calls else []),
                   *(["--pin", args.pin] if args.pin else []),
                   *(["--skip-kv-writes", args.skip_kv_writes] if args.skip_kv_writes else []),
                   *(["--load-mb-s", str(args.load_mb_s)] if args.ab_pause in LOADS else []),
                   *(["--load-churn"] if args.load_churn else []),
                   *(["--load-handovers", str(args.load_handovers)] if args.load_handovers else []),
                   *(["--py-spy", args.py_spy] if args.py_spy else [])]
            if bgt.VARIANTS[v] is not None:
                cmd = [sys.executable, "-m", "kvtrace", "record", "-o", str(session),
                       *bgt.VARIANTS[v], "--", *cmd]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            if proc.returncode != 0 or not result.exists():
                raise SystemExit(f"profile: {v} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            said = [line for line in proc.stderr.splitlines() if line.startswith("kvtrace:")]
            if args.ab_blocks:
                print(ab_blocks_report(v, json.loads(result.read_text())), *ring_lines(session), *said[-1:],
                      sep="\n", flush=True)
                shutil.rmtree(session, ignore_errors=True)
                continue
            if args.ab:
                print(ab_report(v, json.loads(result.read_text())), *said[-1:], sep="\n", flush=True)
                shutil.rmtree(session, ignore_errors=True)
                continue
            if args.threads:
                r = json.loads(result.read_text())
                gil, calls = Path(str(result) + ".gil"), Path(str(result) + ".calls.json")
                call_lines = json.loads(calls.read_text()) if calls.exists() else None
                print(thread_row(v, r), *([gil_summary(gil, r["wall_s"], call_lines)] if gil.exists() else []),
                      *([hook_report(r["hooks"], r["steps"])] if r.get("hooks") else []),
                      *said[-1:], sep="\n", flush=True)
                shutil.rmtree(session, ignore_errors=True)
                continue
            print(f"== {args.shape} {v}\n" + result.read_text().split("all functions by self time:")[0]
                  + "\n".join(said[-3:]), flush=True)


def ring_lines(session: Path) -> list[str]:
    """What each KV ring of a recorded session kept and how its graph replays got their step (proc.json's
    kv_ring_* facts): a line a ring, for the reports (step tickets taken and lost, steps whose state
    launch came too late, records dropped)."""
    try:
        rings = bgt.ring_facts(bgt.session_procs(session))
    except (OSError, ValueError) as exc:  # the A/B's own report still prints
        return [f"  KV rings: the session's proc.json unreadable ({exc})"]
    return [f"  {key}: " + ", ".join(f"{k} {st[k]}" for k in ("kv_rows", "kv_dropped", "drains", "step_tickets",
                                                            "step_tickets_lost", "state_missed_steps") if k in st)
            for key, st in rings]


def tlb_shootdowns() -> int | None:
    """TLB shootdown interrupts so far, all CPUs summed (/proc/interrupts' TLB line), or None. A process
    that unmaps or gives back memory interrupts every CPU running one of its threads to flush its TLB."""
    try:
        with open("/proc/interrupts") as f:
            for line in f:
                name, _, rest = line.strip().partition(":")
                if name == "TLB":
                    return sum(int(x) for x in rest.split() if x.isdigit())
    except (OSError, ValueError):
        pass
    return None


def machine_cpu() -> list[int] | None:
    """The machine's CPU time so far by state (/proc/stat's `cpu` line, in clock ticks), or None."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def machine_cpu_delta(before: list[int] | None) -> dict | None:
    """Over a window: the machine's busy and stolen shares of its CPU time (steal: time the hypervisor
    ran something else while a vCPU had work; a thread holding the GIL then holds it longer)."""
    after = machine_cpu()
    if before is None or after is None or len(after) < 8:
        return None
    d = [b - a for a, b in zip(before, after)]
    total = max(1, sum(d[:8]))  # user nice system idle iowait irq softirq steal (guest is inside user)
    return {"busy": (total - d[3] - d[4] - d[7]) / total, "steal": d[7] / total}


def tlb_note(r: dict) -> str:
    """TLB shootdowns a step (all CPUs) in the on and off blocks, as a report's clause ('' when unknown)."""
    tlb = r.get("tlb_shootdowns")
    if not tlb:
        return ""
    on_name, off_name = PAUSE_NAMES[r.get("paused", "records")]
    steps = {True: 0, False: 0}
    for _, recording, _, _ in r["calls"]:
        steps[recording] += 1
    return (f"; TLB shootdowns (all CPUs) {tlb['on'] / max(1, steps[True]):.2f} a step {on_name}, "
            f"{tlb['off'] / max(1, steps[False]):.2f} {off_name}")


def machine_note(r: dict) -> str:
    """The machine's busy and stolen CPU over a window, as a report's last clause ('' when unknown)."""
    m = r.get("machine_cpu")
    return f"; machine CPU busy {100 * m['busy']:.1f}%, stolen {100 * m['steal']:.2f}%" if m else ""


def thread_row(variant: str, r: dict) -> str:
    """One line of ms a step over the timed repetitions: wall, the engine thread's CPU, kvtrace's ring
    drain and shard writer threads' CPU, and the rest of the process's CPU (vLLM's and CUDA's threads)."""
    n = r["steps"] / 1e3
    rest = r["process_cpu_s"] - r["engine_thread_cpu_s"] - r["ring_cpu_s"] - r["writer_cpu_s"]
    return (f"{variant:>18}: {r['steps']} steps, wall {r['wall_s'] / n:.3f} ms a step; CPU ms a step: engine "
            f"thread {r['engine_thread_cpu_s'] / n:.3f}, kvtrace-kv-ring {r['ring_cpu_s'] / n:.3f}, "
            f"kvtrace-writer {r['writer_cpu_s'] / n:.3f}, other threads {rest / n:.3f}"
            + (f"; {r['drains']} drains ({'native' if r['native_drain'] else 'Python'})" if r.get("drains") else "")
            + machine_note(r))


if __name__ == "__main__":
    main()
