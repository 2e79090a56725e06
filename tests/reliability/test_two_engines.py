"""One recorded command that starts two vLLM engines in sequence (tests/helpers/reliability_two_engines.py), used
for three things at once, as a real vLLM start is the expensive part:

- version drift: engine 2 runs against a really altered vLLM (BlockPool.touch's signature changed by
  tests/data/drift/sitecustomize.py before the plugin looks) and an `extra_targets` option naming a
  missing method; the two probes are disabled with the reason, the engine finishes, the scheduler probe
  records. A probe raising inside vLLM (`inject_fault` in engine 1) is switched off, counted, recorded.
- two engines in one recording: no event is attributed to the wrong engine, steps count per engine.
- privacy: prompts carry a marker, the environment and the command line carry secrets; none of them, no
  output text and no token id sequence is anywhere in the session files or the database; block hashes are.

See docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from pathlib import Path

import duckdb
import pytest

from tests.helpers.reliability_util import ingest, manifest, procs, query
from tests.helpers.run import JOB_PATTERN, REPO, run_kvtrace

pytestmark = pytest.mark.vllm
MARKER = "UNIQUE_STRING_XYZ"
SECRETS = {"MY_API_TOKEN": "supersecret1", "HF_TOKEN": "supersecret3", "VLLM_API_KEY": "supersecret4",
           "KVTRACE_TEST_PASSWORD": "supersecret5"}
ARGV_SECRET = "secret2-argv"
JOBS, MAX_TOKENS = 4, 16
SUFFIX = re.compile(r"-[0-9a-f]{8}$")  # vLLM appends a random suffix to request ids


def base_id(rid: str) -> str:
    return SUFFIX.sub("", rid)


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("two_engines")
    session, result, db = tmp / "two", tmp / "result.json", tmp / "two.duckdb"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "tests" / "data" / "drift"), str(REPO),
                                                     os.environ.get("PYTHONPATH", "")) if p),
           "RELIABILITY_MARKER": MARKER, **SECRETS}
    rec = run_kvtrace("record", "-o", str(session), "--job-pattern", JOB_PATTERN, "--kv-granularity", "blocks",
                      "--kv-layers", "all", "--", sys.executable, str(REPO / "tests" / "helpers" / "reliability_two_engines.py"),
                      "--model", tiny_model, "--api-key", ARGV_SECRET, "--jobs", str(JOBS),
                      "--max-tokens", str(MAX_TOKENS), "--out", str(result), env=env, check=False)
    assert rec.returncode == 0, rec.stderr[-5000:]
    res = ingest(session, db)
    assert res.returncode == 0, res.stderr
    engines = {}
    for k in ("1", "2"):
        pids = query(db, "select distinct pid from request_events where request_id like ?", [f"e{k}-%"])
        assert len(pids) == 1, (k, pids)
        engines[k] = pids[0][0]
    return {"session": session, "db": db, "record": rec, "ingest": res, "result": json.loads(result.read_text()),
            "engines": engines, "tmp": tmp}


# ---- the engines were not harmed --------------------------------------------------------------------
def test_both_engines_finish_every_request(run):
    for k in ("1", "2"):
        r = run["result"][k]
        assert len(r["requests"]) == JOBS
        assert all(len(o["token_ids"]) == MAX_TOKENS for o in r["outputs"].values())
    assert run["engines"]["1"] != run["engines"]["2"]
    assert manifest(run["session"])["exit_code"] == 0


# ---- version drift and probe faults -----------------------------------------------------------------
def probe_rows(run, pid: int) -> dict[str, tuple[str, str]]:
    return {p: (s, r) for p, s, r in query(run["db"], "select probe, status, reason from probes where pid = ?", [pid])}


def test_drifted_targets_disable_their_probe_with_the_reason(run):
    e2 = probe_rows(run, run["engines"]["2"])
    status, reason = e2["kv_blocks"]
    assert status == "disabled"
    assert reason == "vllm.v1.core.block_pool.BlockPool.touch: signature changed, missing parameter(s) blocks"
    status, reason = e2["prefix_cache"]
    assert status == "disabled"
    assert "KVCacheManager.no_such_method not found" in reason
    assert e2["scheduler"][0] == "attached"
    # ... shown by ingest, by the summary query and kept in the manifest
    out = run["ingest"].stdout
    pid2 = run["engines"]["2"]
    assert f"probe kv_blocks (engine pid {pid2}): disabled: vllm.v1.core.block_pool.BlockPool.touch" in out
    assert f"probe prefix_cache (engine pid {pid2}): disabled:" in out
    summary = run_kvtrace("query", str(run["db"]), "summary", "--format", "json").stdout
    shown = json.loads(summary)[0]["probes_disabled"]
    assert "kv_blocks:disabled" in shown and "prefix_cache:disabled" in shown and "prefix_cache:failed" in shown
    probes = manifest(run["session"])["probes"]
    assert probes["kv_blocks"][f"engine:{pid2}"]["status"] == "disabled"


def test_the_other_probes_still_record(run):
    pid2 = run["engines"]["2"]
    n = dict(query(run["db"], "select 'steps', count(*) from steps where pid = ? union all "
                              "select 'events', count(*) from request_events where pid = ? union all "
                              "select 'blocks', count(*) from block_events where pid = ?", [pid2] * 3))
    assert n["steps"] > 0 and n["events"] >= 3 * JOBS and n["blocks"] == 0


def test_a_probe_that_raises_is_switched_off_counted_and_recorded(run):
    pid1 = run["engines"]["1"]
    status, reason = probe_rows(run, pid1)["prefix_cache"]
    assert status == "failed" and reason.startswith("RuntimeError: injected fault in probe prefix_cache at ")
    doc = next(d for d in procs(run["session"]) if d["pid"] == pid1)
    assert doc["probe_faults"] == {"prefix_cache": 1}
    assert f"probe prefix_cache (engine pid {pid1}): failed: RuntimeError: injected fault" in run["ingest"].stdout
    # the engine's other probes went on: block events (with hashes) and steps for all its requests
    assert query(run["db"], "select count(*) from block_events where pid = ? and event = 'cache' "
                            "and block_hash is not null", [pid1])[0][0] > 0
    assert query(run["db"], "select count(*) from prefix_lookups where pid = ?", [pid1])[0][0] == 0


def test_each_problem_is_one_warning_line(run):
    warnings = [line for line in run["record"].stderr.splitlines() if "kvtrace: warning:" in line]
    pid1, pid2 = run["engines"]["1"], run["engines"]["2"]
    assert sum("probe prefix_cache raised" in w and f"pid {pid1}" in w for w in warnings) == 1, warnings
    assert sum("probe kv_blocks disabled" in w and f"pid {pid2}" in w for w in warnings) == 1, warnings
    assert not any("Traceback" in line for line in run["record"].stderr.splitlines() if "kvtrace" in line)


# ---- two engines in one recording ---------------------------------------------------------------------
@pytest.mark.parametrize("table", ["request_events", "step_requests", "block_events"])
def test_events_of_each_engine_stay_with_it(run, table):
    for k, pid in run["engines"].items():
        ids = {base_id(r[0]) for r in query(run["db"], f"select distinct request_id from {table} "
                                                       "where pid = ? and request_id is not null", [pid])}
        expected = set(run["result"][k]["requests"])
        if table == "block_events" and k == "2":
            assert ids == set()  # kv_blocks disabled in engine 2
            continue
        assert ids == {base_id(r) for r in expected}, (k, table, ids)


def test_steps_are_counted_per_engine(run):
    for pid in run["engines"].values():
        steps = [r[0] for r in query(run["db"], "select step from steps where pid = ? order by step", [pid])]
        assert steps == list(range(1, len(steps) + 1))  # each engine numbers from 1, no gap, no duplicate
        finished = query(run["db"], "select count(*), sum(value) from request_events where pid = ? "
                                    "and event = 'finished'", [pid])[0]
        assert finished == (JOBS, JOBS * MAX_TOKENS)
        assert query(run["db"], "select sum(num_finished) from steps where pid = ?", [pid])[0][0] == JOBS
    requests = query(run["db"], "select count(*), count(distinct request_id) from requests")[0]
    assert requests == (2 * JOBS, 2 * JOBS)


# ---- privacy -------------------------------------------------------------------------------------------
def forbidden(run) -> dict[str, bytes]:
    """Everything that must not be recorded: marker, secrets, output texts and token id sequences."""
    out = {"marker": MARKER.encode(), "argv secret": ARGV_SECRET.encode()}
    out.update({f"env {k}": v.encode() for k, v in SECRETS.items()})
    for r in run["result"].values():
        for rid, o in r["outputs"].items():
            text = o["text"].strip()
            if len(text) >= 12:
                out[f"output text {rid}"] = text.encode()
            for width in ("<i", "<q"):  # token ids as int32 or int64 columns would hold them
                out[f"output ids {rid} {width}"] = b"".join(struct.pack(width, t) for t in o["token_ids"][:6])
        for rid, ids in r["prompt_token_ids"].items():
            tail = ids[-12:-6]  # the marker's part of the prompt (the shared prefix comes first)
            for width in ("<i", "<q"):
                out[f"prompt ids {rid} {width}"] = b"".join(struct.pack(width, t) for t in tail)
    return out


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_session_files_hold_no_prompt_output_token_or_secret(run):
    files = files_under(run["session"])
    assert files
    blob = {p: p.read_bytes() for p in files}
    assert any(b"e1-job0-turn0" in b for b in blob.values())  # the search finds what is recorded
    for what, needle in forbidden(run).items():
        hits = [str(p) for p, b in blob.items() if needle in b]
        assert not hits, f"{what} found in {hits}"


def test_command_line_and_environment_are_redacted(run):
    """The command line is kept as given (it says what ran), except values of secret-looking options; of
    the environment only VLLM_, KVTRACE_, CUDA_, OMP_, HF_, TORCH_, NCCL_ variables, secret-looking
    names redacted. (So a prompt given on the command line is recorded; the marker here comes through
    the environment, as a prompt file or a server's requests would.)"""
    doc = manifest(run["session"])
    cmd = doc["command"]
    assert cmd[cmd.index("--api-key") + 1] == "<redacted>" and cmd[cmd.index("--jobs") + 1] == str(JOBS)
    assert "RELIABILITY_MARKER" not in doc["env"]
    assert doc["env"]["HF_TOKEN"] == doc["env"]["VLLM_API_KEY"] == doc["env"]["KVTRACE_TEST_PASSWORD"] == "<redacted>"
    assert doc["env"].get("MY_API_TOKEN", "<redacted>") == "<redacted>"
    assert doc["options"].get("record_tokens") is False


def test_database_holds_no_prompt_output_token_or_secret(run):
    db = run["db"]
    data = db.read_bytes()
    for what, needle in forbidden(run).items():
        assert needle not in data, f"{what} found in {db}"
    # DuckDB compresses strings, so also search every text column through SQL.
    cols = query(db, "select table_name, column_name from information_schema.columns "
                     "where data_type in ('VARCHAR', 'JSON') and table_schema = 'main'")
    assert cols
    texts = [MARKER, ARGV_SECRET, *SECRETS.values()]
    by_table: dict[str, list[str]] = {}
    for table, col in cols:
        by_table.setdefault(table, []).append(col)
    for table, columns in by_table.items():  # one scan per table
        found = ", ".join(f'count(*) filter (where cast("{c}" as varchar) like ?) as "{c}|{t}"'
                          for c in columns for t in texts)
        con = duckdb.connect(str(db), read_only=True)
        try:
            cur = con.execute(f'select {found} from "{table}"', [f"%{t}%" for _ in columns for t in texts])
            hits = {d[0]: n for d, n in zip(cur.description, cur.fetchone()) if n}
        finally:
            con.close()
        assert not hits, f"in {table}: {hits}"
    hits = query(db, "select count(*) from request_events where request_id like 'e1-job0-turn0%'")[0][0]
    assert hits > 0  # the SQL search finds what is recorded
    # Block hashes are kept (they identify content without revealing it).
    assert query(db, "select count(*) from block_events where block_hash is not null")[0][0] > 0


def test_exports_hold_no_prompt_or_secret(run, tmp_path):
    """The viewer, Perfetto and Parquet exports (when this tree has them) carry no more than the database."""
    made = []
    for fmt, out in (("html", tmp_path / "v.html"), ("perfetto", tmp_path / "p.json"), ("parquet", tmp_path / "pq")):
        res = run_kvtrace("export", str(run["db"]), "--format", fmt, "-o", str(out), check=False)
        if res.returncode == 0:
            made.append(out)
    if not made:
        pytest.skip("no export format works in this tree yet")
    needles = {k: v for k, v in forbidden(run).items() if not k.startswith(("output ids", "prompt ids"))}
    for out in made:
        for p in ([out] if out.is_file() else files_under(out)):
            data = p.read_bytes()
            for what, needle in needles.items():
                assert needle not in data, f"{what} in {p}"
