"""The whole path on a real vLLM 0.32 engine (CPU build, tiny model): record -> shards -> DuckDB ->
query -> viewer, checked against vLLM's own counters from the same run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import duckdb
import pytest

from kvtrace.format import schema
from tests.helpers.run import VLLM_ENV, kvtrace_cmd, record_workload, run_kvtrace, vllm_reported_prefix_tokens
from tests.helpers.run import query as q

pytestmark = pytest.mark.vllm


@pytest.mark.exactness
def test_summary_equals_vllm_counters(recorded_run):
    vllm = recorded_run["metrics"]["vllm"]
    out = run_kvtrace("query", str(recorded_run["db"]), "summary", "--format", "json").stdout
    (row,) = json.loads(out)
    assert row["status"] == "complete"
    con = duckdb.connect(str(recorded_run["db"]), read_only=True)
    try:  # every lookup, or what vLLM 0.26-0.27 leave in their counters (tests/helpers/run.py)
        assert vllm_reported_prefix_tokens(con) == (vllm["prefix_cache_queries"], vllm["prefix_cache_hits"])
        ((query, hits),) = con.execute("select sum(query_tokens), sum(hit_tokens) from prefix_lookups "
                                        "where after_preemption = 0").fetchall()
    finally:
        con.close()
    assert (row["prefix_query_tokens"], row["prefix_hit_tokens"]) == (query, hits)
    assert row["preemptions"] == vllm["num_preemptions"]
    assert row["output_tokens"] == vllm["generation_tokens"] > 0
    assert vllm["num_preemptions"] > 0, "the standard workload must force preemptions"
    assert vllm["prefix_cache_hits"] > 0, "the standard workload must hit the prefix cache"
    assert row["requests"] == 18 and row["dropped_events"] == 0
    assert row["block_allocs"] > 0 and row["block_frees"] > 0
    for key in ("steps", "requests", "preemptions", "prefix_query_tokens", "prefix_hit_tokens",
                "block_allocs", "block_frees", "dropped_events"):
        assert key in row


@pytest.mark.exactness
def test_every_step_has_a_row(recorded_run):
    db = recorded_run["db"]
    (n, lo, hi, distinct, unfinished), = q(db, "select count(*), min(step), max(step), count(distinct step), "
                                              "count(*) filter (t_end_ns is null) from steps")
    # vLLM numbers steps 1, 2, ... (Scheduler.current_step); a missing row would leave a gap.
    assert (lo, hi, distinct, n) == (1, n, n, n)
    assert unfinished == 0
    # Every scheduled (step, request) belongs to a recorded step, and token counts add up.
    (mismatch,), = q(db, """select count(*) from steps s join (select step, sum(tokens) t from step_requests
                            group by step) r using (step) where r.t <> s.scheduled_tokens""")
    assert mismatch == 0


@pytest.mark.exactness
def test_requests_lifecycle(recorded_run):
    db = recorded_run["db"]
    rows = q(db, "select request_id, job_id, turn, output_tokens, finish_reason, arrival_ns <= queued_ns, "
                 "queued_ns <= first_scheduled_ns, first_scheduled_ns <= first_token_ns, "
                 "first_token_ns <= finish_ns from requests")
    assert len(rows) == 18
    assert {(r[1], r[2]) for r in rows} == {(str(j), t) for j in range(6) for t in range(3)}
    for r in rows:
        assert r[3] == 32 and r[4] == "length"
        assert all(r[5:]), r


def test_query_sql_and_list(recorded_run):
    out = run_kvtrace("query", str(recorded_run["db"]), "--sql",
                      "select * from steps order by step limit 5").stdout
    assert len(out.strip().splitlines()) == 2 + 5
    listed = run_kvtrace("query", "--list").stdout
    assert "summary" in listed


def test_python_dash_m_equals_console_script(recorded_run, tmp_path):
    exe = Path(sys.executable).with_name("kvtrace")
    a = subprocess.run([str(exe), "query", str(recorded_run["db"]), "summary", "--format", "csv"],
                       capture_output=True, text=True, check=True).stdout
    b = run_kvtrace("query", str(recorded_run["db"]), "summary", "--format", "csv").stdout
    assert a == b and a.count("\n") == 2


def test_export_html(recorded_run, tmp_path):
    out = tmp_path / "run.html"
    run_kvtrace("export", str(recorded_run["db"]), "--format", "html", "-o", str(out))
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") or text.lower().startswith("<!doctype html>")
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text


def test_reingest_is_idempotent(recorded_run, tmp_path):
    db = tmp_path / "again.duckdb"
    run_kvtrace("ingest", str(recorded_run["session"]), "-o", str(db))
    first = q(db, "select (select count(*) from steps), (select count(*) from block_events), "
                  "(select count(*) from sessions)")
    run_kvtrace("ingest", str(recorded_run["session"]), "-o", str(db))
    assert q(db, "select (select count(*) from steps), (select count(*) from block_events), "
                 "(select count(*) from sessions)") == first


def test_manifest(recorded_run):
    manifest = json.loads((recorded_run["session"] / "manifest.json").read_text())
    assert manifest["schema_version"] == schema.SCHEMA_VERSION and manifest["status"] == "complete"
    assert manifest["exit_code"] == 0
    cfg = manifest["engine_config"]
    assert cfg["block_size"] == 32 and cfg["num_kv_blocks"] == 40 and cfg["max_num_seqs"] == 8
    assert cfg["max_num_batched_tokens"] == 256 and cfg["enable_prefix_caching"] is True
    assert {"engine", "worker"} <= {p["role"] for p in manifest["procs"]}
    # Every probe attached wherever its targets are loaded; the attention probe waits for vLLM's
    # attention package, which only workers import: "unused" elsewhere.
    for name, per in manifest["probes"].items():
        for where, st in per.items():
            unused_ok = name == "attention" and not where.startswith("worker:")
            assert st["status"] == "attached" or (unused_ok and st["status"] == "unused"), (name, where, st)
    assert any(where.startswith("worker:") and st["status"] == "attached"
               for where, st in manifest["probes"]["attention"].items())
    # ... and EngineCore never imports it for kvtrace's sake (~1 s of start-up). The front end may: with
    # vLLM's model-info cache cold (~/.cache/vllm/modelinfos, a fresh machine), vLLM's model registry
    # imports the model's module, attention package with it, in the front end and in a subprocess of it.
    assert all(st["status"] == "unused" for where, st in manifest["probes"]["attention"].items()
               if where.startswith("engine:"))
    assert manifest["vllm_version"].startswith("0.32.0")


@pytest.mark.exactness
def test_missing_probe_target_is_reported_and_run_goes_on(tiny_model, tmp_path):
    extra = {"extra_targets": {"kv_blocks": [["vllm.v1.core.block_pool", "BlockPool.no_such_method", []]]}}
    run = record_workload(tmp_path, "drift", tiny_model, ["--jobs", "2", "--turns", "1"],
                          ["--options-json", json.dumps(extra)])
    manifest = json.loads((run["session"] / "manifest.json").read_text())
    statuses = {k: st for k, st in manifest["probes"]["kv_blocks"].items()}
    assert statuses and all(st["status"] == "disabled" for st in statuses.values())
    assert any("no_such_method" in st["reason"] for st in statuses.values())
    # The engine ran to the end and the other probes recorded.
    assert manifest["exit_code"] == 0 and run["metrics"]["runs"][0]["requests"] == 2
    (steps, blocks), = q(run["db"], "select (select count(*) from steps), (select count(*) from block_events)")
    assert steps > 0 and blocks == 0
    summary = json.loads(run_kvtrace("query", str(run["db"]), "summary", "--format", "json").stdout)[0]
    assert "kv_blocks:disabled" in summary["probes_disabled"]
    # Not complete: the session says what is missing, in the manifest and in the summary.
    assert manifest["status"] == summary["status"] == "degraded"
    assert any("probe kv_blocks" in p and "no_such_method" in p for p in manifest["problems"])
    assert "probe kv_blocks" in summary["problems"] and "no_such_method" in summary["problems"]
    # ... and `kvtrace record` said so while the command ran, as soon as the engine's probes were in.
    verdicts = [ln for ln in run["record_stderr"].splitlines() if ln.startswith("kvtrace: probes in pid ")]
    assert verdicts and any("scheduler attached" in ln for ln in verdicts)
    assert all("kv_blocks disabled" in ln and "no_such_method" in ln for ln in verdicts)


def test_attention_without_step_ids_says_so_rather_than_recording_nothing(tiny_model, tmp_path):
    """With the scheduler probe off, the worker's forward passes carry no step id: the attention probe
    records none of them (their rows would take made-up step ids), and says why."""
    run = record_workload(tmp_path, "untagged", tiny_model, ["--jobs", "2", "--turns", "1"],
                          ["--probes", "attention,engine_stop"])  # engine_stop: the worker flushes at the end
    manifest = json.loads((run["session"] / "manifest.json").read_text())
    assert manifest["status"] == "empty"
    assert any(p.startswith("probe attention (worker pid ") and "forward passes had no step id" in p
               for p in manifest["problems"]), manifest["problems"]
    (rows,), = q(run["db"], "select count(*) from kv_access")
    assert rows == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


@pytest.mark.exactness
def test_vllm_serve_recorded_and_stopped_with_sigint(tiny_model, tmp_path):
    port = _free_port()
    name = f"tiny-{os.getpid()}-{port}"  # so we know the server answering is ours, not a neighbour's
    session = tmp_path / "serve"
    env = {**os.environ, **VLLM_ENV}
    proc = subprocess.Popen(
        kvtrace_cmd("record", "-o", str(session), "--", "vllm", "serve", tiny_model, "--port", str(port),
                    "--host", "127.0.0.1", "--dtype", "float32", "--block-size", "32", "--max-model-len", "512",
                    "--enforce-eager", "--max-num-seqs", "4", "--served-model-name", name),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as resp:
                    assert name in resp.read().decode(), "another server answers on our port"
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("vllm serve did not come up:\n" + (proc.stdout.read() or "")[-4000:]) from None
                time.sleep(1)
        prompt = "kv cache prefix block " * 20
        for i in range(3):
            out = _post(f"http://127.0.0.1:{port}/v1/completions",
                        {"model": name, "prompt": prompt + str(i), "max_tokens": 8, "temperature": 0})
            assert out["choices"][0]["text"] is not None
        chat = _post(f"http://127.0.0.1:{port}/v1/chat/completions",  # the tiny model has a chat template
                     {"model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8})
        assert chat["choices"][0]["message"]["role"] == "assistant"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert code == 0, log[-3000:]
    manifest = json.loads((session / "manifest.json").read_text())
    assert manifest["status"] == "complete", (manifest, log[-3000:])
    assert {"api", "engine", "worker"} & {p["role"] for p in manifest["procs"]} >= {"engine", "worker"}
    db = tmp_path / "serve.duckdb"
    run_kvtrace("ingest", str(session), "-o", str(db))
    (requests, finished, hits), = q(db, "select count(*), count(finish_ns), (select sum(hit_tokens) from "
                                       "prefix_lookups) from requests")
    assert requests == 4 and finished == 4
    assert hits > 0  # the three prompts share a long prefix
    # ... and `kvtrace replay` of the server's recording at its own configuration is the run again
    run_kvtrace("replay", str(session), "-o", str(tmp_path / "again"))
    run_kvtrace("ingest", str(tmp_path / "again"), "-o", str(tmp_path / "again.duckdb"))
    counts = ("select count(*), count(finish_ns), sum(output_tokens) from requests",
              "select sum(query_tokens), sum(hit_tokens) from prefix_lookups",
              "select count(*) from steps where scheduled_tokens > 0")
    assert [q(tmp_path / "again.duckdb", sql) for sql in counts] == [q(db, sql) for sql in counts]


def test_probes_do_not_import_the_attention_package(tmp_path):
    """A process that loads the plugin (the front end, EngineCore) is not made to import vLLM's attention
    package (~1 s of start-up): the attention probe waits for it, reported `unused` until it comes."""
    code = ("import sys; from kvtrace.probes import lifecycle; from kvtrace.probes.vllm import plugin; "
            "plugin.register(); print(sorted(type(p).__name__ for p in lifecycle.installed()), "
            "'vllm.model_executor.layers.attention' in sys.modules)")
    env = {**os.environ, "KVTRACE_SESSION": str(tmp_path / "s")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    probes, imported = out.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert "AttentionProbe" in probes and imported == "False", out.stdout[-2000:]
