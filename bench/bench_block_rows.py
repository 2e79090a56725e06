"""Cost of one block_events row on vLLM's real BlockPool, hot and with the caches cold, as under an engine.

    python bench/bench_block_rows.py                  # ~1 min on 2 cores
    python bench/bench_block_rows.py --thrash-mb 0    # hot caches only

Why cold. Under a real engine, vLLM's own work between two pool calls (the rest of `allocate_slots`, other
requests, the model runner, the CUDA driver) evicts what the last row touched, and each cache line a
row needs is then a likely miss to DRAM: a hot loop reads a row at ~0.07 us, which says little about an
engine. Here each call is preceded by a write to every cache line of a buffer larger than the last-level
cache (`--thrash-mb`, 64 MB against 32 MB of L3 on this project's CPU machine): the row then costs ~1 us,
close to the ~1.1 us the H100's host read under the engine (`profile_engine_thread.py --ab-calls`), but
most of that figure was something else, Python 3.12's frame API (docs/performance.md, "This tree"): what
this bench compares is the layout's cold cost, Python 3.11's frame reads here.

Method: `get_new_blocks(1)` of a real `BlockPool`, called through a function with a `request_id`
argument as vLLM's `SingleTypeKVCacheManager.allocate_new_blocks` is, with kvtrace's native hook in
place (`BlockHook`, `_columns.c`); the hook switched on and off on alternate calls, so the two kinds of
call see the same machine. Per-call wall time around the call; figures are medians, and the row's cost
is on - off. The blocks are freed every 1,000 calls (outside the timing). Needs the native module
(`_columns.c`); the Python wrappers are not measured here (bench_host_probes.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def measure(calls: int, thrash_mb: int) -> tuple[float, float]:
    """(median ns of a call with the row made, without), over `calls` alternating calls."""
    from vllm.v1.core.block_pool import BlockPool

    from kvtrace.probes.vllm.kv_blocks import hash_attribute
    from kvtrace.record.buffers import block_hook, block_log

    pool = BlockPool(40000, True, 16)
    log = block_log(hash_attr=hash_attribute())
    orig = BlockPool.get_new_blocks
    hook = block_hook("alloc", orig, log, (), log.take, lambda exc: (_ for _ in ()).throw(exc))
    if hook is None:
        sys.exit("bench_block_rows: the native module (_columns.c) is not built here")
    thrash = np.zeros(max(thrash_mb, 0) << 20, np.uint8)
    BlockPool.get_new_blocks = hook
    try:
        def allocate_new_blocks(request_id: str, num_blocks: int) -> list:  # vLLM's caller, by its argument
            return pool.get_new_blocks(num_blocks)

        rid = "cmpl-0123456789abcdef0123456789abcdef-0"
        times: dict[bool, list[int]] = {True: [], False: []}
        held: list = []
        for i in range(calls):
            on = i % 2 == 0
            hook.enabled = on
            if thrash.size:
                thrash[::64] += 1  # every cache line of the buffer written: the caches hold it, not ours
            t0 = time.perf_counter_ns()
            blocks = allocate_new_blocks(rid, 1)
            t1 = time.perf_counter_ns()
            if i >= 200:  # warm-up
                times[on].append(t1 - t0)
            held.extend(blocks)
            if len(held) >= 1000:
                pool.free_blocks(held)
                held = []
        pool.free_blocks(held)
    finally:
        BlockPool.get_new_blocks = orig
    if log.rows == 0:
        sys.exit("bench_block_rows: no row was made")
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=6000, help="calls per measurement (half with the row)")
    ap.add_argument("--thrash-mb", type=int, default=64, help="buffer written before each cold call (MB)")
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each kind (medians over them)")
    args = ap.parse_args()
    kinds = [("hot", 0)] + ([("cold", args.thrash_mb)] if args.thrash_mb > 0 else [])
    print("| caches | get_new_blocks with the row (ns) | without (ns) | the row (ns) |")
    print("|---|---|---|---|")
    for name, mb in kinds:
        runs = [measure(args.calls, mb) for _ in range(args.rounds)]
        on = statistics.median(r[0] for r in runs)
        off = statistics.median(r[1] for r in runs)
        rows = [r[0] - r[1] for r in runs]
        print(f"| {name}{f' ({mb} MB written before each call)' if mb else ''} | {on:.0f} | {off:.0f} | "
              f"{statistics.median(rows):.0f} (rounds: {', '.join(f'{x:.0f}' for x in rows)}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
