"""Running kvtrace and reading what it wrote, as the tests do: the CLI as a subprocess, DuckDB read-only,
and the standard recorded workload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
NSYS_FIXTURES = DATA / "nsys"  # real Nsight Systems exports, copied in with their provenance
HELPERS = Path(__file__).resolve().parent
JOB_PATTERN = r"job(?P<job>\d+)-turn(?P<turn>\d+)"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def kvtrace_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtrace", *args]


def run_kvtrace(*args: str, check: bool = True, env: dict | None = None, timeout: float = 600,
                **kw) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **VLLM_ENV, **(env or {})}
    proc = subprocess.run(kvtrace_cmd(*args), capture_output=True, text=True, env=full_env,
                          timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvtrace {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def query(db: Path, sql: str, params: list | None = None) -> list[tuple]:
    """Rows of `sql` on the DuckDB file `db`, opened read-only for this one query."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def record_workload(tmp: Path, name: str, model: str, workload_args: list[str],
                    record_args: list[str] | None = None) -> dict:
    """Record `python -m kvtrace.demo.workload` under `kvtrace record`, ingest it; returns paths and vLLM counters."""
    session = tmp / name
    metrics = tmp / f"{name}-metrics.json"
    db = tmp / f"{name}.duckdb"
    run_kvtrace("record", "-o", str(session), "--job-pattern", JOB_PATTERN, *(record_args or []), "--",
                sys.executable, "-m", "kvtrace.demo.workload", "--model", model, "--metrics-out", str(metrics),
                *workload_args)
    run_kvtrace("ingest", str(session), "-o", str(db))
    return {"session": session, "db": db, "metrics": json.loads(metrics.read_text())}
