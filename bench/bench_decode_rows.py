"""Cost of a decode step's rows in the native DecodeLog, hot and with its own state cold, as under an engine.

    python bench/bench_decode_rows.py                    # 256 requests decoding (~20 s on 2 cores)
    python bench/bench_decode_rows.py --requests 1024
    python bench/bench_decode_rows.py --thrash-mb 0      # hot caches only

What it times: `DecodeLog.add` (record/_columns.c), the call the scheduler probe's `StepRows.decode` makes
for every step in which all scheduled requests decode, with a SchedulerOutput's lists as vLLM 0.26-0.33
hands them over: the running requests' ids (the same str objects from step to step), their computed
tokens (new int objects each step) and their new block ids (None but every `--block-size`th step of a
request, when it starts a block). Under an engine, `StepRows.decode` reads 12.6 µs a step for 256
requests on an H200 host (docs/performance.md, "Where the 1B default's cost sits").

Cold: before each timed call a buffer larger than the last-level cache is written (`--thrash-mb`), then
the step's lists are built, as vLLM builds them just before the call: vLLM's objects are in the caches,
the log's own state (its last step's rows, its runs) is not. The difference between the two figures is
what the cache lines the log touches cost, which is where its time under an engine goes.

Every measurement checks what the log kept: as many rows as were added, in one run per request and block
(a request's run ends where it starts a new block).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

WARM_STEPS = 50  # untimed steps before each measurement


def decode_steps(requests: int, block_size: int, step: int) -> tuple[list, list]:
    """One step's computed tokens and new block ids for `requests` decoding requests (request i started
    with 512 + i tokens: its blocks fill at different steps)."""
    computed = [512 + i + step for i in range(requests)]
    new_blocks = [([7 * i + step],) if (512 + i + step) % block_size == 0 else None for i in range(requests)]
    return computed, new_blocks


def measure(requests: int, steps: int, thrash_mb: int, block_size: int) -> tuple[float, dict]:
    """(median ns of an add() call, what the log kept) over `steps` steps after WARM_STEPS untimed ones."""
    from kvtrace.record.buffers import decode_log

    log = decode_log()
    if not hasattr(log, "take_raw"):
        sys.exit("bench_decode_rows: the native module (_columns.c) is not built here")
    ids = [f"cmpl-{i:032x}-0" for i in range(requests)]
    thrash = np.zeros(max(thrash_mb, 0) << 20, np.uint8)
    times = []
    warm = WARM_STEPS
    for step in range(warm + steps):
        if thrash.size:
            thrash[::64] += 1  # every cache line of the buffer written: the caches hold it, not the log's state
        computed, new_blocks = decode_steps(requests, block_size, step)
        t0 = time.perf_counter_ns()
        log.add(step, ids, computed, new_blocks, None, None)
        t1 = time.perf_counter_ns()
        if step == warm - 1:
            log.take_raw()  # the warm-up's runs out: the check below sees the timed steps' alone
        elif step >= warm:
            times.append(t1 - t0)
    kept = log.take_raw()
    return statistics.median(times), kept


def check(kept: dict, requests: int, steps: int, block_size: int) -> None:
    """As many rows kept as added (requests x steps), and one run per request and block it started in."""
    if kept is None:
        sys.exit("bench_decode_rows: the log kept nothing")
    rows = int(np.frombuffer(kept["steps"], np.int32).sum())
    if rows != requests * steps:
        sys.exit(f"bench_decode_rows: {rows} rows kept, {requests * steps} added")
    # request i starts a block at the steps where 512 + i + step is a multiple of block_size, and has a
    # run open at the first timed step: its runs are 1 + the timed steps after the first that start one
    warm = WARM_STEPS
    runs = sum(1 + sum((512 + i + s) % block_size == 0 for s in range(warm + 1, warm + steps))
               for i in range(requests))
    if kept["runs"] != runs:
        sys.exit(f"bench_decode_rows: {kept['runs']} runs kept, {runs} expected")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256, help="requests decoding in each step")
    ap.add_argument("--steps", type=int, default=1500, help="timed steps per measurement")
    ap.add_argument("--thrash-mb", type=int, default=64, help="buffer written before each cold step (MB)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens a KV block holds")
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each kind (medians over them)")
    args = ap.parse_args()
    kinds = [("hot", 0)] + ([("cold", args.thrash_mb)] if args.thrash_mb > 0 else [])
    print(f"| caches | DecodeLog.add, {args.requests} decode rows (µs) | a row (ns) |")
    print("|---|---|---|")
    for name, mb in kinds:
        runs = []
        for _ in range(args.rounds):
            ns, kept = measure(args.requests, args.steps, mb, args.block_size)
            check(kept, args.requests, args.steps, args.block_size)
            runs.append(ns)
        ns = statistics.median(runs)
        print(f"| {name}{f' ({mb} MB written before each step)' if mb else ''} | {ns / 1e3:.1f} "
              f"(rounds: {', '.join(f'{r / 1e3:.1f}' for r in runs)}) | {ns / args.requests:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
