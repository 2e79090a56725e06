"""Host-probe cost in instructions: bench_host_probes' rounds under callgrind, one round per mode.

    PYTHONHASHSEED=0 valgrind --tool=callgrind --separate-threads=yes --instr-atstart=no \
        --callgrind-out-file=/tmp/kvt-cg.%p .venv/bin/python bench/count_instructions.py \
        [--modes off,all,scheduler,kv_blocks,prefix_cache]

On this project's shared 2-core machines, wall and CPU times of a round move by several percent from
run to run, more than most single changes to the probes; instruction counts do not (the same round
gives the same count to ~0.05%). Each mode runs one uninstrumented warm-up round, then one round with
instrumentation switched on around it (`callgrind_control -i on|off`, then a dump), and prints the
instructions of every thread of the process (the probes, and the recorder's writer: each on-round ends
with a flush inside the counted window, as in bench_host_probes).

Under valgrind a round takes ~50x longer in wall time, so work that the clock triggers (the logs'
hand-overs every 250 ms, the writer's 0.5 s flushes) would run ~50x more often per round than at full
speed, and be overstated as much (as the counts before 2026-11-24 were): `--slowdown` (50) stretches
those intervals by the same factor, so each happens about as often per round as at full speed.

Where the difference is: `callgrind_annotate --auto=no OUT.2-01` against `OUT.1-01` (mode 2 against
mode 1, the scheduler's thread), function by function. Valgrind's `--cache-sim=yes` / `--branch-sim=yes`
add cache misses and branch mispredictions per function (docs/performance.md, "Tenth session").
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


def dumped_totals(out_file: str, part: int) -> dict[int, int]:
    """Instructions per thread (callgrind's thread number) of dump `part` (with --separate-threads=yes,
    callgrind writes OUT.PART-THREAD; without it, OUT.PART, counted as thread 1)."""
    totals: dict[int, int] = {}
    for path in glob.glob(f"{out_file}.{part}-*") or glob.glob(f"{out_file}.{part}"):
        thread = int(path.rsplit("-", 1)[1]) if "-" in Path(path).name.rsplit(".", 1)[-1] else 1
        for line in Path(path).read_text(errors="replace").splitlines():
            if line.startswith("totals:"):
                totals[thread] = int(line.split()[1])
    return totals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="off,all", help="comma-separated: off, all, or one host probe's name")
    ap.add_argument("--slowdown", type=float, default=50.0, help="stretch the probes' clocks by this factor")
    ap.add_argument("--out", default="/tmp/kvt-cg.{pid}",
                    help="valgrind's --callgrind-out-file, with %%p written {pid} (to read the dumps back)")
    args = ap.parse_args(argv)

    from kvtrace.model import ensure_tiny_model
    from kvtrace.probes import columns
    from kvtrace.recorder import Recorder

    columns.FLUSH_NS = int(columns.FLUSH_NS * args.slowdown)

    model = str(ensure_tiny_model())
    cfg = host.DrivenConfig(num_blocks=900, max_num_seqs=256, max_num_batched_tokens=2048)
    prompts = host.shared_prefix_prompts(512, 8, 512, 64)  # bench_host_probes' default workload
    with tempfile.TemporaryDirectory(prefix="kvtrace-count-") as tmp:
        rec = Recorder(Path(tmp) / "session", "engine", {"flush_interval_s": 0.5 * args.slowdown})
        for mode in args.modes.split(","):
            names = () if mode == "off" else host.HOST_PROBES if mode == "all" else (mode,)
            for counted in (False, True):
                probes = host.install_probes(rec, names) if names else []
                finish = rec.flush if names else None
                start = gc.collect
                if counted:  # the round's full collection before its window, then count the window only
                    def start() -> None:
                        gc.collect()
                        control("-z")
                        control("-i", "on")
                host.run_round(model, cfg, prompts, 256, 96, finish=finish, before=start)
                if counted:
                    control("-i", "off")
                    control("-d", mode)
                host.uninstall_probes(probes)
            print(f"mode {mode}: dumped", flush=True)
        rec.close()
    out_file = args.out.format(pid=os.getpid())
    rows = [(mode, dumped_totals(out_file, part)) for part, mode in enumerate(args.modes.split(","), 1)]
    if not any(t for _, t in rows):
        print(f"no dumps found at {out_file}.*: run under valgrind --tool=callgrind (see --help)")
        return 1
    base = dict(rows[0][1])
    main_base, all_base = base.get(1, 0), sum(base.values())
    print(f"\ninstructions per round, millions (thread 1 = the scheduler's; the rest = the recorder's writer "
          f"and any other thread), against {rows[0][0]}:")
    print("| mode | scheduler thread | other threads | all | over " + rows[0][0] + " |")
    print("|---|---|---|---|---|")
    for mode, totals in rows:
        main, total = totals.get(1, 0), sum(totals.values())
        print(f"| {mode} | {main / 1e6:,.1f} ({(main - main_base) / 1e6:+,.1f}) | {(total - main) / 1e6:,.1f} | "
              f"{total / 1e6:,.1f} | {(total - all_base) / 1e6:+,.1f} M ({(total / all_base - 1) * 100:+.2f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
