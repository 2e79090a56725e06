"""What recording the batch's slots costs the engine's thread a step: a row per (step, slot), as the
attention probe wrote them, against runs of steps with the same batch (`SlotRuns`), as it writes them.

After each forward pass the attention probe records which request sat in which row of the batch, so
that device records (which name rows) can name requests. A host-bound engine (a 1B-class model on a GPU,
256 requests decoding) pays for it on its own thread every step. Here both ways take the same sequence
of batches, alternating in one process, timed on the thread's CPU clock per step, with the hand-overs
to a real recorder (the runs' `take()` every second of steps, as the probe does) inside the timing:
`--requests` rows a batch, one request finishing and another joining every `--churn` steps.

    python bench/bench_batch_slots.py [--requests 256] [--steps 2000] [--churn 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from itertools import count, repeat

from kvtrace.record.buffers import SlotRuns
from kvtrace.record.recorder import Recorder


def batches(requests: int, steps: int, churn: int) -> list[list[str]]:
    """The batch's request ids of each step: `requests` rows, the oldest request replaced by a new one
    every `churn` steps (vLLM moves the last row into the freed one)."""
    ids = [f"cmpl-{i:08x}-0-1f2e3d4c" for i in range(requests)]
    out, nxt = [], requests
    for step in range(steps):
        if step and step % churn == 0:
            ids[0] = ids[-1]
            ids[-1] = f"cmpl-{nxt:08x}-0-1f2e3d4c"
            nxt += 1
        out.append(list(ids))
    return out


def run_rows(rec: Recorder, seq: list[list[str]]) -> float:
    slots = rec.buffer("batch_slots")
    t0 = time.thread_time()
    for step, ids in enumerate(seq):
        slots.extend(zip(repeat(step), count(), ids))
    return time.thread_time() - t0


def run_runs(rec: Recorder, seq: list[list[str]], take_every: int) -> float:
    runs = SlotRuns(flush_ns=1 << 62)  # taken by step count below, as the probe does every second
    t0 = time.thread_time()
    for step, ids in enumerate(seq):
        runs.add(step, ids)
        if step % take_every == take_every - 1:
            cols = runs.take()
            if cols is not None:
                rec.append_columns("batch_slot_runs", cols)
    cols = runs.take()
    if cols is not None:
        rec.append_columns("batch_slot_runs", cols)
    return time.thread_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--churn", type=int, default=20, help="steps between two changes of the batch")
    ap.add_argument("--take-every", type=int, default=100, help="steps between two hand-overs of the runs "
                    "(the probe's is one second: ~100 steps of a 1B decode on an H100)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    seq = batches(args.requests, args.steps, args.churn)
    per_step = {"rows": [], "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        rec = Recorder(tmp, "worker", {"flush_interval_s": 1e9})
        try:
            for r in range(args.rounds):
                order = ("rows", "runs") if r % 2 == 0 else ("runs", "rows")
                for name in order:
                    s = run_rows(rec, seq) if name == "rows" else run_runs(rec, seq, args.take_every)
                    per_step[name].append(s / args.steps)
                rec.flush()  # the writer's work is outside the timing (it runs on its own thread)
        finally:
            rec.close()
    rows, runs = statistics.median(per_step["rows"]), statistics.median(per_step["runs"])
    print(f"{args.requests} requests a batch, a change every {args.churn} steps, {args.steps} steps x "
          f"{args.rounds} rounds (medians, thread CPU):")
    print(f"  a row per (step, slot): {1e6 * rows:7.2f} us a step")
    print(f"  runs (SlotRuns):        {1e6 * runs:7.2f} us a step   runs / rows = {runs / rows:.3f}")


if __name__ == "__main__":
    main()
