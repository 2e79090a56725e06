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

`--kv-to frames` (the default) writes the block records as kvtrace does: each drain's records written by
the drain's thread as one frame with one `writev` (Recorder.append_kv_records, format/kv_frames.py), the
shard writer's flush left with the layer timings; `--kv-to shards` the way kvtrace wrote them before:
the drains held until the flush, which makes them Arrow batches (kv_records.packed_batches) and writes
them to an Arrow shard. Either way the figures count the 20 drains' records written and the flush.

    python bench/bench_flush_handovers.py [--records 105000] [--drains 20] [--flushes 5] [--kv-to frames|shards]
"""

from __future__ import annotations

import argparse
import hashlib
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

from kvtrace.format import schema  # noqa: E402
from kvtrace.format.kv_records import TIM_DTYPE, PackedRecords, packed_batches  # noqa: E402
from kvtrace.format.shards import ShardWriter  # noqa: E402
from kvtrace.record.recorder import Recorder  # noqa: E402

CLOCK = (0, 0, 1.0)
TIMINGS_PER_DRAIN = 16 * 10  # a record a layer and step: 16 layers, ~10 steps a 100 ms drain


def switches() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


COPIES = (1, 0, 2, 0)
KV_TO = ("frames", "shards")


class HeldForShards:
    """`--kv-to shards`: drains held as the recorder held them (a copy each) until the flush makes them
    `kv_access_records` Arrow batches and writes them to a shard of their own."""

    def __init__(self, directory: Path) -> None:
        self.held: list[PackedRecords] = []
        self.writer = ShardWriter(directory, "kv_access_records", 1 << 40, 1e9)

    def hold(self, recs: np.ndarray) -> None:
        self.held.append(PackedRecords(recs.copy(), CLOCK, COPIES, len(recs)))

    def flush(self) -> None:
        held, self.held = self.held, []
        for batch in packed_batches(held, schema.arrow_schema("kv_access_records")):
            self.writer.write(batch)


def fill(rec: Recorder, drains: int, recs: np.ndarray | None = None, shards: HeldForShards | None = None) -> None:
    """One flush's worth of drains' timing records, as the ring's drain thread hands them over (held until
    the flush); with `shards`, the drains' block records `recs` held for it too."""
    for _ in range(drains):
        if shards is not None:
            shards.hold(recs)
        rec.append_timing_records(np.zeros(TIMINGS_PER_DRAIN, TIM_DTYPE), CLOCK, owned=True)


def one_flush(rec: Recorder, recs: np.ndarray, drains: int, shards: HeldForShards | None) -> tuple[list, list]:
    """One flush beside the stand-in, with `drains` drains' block records `recs` written (as frames, or with
    `shards` by the flush): ((phase, its switches, time) at each phase it saw, [(the writer's switches,
    the flush's seconds)])."""
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
        if shards is None:
            for _ in range(drains):
                rec.append_kv_records(recs, CLOCK, COPIES)
        else:
            shards.flush()
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


def measure(records: int, drains: int, flushes: int, kv_to: str = "frames") -> dict[str, list[float]]:
    if kv_to not in KV_TO:
        raise ValueError(f"kv_to: {kv_to!r} is not one of {', '.join(KV_TO)}")
    out: dict[str, list[float]] = {"stand-in waits": [], "stand-in waits, no flush": [], "writer waits": [],
                                   "flush ms": []}
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, "worker", {"flush_interval_s": 1e9})  # flushed here only
        shards = HeldForShards(rec.dir) if kv_to == "shards" else None
        recs = device_records(records, 30)
        for _ in range(2):  # warm: imports, the first files
            fill(rec, 2, recs, shards)
            one_flush(rec, recs, 2, shards)
        for _ in range(flushes):
            fill(rec, drains, recs, shards)
            marks, result = one_flush(rec, recs, drains, shards)
            at = {p: (s, t) for p, s, t in marks}
            idle = (at[2][0] - at[1][0]) / (at[2][1] - at[1][1])  # waits a second without a flush
            out["stand-in waits"].append(at[3][0] - at[2][0] - idle * (at[3][1] - at[2][1]))
            out["stand-in waits, no flush"].append(idle * (at[3][1] - at[2][1]))
            out["writer waits"].append(result[0][0])
            out["flush ms"].append(1e3 * result[0][1])
        rec.close()
        if shards is not None:
            shards.writer.close()
        out["KV MB written"] = [sum(p.stat().st_size for p in Path(rec.dir).glob("kv_access_records.*")) / 1e6]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=105_000, help="block records a drain (1B default, 100 ms)")
    ap.add_argument("--drains", type=int, default=20, help="drains a flush (every 100 ms, flushed every 2 s)")
    ap.add_argument("--flushes", type=int, default=5)
    ap.add_argument("--kv-to", choices=KV_TO, default="frames",
                    help="the block records: as frames by the drain's thread (as recorded) or to an Arrow shard by "
                    "the flush (as kvtrace wrote them before)")
    args = ap.parse_args()
    out = measure(args.records, args.drains, args.flushes, args.kv_to)
    print(f"{args.drains} drains of {args.records} records and their timings a flush, block records to "
          f"{args.kv_to}, {args.flushes} flushes (medians): "
          + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in out.items()))


if __name__ == "__main__":
    main()
