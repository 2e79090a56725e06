"""Running kvtrace and reading what it wrote, as the tests do: the CLI as a subprocess, DuckDB read-only,
and the standard recorded workload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOB_PATTERN = r"job(?P<job>\d+)-turn(?P<turn>\d+)"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def have_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def bench_module(name: str):
    """A script of bench/ imported as a module (bench/ is not a package; its scripts import each other
    by name, so the folder is on the path while it loads)."""
    import importlib

    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


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


# How conftest's recorded_run records the standard workload: every probe, block records for every layer.
STD_RECORD_ARGS = ["--kv-granularity", "blocks", "--kv-layers", "all"]


def record_workload(tmp: Path, name: str, model: str, workload_args: list[str],
                    record_args: list[str] | None = None, env: dict | None = None) -> dict:
    """Record `python -m kvtrace.demo.workload` under `kvtrace record`, ingest it; returns paths and vLLM counters."""
    session = tmp / name
    metrics = tmp / f"{name}-metrics.json"
    db = tmp / f"{name}.duckdb"
    rec = run_kvtrace("record", "-o", str(session), "--job-pattern", JOB_PATTERN, *(record_args or []), "--",
                      sys.executable, "-m", "kvtrace.demo.workload", "--model", model, "--metrics-out",
                      str(metrics), *workload_args, env=env)
    run_kvtrace("ingest", str(session), "-o", str(db))
    return {"session": session, "db": db, "metrics": json.loads(metrics.read_text()), "record_stderr": rec.stderr}


def vllm_reports_every_step() -> bool:
    """Whether the installed vLLM's offline engine records the scheduler stats of every step. 0.32 does;
    0.26 and 0.27 record them only for a step that returned a request output (`LLMEngine.step`: `if ...
    len(outputs.outputs) > 0`), so their prefix-cache counters leave out the lookups made in a step that
    produced no token (a first prefill chunk), which vLLM's scheduler did count."""
    import inspect

    from vllm.v1.engine.llm_engine import LLMEngine

    return "len(outputs.outputs) > 0" not in inspect.getsource(LLMEngine.step)


def vllm_reported_prefix_tokens(con) -> tuple[int, int]:
    """The prefix-cache (query, hit) tokens vLLM's counters show for a recorded run (`con`: its database):
    every lookup but those after a preemption (vLLM counts them apart), or, with an engine that drops the
    stats of steps without output, the lookups of the steps that returned one (a decode, a first token or
    a finish; with sync scheduling a step's lookups are in that step's stats)."""
    where = "" if vllm_reports_every_step() else """
          and (s.num_decode_reqs > 0 or s.num_finished > 0
               or exists (select 1 from request_events e where e.session = l.session and e.step = l.step
                          and e.event = 'first_token'))"""
    ((query, hits),) = con.execute(f"""
        select coalesce(sum(l.query_tokens), 0), coalesce(sum(l.hit_tokens), 0) from prefix_lookups l
        join steps s on s.session = l.session and s.step = l.step and s.rank = l.rank
        where l.after_preemption = 0 {where}""").fetchall()
    return int(query), int(hits)
