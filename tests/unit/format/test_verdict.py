"""A session's verdict (format/session.py): complete only when nothing is missing; otherwise degraded,
empty or incomplete, with one line per reason."""

from __future__ import annotations

from kvtrace.format.session import session_problems, verdict


def proc(role: str, pid: int, probes: dict | None = None, rows: dict | None = None, dropped: dict | None = None):
    return {"role": role, "pid": pid, "status": "complete", "probes": probes or {},
            "rows_written": rows or {}, "dropped": dropped or {}}


ATTACHED = {"status": "attached", "reason": ""}
ENGINE = proc("engine", 10, {"scheduler": ATTACHED, "kv_blocks": ATTACHED, "prefix_cache": ATTACHED},
              {"steps": 40, "request_events": 12, "prefix_lookups": 4, "block_events": 30})
WORKER = proc("worker", 11, {"attention": ATTACHED}, {"kv_access": 500, "layer_timings": 80, "batch_slots": 60})
FRONT = proc("proc", 9, {"attention": {"status": "attached", "reason": ""}})  # imported the layers, ran none
CACHING = {"enable_prefix_caching": True}


def test_a_whole_session_is_complete():
    assert verdict(True, [FRONT, ENGINE, WORKER], CACHING) == ("complete", [])


def test_a_probe_that_did_not_attach_degrades_it_with_its_reason():
    engine = {**ENGINE, "probes": {**ENGINE["probes"], "kv_blocks": {"status": "disabled",
                                                                     "reason": "BlockPool.touch not found"}}}
    status, problems = verdict(True, [engine, WORKER], CACHING)
    assert status == "degraded"
    assert problems == ["probe kv_blocks (engine pid 10): disabled: BlockPool.touch not found"]


def test_a_degraded_or_unsupported_probe_is_said():
    worker = {**WORKER, "probes": {"attention": {"status": "unsupported", "reason": "unsupported: FlashInferMetadata"}}}
    engine = {**ENGINE, "probes": {**ENGINE["probes"], "scheduler": {"status": "degraded",
                                                                     "reason": "not recorded: kv-insuf"}}}
    status, problems = verdict(True, [engine, worker], CACHING)
    assert status == "degraded"
    assert "probe scheduler (engine pid 10): degraded: not recorded: kv-insuf" in problems
    assert "probe attention (worker pid 11): unsupported: unsupported: FlashInferMetadata" in problems


def test_lost_rows_are_counted_by_table_and_cause():
    worker = {**WORKER, "dropped": {"kv_access": {"ring-wrap": 7, "drain-error": 3}}}
    engine = {**ENGINE, "dropped": {"kv_access": {"ring-wrap": 1}}}
    status, problems = verdict(True, [engine, worker], CACHING)
    assert status == "degraded"
    assert problems == ["11 rows lost (kv_access: drain-error 3, kv_access: ring-wrap 8)"]


def test_an_attached_probe_that_recorded_nothing_is_flagged():
    silent_worker = {**WORKER, "rows_written": {"batch_slots": 60}}
    no_lookups = {**ENGINE, "rows_written": {**ENGINE["rows_written"], "prefix_lookups": 0}}
    problems = session_problems([no_lookups, silent_worker], CACHING)
    assert problems == [
        "probe prefix_cache attached (engine pid 10) but recorded no lookup for the requests it saw, "
        "with prefix caching on",
        "probe attention attached (worker pid 11) but recorded no KV access in 40 engine steps"]
    # Without prefix caching there is nothing to look up; a front end that ran no layer is not flagged.
    assert session_problems([no_lookups, FRONT, WORKER], {"enable_prefix_caching": False}) == []


def test_requests_without_steps_are_flagged():
    engine = {**ENGINE, "rows_written": {"request_events": 12, "block_events": 3, "prefix_lookups": 4}}
    assert session_problems([engine], CACHING) == [
        "the engine ran requests but no step was recorded (is the scheduler probe attached?)"]


def test_nothing_recorded_is_empty_not_complete():
    status, problems = verdict(True, [], CACHING)
    assert status == "empty" and problems[0].startswith("no vLLM process was recorded")
    bookkeeping_only = proc("proc", 5, {"scheduler": ATTACHED}, {"clock_anchors": 3, "drops": 0})
    assert verdict(True, [bookkeeping_only], None) == ("empty", ["nothing was recorded"])


def test_incomplete_wins_and_keeps_the_reasons():
    worker = {**WORKER, "dropped": {"kv_access": {"ring-wrap": 2}}}
    assert verdict(False, [ENGINE, worker], CACHING) == ("incomplete", ["2 rows lost (kv_access: ring-wrap 2)"])


def test_wrong_typed_documents_do_not_raise():
    odd = {"role": "engine", "pid": 1, "probes": ["x"], "rows_written": {"steps": "many"}, "dropped": {"t": 5}}
    assert verdict(True, [odd], None)[0] == "empty"
