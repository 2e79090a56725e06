"""How long the engine's thread waits for the GIL while a KV access ring's drain and the shard writer
run beside it (issue 33: a small model's engine is bound by its host thread, so each millisecond of its
own that it waits is throughput lost).

On the GPU the ring's drain thread and the recorder's writer thread spend ~0.3 and ~0.15 ms of CPU a
step for a 1B-class model at the default granularity (bench/profile_engine_thread.py --threads). What
matters to the engine is the part of it that holds the GIL. Here a pure-Python loop stands in for the
engine's thread (it needs the GIL all the time: every moment it is off the CPU it is waiting for it),
while `--records` packed records are drained every 100 ms into a real recorder, whose own writer thread
flushes every 2 s, as the ring's drain thread and the writer do. Printed, alternating in one process: the
loop thread's share of wall time spent waiting, with no drain (a background thread waking every 100 ms
and doing nothing), with the drain loop as kvtrace runs it on a GPU (`_drain.Drainer` on the driver's
calls done in C on host memory, `_drain.host_driver`: it drains and writes its frames without the GIL,
back to Python once a second for the timing records; the background thread only moves the "device"
heads), with each drain a native call from Python (the lap check and copy in one call without the GIL,
then the frame written and handed over in Python), and with the NumPy fallback (each NumPy operation on
the records lets go of the GIL and takes it back: a hand-over each).

What costs the loop is less the time the background holds the GIL than how often it takes it back:
each time, the loop thread stops for two thread wake-ups (its own and the other's).

    python bench/bench_drain_gil.py [--records 105000] [--seconds 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

import kvtrace.probes.kv_access.ring as ring_module
from kvtrace.probes.kv_access.ring import REC_DTYPE, TIM_DTYPE, KVAccessRing, set_laps
from kvtrace.record.recorder import Recorder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kv_drain import device_records  # noqa: E402

DRAIN_EVERY_S = 0.1  # the device ring's drain interval
FLUSH_EVERY_S = 2.0  # the recorder's writer thread flushes every 2 s
TIMINGS_PER_DRAIN = 16 * 10  # a timing record a layer and step: 16 layers, ~10 steps a 100 ms drain


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class LoopDrain:
    """`_drain.Drainer` draining a "device" ring in host memory (records with the laps of their positions,
    enough of them for the whole run: no wrap) into `rec`'s frame sink, on a thread of its own; `advance()`
    is what the device does in 100 ms: `n` records more behind the heads the next drain reads."""

    def __init__(self, rec: Recorder, n: int, seconds: float):
        native = ring_module.native_drain
        drains = int(seconds / DRAIN_EVERY_S) + 20
        cap = 1 << (n * drains).bit_length()
        self.n, self.rec = n, rec
        self.ring, self.stage = device_records(cap, cap.bit_length() - 1), np.empty(cap, REC_DTYPE)
        tcap = 1 << (TIMINGS_PER_DRAIN * drains).bit_length()
        self.tring, self.tstage = np.zeros(tcap, TIM_DTYPE), np.empty(tcap, TIM_DTYPE)
        set_laps(self.tring, 0, tcap.bit_length() - 1)
        self.state, self.live, self.snaps = np.zeros(8, np.int64), np.zeros(8, np.int64), np.zeros((65, 8), np.int64)
        self.drainer = native.Drainer(native.host_driver(), addr(self.snaps), 64, 0, (2, 3), (5, 6),
                                      (addr(self.ring), addr(self.stage), cap), (addr(self.tring), addr(self.tstage), tcap),
                                      addr(self.state), addr(self.live), 0, 0, rec.kv_frame_sink(native.FrameSink))
        self.drainer.set_policy(DRAIN_EVERY_S, 0.001, DRAIN_EVERY_S, True)
        self.thread = threading.Thread(target=self._host)
        self.thread.start()

    def _host(self) -> None:
        """The ring's drain thread: in the loop, back once a second for the timing records (_take_native)."""
        while self.drainer.run(time.monotonic() + 1.0) != "stop":
            self._take()
        self._take()

    def _take(self) -> None:
        _, timings, _, _ = self.drainer.take()
        for recs, clock, _ in timings:
            self.rec.append_timing_records(np.frombuffer(recs, TIM_DTYPE), clock, True)

    def advance(self) -> None:
        self.state[5] += self.n
        self.state[6] += TIMINGS_PER_DRAIN
        self.state[2], self.state[3] = self.state[5], self.state[6]

    def stop(self) -> None:
        self.drainer.stop()
        self.thread.join()


def waited_share(n: int, seconds: float, how: str) -> tuple[float, float, float]:
    """(share of wall time the loop thread was off the CPU, the drain and writer threads' CPU share, the
    loop thread's voluntary context switches a second: each a wait for the GIL; off the CPU it can also be
    for another thread's turn on a busy core, an involuntary switch). `how`: "none", "loop" (the drain
    loop), "call" (a native call a drain), "numpy"."""
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, "worker", {"flush_interval_s": FLUSH_EVERY_S})
        ring = KVAccessRing(recorder=rec, capacity=1 << 30)
        recs = device_records(n, ring.log2cap)
        ring._decode_window(recs, 0, 0, n, ring.log2cap, 0, False)  # warm: imports, first shards
        timings = np.zeros(TIMINGS_PER_DRAIN, TIM_DTYPE)
        rec.append_timing_records(timings, (0, 0, 1.0), True)  # (the first decode of them imports more)
        rec.flush()
        loop = LoopDrain(rec, n, seconds) if how == "loop" else None
        stop = threading.Event()
        busy = [0.0]
        writer0 = rec.writer_cpu_s  # the writer thread's own clock, read after each of its flushes
        loop_cpu0 = loop.drainer.thread_cpu_s() if loop is not None else 0.0

        def background() -> None:
            while not stop.is_set():
                c = time.thread_time()
                if loop is not None:
                    loop.advance()
                elif how != "none":
                    ring._decode_window(recs, 0, 0, n, ring.log2cap, 0, False)
                busy[0] += time.thread_time() - c
                stop.wait(DRAIN_EVERY_S)

        thread = threading.Thread(target=background)
        thread.start()
        t0, c0, v0, x = time.perf_counter(), time.thread_time(), voluntary_switches(), 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(1000):
                x += 1
        wall, cpu, waits = time.perf_counter() - t0, time.thread_time() - c0, voluntary_switches() - v0
        stop.set()
        thread.join()
        if loop is not None:
            busy[0] += loop.drainer.thread_cpu_s() - loop_cpu0
            loop.stop()
        writer = rec.writer_cpu_s - writer0  # its flushes in the window (the last one may end just after)
        rec.close()
    return 1.0 - cpu / wall, (busy[0] + writer) / wall, waits / wall


def voluntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=105_000, help="records per drain (1B default: ~10 steps)")
    ap.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    native = ring_module.native_drain
    if native is None:
        print("the native drain (_drain.c) is not built here: its figure is the NumPy one, and no drain loop")
    variants = {"no drain": ("none", native), "drain loop (native)": ("loop", native),
                "drain call (native)": ("call", native), "drain (NumPy)": ("numpy", None)}
    if native is None or not hasattr(native, "Drainer"):
        del variants["drain loop (native)"]
    waits: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    switches: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for name, (how, module) in variants.items():
            ring_module.native_drain = module
            w, b, v = waited_share(args.records, args.seconds, how)
            waits[name].append(w)
            cpu[name].append(b)
            switches[name].append(v)
    ring_module.native_drain = native
    print(f"{args.records} records drained every 100 ms and flushed every 2 s, {args.rounds} rounds of "
          f"{args.seconds} s (medians):")
    base = statistics.median(waits["no drain"])
    for name in variants:
        w, b, v = statistics.median(waits[name]), statistics.median(cpu[name]), statistics.median(switches[name])
        print(f"  {name:20s} loop thread off the CPU {100 * w:5.2f}% of wall (+{100 * (w - base):.2f}), "
              f"{v:6.1f} waits for the GIL a second; background CPU {100 * b:5.2f}% of wall")


if __name__ == "__main__":
    main()
