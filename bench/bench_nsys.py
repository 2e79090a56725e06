"""Nsight Systems ingest throughput, and SQLite -> Arrow readers compared.

    python bench/bench_nsys.py [--kernels 1000000] [--repeat 3]

Prints, for the largest real export in tests/data/nsys and for an export with ~1 M kernels made
from it (a copy whose kernel and CUDA runtime rows are repeated with shifted times and correlation
ids, so names, launch configs and the launch join stay real), the rows per second of `load_nsys`
(all tables, wall clock and CPU seconds of all threads); then the rows per second of reading that
export's kernel table into Arrow with the query the loader uses, by stdlib sqlite3 (fetchmany ->
Arrow arrays), sqlite-utils (rows as dicts -> Arrow) and ADBC (one query, and kvtrace's parallel reader);
then the time of the per-step queries on that export joined to --steps engine steps.
DuckDB and the reader use as many threads as the process's CPU affinity allows (`taskset -c 0,1 ...`
measures a 2-core machine on a bigger one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

import duckdb
import pyarrow as pa

from kvtrace.ingest import nsys_read
from kvtrace.ingest.nsys import SOURCES, align_nsys, load_nsys
from kvtrace.queries import run_query

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "data" / "nsys"
KERNEL, RUNTIME = "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME"
KERNEL_COLUMNS = next(s.columns for s in SOURCES if s.table == KERNEL)
THREADS = len(os.sched_getaffinity(0))  # DuckDB threads: the CPUs this process may use


def connect(path: str = ":memory:") -> duckdb.DuckDBPyConnection:
    return duckdb.connect(path, config={"threads": THREADS})


def make_big_export(base: Path, dst: Path, kernels: int) -> Path:
    """A copy of `base` whose kernel and runtime rows are repeated until there are >= `kernels` kernels."""
    shutil.copyfile(base, dst)
    db = sqlite3.connect(dst)
    have = db.execute(f"SELECT count(*), max(\"end\") - min(start) + 1, max(correlationId) + 1 FROM {KERNEL}").fetchone()
    copies = -(-kernels // have[0]) - 1
    db.execute(f"CREATE TEMP TABLE copies AS WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c "
               f"WHERE i < {copies}) SELECT i FROM c")
    span = max(have[1], db.execute(f'SELECT max("end") - min(start) + 1 FROM {RUNTIME}').fetchone()[0])
    for table in (KERNEL, RUNTIME):
        cols = [r[1] for r in db.execute(f"PRAGMA table_info({table})")]
        shifted = {"start": f"start + i * {span}", "end": f'"end" + i * {span}',
                   "correlationId": f"correlationId + i * {have[2]}"}
        exprs = ", ".join(shifted.get(c, f'"{c}"') for c in cols)
        db.execute(f"INSERT INTO {table} SELECT {exprs} FROM {table}, copies")
    db.commit()
    db.close()
    return dst


def time_load(path: Path, repeat: int) -> tuple[int, float, float]:
    """(rows loaded, best wall s, CPU s of that run) for load_nsys into a fresh in-memory database."""
    best = None
    for _ in range(repeat):
        con = connect()
        wall, cpu = time.perf_counter(), time.process_time()
        stats = load_nsys(con, path)
        run = (sum(stats["rows"].values()), time.perf_counter() - wall, time.process_time() - cpu)
        con.close()
        best = run if best is None or run[1] < best[1] else best
    return best


def read_sqlite3(path: Path, sql: str) -> int:
    return nsys_read._read_sqlite3(_uri(path), sql, KERNEL_COLUMNS).num_rows - 1


def read_sqlite_utils(path: Path, sql: str) -> int:
    import sqlite_utils

    db = sqlite_utils.Database(sqlite3.connect(_uri(path), uri=True))
    return pa.Table.from_pylist(list(db.query(sql))).num_rows - 1


def read_adbc(path: Path, sql: str) -> int:
    return nsys_read._read_adbc(_uri(path), sql).num_rows - 1


def read_kvtrace(path: Path, _sql: str) -> int:
    export = nsys_read.open_export(path)
    try:
        return sum(t.num_rows for t in nsys_read.read_table(export, KERNEL, KERNEL_COLUMNS))
    finally:
        export.close()


def _uri(path: Path) -> str:
    return f"file:{path}?mode=ro&immutable=1"


def time_step_queries(path: Path, steps: int) -> None:
    """The per-step queries on `path` joined to `steps` engine steps spread over its kernels."""
    con = connect()
    con.execute("CREATE TABLE sessions (session VARCHAR, start_utc_ns BIGINT, start_monotonic_ns BIGINT)")
    con.execute("INSERT INTO sessions VALUES ('bench', 0, 0)")  # utc-approx: offset = utcEpochNs - ...
    load_nsys(con, path, session="bench")
    lo, hi = con.execute("SELECT min(t_start_ns), max(t_end_ns) FROM nsys_kernels").fetchone()
    width = (hi - lo) // steps
    con.execute(f"CREATE TABLE steps AS SELECT 'bench' AS session, 0 AS rank, 1 AS pid, range AS step, "
                f"{lo} + range * {width} AS t_start_ns, {lo} + range * {width} + 1000 AS t_sched_end_ns, "
                f"{lo} + (range + 1) * {width} - 1000 AS t_end_ns FROM range({steps})")
    align_nsys(con, "bench")
    for name in ("step_kernels", "step_gpu_time", "kernel_summary", "memcpy_summary", "nvtx_summary"):
        wall = time.perf_counter()
        rows = run_query(con, name, {"session": "bench"})[1]
        print(f"{name:<44} {len(rows):>10,} {time.perf_counter() - wall:>8.2f}")
    con.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=1_000_000, help="kernels in the generated export")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (best is shown)")
    parser.add_argument("--steps", type=int, default=100_000, help="engine steps for the per-step queries")
    args = parser.parse_args()
    largest = max(FIXTURES.glob("*.sqlite"), key=lambda p: p.stat().st_size)
    print(f"machine: {os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable, load average "
          f"{os.getloadavg()[0]:.1f}; reader pool {nsys_read.WORKERS} threads, DuckDB {THREADS} threads")
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        big = make_big_export(largest, Path(tmp) / "big.sqlite", args.kernels)
        print(f"generated {big.name} from {largest.name} in {time.perf_counter() - started:.1f} s "
              f"({big.stat().st_size / 1e6:.0f} MB)\n")
        print(f"{'load_nsys':<44} {'rows':>10} {'wall s':>8} {'cpu s':>7} {'rows/s':>12}")
        for path in (largest, big):
            rows, wall, cpu = time_load(path, args.repeat)
            print(f"{path.name:<44} {rows:>10,} {wall:>8.2f} {cpu:>7.2f} {rows / wall:>12,.0f}")
        export = nsys_read.open_export(big)
        sql = nsys_read.select_sql(export, KERNEL, KERNEL_COLUMNS)
        export.close()
        print(f"\nread {KERNEL} ({len(KERNEL_COLUMNS)} columns) into Arrow")
        print(f"{'reader':<44} {'rows':>10} {'wall s':>8} {'cpu s':>7} {'rows/s':>12}")
        for name, read in (("sqlite3 (stdlib, fetchmany)", read_sqlite3), ("sqlite-utils", read_sqlite_utils),
                           ("adbc-driver-sqlite (one query)", read_adbc),
                           (f"adbc, kvtrace read_table ({nsys_read.WORKERS} threads)", read_kvtrace)):
            wall, cpu = time.perf_counter(), time.process_time()
            rows = read(big, sql)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(f"{name:<44} {rows:>10,} {wall:>8.2f} {cpu:>7.2f} {rows / wall:>12,.0f}")
        print(f"\nper-step queries, {big.name} joined to {args.steps:,} steps (utc-approx aligned)")
        print(f"{'query':<44} {'rows':>10} {'wall s':>8}")
        time_step_queries(big, args.steps)


if __name__ == "__main__":
    main()
