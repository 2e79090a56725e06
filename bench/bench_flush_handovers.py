"""How many times the shard writer takes the GIL back in one flush of a small model's KV records.

On an H200 (`profile_engine_thread.py --ab-calls --ab-pause all-writer`) a 1B-class model's engine thread
made 1.45 more voluntary context switches an engine step with the writer's work in the block than without.
Each is a wait for the GIL: every Arrow or NumPy call that lets the GIL go (to validate, serialize, copy,
write) gives the engine's thread a moment to take it, after which the writer waits for it again, or the
other way round. This counts those hand-overs on a CPU machine, to compare ways of writing a flush. (On
the H200 most of the threads' cost read as more CPU time on the engine thread, not as time waiting: fewer
hand-overs, with 16 MB batches, did not lower it.)

Here a thread stands in for the engine's (Python work with the GIL let go every few microseconds, as each
torch call's binding does) while a real recorder flushes 2 s of the 1B default's ring data (20 drains of
`--records` packed block records, each with its layer timing records) to real shards. Printed per flush,
medians over `--flushes`: the stand-in's voluntary context switches during the flush beyond its own rate
without one (each a wait for the GIL), the same rate over the flush's length, the writer thread's switches,
and the flush's wall time.

`--kv-to spool` measures the other way of writing the block records: each drain's records written by the
drain's own thread as one raw frame with one `pwritev` (profile_engine_thread.py's `KvSpool`, the layout
`--skip-kv-writes spool` prices on a GPU), straight from the drain's memory, the shard writer's flush
left with the layer timings. The figures then count the 20 frames' writes and that flush together.

    python bench/bench_flush_handovers.py [--records 105000] [--drains 20] [--flushes 5] [--kv-to shards|spool]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_drain import device_records  # noqa: E402
from profile_engine_thread import KvSpool  # noqa: E402

from kvtrace.format.kv_records import TIM_DTYPE  # noqa: E402
from kvtrace.record.recorder import Recorder  # noqa: E402

CLOCK = (0, 0, 1.0)
TIMINGS_PER_DRAIN = 16 * 10  # a record a layer and step: 16 layers, ~10 steps a 100 ms drain


def switches() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


COPIES = (1, 0, 2, 0)


def fill(rec: Recorder, recs: np.ndarray, drains: int, kv: bool = True) -> None:
    """One flush's worth of drains, as the ring's drain thread hands them over (records in memory of their
    own); `kv=False`: the timings only (the block records go to the spool)."""
    for _ in range(drains):
        if kv:
            rec.append_kv_records(recs.copy(), CLOCK, COPIES, owned=True)
        rec.append_timing_records(np.zeros(TIMINGS_PER_DRAIN, TIM_DTYPE), CLOCK, owned=True)


def one_flush(rec: Recorder, spool=None, recs: np.ndarray | None = None, drains: int = 0) -> tuple[list, list]:
    """One flush beside the stand-in: ((phase, its switches, time) at each phase it saw, [(the writer's
    switches, the flush's seconds)]). With a `spool`, `drains` frames of `recs` are written first."""
    phase, marks, stop = [0], [], threading.Event()

    def stand_in() -> None:
        """Python work, the GIL let go every ~2 us by a C call that makes no system call (as
        torch's bindings do around each call): its voluntary switches are waits for the GIL."""
        data, seen = b"x" * 4096, 0
        while not stop.is_set():
            if phase[0] != seen:
                seen = phase[0]
                marks.append((seen, switches(), time.perf_counter()))
            sum(range(50))
            hashlib.sha1(data)  # lets the GIL go (hashlib does from 2 KB)

    thread = threading.Thread(target=stand_in)
    thread.start()
    result = []

    def seen(n: int) -> None:  # until the stand-in has marked phase n
        while len(marks) < n:
            time.sleep(0.0005)

    def flush() -> None:
        time.sleep(0.02)
        phase[0] = 1  # 20 ms with no flush (the stand-in's own rate of waits), then the flush
        time.sleep(0.02)
        phase[0] = 2
        seen(2)
        s0, t0 = switches(), time.perf_counter()
        for _ in range(drains if spool is not None else 0):
            spool.append(recs, CLOCK, COPIES)
        rec.flush()
        result.append((switches() - s0, time.perf_counter() - t0))
        phase[0] = 3
        seen(3)

    writer = threading.Thread(target=flush)
    writer.start()
    writer.join()
    stop.set()
    thread.join()
    return marks, result


def measure(records: int, drains: int, flushes: int, kv_to: str = "shards") -> dict[str, list[float]]:
    if kv_to not in ("shards", "spool"):
        raise ValueError(f"kv_to: {kv_to!r} is neither 'shards' nor 'spool'")
    out: dict[str, list[float]] = {"stand-in waits": [], "stand-in waits, no flush": [], "writer waits": [],
                                   "flush ms": []}
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, "worker", {"flush_interval_s": 1e9})  # flushed here only
        spool = KvSpool(Path(tmp) / "kv.spool", rec) if kv_to == "spool" else None
        recs = device_records(records, 30)
        fill(rec, recs, 2)
        rec.flush()  # warm: imports, the first shards
        for _ in range(flushes):
            fill(rec, recs, drains, kv=spool is None)
            marks, result = one_flush(rec, spool, recs, drains)
            at = {p: (s, t) for p, s, t in marks}
            idle = (at[2][0] - at[1][0]) / (at[2][1] - at[1][1])  # waits a second without a flush
            out["stand-in waits"].append(at[3][0] - at[2][0] - idle * (at[3][1] - at[2][1]))
            out["stand-in waits, no flush"].append(idle * (at[3][1] - at[2][1]))
            out["writer waits"].append(result[0][0])
            out["flush ms"].append(1e3 * result[0][1])
        rec.close()
        if spool is not None:
            os.close(spool.fd)
            out["spool MB"] = [spool.offset / 1e6]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=105_000, help="block records a drain (1B default, 100 ms)")
    ap.add_argument("--drains", type=int, default=20, help="drains a flush (every 100 ms, flushed every 2 s)")
    ap.add_argument("--flushes", type=int, default=5)
    ap.add_argument("--kv-to", choices=("shards", "spool"), default="shards",
                    help="the block records: to the shard writer's flush (as recorded) or as raw frames")
    args = ap.parse_args()
    out = measure(args.records, args.drains, args.flushes, args.kv_to)
    print(f"{args.drains} drains of {args.records} records and their timings a flush, block records to "
          f"{args.kv_to}, {args.flushes} flushes (medians): "
          + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
