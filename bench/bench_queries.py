"""How long each canned analysis takes on a 10 M-event session.

    python bench/bench_queries.py                    # build the session once (cached), time every query
    python bench/bench_queries.py --events 1000000   # a smaller session
    python bench/bench_queries.py --threads 1        # DuckDB on one thread (CPU cost, load-independent)

The session comes from `kvtrace.testing.synth` (exactly N shard rows of realistic shape: steps, scheduler rows,
block events, prefix lookups, preemptions, per-layer timings and a sampled layer's KV access records),
ingested with `kvtrace ingest`'s own loader, plus what the generator does not write: connector transfers
(a save per step, a per-layer load for every resumed preemption) and pins (a TTL pin per finished
request), added with DuckDB `range()` INSERTs so that every query has rows to work on. The database is
kept under --dir and reused.

Each query runs with its default parameters (plus a few heavier variants, marked), best of --repeat
runs, the result fetched as an Arrow table (what a notebook or the report reads); printing rows in a
terminal is extra. Wall and CPU (process) time are both printed: on a shared machine the wall time
follows the load, printed before and after.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

QUERIES = ["forward_pass_throughput", "context_utilization", "access_pattern", "kv_idle_gaps",
           "recompute_vs_swap", "kv_utilization", "step_time_fit", "admission_limits", "prefix_hits",
           "turn_latency", "job_completion", "pins", "fragmentation", "block_lifetimes", "preemptions"]
VARIANTS = [("kv_idle_gaps", {"by": "layer"}), ("kv_idle_gaps", {"layer": "all"}),
            ("prefix_hits", {"by": "step"}), ("prefix_hits", {"by": "turn"}), ("recompute_vs_swap", {"by": "bin"})]
LIMIT_S = 1.0


def build(db: Path, events: int, seed: int) -> None:
    import duckdb

    from kvtrace.ingest.load import ingest_session
    from kvtrace.store.layout import create_tables
    from kvtrace.testing.synth import generate

    session_dir = db.with_suffix("")
    t0 = time.monotonic()
    info = generate(session_dir, events, seed=seed)
    print(f"synth: {info['events']:,} events in {time.monotonic() - t0:.1f} s -> {session_dir}", flush=True)
    tmp = db.with_suffix(".tmp.duckdb")
    tmp.unlink(missing_ok=True)
    con = duckdb.connect(str(tmp))
    create_tables(con)
    t0 = time.monotonic()
    report = ingest_session(con, session_dir)
    sid = report["session"]
    print(f"ingest: {report['events']:,} rows in {time.monotonic() - t0:.1f} s", flush=True)
    # Connector transfers: a save_kv_layer per step and layer pair (2 rows), and for every preemption a
    # start_load_kv call in the step that resumed the request, one row per layer (32) of that one call.
    con.execute("""
        INSERT INTO transfers
        SELECT session, rank, pid + 1, t_start_ns + 100000, t_start_ns + 200000, step, 'Synth', 'save_kv_layer',
            'save', NULL, 'model.layers.' || l || '.self_attn.attn', scheduled_tokens * 4096, scheduled_tokens
        FROM steps, range(2) r(l) WHERE session = ?""", [sid])
    con.execute("""
        INSERT INTO transfers
        SELECT sr.session, sr.rank, sr.pid + 1, s.t_start_ns + 50000, s.t_start_ns + 90000, sr.step, 'Synth',
            'start_load_kv', 'load', sr.request_id, 'model.layers.' || l || '.self_attn.attn',
            sr.computed_before * 4096, sr.computed_before
        FROM step_requests sr JOIN steps s USING (session, rank, step), range(32) r(l)
        WHERE sr.kind = 'resumed' AND sr.session = ?""", [sid])
    # Pins: every finished request's blocks pinned for 2 s; one in three reused before it expires.
    con.execute("""
        INSERT INTO pins
        SELECT session, rank, pid, ts_ns + k * 1000, step, ev, request_id, [1, 2, 3], 2000000000, 'ttl-pin'
        FROM request_events, (VALUES (0, 'pin'), (1, 'reuse'), (2, 'expire')) v(k, ev)
        WHERE event = 'finished' AND session = ? AND (ev <> 'reuse' OR hash(request_id) % 3 = 0)""", [sid])
    con.close()
    tmp.rename(db)


def bench(db: Path, repeat: int, threads: int | None) -> list[tuple]:
    import duckdb

    from kvtrace.queries import all_queries

    con = duckdb.connect(str(db), read_only=True)
    if threads:
        con.execute(f"SET threads = {int(threads)}")
    queries = all_queries()
    rows = []
    for name, params in [(n, {}) for n in QUERIES] + VARIANTS:
        cq = queries[name]
        values = {p: params.get(p) for p in cq.params if re.search(rf"\${re.escape(p)}\b", cq.sql)}
        wall = cpu = float("inf")
        n = 0
        for _ in range(repeat):
            w0, c0 = time.perf_counter(), time.process_time()
            n = con.sql(cq.sql, params=values or None).to_arrow_table().num_rows
            wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
        label = name + (" " + " ".join(f"{k}={v}" for k, v in params.items()) if params else "")
        rows.append((label, bool(params), n, wall, cpu))
        print(f"{label:34s} {n:>9,} rows  wall {wall * 1e3:8.1f} ms  cpu {cpu * 1e3:8.1f} ms"
              f"{'' if params or wall < LIMIT_S else '  SLOW'}", flush=True)
    con.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default="/tmp/kvtrace-bench", help="where the session and database are kept")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: all cores)")
    args = ap.parse_args(argv)
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    db = out / f"synth-{args.events}-s{args.seed}.duckdb"
    if not db.exists():
        build(db, args.events, args.seed)
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        counts = {t: con.execute(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in (
            "steps", "step_requests", "request_events", "block_events", "prefix_lookups", "preemptions",
            "transfers", "pins", "batch_slots", "kv_access", "layer_timings")}
    print(f"{db}: {sum(counts.values()):,} rows ({', '.join(f'{t} {n:,}' for t, n in counts.items())})")
    print(f"{os.cpu_count()} cores, load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"DuckDB threads: {args.threads or 'default'}, best of {args.repeat}")
    rows = bench(db, args.repeat, args.threads)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    slow = [r[0] for r in rows if not r[1] and r[3] >= LIMIT_S]
    print(f"{len(QUERIES) - len(slow)}/{len(QUERIES)} default queries under {LIMIT_S:.0f} s"
          + (f"; over: {', '.join(slow)}" if slow else ""))
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
