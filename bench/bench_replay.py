"""How well `kvtrace replay` predicts a real run at another KV pool size, and how fast it is (issue 37).

The standard workload (`python -m kvtrace.demo.workload`: jobs of several turns sharing prefixes, on
vLLM's CPU build) is recorded for real once per pool size. The recording at `--base` blocks is then
replayed at every size, and each prediction is set beside the real run of that size: prefix-cache hit
tokens, preemptions, engine steps, blocks evicted, with the relative error of each, and the seconds the
real run and the replay took.

    python bench/bench_replay.py [--sizes 34,40,48,64] [--base 40] [--jobs 6] [--turns 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

FIGURES = {"hit_tokens": "select coalesce(sum(hit_tokens), 0) from prefix_lookups",
           "preemptions": "select count(*) from preemptions",
           "steps": "select count(*) from steps",
           "evictions": "select count(*) from block_events where event = 'evict'"}


def kvtrace(*args: str) -> float:
    """Run a kvtrace command; returns its wall seconds."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "kvtrace", *args], check=True, capture_output=True, text=True)
    return time.monotonic() - t0


def figures(session: Path, db: Path) -> dict[str, int]:
    kvtrace("ingest", str(session), "-o", str(db))
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {k: con.execute(sql).fetchone()[0] for k, sql in FIGURES.items()}
    finally:
        con.close()


def error(pred: int, real: int) -> str:
    if real == 0:
        return "exact" if pred == 0 else f"+{pred}"
    return f"{(pred - real) / real:+.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="34,40,48,64", help="KV pool sizes (blocks) to record and predict")
    ap.add_argument("--base", type=int, default=40, help="the pool size whose recording is replayed")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=None, help="keep the sessions and results.json here")
    a = ap.parse_args()
    sizes = sorted({int(x) for x in a.sizes.split(",")} | {a.base})
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="bench-replay-"))
    root.mkdir(parents=True, exist_ok=True)
    workload = ["--jobs", str(a.jobs), "--turns", str(a.turns)]
    real, real_s = {}, {}
    for n in sizes:
        session = root / f"real{n}"
        real_s[n] = kvtrace("record", "-o", str(session), "--", sys.executable, "-m", "kvtrace.demo.workload",
                            *workload, "--num-blocks", str(n))
        real[n] = figures(session, root / f"real{n}.duckdb")
    rows = []
    for n in sizes:
        out = root / f"replay{a.base}to{n}"
        seconds = kvtrace("replay", str(root / f"real{a.base}"), "-o", str(out), "--num-blocks", str(n))
        pred = figures(out, root / f"replay{a.base}to{n}.duckdb")
        rows.append({"blocks": n, "real": real[n], "predicted": pred, "real_s": real_s[n], "replay_s": seconds})
    print(f"workload: {a.jobs} jobs x {a.turns} turns; recording replayed: {a.base} blocks; "
          f"real runs on vLLM's CPU build (this machine)")
    print(f"{'blocks':>6}  " + "  ".join(f"{k + ' real/pred (err)':>30}" for k in FIGURES)
          + f"  {'real s':>7}  {'replay s':>8}")
    for r in rows:
        cells = [f"{r['real'][k]}/{r['predicted'][k]} ({error(r['predicted'][k], r['real'][k])})" for k in FIGURES]
        print(f"{r['blocks']:>6}  " + "  ".join(f"{c:>30}" for c in cells)
              + f"  {r['real_s']:>7.1f}  {r['replay_s']:>8.1f}")
    (root / "results.json").write_text(json.dumps(rows, indent=1))
    print(f"sessions and results.json: {root}")


if __name__ == "__main__":
    main()
