"""Wall time of the demo workload recorded vs not recorded, side by side in one run (issue: target <= 1.10).

Each round runs `python -m kvtrace.demo.workload` twice, once plain and once under `kvtrace record` (the
order alternates between rounds, so drift on this shared machine hits both alike). Two figures per run:
the whole command (engine start included, what a user waits for) and the generation loop alone (the
workload reports it; this is where the probes run). Ratios are of medians.

    python bench/bench_overhead.py [--rounds 3] [--repeat 4] [--granularity timing]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_once(recorded: bool, model: str, workdir: Path, repeat: int, granularity: str, idx: int) -> tuple[float, float]:
    metrics = workdir / f"m-{idx}-{int(recorded)}.json"
    workload = [sys.executable, "-m", "kvtrace.demo.workload", "--model", model, "--repeat", str(repeat),
                "--metrics-out", str(metrics)]
    cmd = workload
    if recorded:
        cmd = [sys.executable, "-m", "kvtrace", "record", "-o", str(workdir / f"s{idx}"),
               "--kv-granularity", granularity, "--", *workload]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    gen = sum(r["seconds"] for r in json.loads(metrics.read_text())["runs"])
    return wall, gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=4, help="job sets per run (more = longer generation phase)")
    ap.add_argument("--granularity", default="timing", choices=["off", "timing", "blocks"])
    args = ap.parse_args()
    from kvtrace.demo.model import ensure_tiny_model

    model = str(ensure_tiny_model())
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for recorded in ((False, True) if r % 2 == 0 else (True, False)):
                wall, gen = run_once(recorded, model, Path(tmp), args.repeat, args.granularity, r)
                results[recorded].append((wall, gen))
                print(f"round {r} {'recorded' if recorded else 'plain   '}: wall {wall:7.2f} s  "
                      f"generation {gen:6.3f} s", flush=True)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(g for _, g in v)) for k, v in results.items()}
    print(f"\nworkload: 6 jobs x 3 turns x {args.repeat} repeats, tiny Llama on vLLM 0.32 CPU, "
          f"--kv-granularity {args.granularity}, {args.rounds} rounds")
    print(f"{'':12s} {'plain':>10s} {'recorded':>10s} {'ratio':>7s}")
    print(f"{'wall (s)':12s} {med[False][0]:10.2f} {med[True][0]:10.2f} {med[True][0] / med[False][0]:7.3f}")
    print(f"{'generation':12s} {med[False][1]:10.3f} {med[True][1]:10.3f} {med[True][1] / med[False][1]:7.3f}")


if __name__ == "__main__":
    main()
