"""Holds and pins: KV kept against eviction for a reason other than a running request.

(a) Connector holds: no connector that delays frees runs on the CPU build, so tests/helpers/delay_free_connector.py
    (ExampleConnector + request_finished returning True, the send reported done 3 worker steps later)
    stands in; the scheduler probe records hold/release, the connector probe the calls that cause them.
(b) Pins: tests/helpers/pinning_scheduler.py keeps every finished turn's full blocks for a TTL through the pin
    adapter (kvtrace.probes.pins), and the job's next turn arrives after a 0.3 s "tool call".
Both run in one recorded engine run (4 jobs x 3 turns).
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers.run import JOB_PATTERN, REPO, run_kvtrace

TTL_S = 1.5
DELAY_STEPS = 3
JOBS, TURNS = 4, 3


# ---- the adapter, without an engine ----------------------------------------------------------------
@pytest.fixture
def pins_module(monkeypatch):
    from kvtrace.probes import pins

    pins._reset_for_tests()
    yield pins
    pins._reset_for_tests()


def test_adapter_is_a_noop_when_not_recording(pins_module, monkeypatch):
    import kvtrace.record.recorder as recorder

    monkeypatch.delenv("KVTRACE_SESSION", raising=False)
    monkeypatch.setattr(recorder, "_recorder", None)
    pins_module.report_pin("r1", [1, 2], 10**9, "ttl-pin")
    pins_module.report_reuse("r1", [1], "ttl-pin")
    pins_module.report_unpin("r1", [1, 2], "ttl-pin")
    pins_module.report_expire("r1", None, 10**9, "ttl-pin")
    assert pins_module._pins_buffer() is None


@pytest.mark.parametrize("disabled", [False, True])
def test_adapter_appends_pins_rows(pins_module, monkeypatch, tmp_path, disabled):
    import kvtrace.record.recorder as recorder
    from kvtrace.format.shards import rows_to_batch
    from kvtrace.record.context import ctx
    from kvtrace.record.recorder import Recorder

    rec = Recorder(tmp_path, "engine", {"disable_probes": ["pins"]} if disabled else {})
    try:
        monkeypatch.setattr(recorder, "_recorder", rec)
        monkeypatch.setattr(ctx, "step", 7)
        pins_module.report_pin("job0-turn0", [3, 4], 2 * 10**9, "ttl-pin")
        pins_module.report_reuse("job0-turn0", [3], "ttl-pin", step=9)
        pins_module.report_unpin("job0-turn0", (b for b in [3, 4]), "ttl-pin", step=9)
        pins_module.report_expire("job1-turn0", [5], 2 * 10**9, "ttl-pin")
        pins_module.report_pin("bad", ["not a block"], None)  # swallowed: never raises into vLLM
        rows = [r[1:] for r in rec.take_rows("pins")]
        if disabled:
            assert rows == []
            return
        assert rows == [
            (7, "pin", "job0-turn0", [3, 4], 2 * 10**9, "ttl-pin"),
            (9, "reuse", "job0-turn0", [3], None, "ttl-pin"),
            (9, "unpin", "job0-turn0", [3, 4], None, "ttl-pin"),
            (7, "expire", "job1-turn0", [5], 2 * 10**9, "ttl-pin"),
        ]
        assert rows_to_batch("pins", [(0, *r) for r in rows]).num_rows == 4  # the rows fit the schema
        assert rec.dropped == {}
    finally:
        rec.close()


# ---- a real engine run ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pin_run(tiny_model, tmp_path_factory):
    import duckdb

    tmp = tmp_path_factory.mktemp("pins")
    session, db = tmp / "pins", tmp / "pins.duckdb"
    run_kvtrace("record", "-o", str(session), "--job-pattern", JOB_PATTERN, "--",
                sys.executable, str(REPO / "tests" / "helpers" / "pinning_scheduler.py"), "--model", tiny_model,
                "--connector-dir", str(tmp / "kvstore"), "--metrics-out", str(tmp / "metrics.json"),
                "--jobs", str(JOBS), "--turns", str(TURNS), "--delay-steps", str(DELAY_STEPS),
                env={"KVTRACE_TEST_PIN_TTL_S": str(TTL_S)})
    run_kvtrace("ingest", str(session), "-o", str(db))
    con = duckdb.connect(str(db), read_only=True)
    yield con
    con.close()


def rows(con, sql, *params):
    cur = con.execute(sql, list(params))
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


@pytest.mark.vllm
def test_pinning_scheduler_was_used(pin_run):
    cfg = rows(pin_run, "select manifest->>'$.engine_config.scheduler_cls' as cls from sessions")[0]
    assert "PinningScheduler" in cfg["cls"]
    assert rows(pin_run, "select count(*) as n from requests")[0]["n"] == JOBS * TURNS


@pytest.mark.vllm
def test_connector_holds_until_the_send_is_reported(pin_run):
    con = pin_run
    finished = {r["request_id"] for r in rows(con, "select request_id from request_events where event = 'finished'")}
    assert len(finished) == JOBS * TURNS
    held = rows(con, """select request_id, event, step, block_ids from pins
                        where reason = 'connector-delay-free' order by ts_ns""")
    by_req: dict[str, dict] = {}
    for r in held:
        assert r["event"] not in by_req.setdefault(r["request_id"], {}), "one hold and one release each"
        by_req[r["request_id"]][r["event"]] = r
    assert set(by_req) == finished
    for rid, ev in by_req.items():
        hold, release = ev["hold"], ev["release"]
        assert release["block_ids"] == hold["block_ids"] and hold["block_ids"]
        # Finished at step s, the worker is told at s+1 and reports the send done on its 3rd
        # get_finished call, at s+3; the scheduler frees the blocks in that step's update_from_output.
        assert release["step"] - hold["step"] == DELAY_STEPS
        calls = rows(con, """select method, direction, step, tokens from transfers where request_id = ?
                             and method in ('request_finished', 'get_finished') order by ts_start_ns""", rid)
        assert [(c["method"], c["direction"], c["step"]) for c in calls] == [
            ("request_finished", "finish", hold["step"]), ("get_finished", "save", release["step"])]
        assert calls[0]["tokens"] == 1  # the connector delayed the free


@pytest.mark.vllm
def test_pins_are_reused_by_the_next_turn_before_expiry(pin_run):
    con = pin_run
    pin_rows = rows(con, """select p.*, q.job_id, q.turn from pins p join requests q using (session, request_id)
                            where p.reason = 'ttl-pin' order by p.ts_ns""")
    life: dict[str, dict] = {}
    for r in pin_rows:
        life.setdefault(r["request_id"], {})[r["event"]] = r
    assert len(life) == JOBS * TURNS  # every finished turn pinned its full blocks
    ttl_ns = int(TTL_S * 1e9)
    for rid, ev in life.items():
        pin = ev["pin"]
        assert pin["ttl_ns"] == ttl_ns and pin["block_ids"]
        release = rows(con, """select step from pins where request_id = ? and event = 'release'""", rid)[0]
        if pin["turn"] == TURNS - 1:  # no next turn: the pin runs out
            assert set(ev) == {"pin", "expire"}, rid
            assert ev["expire"]["ts_ns"] - pin["ts_ns"] >= ttl_ns
            assert ev["expire"]["block_ids"] == pin["block_ids"]
            continue
        assert set(ev) == {"pin", "reuse", "unpin"}, rid
        reuse, unpin = ev["reuse"], ev["unpin"]
        assert reuse["ts_ns"] - pin["ts_ns"] < ttl_ns and reuse["step"] == unpin["step"]
        # The connector's hold had ended: only the pin kept a reference when the next turn came.
        assert reuse["step"] > release["step"]
        assert reuse["block_ids"] and set(reuse["block_ids"]) <= set(pin["block_ids"])
        # The next turn of the same job got those blocks from the prefix cache in that step.
        nxt = rows(con, "select request_id from requests where job_id = ? and turn = ?",
                   pin["job_id"], pin["turn"] + 1)[0]["request_id"]
        touched = {r["block_id"] for r in rows(con, """select block_id from block_events
                   where request_id = ? and event = 'touch' and step = ?""", nxt, reuse["step"])}
        assert set(reuse["block_ids"]) <= touched
        hit = rows(con, "select hit_blocks, step from prefix_lookups where request_id = ?", nxt)[0]
        assert hit["step"] == reuse["step"] and hit["hit_blocks"] >= len(reuse["block_ids"])
    # Pinned blocks were never evicted while pinned.
    evicted = rows(con, """select count(*) as n from pins p join block_events b
                           on b.event = 'evict' and list_contains(p.block_ids, b.block_id)
                           and b.ts_ns > p.ts_ns and b.ts_ns < (select min(e.ts_ns) from pins e
                             where e.request_id = p.request_id and e.event in ('unpin', 'expire'))
                           where p.event = 'pin'""")
    assert evicted[0]["n"] == 0
