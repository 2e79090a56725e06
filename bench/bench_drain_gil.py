"""How long the engine's thread waits for the GIL while a KV access ring's drain and the shard writer
run beside it (issue 33: a small model's engine is bound by its host thread, so each millisecond of its
own that it waits is throughput lost).

On the GPU the ring's drain thread and the recorder's writer thread spend ~0.3 and ~0.15 ms of CPU a
step for a 1B-class model at the default granularity (bench/profile_engine_thread.py --threads). What
matters to the engine is the part of it that holds the GIL. Here a pure-Python loop stands in for the
engine's thread (it needs the GIL all the time: every moment it is off the CPU it is waiting for it),
while a background thread drains `--records` packed records every 100 ms into a real recorder, whose
own writer thread flushes them to real shards every 2 s, as the ring's drain thread and the writer do. Printed,
alternating in one process: the loop thread's share of wall time spent waiting, with no drain, with the
drain as kvtrace does it (the lap check and copy in one native call without the GIL, `_drain.c`; the
shard rows built at the flush), and with its NumPy fallback (each NumPy operation on the records lets go
of the GIL and takes it back: a hand-over each).

What costs the loop is less the time the background holds the GIL than how often it takes it back:
each time, the loop thread stops for two thread wake-ups (its own and the other's).

    python bench/bench_drain_gil.py [--records 105000] [--seconds 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import kvtrace.probes.kv_access.ring as ring_module
from kvtrace.probes.kv_access.ring import KVAccessRing
from kvtrace.record.recorder import Recorder

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kv_drain import device_records  # noqa: E402

DRAIN_EVERY_S = 0.1  # the device ring's drain interval
FLUSH_EVERY_S = 2.0  # the recorder's writer thread flushes every 2 s


def waited_share(n: int, seconds: float, drain: bool) -> tuple[float, float]:
    """(share of wall time the loop thread was off the CPU, the drain and writer threads' CPU share)."""
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, "worker", {"flush_interval_s": FLUSH_EVERY_S})
        ring = KVAccessRing(recorder=rec, capacity=1 << 30)
        recs = device_records(n, ring.log2cap)
        ring._decode_window(recs, 0, 0, n, ring.log2cap, 0, False)  # warm: imports, first shard
        rec.flush()
        stop = threading.Event()
        busy = [0.0]
        writer0 = rec.writer_cpu_s  # the writer thread's own clock, read after each of its flushes

        def background() -> None:
            while not stop.is_set():
                c = time.thread_time()
                if drain:
                    ring._decode_window(recs, 0, 0, n, ring.log2cap, 0, False)
                busy[0] += time.thread_time() - c
                stop.wait(DRAIN_EVERY_S)

        thread = threading.Thread(target=background)
        thread.start()
        t0, c0, x = time.perf_counter(), time.thread_time(), 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(1000):
                x += 1
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        stop.set()
        thread.join()
        writer = rec.writer_cpu_s - writer0  # its flushes in the window (the last one may end just after)
        rec.close()
    return 1.0 - cpu / wall, (busy[0] + writer) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=105_000, help="records per drain (1B default: ~10 steps)")
    ap.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    native = ring_module.native_drain
    if native is None:
        print("the native drain (_drain.c) is not built here: its figure is the NumPy one")
    variants = {"no drain": (False, native), "drain (native)": (True, native), "drain (NumPy)": (True, None)}
    waits: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for name, (drain, module) in variants.items():
            ring_module.native_drain = module
            w, b = waited_share(args.records, args.seconds, drain)
            waits[name].append(w)
            cpu[name].append(b)
    ring_module.native_drain = native
    print(f"{args.records} records drained every 100 ms and flushed every 2 s, {args.rounds} rounds of "
          f"{args.seconds} s (medians):")
    base = statistics.median(waits["no drain"])
    for name in variants:
        w, b = statistics.median(waits[name]), statistics.median(cpu[name])
        print(f"  {name:20s} loop thread waiting {100 * w:5.2f}% of wall (+{100 * (w - base):.2f}), "
              f"background CPU {100 * b:5.2f}% of wall")


if __name__ == "__main__":
    main()
