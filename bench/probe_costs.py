"""Direct cost of each host-probe handler, per round of bench_host_probes' workload.

    python bench/probe_costs.py [--rounds 2]
    python bench/probe_costs.py --decode-heavy --thrash-mb 64   # the GPU 1B workload's steps, caches cold

bench_host_probes.py measures the probes' whole cost (probes on vs off), but on a shared 2-core machine
its rounds vary by several percent, more than the pieces one would want to compare. This times the
pieces themselves: each handler below is wrapped in a `perf_counter` pair (about 0.2 us a call of its
own, included in the figures), and the rounds run with every host probe on. It prints, per round, the
scheduler thread's CPU time and, per handler, its total time, calls and time per call. What it cannot
see: the generated block-pool wrappers around the handlers, handler code not listed here, and vLLM code
that runs slower beside ours.

`--thrash-mb MB` writes every cache line of a buffer that large before each step (before `schedule`,
untimed): the handlers then find their code and data cold, as under an engine, where the forward pass's
work between two steps evicts them, and vLLM's own data as vLLM's step brings it back. With
`--decode-heavy` (256 requests of 512 prompt tokens and 256 out, blocks of 16: the steps of the GPU
benchmark's 1B workload) the rounds stay short. Medians are printed beside the means: a cold call's
time has a long tail (page faults, the writer thread's turn, the ~1 s hand-overs).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
import types
from pathlib import Path

# Run as `python bench/probe_costs.py`, this directory is first on sys.path; bench_host_probes puts the
# repository there too and brings the driven scheduler's helpers, used below through it.
import bench_host_probes as host
import numpy as np

TOTAL: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()
TIMES: collections.defaultdict = collections.defaultdict(list)  # label -> seconds of each call
THRASH = np.zeros(0, np.uint8)  # --thrash-mb: written before each step (before `schedule`, untimed)


def _timed(label: str, fn):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            TOTAL[label] += dt
            CALLS[label] += 1
            TIMES[label].append(dt)
    return timed


def wrap_handlers() -> None:
    """Replace the handlers with timed versions (class attributes; module functions the handlers call by
    their global name)."""
    from kvtrace.probes.vllm import kv_blocks, scheduler
    from kvtrace.record import buffers

    methods = {
        scheduler.SchedulerProbe: ("on_schedule", "after_update", "on_preempt", "on_finished",
                                   "may_watch", "disarm_admission", "nvtx_open", "nvtx_close", "take"),
        kv_blocks.BlockPoolProbe: ("take",),
        # The logs in use (native or Python). Their timing wrapper is one more frame between the pool
        # wrapper and the log, so requests are misnamed here: costs only, not rows.
        type(buffers.block_log()): ("alloc", "evict", "free", "touch", "cache", "take"),
        type(buffers.decode_log()): ("add", "take"),
    }
    for cls, names in methods.items():
        for name in names:
            setattr(cls, name, _timed(f"{cls.__name__}.{name}", getattr(cls, name)))


def wrap_step_rows() -> None:
    """The scheduler probe's decode steps in C (`StepRows`) are a name in its wrappers' globals, set at
    install: timed there, by a stand-in."""
    from vllm.v1.core.sched.scheduler import Scheduler

    envs = [Scheduler.schedule.__globals__, Scheduler.update_from_output.__globals__]
    rows = envs[0].get("rows")
    if rows is None:
        return
    stand_in = types.SimpleNamespace(decode=_timed("StepRows.decode", rows.decode), end=_timed("StepRows.end", rows.end))
    for env in envs:
        env["rows"] = stand_in


def thrash_before_schedule():
    """Put a wrapper that writes THRASH before every step around the probed Scheduler.schedule; returns
    what undoes it (before the probes are uninstalled, so they find their own wrapper to take off)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    probed = Scheduler.__dict__["schedule"]

    def schedule(self, *args, **kwargs):
        THRASH[::64] += 1
        return probed(self, *args, **kwargs)

    Scheduler.schedule = schedule
    return lambda: setattr(Scheduler, "schedule", probed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds (after one warm-up)")
    ap.add_argument("--thrash-mb", type=int, default=0, metavar="MB",
                    help="write a buffer this large before each step, untimed (64: over the CPU machine's 32 MB of L3)")
    ap.add_argument("--decode-heavy", action="store_true",
                    help="256 requests of 512 prompt tokens, 256 out, 16,000 blocks of 16 (the GPU 1B workload's steps)")
    args = ap.parse_args(argv)
    global THRASH
    THRASH = np.zeros(max(args.thrash_mb, 0) << 20, np.uint8)

    from kvtrace.demo.model import ensure_tiny_model
    from kvtrace.record.recorder import Recorder

    model = str(ensure_tiny_model())
    if args.decode_heavy:
        cfg = host.DrivenConfig(num_blocks=16000, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048)
        prompts, max_tokens = host.shared_prefix_prompts(256, 8, 0, 512), 256
    else:  # bench_host_probes' default workload
        cfg = host.DrivenConfig(num_blocks=900, max_num_seqs=256, max_num_batched_tokens=2048)
        prompts, max_tokens = host.shared_prefix_prompts(512, 8, 512, 64), 96
    wrap_handlers()
    with tempfile.TemporaryDirectory(prefix="kvtrace-probe-costs-") as tmp:
        rec = Recorder(Path(tmp) / "session", "engine", {})
        for i in range(args.rounds + 1):
            probes = host.install_probes(rec, host.HOST_PROBES)
            wrap_step_rows()
            unthrash = thrash_before_schedule() if THRASH.size else None
            TOTAL.clear()
            CALLS.clear()
            TIMES.clear()
            _, c = host.run_round(model, cfg, prompts, 256, max_tokens)
            if unthrash is not None:
                unthrash()
            host.uninstall_probes(probes)
            if i == 0:
                continue  # warm-up
            print(f"round {i}: {c.steps} steps, scheduler thread {c.main_cpu:.3f} CPU-s, process {c.cpu:.3f} CPU-s")
            timed = sum(TOTAL.values())
            print(f"  {'handler':34s} {'ms':>8s} {'% of thread':>12s} {'calls':>7s} {'us/call':>8s} {'median':>7s}")
            for label in sorted(TOTAL, key=TOTAL.get, reverse=True):
                print(f"  {label:34s} {TOTAL[label] * 1e3:8.2f} {TOTAL[label] / c.main_cpu * 100:11.2f}% "
                      f"{CALLS[label]:7d} {TOTAL[label] / CALLS[label] * 1e6:8.2f} {np.median(TIMES[label]) * 1e6:7.2f}")
            print(f"  (nested labels overlap: a probe's take includes its log's take, on_schedule a DecodeLog.add; "
                  f"sum {timed * 1e3:.1f} ms)")
        rec.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
