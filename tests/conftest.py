"""Shared fixtures. Real vLLM runs are expensive on a 2-core machine (~30 s each), so the standard
recorded runs are made once per test session and shared by every test module that needs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
NSYS_FIXTURES = SHARED / "fixtures" / "nsys"
JOB_PATTERN = r"job(?P<job>\d+)-turn(?P<turn>\d+)"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
# Child processes find the environment's scripts (`vllm`, `kvtrace`) as in an activated venv, also when
# the tests run as `.venv/bin/python -m pytest` (what `make test` and CI do).
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


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


@pytest.fixture(scope="session")
def tiny_model() -> str:
    if not have_vllm():
        pytest.skip("vLLM (vllm-cpu) is not installed")
    from kvtrace.model import ensure_tiny_model

    return str(ensure_tiny_model())


def record_workload(tmp: Path, name: str, model: str, workload_args: list[str],
                    record_args: list[str] | None = None) -> dict:
    """Record `python -m kvtrace.workload` under `kvtrace record`, ingest it; returns paths and vLLM counters."""
    session = tmp / name
    metrics = tmp / f"{name}-metrics.json"
    db = tmp / f"{name}.duckdb"
    run_kvtrace("record", "-o", str(session), "--job-pattern", JOB_PATTERN, *(record_args or []), "--",
                sys.executable, "-m", "kvtrace.workload", "--model", model, "--metrics-out", str(metrics),
                *workload_args)
    run_kvtrace("ingest", str(session), "-o", str(db))
    return {"session": session, "db": db, "metrics": json.loads(metrics.read_text())}


@pytest.fixture(scope="session")
def recorded_run(tiny_model, tmp_path_factory) -> dict:
    """The standard workload (6 jobs x 3 turns, 40-block pool: prefix hits and preemptions), recorded
    once with all probes and KV access block records for every layer, then ingested.

    Returns {"session": Path, "db": Path, "metrics": {"vllm": {...vLLM's counters...}, "runs": [...]}}.
    """
    tmp = tmp_path_factory.mktemp("recorded")
    return record_workload(tmp, "std", tiny_model, [],
                           ["--kv-granularity", "blocks", "--kv-layers", "all"])
