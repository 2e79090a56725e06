"""Perfetto / Chrome trace-event JSON (`kvtrace export --format perfetto`) from a real recorded run:
the structure of the trace-event format (phases, required fields, nesting, monotonic timestamps per
track) and what it must contain (every step with its phases, one async track per request, counters,
preemptions), plus edge cases made by editing a copy of the database."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict

import duckdb
import pytest

from tests.helpers.run import query as q
from tests.helpers.run import run_kvtrace

pytestmark = pytest.mark.vllm

PHASES = {"X", "B", "E", "b", "e", "n", "i", "I", "C", "M"}
NUMBER = (int, float)


def check_trace_events(trace: dict) -> list[dict]:
    """Assert the JSON-object form of the trace-event format; returns the events.

    Checked: phases known; name/ph/pid on every event, ts (>= 0) on every non-metadata event; tid on
    thread-scoped ones; X has dur >= 0 and X slices of one thread nest properly; b/e pairs match per
    (cat, id) like a stack; C args are numbers; instants have a scope; timestamps never go backwards
    within a track (X/i: pid+tid, C: pid+name, b/e: cat+id), in file order.
    """
    assert isinstance(trace, dict) and isinstance(trace.get("traceEvents"), list)
    events = trace["traceEvents"]
    last_ts: dict[tuple, float] = {}
    open_async: dict[tuple, list[str]] = defaultdict(list)
    open_x: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for n, ev in enumerate(events):
        where = f"event {n}: {ev}"
        ph = ev.get("ph")
        assert ph in PHASES, where
        assert isinstance(ev.get("name"), str) and ev["name"], where
        assert isinstance(ev.get("pid"), int), where
        if "args" in ev:
            assert isinstance(ev["args"], dict), where
        if ph == "M":
            assert isinstance(ev.get("args"), dict), where
            continue
        assert isinstance(ev.get("ts"), NUMBER) and ev["ts"] >= 0, where
        if ph in ("X", "B", "E", "i", "I"):
            assert isinstance(ev.get("tid"), int), where
        if ph == "X":
            assert isinstance(ev.get("dur"), NUMBER) and ev["dur"] >= 0, where
            # In integer ns, as Perfetto imports them (µs floats do not add up exactly).
            start = round(ev["ts"] * 1000)
            end = start + round(ev["dur"] * 1000)
            stack = open_x[(ev["pid"], ev["tid"])]
            while stack and start >= stack[-1][1]:
                stack.pop()
            if stack:  # starts inside the open slice: must end inside it too
                assert end <= stack[-1][1], f"{where} overlaps its parent {stack[-1]}"
            stack.append((start, end))
            track = ("thread", ev["pid"], ev["tid"])
        elif ph in ("b", "e", "n"):
            assert isinstance(ev.get("cat"), str) and ev.get("id") is not None, where
            track = ("async", ev["cat"], ev["id"])
            if ph == "b":
                open_async[track].append(ev["name"])
            elif ph == "e":
                assert open_async[track] and open_async[track][-1] == ev["name"], f"{where}: unmatched end"
                open_async[track].pop()
        elif ph == "C":
            assert ev.get("args") and all(isinstance(v, NUMBER) for v in ev["args"].values()), where
            track = ("counter", ev["pid"], ev["name"])
        elif ph in ("i", "I"):
            assert ev.get("s", "t") in ("g", "p", "t"), where
            track = ("thread", ev["pid"], ev["tid"], "instant")
        else:
            track = ("thread", ev["pid"], ev.get("tid"))
        assert ev["ts"] >= last_ts.get(track, float("-inf")), f"{where}: ts goes back on {track}"
        last_ts[track] = ev["ts"]
    assert not any(open_async.values()), {k: v for k, v in open_async.items() if v}
    return events


@pytest.fixture(scope="module")
def trace(recorded_run, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("perfetto") / "run.json"
    proc = run_kvtrace("export", str(recorded_run["db"]), "--format", "perfetto", "-o", str(out))
    assert proc.stdout.startswith(f"wrote {out}") and "trace events" in proc.stdout
    return json.loads(out.read_text())


def test_structure(trace):
    events = check_trace_events(trace)
    assert {e["ph"] for e in events} >= {"M", "X", "C", "b", "e"}


def test_steps_and_phases_are_slices(trace, recorded_run):
    steps = q(recorded_run["db"], "SELECT step, t_start_ns, t_sched_end_ns, t_end_ns FROM steps ORDER BY step")
    t0 = q(recorded_run["db"], "SELECT start_monotonic_ns FROM sessions")[0][0]
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_step = {e["args"]["step"]: e for e in xs if e["cat"] == "step"}
    assert sorted(by_step) == [s for s, *_ in steps]
    phases = defaultdict(dict)
    for e in xs:
        if e["cat"] == "step_phase":
            phases[e["args"]["step"]][e["name"]] = e
    for step, ts, se, te in steps:
        ev = by_step[step]
        assert ev["name"] == f"step {step}"
        assert ev["ts"] == pytest.approx((ts - t0) / 1000, abs=1e-3)
        sched = phases[step]["schedule"]
        assert sched["ts"] == ev["ts"] and sched["dur"] == pytest.approx((se - ts) / 1000, abs=2e-3)
        if te is not None:
            exe = phases[step]["execute+update"]
            assert exe["ts"] == pytest.approx((se - t0) / 1000, abs=1e-3)
            assert exe["dur"] == pytest.approx((te - se) / 1000, abs=2e-3)
            assert ev["dur"] == pytest.approx((te - ts) / 1000, abs=2e-3)
        for key in ("scheduled_tokens", "kv_blocks_used", "admission_stop"):
            assert key in ev["args"]


def test_requests_are_async_tracks(trace, recorded_run):
    ids = {r for r, in q(recorded_run["db"], "SELECT request_id FROM requests")}
    tops = defaultdict(list)
    nested = defaultdict(set)
    depth: dict = defaultdict(int)
    for e in trace["traceEvents"]:
        if e["ph"] not in ("b", "e") or e["cat"] != "request":
            continue
        key = e["id"]
        if e["ph"] == "b":
            if depth[key] == 0:
                tops[key].append(e["name"])
            else:
                nested[key].add(e["name"])
            depth[key] += 1
        else:
            depth[key] -= 1
    assert sorted(n for names in tops.values() for n in names) == sorted(ids)
    assert all(len(names) == 1 for names in tops.values())  # one track per request
    kinds = set().union(*nested.values())
    assert {"queued", "prefill", "decode"} <= kinds
    # The standard run preempts: the preempted request's track shows it.
    if q(recorded_run["db"], "SELECT count(*) FROM preemptions")[0][0]:
        assert "preempted" in kinds


def test_counters_and_instants(trace, recorded_run):
    db = recorded_run["db"]
    n_steps, n_pre, n_pins = q(db, "SELECT (SELECT count(*) FROM steps), (SELECT count(*) FROM preemptions), "
                                   "(SELECT count(*) FROM pins)")[0]
    counters = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "C":
            counters[e["name"]].append(e["args"])
    assert len(counters["KV blocks"]) == n_steps and len(counters["KV usage %"]) == n_steps
    used = [u for u, in q(db, "SELECT kv_blocks_used FROM steps ORDER BY t_start_ns")]
    assert [a["used"] for a in counters["KV blocks"]] == used
    total = q(db, "SELECT max(kv_blocks_total) FROM steps")[0][0]
    assert all(a["used"] + a["free"] == total for a in counters["KV blocks"])
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i" and e["cat"] != "origin"]
    assert sum(e["cat"] == "preemption" for e in instants) == n_pre
    assert sum(e["cat"] == "pin" for e in instants) == n_pins
    for e in instants:
        assert "step" in e["args"] and e["args"]["request_id"] in e["name"]


def test_clock_metadata(trace, recorded_run):
    t0, utc = q(recorded_run["db"], "SELECT start_monotonic_ns, start_utc_ns FROM sessions")[0]
    clocks = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "clock"]
    assert clocks and all(c["args"]["unit"] == "us" and c["args"]["origin"] == "session start" for c in clocks)
    assert clocks[0]["args"]["origin_monotonic_ns"] == t0 and clocks[0]["args"]["origin_utc_ns"] == utc
    assert trace["otherData"]["origin_monotonic_ns"] == t0
    # kvtrace query's t_s origin (the first engine step) is in the trace: in its metadata and as a marker.
    (first,), = q(recorded_run["db"], "SELECT min(t_start_ns) FROM steps")
    assert trace["otherData"]["first_engine_step_us"] == pytest.approx((first - t0) / 1000, abs=1e-3)
    (mark,) = [e for e in trace["traceEvents"] if e["name"].startswith("first engine step")]
    assert mark["ph"] == "i" and mark["ts"] == trace["otherData"]["first_engine_step_us"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"vLLM engine rank 0", "requests rank 0"} <= names


def test_edited_copy_edge_cases(recorded_run, tmp_path):
    """Edits a copy: the last step never finished, step 3 starts before step 2 ended (async
    scheduling), a pin. The export stays well-formed: no execute slice for the open step, the
    overlapping one on a second thread so slices still nest, the pin an instant."""
    db = tmp_path / "edited.duckdb"
    shutil.copy(recorded_run["db"], db)
    con = duckdb.connect(str(db))
    last = con.execute("SELECT max(step) FROM steps").fetchall()[0][0]
    con.execute("UPDATE steps SET t_end_ns = NULL WHERE step = ?", [last])
    (end2,), = con.execute("SELECT t_end_ns FROM steps WHERE step = 2").fetchall()
    (s3, e3), = con.execute("SELECT t_start_ns, t_sched_end_ns FROM steps WHERE step = 3").fetchall()
    shift = s3 - (end2 - 1000)
    con.execute("UPDATE steps SET t_start_ns = t_start_ns - ?, t_sched_end_ns = t_sched_end_ns - ? WHERE step = 3",
                [shift, shift])
    con.execute("INSERT INTO pins SELECT session, 0, 1, t_end_ns, step, 'pin', 'job0-x', [1, 2], 10, 'ttl' FROM steps "
                "WHERE step = 5")
    con.close()
    out = tmp_path / "edited.json"
    run_kvtrace("export", str(db), "-o", str(out))  # .json picks perfetto
    events = check_trace_events(json.loads(out.read_text()))
    phases = {(e["args"]["step"], e["name"]) for e in events if e["ph"] == "X" and e["cat"] == "step_phase"}
    assert (last, "schedule") in phases and (last, "execute+update") not in phases
    step3 = next(e for e in events if e["ph"] == "X" and e["cat"] == "step" and e["args"]["step"] == 3)
    step2 = next(e for e in events if e["ph"] == "X" and e["cat"] == "step" and e["args"]["step"] == 2)
    assert step3["tid"] != step2["tid"]
    last_ev = next(e for e in events if e["ph"] == "X" and e["cat"] == "step" and e["args"]["step"] == last)
    assert last_ev["args"]["finished"] is False
    pin = next(e for e in events if e["ph"] == "i" and e["cat"] == "pin")
    assert pin["name"] == "pin job0-x" and pin["args"]["step"] == 5 and pin["args"]["blocks"] == 2


def test_checker_rejects_bad_traces():
    """The structural check itself catches what it claims to."""
    good = {"name": "s", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1}
    check_trace_events({"traceEvents": [good]})
    bad = [
        [{**good, "ph": "Q"}],
        [{**good, "dur": -1}],
        [{**good, "ts": 5.0}, {**good, "ts": 4.0}],  # back in time on one thread
        [{**good, "dur": 10}, {**good, "ts": 5.0, "dur": 10}],  # overlaps without nesting
        [{"name": "r", "ph": "b", "ts": 1, "pid": 1, "cat": "request", "id": "0x1"}],  # never ends
        [{"name": "c", "ph": "C", "ts": 1, "pid": 1, "args": {"v": "x"}}],
    ]
    for events in bad:
        with pytest.raises(AssertionError):
            check_trace_events({"traceEvents": events})
