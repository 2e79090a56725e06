"""Host CPU a KV access ring's drain costs per step, decoded in the recording process vs packed (issue 33).

A step of a small model on a GPU at the default granularity produces ~10,000 block records (one layer's
block lists for 256 sequences). The drain thread hands them to the recorder, whose writer thread puts them
in shards; both run in vLLM's process, beside the engine's thread, under the same GIL. This times both
parts on this machine with the real recorder writing real shards, for the two ways the records can go:

- decoded: eight NumPy columns per drain (what a ring gives a recorder that keeps rows in memory), joined
  and written as `kv_access` batches;
- packed: the drain's records as they are, one `kv_access_records` row (what a ring gives the shard
  recorder; ingest decodes them).

Both are run alternately in one process, and the ratio of their medians is printed.

    python bench/bench_kv_drain.py [--records 10000] [--steps 200] [--rounds 5]

`--batch-mb 64,4` compares instead the packed path's batch sizes (`kv_records.BATCH_BYTES`), alternating
in one process: the writer's CPU for a flush and the minor page faults it takes (a buffer larger than
glibc's largest dynamic mmap threshold, 32 MB, is mapped and faulted in at each flush, and unmapped):

    python bench/bench_kv_drain.py --records 105000 --steps 20 --rounds 5 --batch-mb 64,4   # a 1B model's 2 s
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import numpy as np

from kvtrace.format import kv_records
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


def compare_batch_sizes(args) -> None:
    """The packed path with each of `--batch-mb`'s batch sizes, alternating."""
    sizes = [int(float(mb) * (1 << 20)) for mb in args.batch_mb.split(",")]
    got: dict[int, list[tuple[float, float, int]]] = {size: [] for size in sizes}
    default = kv_records.BATCH_BYTES
    for r in range(args.rounds):
        for size in (sizes if r % 2 == 0 else sizes[::-1]):
            kv_records.BATCH_BYTES = size
            got[size].append(one_round(True, args.records, args.steps))
    kv_records.BATCH_BYTES = default
    print(f"{args.records} records per drain, {args.steps} drains per flush, {args.rounds} rounds (medians)")
    for size, rows in got.items():
        flush = statistics.median(f * args.steps for _, f, _ in rows)
        faults = statistics.median(p for _, _, p in rows)
        print(f"  batches of at most {size / (1 << 20):g} MB: flush {flush:.1f} ms of CPU, {faults:,.0f} minor page faults")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000, help="records per drain (per step)")
    ap.add_argument("--steps", type=int, default=200, help="drains per round (one flush after them)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-mb", help="compare these batch sizes of the packed path instead (MB, comma-separated)")
    args = ap.parse_args()
    if args.batch_mb:
        return compare_batch_sizes(args)
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
