"""Cost of the host probes (scheduler, kv_blocks, prefix_cache, connector) on vLLM's real scheduler.

    python bench/bench_host_probes.py                  # the benchmark (~2 min on 2 cores; ~4 on a slow day)
    python bench/bench_host_probes.py --processes 10   # a narrower interval (~3.5 min)
    python bench/bench_host_probes.py --processes 1    # one process only (~20-40 s; noisier, see below)
    python bench/bench_host_probes.py --profile on     # cProfile of one round with the probes on

Drives vLLM's own `Scheduler` + `KVCacheManager` + `BlockPool` (tests/helpers/driven_scheduler.py: the VllmConfig
of the tiny model, a real KVCacheConfig, requests hashed with the engine's block hasher) with made-up
model outputs, so the step is scheduling only: the worst case for the probes' relative cost (a real step
adds the forward pass). Workload: `--concurrency` (256) requests in flight at all times (a finished
request is replaced at once) out of `--requests` in all; prompts come in 8 families sharing a long prefix
(half of it shared by all families), so the prefix cache hits; the KV pool (`--num-blocks`) is small
enough to preempt.

Each round builds a fresh scheduler and runs the whole workload; rounds alternate probes off / on in one
process (probes installed with a real `Recorder` writing Arrow shards to a temporary session, in the
background, as in a recorded engine, and removed with `probe.uninstall()`). An on-round ends by flushing
the recorder inside its timed window: the writer's work for that round's rows (Arrow conversion, IPC
serialisation, the file writes) is charged to it. Before 2026-11-23 it was not, and the last ~0.5 s of
each on-round's rows were written during the next off-round, which understated the overhead by ~3-4 points.
The rounds run in `--processes` (5) processes one after the other, `--rounds` (6) each way per process
after a warm-up, in the order off, on, off, ..., on, off.

The verdict: each on-round's CPU time against the mean of the off-rounds on either side of it (so a
drift of the machine's speed over a few rounds cancels), the median of those figures over all processes,
and a 95% interval for that median from a bootstrap that resamples processes, then their rounds. MET when
the whole interval is at or under the target, MISSED when it is all over it (or a count differs from
vLLM's, or a row was dropped), NOT RESOLVED when it spans the target: on this project's shared 2-core
machines one process's figure moves by about +-2 points with the same code, as much as the target itself.
The same rounds give an A/A figure (each off-round against the off-round two rounds earlier): what the
machine's noise alone does to a ratio of rounds, printed next to the verdict. Also prints each process's
figures, the rows recorded against what vLLM itself counted, drops, and a final table.

Two clocks: wall-clock steps/s (what the issue asks for) and steps per CPU-second of the whole process
(probes, and the recorder's writer thread, included). On a shared 2-core machine the wall clock mostly
measures the neighbours; the CPU figure is the one to compare. For attribution below the noise,
count instructions instead: bench/count_instructions.py runs the same rounds under callgrind.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtrace.record.recorder import FLUSH_INTERVAL_S  # noqa: E402
from tests.helpers.driven_scheduler import (  # noqa: E402
    HOST_PROBES,
    DrivenConfig,
    DrivenScheduler,
    install_probes,
    shared_prefix_prompts,
    uninstall_probes,
)

TARGET_PCT = 3.0


class Counters:
    """What vLLM itself says happened in a round (for the every-event-recorded check), and its times."""

    def __init__(self) -> None:
        self.steps = self.scheduled = self.preemptions = self.finished = 0
        self.lookups = self.queries = self.hits = 0
        self.wall = self.cpu = self.main_cpu = self.finish_cpu = 0.0


class Workload:
    """One scheduler's run of the workload (also bench_host_steps.py's): the first `concurrency`
    requests, then the next one each time one finishes; `step()` runs one engine step and adds what
    vLLM reports to `counters`."""

    def __init__(self, d: DrivenScheduler, prompts: list[list[int]], concurrency: int, max_tokens: int):
        self.d, self.prompts, self.max_tokens = d, prompts, max_tokens
        self.counters = Counters()
        for i in range(concurrency):
            d.add(f"r{i}", prompts[i], max_tokens)
        self.next = concurrency

    def step(self) -> None:
        d, c = self.d, self.counters
        out = d.step()
        c.steps += 1
        c.scheduled += len(out.num_scheduled_tokens)
        c.preemptions += len(out.preempted_req_ids)
        for eco in d.outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    c.finished += 1
                    if self.next < len(self.prompts):
                        d.add(f"r{self.next}", self.prompts[self.next], self.max_tokens)
                        self.next += 1
            if eco.scheduler_stats is not None:
                p = eco.scheduler_stats.prefix_cache_stats
                c.lookups += p.requests + p.preempted_requests
                c.queries += p.queries + p.preempted_queries
                c.hits += p.hits + p.preempted_hits


def run_round(model: str, cfg: DrivenConfig, prompts: list[list[int]], concurrency: int,
              max_tokens: int, finish: Callable[[], None] | None = None,
              before: Callable[[], None] | None = gc.collect) -> tuple[float, Counters]:
    """One whole workload on a fresh scheduler; returns (CPU seconds spent stepping, counters).

    `before` runs just before the timed window (a full garbage collection, so that no round inherits
    another's garbage). `finish` runs at the end, inside the timed window: the on-rounds flush the
    recorder there, so the writer's work for a round's rows is charged to that round, not left to the
    next (an off-round)."""
    w = Workload(DrivenScheduler(model, cfg), prompts, concurrency, max_tokens)
    c = w.counters
    if before is not None:
        before()
    t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    while w.d.has_work():
        w.step()
    if finish is not None:
        f0 = time.thread_time()
        finish()
        c.finish_cpu = time.thread_time() - f0
    c.wall = time.perf_counter() - t0
    c.cpu = time.process_time() - c0  # every thread of the process: the probes and the shard writer
    c.main_cpu = time.thread_time() - m0  # the scheduler's thread only
    return c.cpu, c


def measure(args: argparse.Namespace, verbose: bool = True) -> dict:
    """Interleaved off/on rounds in this process; returns medians, the paired ratio, the per-thread
    split and the row checks (every recorded count against vLLM's own)."""
    from kvtrace.demo.model import ensure_tiny_model
    from kvtrace.record.recorder import Recorder

    names = tuple(n for n in args.probes.split(",") if n)
    model = str(ensure_tiny_model())
    cfg = DrivenConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.concurrency,
                       max_num_batched_tokens=2048)
    prompts = shared_prefix_prompts(args.requests, 8, args.prefix_tokens, args.suffix_tokens)
    tmp = tempfile.TemporaryDirectory(prefix="kvtrace-bench-host-")
    rec = Recorder(Path(tmp.name) / "session", "engine", {"flush_interval_s": args.flush_interval})
    results: dict[str, list[Counters]] = {"off": [], "on": []}
    expected = Counters()
    # off, on, off, on, ..., off: every measured on-round has an off-round on either side (ABA), so a
    # drift of the machine's speed over a few rounds cancels out of its ratio.
    for i, mode in enumerate(["off", "on"] * (args.rounds + 1) + ["off"]):
        probes = install_probes(rec, names) if mode == "on" else []
        _, c = run_round(model, cfg, prompts, args.concurrency, args.max_tokens,
                         finish=rec.flush if mode == "on" else None)
        uninstall_probes(probes)
        warm = i < 2
        if verbose:
            print(f"  round {i // 2:2d} {mode:3s}: {c.steps} steps, {c.wall:6.3f} s wall = {c.steps / c.wall:6.1f} "
                  f"steps/s, {c.cpu:6.3f} s CPU = {c.steps / c.cpu:6.1f} steps/CPU-s (preemptions {c.preemptions}, "
                  f"prefix hits {c.hits}/{c.queries} tokens){'  [warm-up]' if warm else ''}", flush=True)
        if mode == "on":  # every on-round's rows are in the recorder, warm-up included
            for k in ("steps", "scheduled", "preemptions", "finished", "lookups", "queries", "hits"):
                setattr(expected, k, getattr(expected, k) + getattr(c, k))
        if not warm:
            results[mode].append(c)
    rec.close()
    # Rows as ingest would store them: decode rows come as decode_runs, each expanded into its rows.
    from kvtrace.format.shards import stored_rows

    stored = stored_rows(rec.dir)
    tmp.cleanup()

    def median_rate(mode: str, clock: str) -> float:
        return statistics.median(c.steps / getattr(c, clock) for c in results[mode])

    offs, ons = results["off"], results["on"]
    # Each on-round's CPU time over the mean of the off-rounds on either side; and, from the same rounds,
    # each off-round over the one two rounds before it: an A/A figure, what the machine alone does to a
    # ratio of rounds this far apart (it should be ~0).
    aba = [on.cpu / ((a.cpu + b.cpu) / 2) * 100 - 100 for a, on, b in zip(offs, ons, offs[1:])]
    aa = [b.cpu / a.cpu * 100 - 100 for a, b in zip(offs, offs[1:])]

    # Where the extra CPU goes: the probes' handlers on the scheduler's thread, and the recorder's
    # writing (Arrow conversion, IPC serialisation, file writes: its writer thread, plus the final
    # flush, which runs on the scheduler's thread), in ms per round (medians).
    def extra(part) -> float:
        return (statistics.median(map(part, results["on"])) - statistics.median(map(part, results["off"]))) * 1e3

    rows = rec.rows_written
    return {
        "wall_off": median_rate("off", "wall"), "wall_on": median_rate("on", "wall"),
        "cpu_off": median_rate("off", "cpu"), "cpu_on": median_rate("on", "cpu"),
        # median over rounds of on/off CPU time of adjacent rounds
        "paired_pct": statistics.median(on.cpu / off.cpu for off, on in zip(results["off"], results["on"])) * 100 - 100,
        "aba_pct": aba, "aa_pct": aa,
        "handlers_ms": extra(lambda c: c.main_cpu - c.finish_cpu),
        "writing_ms": extra(lambda c: c.cpu - c.main_cpu + c.finish_cpu),
        "off_cpu_ms": statistics.median(c.cpu for c in results["off"]) * 1e3,
        "rows": dict(rows), "drops": sum(n for per in rec.dropped.values() for n in per.values()),
        "checks": [("steps", rows["steps"], expected.steps),
                   ("step_requests", stored.get("step_requests", 0), expected.scheduled),
                   ("preemptions", rows["preemptions"], expected.preemptions),
                   ("prefix_lookups", rows["prefix_lookups"], expected.lookups)],
    }


def median_interval(groups: list[list[float]], draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """The median of all values, and a 95% interval for it: bootstrap resampling processes, then each
    chosen process's rounds (rounds of one process share its memory layout, so they are not independent
    draws; the processes are)."""
    import random

    rng = random.Random(seed)
    values = [v for g in groups for v in g]
    meds = []
    for _ in range(draws):
        sample = []
        for g in rng.choices(groups, k=len(groups)):
            sample.extend(rng.choices(g, k=len(g)))
        meds.append(statistics.median(sample))
    meds.sort()
    return statistics.median(values), meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def overhead_pct(r: dict, clock: str) -> float:
    """Extra time per step with the probes, in % of the time without (from steps/s medians)."""
    return (r[f"{clock}_off"] / r[f"{clock}_on"] - 1) * 100


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The workload's options (also bench_host_steps.py's): its defaults are the workload both measure."""
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--prefix-tokens", type=int, default=512, help="shared prefix per family (tokens)")
    ap.add_argument("--suffix-tokens", type=int, default=64, help="own prompt tail per request (tokens)")
    ap.add_argument("--max-tokens", type=int, default=96, help="output tokens per request")
    ap.add_argument("--num-blocks", type=int, default=900, help="KV pool (blocks of --block-size tokens)")
    ap.add_argument("--block-size", type=int, default=32, help="tokens per KV block (vLLM's CUDA default is 16)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=5,
                    help="processes, one after the other, each with its own interleaved rounds (1: this one)")
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds per mode and process (after a warm-up)")
    add_workload_args(ap)
    ap.add_argument("--profile", choices=("on", "off"), help="cProfile one round in this mode, then stop")
    ap.add_argument("--profile-dump", help="with --profile: also write the pstats file here")
    ap.add_argument("--profile-only", default="",
                    help="with --profile: list only functions whose file or name contains this (e.g. kvtrace)")
    ap.add_argument("--probes", default=",".join(HOST_PROBES),
                    help="which host probes the on-rounds install (comma-separated; to attribute the cost)")
    ap.add_argument("--flush-interval", type=float, default=FLUSH_INTERVAL_S,
                    help="the recorder's writer flushes this often (s; the recorder's default); a value longer than a round leaves all "
                         "the writing to the round's final flush (to see what the writer thread costs the rest)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one process's rounds, as JSON
    args = ap.parse_args(argv)

    if args.profile:
        return profile(args)
    if args.child:
        print(json.dumps(measure(args, verbose=False)))
        return 0
    from kvtrace.record.buffers import NATIVE_MISSING, native

    print(f"workload: {args.requests} requests, {args.concurrency} in flight, prefix {args.prefix_tokens} + "
          f"{args.suffix_tokens} tokens, {args.max_tokens} out, pool {args.num_blocks} blocks of {args.block_size}; "
          f"hot path {'native' if native() else 'python: ' + NATIVE_MISSING}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    if args.processes <= 1:
        runs = [measure(args)]
    else:
        runs = []
        given = list(argv if argv is not None else sys.argv[1:])
        child_args = []  # the same arguments less --processes (as "--processes N" or "--processes=N")
        while given:
            a = given.pop(0)
            if a == "--processes" and given:
                given.pop(0)
            elif not a.startswith("--processes="):
                child_args.append(a)
        for k in range(args.processes):
            out = subprocess.run([sys.executable, __file__, *child_args, "--child"], capture_output=True,
                                 text=True, cwd=REPO)
            if out.returncode != 0:
                raise SystemExit(f"process {k} failed:\n{out.stderr[-3000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(r)
            print(f"  process {k}: off {r['cpu_off']:.1f} / on {r['cpu_on']:.1f} steps per CPU-s: "
                  f"{overhead_pct(r, 'cpu'):+.1f}% (paired {r['paired_pct']:+.1f}%), wall {overhead_pct(r, 'wall'):+.1f}%; "
                  f"handlers {r['handlers_ms']:+.1f} ms, writing {r['writing_ms']:+.1f} ms a round; "
                  f"on against the offs either side {statistics.median(r['aba_pct']):+.1f}%, "
                  f"A/A {statistics.median(r['aa_pct']):+.1f}%", flush=True)

    checks = [(name, sum(r["checks"][i][1] for r in runs), sum(r["checks"][i][2] for r in runs))
              for i, (name, _, _) in enumerate(runs[0]["checks"])]
    drops = sum(r["drops"] for r in runs)
    rows = {t: sum(r["rows"][t] for r in runs) for t in runs[0]["rows"]}
    print("\nrows recorded (all on-rounds) vs vLLM's own counts:")
    for name, got, want in checks:
        print(f"  {name:15s} {got:9d}  vLLM {want:9d}  {'ok' if got == want else 'MISMATCH'}")
    for name in ("decode_runs", "block_events", "request_events"):
        print(f"  {name:15s} {rows[name]:9d}" + ("  (step_requests' decode rows, as runs)" if name == "decode_runs" else ""))
    print(f"  drops: {drops}")

    med = statistics.median
    cpu_ovh = med(overhead_pct(r, "cpu") for r in runs)
    wall_ovh = med(overhead_pct(r, "wall") for r in runs)
    paired = med(r["paired_pct"] for r in runs)
    handlers_ms, writing_ms = med(r["handlers_ms"] for r in runs), med(r["writing_ms"] for r in runs)
    off_cpu_ms = med(r["off_cpu_ms"] for r in runs)
    n = f"{len(runs)} process{'es' if len(runs) > 1 else ''} x {args.rounds} rounds"
    print(f"\n| probes | steps/s, wall ({n}) | steps per CPU-second | rows recorded | drops |")
    print("|---|---|---|---|---|")
    print(f"| off | {med(r['wall_off'] for r in runs):.1f} | {med(r['cpu_off'] for r in runs):.1f} | - | - |")
    print(f"| on  | {med(r['wall_on'] for r in runs):.1f} ({wall_ovh:+.1f}%) | {med(r['cpu_on'] for r in runs):.1f} "
          f"({cpu_ovh:+.1f}%; paired {paired:+.1f}%) | {sum(rows.values())} | {drops} |")
    if len(runs) > 1:
        print(f"(medians over processes; per process the CPU overhead ranged "
              f"{min(overhead_pct(r, 'cpu') for r in runs):+.1f}% to {max(overhead_pct(r, 'cpu') for r in runs):+.1f}%)")
    print(f"\nextra CPU per round (medians): probe handlers {handlers_ms:+.1f} ms "
          f"({handlers_ms / off_cpu_ms * 100:+.1f}% of an off-round), writing the rows {writing_ms:+.1f} ms "
          f"({writing_ms / off_cpu_ms * 100:+.1f}%)")
    est, lo, hi = median_interval([r["aba_pct"] for r in runs])
    aa, aa_lo, aa_hi = median_interval([r["aa_pct"] for r in runs])
    print(f"\nCPU overhead, each on-round against the off-rounds either side of it: median {est:+.1f}%, "
          f"95% interval {lo:+.1f}% to {hi:+.1f}% ({sum(len(r['aba_pct']) for r in runs)} rounds)")
    print(f"A/A, the same rounds' off against off: median {aa:+.1f}%, 95% interval {aa_lo:+.1f}% to {aa_hi:+.1f}% "
          f"(what this machine's noise alone gives)")
    exact = drops == 0 and all(g == w for _, g, w in checks)
    # The verdict follows the interval: a median under the target with an interval that reaches over it
    # is not a measurement of the target (on a shared machine the spread is often wider than the gap).
    verdict = "MET" if exact and hi <= TARGET_PCT else "MISSED" if not exact or lo > TARGET_PCT else "NOT RESOLVED"
    print(f"\ntarget <= {TARGET_PCT}% (CPU time per step: the 95% interval above), 0 drops, every event recorded: "
          f"{verdict}" + (" (the interval spans the target: run again on a quieter machine, or with more "
                           "--processes)" if verdict == "NOT RESOLVED" else ""))
    return 0 if verdict == "MET" else 1


def profile(args: argparse.Namespace) -> int:
    """cProfile of one round in `args.profile` mode."""
    import cProfile
    import pstats

    from kvtrace.demo.model import ensure_tiny_model
    from kvtrace.record.recorder import Recorder

    names = tuple(n for n in args.probes.split(",") if n)
    cfg = DrivenConfig(num_blocks=args.num_blocks, block_size=args.block_size, max_num_seqs=args.concurrency,
                       max_num_batched_tokens=2048)
    prompts = shared_prefix_prompts(args.requests, 8, args.prefix_tokens, args.suffix_tokens)
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-host-") as tmp:
        rec = Recorder(Path(tmp) / "session", "engine", {})
        probes = install_probes(rec, names) if args.profile == "on" else []
        prof = cProfile.Profile()
        prof.enable()
        run_round(str(ensure_tiny_model()), cfg, prompts, args.concurrency, args.max_tokens)
        prof.disable()
        uninstall_probes(probes)
        rec.close()
    if args.profile_dump:
        prof.dump_stats(args.profile_dump)
    stats = pstats.Stats(prof).sort_stats("tottime")
    if args.profile_only:
        stats.sort_stats("ncalls").print_stats(args.profile_only, 40)
    else:
        stats.print_stats(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
