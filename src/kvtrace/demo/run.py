"""`kvtrace demo`: the whole path on a tiny local model, offline, in a few minutes.

Makes the tiny model (cached), records the agentic workload (`kvtrace.demo.workload`: jobs of several turns
sharing prefixes, a KV pool small enough to force preemptions) under `kvtrace record`, ingests it into
DuckDB, prints `summary` and a few canned results, writes the HTML viewer, and says where all of it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kvtrace.errors import KvtraceError

DEMO_QUERIES = ("admission_limits", "prefix_hits", "preemptions", "step_time_fit")


def _say(msg: str) -> None:
    print(f"demo: {msg}", file=sys.stderr, flush=True)


def run_demo(out: Path, num_requests: int = 24) -> dict:
    from kvtrace.demo.model import ensure_tiny_model
    from kvtrace.demo.workload import JOB_PATTERN
    from kvtrace.ingest import ingest
    from kvtrace.queries import all_queries, run_query
    from kvtrace.store.db import open_db

    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        raise KvtraceError(f"the demo needs vLLM's CPU build (bash scripts/setup.sh installs it): {exc}") from None
    _say("making the tiny model (cached after the first time)")
    model = ensure_tiny_model()
    session, db, html = out / "session", out / "demo.duckdb", out / "demo.html"
    turns = 3
    jobs = max(1, num_requests // turns)
    _say(f"recording {jobs} jobs x {turns} turns on vLLM (CPU) -> {session}")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    cmd = [sys.executable, "-m", "kvtrace", "record", "-o", str(session), "--job-pattern", JOB_PATTERN,
           "--kv-granularity", "blocks", "--kv-layers", "all", "--",
           sys.executable, "-m", "kvtrace.demo.workload", "--model", str(model), "--jobs", str(jobs),
           "--turns", str(turns), "--metrics-out", str(out / "vllm-metrics.json")]
    log = out / "vllm.log"
    with open(log, "w") as f:
        code = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        raise KvtraceError(f"the recorded vLLM run failed (exit {code}); see {log}")
    _say(f"ingesting -> {db}")
    ingest([session], db)
    con = open_db(db, read_only=True)
    try:
        for name in ("summary", *[q for q in DEMO_QUERIES if q in all_queries()]):
            columns, rows = run_query(con, name)
            print(f"\n== {name} ==")
            _print_table(columns, rows[:12])
    finally:
        con.close()
    from kvtrace.export.viewer import export_html

    export_html(db, html)
    _say(f"done in {time.monotonic() - t0:.0f} s")
    print(f"\nsession:  {session}\ndatabase: {db}\nviewer:   {html}  (open it in a browser; no network needed)"
          f"\nvLLM log: {log}\nnext:     kvtrace query {db} --list"
          f"\n          (kvtrace is in {Path(sys.executable).parent}: `source {Path(sys.executable).parent}/activate` "
          f"puts it on the PATH)")
    return {"session": session, "db": db, "html": html}


def _print_table(columns: list[str], rows: list[tuple]) -> None:
    cells = [[("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
