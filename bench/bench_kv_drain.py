"""Host CPU a KV access ring's drain costs per step, decoded in the recording process vs packed (issue 33).

A step of a small model on a GPU at the default granularity produces ~10,000 block records (one layer's
block lists for 256 sequences). The drain thread hands them to the recorder; both it and the recorder's
writer thread run in vLLM's process, beside the engine's thread, under the same GIL. This times both
threads' parts on this machine with the real recorder writing real files, for the two ways the records
can go:

- decoded: eight NumPy columns per drain (what a ring gives a recorder that keeps rows in memory), joined
  and written by the flush as `kv_access` batches;
- packed: the drain's records as they are, written by the drain's thread as one frame
  (`kv_access_records` frame files, format/kv_frames.py; ingest decodes them).

Both are run alternately in one process, and the ratio of their medians is printed.

    python bench/bench_kv_drain.py [--records 10000] [--steps 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import numpy as np

from kvtrace.probes.kv_access.ring import REC_DTYPE, KVAccessRing, set_laps
from kvtrace.record.recorder import Recorder


def device_records(n: int, log2cap: int) -> np.ndarray:
    """`n` records as a drain copies them off the device: distinct blocks, 256 batch rows, timestamps,
    and the lap tag of positions 0.. (bench_drain_gil.py uses them too)."""
    recs = np.zeros(n, REC_DTYPE)
    recs["block_id"] = np.arange(n)
    recs["slot"] = np.arange(n) % 256
    recs["ts"] = np.arange(n, dtype=np.uint64) + np.uint64(10**12)
    set_laps(recs, 0, log2cap)  # the lap the device would have tagged, for position 0
    return recs


def one_round(packed: bool, n: int, steps: int) -> tuple[float, float, int]:
    """(drain ms, flush ms) of CPU per step, and the flush's minor page faults, for `steps` drains of `n`
    records and one flush of them."""
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, "worker", {"flush_interval_s": 1e9})
        ring = KVAccessRing(recorder=rec, capacity=1 << 30)
        if not packed:
            ring._append_records = None  # as for a recorder without append_kv_records
        recs = device_records(n, ring.log2cap)
        for _ in range(5):  # warm: the first calls import and allocate
            ring._decode_window(recs, 0, 0, n, ring.log2cap, 0, False)
        rec.flush()
        c0 = time.thread_time()
        for _ in range(steps):
            ring._decode_window(recs, 0, 0, n, ring.log2cap, 0, False)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        c1 = time.thread_time()
        rec.flush()
        c2 = time.thread_time()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        rec.close()
    return 1e3 * (c1 - c0) / steps, 1e3 * (c2 - c1) / steps, faults


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000, help="records per drain (per step)")
    ap.add_argument("--steps", type=int, default=200, help="drains per round (one flush after them)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    got: dict[bool, list[tuple[float, float, int]]] = {False: [], True: []}
    for r in range(args.rounds):
        for packed in ((False, True) if r % 2 == 0 else (True, False)):
            got[packed].append(one_round(packed, args.records, args.steps))
    print(f"{args.records} records per drain, {args.steps} drains per round, {args.rounds} rounds "
          "(medians of CPU ms per step)")
    print(f"{'':9s} {'drain':>8s} {'flush':>8s} {'total':>8s}")
    total = {}
    for packed, rows in got.items():
        drain = statistics.median(d for d, _, _ in rows)
        flush = statistics.median(f for _, f, _ in rows)
        total[packed] = statistics.median(d + f for d, f, _ in rows)
        print(f"{'packed' if packed else 'decoded':9s} {drain:8.3f} {flush:8.3f} {total[packed]:8.3f}")
    print(f"packed / decoded: {total[True] / total[False]:.3f}")


if __name__ == "__main__":
    main()
