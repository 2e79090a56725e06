"""Signals to `kvtrace record -- vllm serve ...`, and two recordings at once.

Three servers are recorded at the same time, into three session directories, and serve requests with
their own request ids; then server A gets SIGINT, B SIGTERM, C SIGINT twice. What must hold: the signal
reaches vLLM, which shuts down its own way; kvtrace finalises the session and exits with the child's
status; after a second SIGINT nothing of the process group is left; no process anywhere still records
into a session; each session holds its own server's requests and none of the others'. Server A also
runs with `--api-key` and a secret in its environment, and its prompts carry a marker: none of them is
recorded. See docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time

import pytest

from tests.helpers.reliability_util import (
    STARTUP_S,
    free_port,
    group_gone,
    group_members,
    healthy,
    http_json,
    ingest,
    manifest,
    procs,
    query,
    rows,
    serve_cmd,
    session_line,
    start_record,
    wait_until,
)

pytestmark = pytest.mark.vllm
SERVERS = {"a": signal.SIGINT, "b": signal.SIGTERM, "c": "double-SIGINT"}
REQUESTS = 3
MARKER = "UNIQUE_SERVE_MARKER_QRS"
API_KEY = "secret2-serve-key"
ENV_SECRET = "supersecret-serve-env"


def recording_processes(session) -> list[int]:
    """Processes anywhere on the machine whose environment says they record into `session`."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(Exception):
            if p.environ().get("KVTRACE_SESSION") == str(session):
                found.append(p.pid)
    return found


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("signals")
    recs, ports = {}, {}
    for name in SERVERS:
        ports[name] = free_port()
        extra = ["--api-key", API_KEY] if name == "a" else []
        env = {"HF_TOKEN": ENV_SECRET, "MY_API_TOKEN": ENV_SECRET} if name == "a" else {}
        recs[name] = start_record(tmp / name, serve_cmd(tiny_model, ports[name], *extra), env=env)
    try:
        for name, rec in recs.items():
            wait_until(lambda port=ports[name]: healthy(port), STARTUP_S, f"server {name} to start", rec, every=1.0)
            rec.child()
        sent = {}
        for name in SERVERS:
            headers = {"Authorization": f"Bearer {API_KEY}"} if name == "a" else {}
            sent[name] = []
            for i in range(REQUESTS):
                rid = f"{name}srv-req{i}"
                body = {"model": "tiny", "prompt": f"Request {i} {MARKER if name == 'a' else ''} of {name}: " * 8,
                        "max_tokens": 8}
                out = http_json(f"http://127.0.0.1:{ports[name]}/v1/completions", body,
                                {**headers, "X-Request-Id": rid})
                sent[name].append((rid, out["choices"][0]["text"]))
        for name, rec in recs.items():  # every request's events flushed (5 lifecycle events each)
            wait_until(lambda rec=rec: any(rows(d, "request_events") >= 5 * REQUESTS for d in procs(rec.session)), 60,
                       f"{name}'s events to be flushed", rec)
        for name, sig in SERVERS.items():
            rec = recs[name]
            rec.notes["signalled_at"] = time.monotonic()
            if sig == "double-SIGINT":
                rec.proc.send_signal(signal.SIGINT)
                time.sleep(0.3)
                rec.proc.send_signal(signal.SIGINT)
            else:
                rec.proc.send_signal(sig)
        for rec in recs.values():
            rec.notes["exit"] = rec.wait(timeout=180)
            rec.notes["exited_at"] = time.monotonic()
            rec.notes["gone"] = group_gone(rec.child_pgid)
            rec.notes["members"] = [] if rec.notes["gone"] else group_members(rec.child_pgid)
            rec.notes["recording"] = recording_processes(rec.session)
        for name, rec in recs.items():
            rec.notes["db"] = tmp / f"{name}.duckdb"
            rec.notes["ingest"] = ingest(rec.session, rec.notes["db"])
        yield {"recs": recs, "sent": sent}
    finally:
        for rec in recs.values():
            rec.kill_all()


def vllm_log(rec) -> str:
    return rec.stdout + rec.stderr


def force_killed_by_vllm(rec) -> set[int]:
    """Pids vLLM's own shutdown SIGKILLed (it does so to workers and engines that do not exit at once)."""
    return {int(p) for p in re.findall(r"force killing (?:remaining process|sub process) \S+(?: \S+)? pid (\d+)",
                                       vllm_log(rec))}


@pytest.mark.parametrize("name", ["a", "b"])
def test_signal_reaches_vllm_which_shuts_down_and_kvtrace_finalises(servers, name):
    rec = servers["recs"][name]
    doc = manifest(rec.session)
    child = doc["exit_code"]
    assert child is not None
    assert rec.notes["exit"] == (128 - child if child < 0 else child)  # the child's status, as a shell gives it
    log = vllm_log(rec)
    assert "[shutdown] API server: shutdown triggered" in log or "Shutting down" in log, log[-3000:]
    assert doc["status"] in ("complete", "incomplete") and doc["clock"].get("end_monotonic_ns")
    assert {p["role"] for p in doc["procs"]} >= {"engine"}
    # A process that neither closed its shards nor flushed them when kvtrace passed the signal on (status
    # "flushed") was SIGKILLed by vLLM's own shutdown, never by kvtrace.
    unclosed = {p["pid"] for p in doc["procs"] if p["status"] not in ("complete", "flushed")}
    assert unclosed <= force_killed_by_vllm(rec), (unclosed, log[-3000:])
    assert (doc["status"] == "complete") == (not unclosed and child in (0, -2, -15, 130, 143))
    last = session_line(rec.stderr)
    assert last.startswith(f"kvtrace: session {rec.session} (") and last.endswith(f"exit {child})"), last
    assert rec.notes["gone"], rec.notes["members"]
    assert rec.notes["recording"] == []
    assert rec.notes["ingest"].returncode == 0
    assert query(rec.notes["db"], "select status from sessions") == [(doc["status"],)]  # ingest agrees


def test_second_sigint_leaves_no_process_behind(servers):
    rec = servers["recs"]["c"]
    assert rec.notes["gone"], rec.notes["members"]
    assert rec.notes["recording"] == []
    assert rec.notes["exited_at"] - rec.notes["signalled_at"] < 30  # no waiting for a graceful shutdown
    doc = manifest(rec.session)
    assert doc["exit_code"] is not None and rec.notes["exit"] == (128 - doc["exit_code"] if doc["exit_code"] < 0
                                                                  else doc["exit_code"])
    res = rec.notes["ingest"]
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("name", list(SERVERS))
def test_each_session_holds_its_own_requests_only(servers, name):
    rec = servers["recs"][name]
    res = rec.notes["ingest"]
    assert res.returncode == 0, res.stderr
    ids = [r[0] for r in query(rec.notes["db"], "select distinct request_id from request_events")]
    for other in SERVERS:
        mine = [i for i in ids if f"{other}srv-req" in i]
        if other == name:
            assert len(mine) == REQUESTS, ids
        else:
            assert mine == [], f"{other}'s requests in {name}'s session: {mine}"
    finished = query(rec.notes["db"], "select count(*) from request_events where event = 'finished'")[0][0]
    assert finished == REQUESTS


def test_served_prompts_outputs_and_secrets_are_not_recorded(servers):
    rec = servers["recs"]["a"]
    needles = {"marker": MARKER.encode(), "api key": API_KEY.encode(), "env": ENV_SECRET.encode()}
    for rid, text in servers["sent"]["a"]:
        if len(text.strip()) >= 12:
            needles[f"output {rid}"] = text.strip().encode()
    for path in [p for p in rec.session.rglob("*") if p.is_file()] + [rec.notes["db"]]:
        data = path.read_bytes()
        for what, needle in needles.items():
            assert needle not in data, f"{what} in {path}"
    doc = manifest(rec.session)
    assert doc["command"][doc["command"].index("--api-key") + 1] == "<redacted>"
    assert doc["env"]["HF_TOKEN"] == "<redacted>" and "MY_API_TOKEN" not in doc["env"]
