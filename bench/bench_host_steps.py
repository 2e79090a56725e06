"""Cost of the host probes, step by step: identical schedulers stepped in turn, the probes on one of them.

    python bench/bench_host_steps.py                 # 12 rounds (~2 min on 2 cores)
    python bench/bench_host_steps.py --rounds 30     # a narrower interval (~5 min)
    python bench/bench_host_steps.py --probes kv_blocks   # one probe's part
    python bench/bench_host_steps.py --null-patches  # control: the method's own bias (~0)
    python bench/bench_host_steps.py --disabled      # the probes' wrappers alone, switched off
    python bench/bench_host_steps.py --thrash-mb 64  # each step with the caches cold, as in an engine

Why a second benchmark. bench_host_probes.py compares whole rounds (one workload on a fresh scheduler,
0.4-1.5 s each) with the probes off and on. On a quiet machine its rounds agree to +-1%; on a slow,
shared VM they differ by 10-20% with the same code (its A/A figure), and no practical number of rounds
narrows its interval to the 1-point scale of the 3% target. Much of that noise is slow (a neighbour's
load, the host's clocks), so it cancels between things timed close together. Here each round builds
three schedulers for the same workload (bench_host_probes' default: 256 requests in flight, shared
prefixes, preemptions), in each of the six orders in turn (round r: the (r mod 6)th; use a multiple of
six rounds), and steps them in turns of `--run` steps, in an order shuffled at every turn:

- `on`: the probes installed as in an engine (a real `Recorder` writing Arrow shards, in the background);
- `off` and `off2`: vLLM's own methods. The probes patch vLLM's classes, so their patches are put on
  before each of `on`'s turns and taken off before the others' (`Patches`): none of the probes' code
  runs for `off` and `off2`, not even a disabled wrapper. (All three are instances of vLLM's own
  classes: objects of different classes meeting in the same vLLM code make CPython 3.11's specialised
  instructions miss in turn, which cost ~1% a step whatever the probes did. Switching a built object's
  `__class__` is worse: its attributes are then read ~2x slower.)

Timing. Putting patches on or off changes the classes' versions, so the first `--warm` step(s) of a turn
re-specialise vLLM's code and are not timed, for any scheduler. The classes are written before every
turn of every scheduler, changed or not, so that vLLM's code re-specialises as often for each (see
`Patches`; written only when they changed, they cost `on` an extra +0.2-0.4%). Every other step (with the requests added
after it, as a client would) is timed on the scheduler thread's CPU clock. The recorder's writer thread
is timed on its own CPU clock, with each round's final flush; it writes the rows of all of `on`'s steps,
so `on` is charged its share for the steps timed. The schedulers share the wall clock (`on` steps for a
third of each second), so the probes' and the recorder's wall-clock intervals (the logs' hand-overs, the
writer's flushes, proc.json's refresh) are stretched threefold: they come as often per step of `on` as
in an engine (unstretched, the writer's part read 3x too high).

The figure is the extra CPU of `on` over `off` per timed step, with a 95% bootstrap interval over blocks
of `--block` turns. `off2` against `off` is the A/A figure of the same steps: what the method gives with no
probe (~0). Every recorded count is checked against vLLM's own, as in bench_host_probes.py, and the
verdict follows its rule: MET when the whole interval is at or under the target.

What the method changes: after another scheduler's turn, a step starts with that scheduler's data in the
caches where an engine would find its own last step's (it runs the forward pass or waits on the workers
in between); the untimed first step of each turn brings the scheduler's own data back. `--thrash-mb`
writes a buffer larger than the last-level cache before every step (untimed, every scheduler alike), so
each step finds its own data and the probes' cold, as an engine's scheduler does after a forward pass:
the probes' cost is then nearer the GPU engine thread's (their code and rows are cache misses too).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

# bench_host_probes, beside this file: the same workload (it puts the repository on the path, and its
# names from tests/helpers/driven_scheduler.py are the ones used here).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_host_probes import (  # noqa: E402
    FLUSH_INTERVAL_S,
    HOST_PROBES,
    TARGET_PCT,
    DrivenConfig,
    DrivenScheduler,
    Workload,
    add_workload_args,
    install_probes,
    shared_prefix_prompts,
    uninstall_probes,
)

MODES = ("on", "off", "off2")
BUILD_ORDERS = list(itertools.permutations(MODES))


class Patches:
    """The probes' patches, put on and taken off vLLM's classes between turns: `on` steps with them,
    `off` and `off2` with vLLM's original methods, so none of the probes' code runs for those (not even
    a disabled wrapper). All three schedulers are instances of the same classes: on CPython 3.11, objects
    of different classes (say, subclasses holding the original methods) passing through the same vLLM
    code make its specialised instructions miss in turn, which cost a scheduler ~1% per step here
    whatever the probes did.

    Every turn starts with the classes written (`set`), whether their methods change or not. Writing a
    class attribute changes the class's version, so every specialised attribute read on its instances
    (all of vLLM's scheduler code) misses and runs the generic path until CPython re-specialises it, after
    ~50 misses for each instruction: vLLM's once-a-step code runs slower for many steps after a write.
    Written only when they changed, the classes were written before nearly every turn of `on` and about
    half of the others', which alone cost `on` +0.20% [95% interval +0.06, +0.34] (the Scheduler's
    patches) to +0.38% [+0.20, +0.56] (all) with vLLM's own functions put back in place of the patches
    (`--null-patches`, no probe code at all; docs/performance.md, "Host probes"). Written at every
    turn, they cost every scheduler alike."""

    def __init__(self, probes: list, null: bool = False):
        self.patched, self.original = [], []
        seen = set()
        for probe in probes:
            for owner, attr, original in probe._patches:
                if (owner, attr) in seen:  # patched twice: the first patch saw vLLM's own
                    continue
                seen.add((owner, attr))
                # --null-patches: `on` gets vLLM's own methods too (the writes' cost alone)
                self.patched.append((owner, attr, original if null else owner.__dict__[attr]))
                self.original.append((owner, attr, original))

    def set(self, on: bool) -> None:
        for owner, attr, value in self.patched if on else self.original:
            setattr(owner, attr, value)


def thread_clock(thread: threading.Thread | None):
    """A function reading `thread`'s CPU time (ns); 0 when there is none."""
    if thread is None or thread.ident is None:
        return lambda: 0
    clock = time.pthread_getcpuclockid(thread.ident)
    return lambda: time.clock_gettime_ns(clock)


def run_round(args, model: str, cfg: DrivenConfig, prompts: list, rec, names: tuple, order_seed: int) -> dict:
    """One workload on three fresh schedulers stepped in turn; per block of steps, ns of CPU per mode."""
    probes = install_probes(rec, names)
    patches = Patches(probes, null=args.null_patches)
    for probe in probes if args.disabled else ():
        probe.enabled = False  # the wrappers in place, each returning through its first line
    feeders = {}
    rng = random.Random(order_seed)
    # Built in each of the six orders in turn, round after round: the order they are built in favours
    # one of them (with --thrash-mb 64 on the CPU machine, --null-patches read +104 us [+49, +161] a step
    # with a seeded shuffle that built `on` first in four rounds of five); over a multiple of six rounds
    # each is built first, second and last equally often.
    for mode in BUILD_ORDERS[order_seed % len(BUILD_ORDERS)]:
        patches.set(mode == "on")
        feeders[mode] = Workload(DrivenScheduler(model, cfg), prompts, args.concurrency, args.max_tokens)
    spin_ns = int(args.calibrate * 1000)  # --calibrate: CPU burnt in each of `on`'s timed steps
    # --thrash-mb: every cache line of a buffer larger than the last-level cache written before each step
    # (untimed, every scheduler alike): the step then finds the caches as an engine's scheduler does after
    # the forward pass, its own data and the probes' cold
    thrash = np.zeros(max(args.thrash_mb, 0) << 20, np.uint8)
    writer = thread_clock(getattr(rec, "_thread", None))
    blocks: list[dict[str, int]] = []
    cur = dict.fromkeys((*MODES, "writer"), 0)  # ns of CPU; "writer": the recorder's part of "on"
    gc.collect()
    w0 = writer()
    n = timed = 0  # turns, and steps timed (per scheduler)
    clock = time.thread_time_ns
    while any(f.d.has_work() for f in feeders.values()):
        order = list(MODES)
        rng.shuffle(order)
        for mode in order:  # a turn each: --run steps in a row, the first --warm of them not timed
            f = feeders[mode]
            patches.set(mode == "on")  # every turn: the next step re-specialises vLLM's code (--warm)
            for j in range(args.run):
                if not f.d.has_work():
                    break
                if thrash.size:
                    thrash[::64] += 1
                if j < args.warm:
                    f.step()
                    continue
                t0 = clock()
                f.step()
                if spin_ns and mode == "on":  # a cost of known size, on top of the step's
                    until = clock() + spin_ns
                    while clock() < until:
                        pass
                cur[mode] += clock() - t0
                timed += mode == "on"
        n += 1
        if n % args.block == 0:
            w1 = writer()
            cur["writer"] += w1 - w0
            w0 = w1
            blocks.append(cur)
            cur = dict.fromkeys((*MODES, "writer"), 0)
    patches.set(True)  # as install_probes left them, for uninstall_probes
    t0 = clock()
    rec.flush()  # the writer's work for this round's rows, charged to it
    cur["writer"] += clock() - t0 + writer() - w0
    if blocks:  # the tail (fewer than --block turns) and the flush go with the last block
        for mode in cur:
            blocks[-1][mode] += cur[mode]
    else:  # a round of fewer turns than a block: one block
        blocks.append(cur)
    uninstall_probes(probes)
    steps = {m: f.counters.steps for m, f in feeders.items()}
    if len(set(steps.values())) != 1:
        raise SystemExit(f"the schedulers took different numbers of steps ({steps}): the workload is not "
                         "deterministic, so steps cannot be compared")
    on = feeders["on"].counters
    # The writer's work is for the rows of all of `on`'s steps; only `timed` of them are timed: charge
    # it that share.
    for b in blocks:
        b["writer"] = round(b["writer"] * timed / on.steps)
        b["on"] += b["writer"]
    return {"blocks": blocks, "timed": timed, "steps": on.steps, "scheduled": on.scheduled, "preemptions": on.preemptions,
            "lookups": on.lookups}


def ratio_interval(blocks: list[dict[str, int]], a: str, b: str, draws: int = 4000,
                   seed: int = 0) -> tuple[float, float, float]:
    """Extra CPU of mode `a` over mode `b`, in %, over all blocks, and a 95% bootstrap interval
    (blocks resampled)."""
    rng = random.Random(seed)
    est = sum(x[a] for x in blocks) / sum(x[b] for x in blocks) * 100 - 100
    figures = []
    for _ in range(draws):
        sample = rng.choices(blocks, k=len(blocks))
        figures.append(sum(x[a] for x in sample) / sum(x[b] for x in sample) * 100 - 100)
    figures.sort()
    return est, figures[int(0.025 * draws)], figures[int(0.975 * draws) - 1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds (after a warm-up round)")
    ap.add_argument("--run", type=int, default=2, help="steps a scheduler takes in a row (a turn)")
    ap.add_argument("--warm", type=int, default=1,
                    help="steps at the start of each turn that are not timed (they find the caches holding "
                         "the other schedulers' data, where an engine finds its own last step's)")
    ap.add_argument("--block", type=int, default=10, help="turns per block (the bootstrap's unit)")
    add_workload_args(ap)  # bench_host_probes' workload
    ap.add_argument("--probes", default=",".join(HOST_PROBES), help="which host probes `on` installs")
    ap.add_argument("--flush-interval", type=float, default=FLUSH_INTERVAL_S,
                    help="the recorder's writer flushes this often (s; the recorder's default)")
    ap.add_argument("--calibrate", type=float, default=0.0, metavar="US",
                    help="also burn US microseconds of CPU in each of `on`'s steps: a cost of known size, to check "
                         "that the method reads it (with --probes '' it is all there is)")
    ap.add_argument("--thrash-mb", type=int, default=0, metavar="MB",
                    help="write every cache line of a buffer this large before each step, untimed, for every scheduler "
                         "(64: more than the CPU machine's 32 MB of L3): the steps then run with the caches cold, as "
                         "a scheduler's do between an engine's forward passes; the extra is also printed in us a step")
    ap.add_argument("--null-patches", action="store_true",
                    help="control: `on` installs the probes but steps with vLLM's own methods put back in their place "
                         "(classes written as at every turn, no probe code runs; reads the method's own bias, ~0)")
    ap.add_argument("--disabled", action="store_true",
                    help="`on` installs the probes switched off: each wrapper returns through its first line and the "
                         "block-pool hooks (C) call vLLM's method alone; what remains of the probes when off "
                         "(profile_engine_thread.py --ab-pause all compares against that)")
    args = ap.parse_args(argv)
    if args.disabled and args.null_patches:
        ap.error("--disabled and --null-patches are two different controls: one at a time")

    from kvtrace.record import buffers, recorder

    # The schedulers share the wall clock: in a second, `on` steps for a third of it. The probes' and the
    # recorder's wall-clock intervals (the logs' hand-overs, the writer's flushes, proc.json's refresh)
    # are stretched as much, so that they come as often per step of `on` as in an engine.
    stretch = len(MODES)
    intervals = buffers.FLUSH_NS, recorder.PROC_REFRESH_S
    buffers.FLUSH_NS, recorder.PROC_REFRESH_S = int(intervals[0] * stretch), intervals[1] * stretch
    try:
        return measure(args, stretch)
    finally:  # as they were (a test calls main() in a process that goes on)
        buffers.FLUSH_NS, recorder.PROC_REFRESH_S = intervals


def measure(args: argparse.Namespace, stretch: int) -> int:
    from kvtrace.demo.model import ensure_tiny_model
    from kvtrace.format.shards import stored_rows
    from kvtrace.record.buffers import NATIVE_MISSING, native
    from kvtrace.record.recorder import Recorder

    names = tuple(n for n in args.probes.split(",") if n)
    model = str(ensure_tiny_model())
    cfg = DrivenConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.concurrency,
                       max_num_batched_tokens=2048)
    prompts = shared_prefix_prompts(args.requests, 8, args.prefix_tokens, args.suffix_tokens)
    print(f"workload: {args.requests} requests, {args.concurrency} in flight, prefix {args.prefix_tokens} + "
          f"{args.suffix_tokens} tokens, {args.max_tokens} out, pool {args.num_blocks} blocks of {args.block_size}; "
          f"probes {','.join(names) or '(none)'}; hot path {'native' if native() else 'python: ' + NATIVE_MISSING}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    tmp = tempfile.TemporaryDirectory(prefix="kvtrace-bench-steps-")
    rec = Recorder(Path(tmp.name) / "session", "engine", {"flush_interval_s": args.flush_interval * stretch})
    blocks: list[dict[str, int]] = []
    steps = 0  # timed steps per scheduler, all rounds
    expected = dict.fromkeys(("steps", "scheduled", "preemptions", "lookups"), 0)
    for r in range(args.rounds + 1):
        res = run_round(args, model, cfg, prompts, rec, names, order_seed=r)
        for k in expected:
            expected[k] += res[k]
        if r == 0:
            print(f"  warm-up round: {res['steps']} steps", flush=True)
            continue
        blocks.extend(res["blocks"])
        steps += res["timed"]
        tot = {m: sum(b[m] for b in res["blocks"]) / 1e9 for m in (*MODES, "writer")}
        print(f"  round {r:2d}: {res['steps']} steps; CPU s: on {tot['on']:.3f}, off {tot['off']:.3f}, off2 "
              f"{tot['off2']:.3f}; writer {tot['writer'] * 1e3:.1f} ms ({tot['on'] / tot['off'] * 100 - 100:+.1f}%; A/A "
              f"{tot['off2'] / tot['off'] * 100 - 100:+.1f}%)", flush=True)
    rec.close()
    stored = stored_rows(rec.dir)
    rows = rec.rows_written
    drops = sum(n for per in rec.dropped.values() for n in per.values())
    tmp.cleanup()

    checks = [("steps", rows["steps"], expected["steps"]),
              ("step_requests", stored.get("step_requests", 0), expected["scheduled"]),
              ("preemptions", rows["preemptions"], expected["preemptions"]),
              ("prefix_lookups", rows["prefix_lookups"], expected["lookups"])]
    if names != tuple(HOST_PROBES):  # a part of the probes records only its own tables
        checks = [c for c in checks if c[1] or c[2] == 0]
    if args.null_patches:  # no probe code ran: nothing to check, and no verdict below
        checks = []
    elif args.disabled:  # switched off, the probes record nothing at all
        checks = [(name, got, 0) for name, got, _ in checks]
    print("\nrows recorded (the `on` scheduler, all rounds) vs vLLM's own counts:"
          + (" none checked (--null-patches: no probe code ran)" if args.null_patches else "")
          + (" none expected (--disabled: the probes switched off)" if args.disabled else ""))
    for name, got, want in checks:
        print(f"  {name:15s} {got:9d}  vLLM {want:9d}  {'ok' if got == want else 'MISMATCH'}")
    print(f"  drops: {drops}")

    est, lo, hi = ratio_interval(blocks, "on", "off")
    aa, aa_lo, aa_hi = ratio_interval(blocks, "off2", "off")
    off_s = sum(b["off"] for b in blocks) / 1e9
    print(f"\n| scheduler | CPU s ({args.rounds} rounds, {steps} steps timed) | steps per CPU-s | over off [95% interval] |")
    print("|---|---|---|---|")
    figures = {"on": (est, lo, hi), "off2": (aa, aa_lo, aa_hi)}
    for mode in MODES:
        s = sum(b[mode] for b in blocks) / 1e9
        e, a, b = figures.get(mode, (None, None, None))
        over = "-" if e is None else f"{e:+.2f}% [{a:+.2f}, {b:+.2f}]"
        print(f"| {mode} | {s:.2f} | {steps / s:.1f} | {over} |")
    print(f"\nCPU overhead of the probes per step: {est:+.2f}%, 95% interval {lo:+.2f}% to {hi:+.2f}% "
          f"({len(blocks)} blocks of {args.block} turns of {args.run} steps, {args.warm} of each turn not timed; off {off_s:.1f} CPU-s in all)")
    print(f"A/A, off2 against off on the same steps: {aa:+.2f}%, 95% interval {aa_lo:+.2f}% to {aa_hi:+.2f}%")
    off_us = off_s * 1e6 / steps
    print(f"per timed step: off {off_us:.1f} us of CPU, on {off_us * (1 + est / 100):.1f}: {off_us * est / 100:+.1f} us "
          f"[{off_us * lo / 100:+.1f}, {off_us * hi / 100:+.1f}]" + (f" (caches cold: {args.thrash_mb} MB written before "
                                                                      "each step)" if args.thrash_mb else ""))
    if args.calibrate:
        expected_pct = args.calibrate * 1e3 * steps / (off_s * 1e9) * 100
        print(f"calibration: `on` burnt {args.calibrate:g} us of CPU a step, {expected_pct:+.2f}% of `off`'s CPU: "
              f"the figure above should read that much more than without it")
    if args.null_patches:
        print("\n--null-patches: the figure above is the method's own bias (vLLM's methods written back at every "
              "turn, no probe code): it should read ~0")
        return 0
    if args.disabled:
        print("\n--disabled: the figure above is what the probes' wrappers cost switched off (vLLM's calls through "
              "them, no probe code beyond the flag)")
        return 0
    exact = drops == 0 and all(g == w for _, g, w in checks)
    verdict = "MET" if exact and hi <= TARGET_PCT else "MISSED" if not exact or lo > TARGET_PCT else "NOT RESOLVED"
    print(f"\ntarget <= {TARGET_PCT}% (the 95% interval above), 0 drops, every event recorded: {verdict}"
          + (" (the interval spans the target: run more --rounds)" if verdict == "NOT RESOLVED" else ""))
    return 0 if verdict == "MET" else 1


if __name__ == "__main__":
    sys.exit(main())
