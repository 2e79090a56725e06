"""Host-probe cost in instructions: bench_host_probes' rounds under callgrind, one round per mode.

    PYTHONHASHSEED=0 valgrind --tool=callgrind --separate-threads=yes --instr-atstart=no \
        --callgrind-out-file=/tmp/kvt-cg.%p .venv/bin/python bench/count_instructions.py \
        [--modes off,all,scheduler,kv_blocks,prefix_cache]

On this project's shared 2-core machines, wall and CPU times of a round move by several percent from
run to run, more than most single changes to the probes; instruction counts much less (the same round
gives the same count to ~0.2%, nearly all of it in two functions: pymalloc's `_PyObject_Free`, whose
arena releases moved 12.5 M between two runs, and `set_lookkey`, sets hashed by address, ~2 M; compare
a change function by function without those, docs/performance.md, "Host probes"). Each mode runs one uninstrumented warm-up round, then one round with
instrumentation switched on around it (`callgrind_control -i on|off`, then a dump), and prints the
instructions of every thread of the process (the probes, and the recorder's writer: each on-round ends
with a flush inside the counted window, as in bench_host_probes).

Under valgrind a round takes ~50x longer in wall time, so work that the clock triggers (the logs'
hand-overs every 250 ms, the writer's 0.5 s flushes) would run ~50x more often per round than at full
speed, and be overstated as much (as the counts before 2026-11-24 were): `--slowdown` (50) stretches
those intervals by the same factor, so each happens about as often per round as at full speed.

Where the difference is: `callgrind_annotate --auto=no OUT.2-01` against `OUT.1-01` (mode 2 against
mode 1, the scheduler's thread), function by function. Valgrind's `--cache-sim=yes` / `--branch-sim=yes`
add cache misses and branch mispredictions per function (docs/performance.md, "Host probes").

Cache misses: the probes' extra *time* is ~3x what their instructions predict, and what accounts for it
is memory, not instructions (docs/performance.md, "Host probes"). Add a cache model whose last
level is the core's own L2 (1 MB here, `lscpu -C`), so that its misses are the accesses that go to the
shared L3 or beyond, and this script prints them per mode too:

    ... valgrind --tool=callgrind ... --cache-sim=yes --I1=32768,8,64 --D1=49152,12,64 \
        --LL=1048576,8,64 ... bench/count_instructions.py

`callgrind_annotate --show=DLmr,DLmw,ILmr --sort=DLmr` then lists them by function. The simulated
misses of the same round move by ~100 k (~4%) from run to run (the memory layout differs), so the
difference of two modes moves by 100-200 k: compare changes per function (`RowLog_append`'s misses, say),
not by the totals (docs/performance.md, "Host probes").
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_host_probes as host


def control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)


def dumped_totals(out_file: str, part: int) -> dict[int, dict[str, int]]:
    """Per thread (callgrind's thread number) of dump `part`, the count of each event it recorded (Ir:
    instructions; with a cache model also ILmr, DLmr, DLmw: last-level misses). With
    --separate-threads=yes callgrind writes OUT.PART-THREAD; without it, OUT.PART, counted as thread 1."""
    totals: dict[int, dict[str, int]] = {}
    for path in glob.glob(f"{out_file}.{part}-*") or glob.glob(f"{out_file}.{part}"):
        thread = int(path.rsplit("-", 1)[1]) if "-" in Path(path).name.rsplit(".", 1)[-1] else 1
        events: list[str] = []
        for line in Path(path).read_text(errors="replace").splitlines():
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("totals:"):
                counts = [int(c) for c in line.split()[1:]]  # callgrind leaves out trailing zeros
                totals[thread] = {ev: counts[i] if i < len(counts) else 0 for i, ev in enumerate(events)}
    return totals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="off,all",
                    help="comma-separated: off, all, disabled (all installed, switched off), or one host probe's name")
    ap.add_argument("--slowdown", type=float, default=50.0, help="stretch the probes' clocks by this factor")
    ap.add_argument("--out", default="/tmp/kvt-cg.{pid}",
                    help="valgrind's --callgrind-out-file, with %%p written {pid} (to read the dumps back)")
    ap.add_argument("--gpu-shape", action="store_true",
                    help="the GPU benchmark's workload (256 prompts of 512 tokens admitted at once, 256 out, "
                         "16-token blocks, no prefix hits or preemptions) instead of bench_host_probes' default")
    args = ap.parse_args(argv)

    from kvtrace.demo.model import ensure_tiny_model
    from kvtrace.record import buffers
    from kvtrace.record.recorder import FLUSH_INTERVAL_S, Recorder

    buffers.FLUSH_NS = int(buffers.FLUSH_NS * args.slowdown)

    model = str(ensure_tiny_model())
    if args.gpu_shape:  # bench_host_steps' "GPU benchmark's own shape" (docs/performance.md)
        cfg = host.DrivenConfig(num_blocks=40000, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048)
        prompts, max_tokens = host.shared_prefix_prompts(256, 8, 0, 512), 256
    else:  # bench_host_probes' default workload
        cfg = host.DrivenConfig(num_blocks=900, max_num_seqs=256, max_num_batched_tokens=2048)
        prompts, max_tokens = host.shared_prefix_prompts(512, 8, 512, 64), 96
    with tempfile.TemporaryDirectory(prefix="kvtrace-count-") as tmp:
        rec = Recorder(Path(tmp) / "session", "engine", {"flush_interval_s": FLUSH_INTERVAL_S * args.slowdown})
        for mode in args.modes.split(","):
            names = () if mode == "off" else host.HOST_PROBES if mode in ("all", "disabled") else (mode,)
            for counted in (False, True):
                probes = host.install_probes(rec, names) if names else []
                for probe in probes if mode == "disabled" else ():
                    probe.enabled = False  # the wrappers in place, each returning through its first line
                finish = rec.flush if names else None
                start = gc.collect
                if counted:  # the round's full collection before its window, then count the window only
                    def start() -> None:
                        gc.collect()
                        control("-z")
                        control("-i", "on")
                host.run_round(model, cfg, prompts, 256, max_tokens, finish=finish, before=start)
                if counted:
                    control("-i", "off")
                    control("-d", mode)
                host.uninstall_probes(probes)
            print(f"mode {mode}: dumped", flush=True)
        rec.close()
    out_file = args.out.format(pid=os.getpid())
    modes = args.modes.split(",")
    dumps = [(mode, dumped_totals(out_file, part)) for part, mode in enumerate(modes, 1)]
    if not any(t for _, t in dumps):
        print(f"no dumps found at {out_file}.*: run under valgrind --tool=callgrind (see --help)")
        return 1
    rows = [(mode, {t: c.get("Ir", 0) for t, c in per.items()}) for mode, per in dumps]
    print_table(f"instructions per round, millions (thread 1 = the scheduler's; the rest = the recorder's "
                f"writer and any other thread), against {modes[0]}:", rows, 1e6, "M")
    misses = [(mode, {t: c["ILmr"] + c["DLmr"] + c["DLmw"] for t, c in per.items() if "DLmr" in c})
              for mode, per in dumps]
    if any(t for _, t in misses):  # run with --cache-sim=yes
        print_table(f"last-level cache misses per round (instruction reads + data reads + data writes), "
                    f"thousands, against {modes[0]}:", misses, 1e3, "k")
    return 0


def print_table(title: str, rows: list[tuple[str, dict[int, int]]], unit: float, suffix: str) -> None:
    base = dict(rows[0][1])
    main_base, all_base = base.get(1, 0), sum(base.values())
    print(f"\n{title}")
    print("| mode | scheduler thread | other threads | all | over " + rows[0][0] + " |")
    print("|---|---|---|---|---|")
    for mode, totals in rows:
        main, total = totals.get(1, 0), sum(totals.values())
        print(f"| {mode} | {main / unit:,.1f} ({(main - main_base) / unit:+,.1f}) | {(total - main) / unit:,.1f} | "
              f"{total / unit:,.1f} | {(total - all_base) / unit:+,.1f} {suffix} "
              f"({(total / max(all_base, 1) - 1) * 100:+.2f}%) |")


if __name__ == "__main__":
    sys.exit(main())
