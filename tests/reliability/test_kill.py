"""Killed mid-run: SIGKILL to the EngineCore, to a worker, and to the whole process group of a recorded
real vLLM run. Three recordings run at once (one per kill) to share the cost of starting vLLM.

What must hold: kvtrace record exits with the child's status and leaves no process behind; every shard
flushed before the kill ingests; the killed process's open shards are reported (and a batch cut by the
kill would be, with its bytes); the session is `incomplete` in the manifest and in the database. See
docs/reliability.md.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.helpers.reliability_util import (
    STARTUP_S,
    engine_with_steps,
    group_gone,
    group_members,
    ingest,
    manifest,
    procs,
    query,
    session_line,
    start_record,
    workload_cmd,
)

pytestmark = pytest.mark.vllm
KILLS = ("engine", "worker", "group")
UNNESTED = {"block_events"}  # one shard row per call, one database row per block


@pytest.fixture(scope="module")
def killed(tiny_model, tmp_path_factory) -> dict:
    """Three recordings of a long workload; once each has flushed steps, one gets its kill."""
    tmp = tmp_path_factory.mktemp("killed")
    # Long enough that no run can finish before its kill: at --repeat 50 (~1,800 steps, a few seconds on
    # a fast day) 2 of 5 runs of this module on 2026-11-24 had a killed recording exit 0, as a run that
    # ended before its kill would. A killed run stops at once whatever its length: the length is free.
    recs = {k: start_record(tmp / k, workload_cmd(tiny_model, "--repeat", "400", "--jobs", "4", "--turns", "2",
                                                  "--max-tokens", "16"))
            for k in KILLS}
    try:
        pending = set(KILLS)
        deadline = time.monotonic() + STARTUP_S
        while pending:
            assert time.monotonic() < deadline, f"no steps flushed in time by {pending}"
            for k in sorted(pending):
                rec = recs[k]
                assert rec.proc.poll() is None, f"{k}: record exited early:\n{rec.stderr[-3000:]}"
                eng = engine_with_steps(rec)
                if not eng:
                    continue
                rec.child()  # learn the group before anything dies
                docs = procs(rec.session)
                target = {"engine": [eng["pid"]], "worker": [d["pid"] for d in docs if d["role"] == "worker"],
                          "group": []}[k]
                if k == "group":
                    os.killpg(rec.child_pgid, signal.SIGKILL)
                else:
                    for pid in target:
                        os.kill(pid, signal.SIGKILL)
                rec.notes.update(killed=target, at=time.monotonic(), before={d["pid"]: d for d in docs})
                pending.discard(k)
            time.sleep(0.2)
        for k, rec in recs.items():
            try:
                rec.notes["exit"] = rec.proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                # vLLM 0.32's offline front end waits forever for outputs once its EngineCore is gone (its
                # output thread exits without queueing EngineDeadError); kvtrace record waits with its
                # child. A user presses Ctrl-C: record forwards it and the front end exits.
                rec.notes["hung"] = True
                rec.proc.send_signal(signal.SIGINT)
                rec.notes["exit"] = rec.wait(timeout=120)
            rec.notes["db"] = tmp / f"{k}.duckdb"
            rec.notes["ingest"] = ingest(rec.session, rec.notes["db"])
        yield recs
    finally:
        for rec in recs.values():
            rec.kill_all()


@pytest.mark.parametrize("kill", KILLS)
def test_record_exits_with_the_childs_status_and_leaves_nothing(killed, kill):
    rec = killed[kill]
    code = rec.notes["exit"]
    doc = manifest(rec.session)
    if kill == "group":
        assert code == 128 + signal.SIGKILL and doc["exit_code"] == -signal.SIGKILL
    else:  # vLLM's front end sees its engine die and exits with an error
        assert code != 0 and doc["exit_code"] == code, (code, doc["exit_code"], rec.stderr[-2000:])
    assert group_gone(rec.child_pgid), group_members(rec.child_pgid)
    assert doc["status"] == "incomplete"
    last = session_line(rec.stderr)  # then the problems a killed run can have (what it did not flush)
    assert "(incomplete, exit" in last, last
    assert "Traceback" not in "".join(line for line in rec.stderr.splitlines() if "kvtrace" in line)


@pytest.mark.parametrize("kill", KILLS)
def test_every_flushed_shard_ingests_and_the_session_is_incomplete(killed, kill):
    rec = killed[kill]
    res = rec.notes["ingest"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert "(incomplete)" in res.stdout, res.stdout
    db = rec.notes["db"]
    assert query(db, "select status from sessions") == [("incomplete",)]
    docs = {d["pid"]: d for d in procs(rec.session)}
    killed_pids = set(rec.notes["killed"]) or set(docs)  # the group kill: every process
    for pid in rec.notes["killed"] or []:
        assert docs[pid]["status"] == "running", docs[pid]  # it never closed
    # Every row a process said it had written (proc.json is rewritten after the shards, at most 2 s apart)
    # is in the database.
    for pid, doc in docs.items():
        for table, n in (doc.get("rows_written") or {}).items():
            if table in UNNESTED or not n:
                continue
            if table == "decode_runs":  # runs, each one or more decode rows of step_requests
                got = query(db, "select count(*) from step_requests where pid = ? and phase = 'decode'", [pid])[0][0]
            elif table == "batch_slot_runs":  # runs, each one or more batch_slots rows
                got = query(db, "select count(*) from batch_slots where pid = ?", [pid])[0][0]
            elif table == "kv_access_records":  # ring drains, each one or more kv_access rows
                got = query(db, "select count(*) from kv_access where pid = ?", [pid])[0][0]
            else:
                got = query(db, f"select count(*) from {table} where pid = ?", [pid])[0][0]
            assert got >= n, f"pid {pid} ({doc['role']}) {table}: {got} rows ingested, {n} written"
    # The killed processes' open shards are reported, with the process's status in `procs`.
    issues = query(db, "select file, problem, bytes_cut from ingest_issues")
    open_files = {str(p) for pid in killed_pids for p in docs[pid]["_dir"].glob("*.arrows.partial")}
    assert open_files, "the killed process left no open shard"
    assert open_files <= {f for f, _, _ in issues}, (open_files, issues)
    statuses = dict(query(db, "select pid, status from procs"))
    assert all(statuses[pid] != "complete" for pid in killed_pids if docs[pid]["status"] != "complete")
    for line in res.stdout.splitlines():
        assert not line.startswith("  incomplete:") or ("not closed" in line or "cut" in line), line


def test_engine_kill_keeps_the_engines_steps(killed):
    """The killed EngineCore's steps up to its last flush are there, numbered from 1 without gaps."""
    rec = killed["engine"]
    pid = rec.notes["killed"][0]
    steps = [r[0] for r in query(rec.notes["db"], "select step from steps where pid = ? order by step", [pid])]
    assert len(steps) >= 5 and steps == list(range(1, len(steps) + 1))


def test_a_batch_cut_by_a_kill_is_reported_with_its_bytes(killed, tmp_path):
    """SIGKILL does not interrupt a write() to a local file, so the real kills above leave whole batches.
    A cut batch comes from a kill during a write on other file systems, or power loss: made here by cutting
    the last batch of the real killed engine's biggest open shard."""
    import pyarrow as pa

    rec = killed["engine"]
    copy = tmp_path / "cut"
    shutil.copytree(rec.session, copy)
    pid = rec.notes["killed"][0]
    engine_dir = next(p for p in (copy / "procs").iterdir() if p.name.endswith(f"-{pid}"))
    shard = max(engine_dir.glob("*.arrows.partial"), key=lambda p: p.stat().st_size)
    table = shard.name.split(".")[0]
    data = shard.read_bytes()
    with open(shard, "rb") as f:
        reader = pa.ipc.open_stream(f)
        ends, batches = [f.tell()], []  # where the schema ends, then where each batch ends
        for batch in reader:
            batches.append(batch)
            ends.append(f.tell())
    assert batches and ends[-1] == len(data)  # whole batches, nothing after the last (never closed)
    whole = ends[-2]
    cut_at = whole + (len(data) - whole) // 2
    shard.write_bytes(data[:cut_at])
    db = tmp_path / "cut.duckdb"
    res = ingest(copy, db)
    assert res.returncode == 0 and "last batch cut" in res.stdout, res.stdout + res.stderr
    got = query(db, "select bytes_cut, problem from ingest_issues where file = ?", [str(shard)])
    kept = sum(b.num_rows for b in batches[:-1])
    assert got == [(cut_at - whole, f"{shard}: last batch cut ({cut_at - whole} bytes after row {kept})")]
    if table not in UNNESTED:
        assert query(db, f"select count(*) from {table} where pid = ?", [pid])[0][0] == kept
