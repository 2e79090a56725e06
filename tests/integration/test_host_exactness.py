"""Host probes, exact: what the scheduler, block-pool and prefix-cache probes record equals what vLLM did.

Two kinds of evidence:
- Small deterministic scenarios on vLLM's own Scheduler + KV cache manager, driven without a model
  (tests/helpers/driven_scheduler.py; a few seconds each): every recorded row is asserted, row by row, against
  what the scenario must produce: (a) a shared 3-block prefix, (b) one preemption in a 5-block pool,
  and the admission-stop reason of constructed steps (tok-budget, max-seqs, kv-insuf, preempted, none).
- vLLM's own KV reports for the same blocks: the residency metrics (`kv_cache_metrics`, sample 1.0: one
  KVCacheEvictionEvent per block allocation that ends, with its lifetime and idle time before the end)
  against the lifetimes kvtrace derives from `block_events` (canned query `block_lifetimes`); and the KV
  events (`kv_events_config`: BlockStored / BlockRemoved with the blocks' hashes) against our `cache` /
  `evict` rows. Once on the driven scheduler (events read in process: exact per event) and once in a
  real engine run recorded with `kvtrace record` (marked vllm), where the eviction events come through
  a custom stat logger and the KV events through the zmq publisher to a subscriber in the script
  (tests/helpers/host_exactness_engine.py); the Prometheus histograms (`llm.get_metrics()`) are checked too.

Hashes: our `block_hash` is the first 8 bytes of vLLM's block hash as a signed little-endian int64.
KV events carry the hash as bytes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; vLLM's default (1)
publishes int.from_bytes(hash, "big") & (2**64 - 1), i.e. the *last* 8 bytes, which no function of our
8 bytes can reproduce: in that mode the test maps vLLM's ints through the requests' full hashes (only
possible in process) to show the events still name exactly our blocks.

Times: vLLM stamps each block inside a pool call, kvtrace once per call (after it): lifetimes and idle
times agree to within the duration of a pool call (tens of microseconds when measured; the test allows
TOLERANCE_S for a loaded 2-core machine).
"""

from __future__ import annotations

import bisect
import collections
import json
import socket
import sys
import time
from pathlib import Path

import duckdb
import pytest

from tests.helpers.driven_scheduler import DrivenConfig, read_rows, record_driven, shared_prefix_prompts
from tests.helpers.run import REPO, run_kvtrace

TOLERANCE_S = 0.005
TIMES = ("ts_ns", "t_start_ns", "t_sched_end_ns", "t_end_ns")


def h64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little", signed=True)


@pytest.fixture(scope="module")
def drive(tiny_model, tmp_path_factory):
    """drive(cfg, scenario, keep_stats=False) -> (session dir, scenario's result), probes recording."""
    root = tmp_path_factory.mktemp("driven")
    count = iter(range(10**6))

    def run(cfg: DrivenConfig, scenario, keep_stats: bool = False):
        session = root / f"s{next(count)}"
        return session, record_driven(session, tiny_model, cfg, scenario, keep_stats=keep_stats)

    return run


def rows(session: Path, table: str) -> list[dict]:
    """The table's rows in time order (stable: rows of one instant keep their recording order; rows
    without a time, step_requests, by step and request), without their timestamps."""
    out = read_rows(session, table)
    key = next((t for t in TIMES if out and t in out[0]), None)
    if key is not None:
        out.sort(key=lambda r: r[key])
    elif out and "step" in out[0]:
        out.sort(key=lambda r: (r["step"], r.get("request_id") or ""))
    return [{k: v for k, v in r.items() if k not in TIMES} for r in out]


def block(step, event, request, ids, hashes=None, group=0):
    return {"step": step, "event": event, "kv_group": group, "request_id": request,
            "block_ids": list(ids), "block_hashes": hashes}


def sreq(step, request, tokens, phase, chunk, computed, new_blocks, kind):
    return {"step": step, "request_id": request, "tokens": tokens, "phase": phase, "chunk_index": chunk,
            "computed_before": computed, "new_blocks": new_blocks, "kind": kind}


def revent(step, request, event, value, reason=None):
    return {"step": step, "request_id": request, "event": event, "value": value, "reason": reason}


# ---- (a) two requests sharing a 3-block prefix -------------------------------------------------------
def test_shared_prefix_rows(drive):
    prefix = list(range(100, 196))  # 96 tokens = 3 blocks of 32

    def scenario(d):
        a = d.add("A", prefix + list(range(300, 320)), 2)  # 116 tokens: 3 full blocks + 20
        d.run()
        b = d.add("B", prefix + list(range(400, 420)), 2)
        d.run()
        return [h64(h) for h in a.block_hashes], [h64(h) for h in b.block_hashes]

    session, (ha, hb) = drive(DrivenConfig(num_blocks=64), scenario)
    assert len(ha) == 3 and ha == hb  # the suffixes differ after the 3rd block boundary
    assert rows(session, "prefix_lookups") == [
        {"step": 1, "request_id": "A", "query_tokens": 116, "hit_tokens": 0, "hit_blocks": 0, "full_blocks": 3,
         "tail_tokens": 20, "missed_hashes": ha, "external_hit_tokens": None, "after_preemption": 0},
        {"step": 4, "request_id": "B", "query_tokens": 116, "hit_tokens": 96, "hit_blocks": 3, "full_blocks": 3,
         "tail_tokens": 20, "missed_hashes": [], "external_hit_tokens": None, "after_preemption": 0},
    ]
    # Block 0 is vLLM's null block. A's 3 full blocks are cached at its prefill and go to the LRU tail
    # when it ends (freed tail first); its partial 4th block goes to the head and is B's new block.
    assert rows(session, "block_events") == [
        block(1, "alloc", "A", [1, 2, 3, 4]),
        block(1, "cache", "A", [1, 2, 3], ha),
        block(2, "free", "A", [4, 3, 2, 1]),
        block(4, "touch", "B", [1, 2, 3]),
        block(4, "alloc", "B", [4]),
        block(5, "free", "B", [4, 3, 2, 1]),
    ]
    # step 3 (and 6) schedule nothing: vLLM's step that reports the finished request to the workers.
    # new_blocks of a "new" row counts every block of the request, prefix hits included (see report).
    assert rows(session, "step_requests") == [
        sreq(1, "A", 116, "prefill", 0, 0, 4, "new"),
        sreq(2, "A", 1, "decode", -1, 116, 0, "running"),
        sreq(4, "B", 20, "prefill", 0, 96, 4, "new"),
        sreq(5, "B", 1, "decode", -1, 116, 0, "running"),
    ]
    steps = {r["step"]: r for r in rows(session, "steps")}
    assert [steps[4][k] for k in ("scheduled_tokens", "prefill_tokens", "num_new_reqs", "prompt_tokens_new",
                                  "cached_tokens_new", "kv_blocks_used", "admission_stop")] == \
        [20, 20, 1, 116, 96, 4, "none"]
    assert rows(session, "request_events") == [
        revent(0, "A", "arrival", 116), revent(0, "A", "queued", 116), revent(1, "A", "scheduled", 0),
        revent(1, "A", "first_token", 1), revent(2, "A", "finished", 2, "length"),
        revent(3, "B", "arrival", 116), revent(3, "B", "queued", 116), revent(4, "B", "scheduled", 96),
        revent(4, "B", "first_token", 1), revent(5, "B", "finished", 2, "length"),
    ]


def test_held_rows_reach_the_recorder_when_the_engine_goes_idle(drive):
    """Rows the probes hold as columns are handed over when the scheduler drains, not at the next
    request or at shutdown (a kill while idle would lose them)."""
    from kvtrace.probes import lifecycle

    def scenario(d):
        d.add("A", list(range(100, 216)), 3)
        d.run()
        probes = {p.name: p for p in lifecycle._installed}
        held = (probes["kv_blocks"].log.rows, probes["scheduler"].decode_log.rows)
        rec = probes["kv_blocks"].rec
        with rec._lock:  # the writer thread may have flushed them already: count both places
            handed = rec.rows_written["block_events"] + sum(b.num_rows for b in rec.buffers["block_events"])
        return held, handed

    _, (held, handed) = drive(DrivenConfig(num_blocks=64), scenario)
    assert held == (0, 0)
    assert handed == 3  # alloc, cache and free of A


# ---- (b) a pool that forces exactly one preemption ------------------------------------------------
PREEMPT_CFG = DrivenConfig(num_blocks=6, enable_prefix_caching=False)  # 5 usable blocks of 32 tokens


def two_requests(d):
    d.add("R1", list(range(100, 164)), 8)  # 64 tokens = 2 blocks; the 1st output token needs a 3rd
    d.add("R2", list(range(200, 264)), 8)
    return d.run()


def test_free_blocks_is_wrapped_only_from_the_first_hold(drive):
    """vLLM calls Scheduler._free_blocks for every request that finishes; only a connector's hold
    (tests/integration/test_pins.py) needs it watched, so the scheduler probe wraps it at the first hold, and
    restores it with its other patches."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtrace.probes import lifecycle

    original = Scheduler.__dict__["_free_blocks"]
    seen = {}

    def scenario(d):
        d.add("A", list(range(100, 140)), 2)
        d.run()
        seen["finished"] = Scheduler.__dict__["_free_blocks"]
        probe = next(p for p in lifecycle._installed if p.name == "scheduler")
        probe.watch_releases()  # what on_finished does at a request's first hold
        seen["held"] = Scheduler.__dict__["_free_blocks"]
        d.add("B", list(range(200, 240)), 2)
        return d.run()

    drive(DrivenConfig(num_blocks=64), scenario)
    assert seen["finished"] is original
    assert seen["held"] is not original and seen["held"].__wrapped__ is original
    assert Scheduler.__dict__["_free_blocks"] is original


def test_token_ids_recorded_only_when_asked(tiny_model, tmp_path):
    """No token ids in a trace unless the user asks (`kvtrace record --record-tokens`): then each request's
    prompt and output token ids, once each."""
    def scenario(d):
        d.add("A", list(range(100, 140)), 3)
        return d.run()

    record_driven(tmp_path / "plain", tiny_model, DrivenConfig(num_blocks=64), scenario)
    assert read_rows(tmp_path / "plain", "request_tokens") == []
    record_driven(tmp_path / "asked", tiny_model, DrivenConfig(num_blocks=64), scenario,
                  options={"record_tokens": True})
    got = {(r["request_id"], r["kind"]): r for r in read_rows(tmp_path / "asked", "request_tokens")}
    assert sorted(got) == [("A", "output"), ("A", "prompt")]
    assert got["A", "prompt"]["token_ids"] == list(range(100, 140))
    assert len(got["A", "output"]["token_ids"]) == 3


@pytest.mark.skipif(sys.version_info < (3, 11), reason="CPython's attribute specialisation is 3.11+")
def test_probe_attributes_stay_inline_values(drive):
    """The wrappers read `probe.enabled` (and the handlers their probe's other attributes) at every call.
    CPython keeps an instance's attributes as inline values, read at a fixed index, only up to 29 of
    them; a probe with more reads a dictionary at each access instead (LOAD_ATTR_WITH_HINT)."""
    import dis

    from kvtrace.probes import lifecycle

    def read_enabled(probe):
        return probe.enabled

    forms = {}

    def scenario(d):
        d.add("A", list(range(100, 140)), 2)
        out = d.run()
        for probe in lifecycle._installed:
            for _ in range(16):  # past CPython's warm-up, so the read is specialised
                read_enabled(probe)
            forms[probe.name] = [i.opname for i in dis.get_instructions(read_enabled, adaptive=True)
                                 if i.opname.startswith("LOAD_ATTR")]
            read_enabled.__code__ = read_enabled.__code__.replace()  # a fresh site for the next probe
        return out

    drive(DrivenConfig(num_blocks=64), scenario)
    assert {"scheduler", "kv_blocks", "prefix_cache"} <= set(forms)
    assert all(f == ["LOAD_ATTR_INSTANCE_VALUE"] for f in forms.values()), forms


def test_request_lengths_are_read_from_vllms_lists_only_where_they_are_its_properties():
    """The probes read len(request._all_token_ids) for num_tokens (and the output ids' for
    num_output_tokens) only where vLLM's properties are exactly that; any other shape keeps the property."""
    from vllm.v1.request import Request

    from kvtrace.probes.base import is_len_of

    assert is_len_of(Request, "num_tokens", "_all_token_ids")
    assert is_len_of(Request, "num_output_tokens", "_output_token_ids")
    assert not is_len_of(Request, "num_tokens", "_output_token_ids")  # another field
    assert not is_len_of(Request, "num_tokens_with_spec", "_all_token_ids")  # more than one len()
    assert not is_len_of(Request, "request_id", "_all_token_ids")  # not a property

    class Other:
        @property
        def num_tokens(self):
            return len(self._all_token_ids) - 1

    assert not is_len_of(Other, "num_tokens", "_all_token_ids")


def test_one_preemption_rows(drive):
    session, steps_run = drive(PREEMPT_CFG, two_requests)
    assert steps_run == 16
    # Step 2: R1 takes the last free block for its 65th token; R2 (the last running request) has none
    # for its own and is preempted: it loses its 64 computed tokens (its sampled token is not computed
    # yet) and its 2 blocks. It needs 3 blocks to resume, only 2 are free until R1 ends after step 8.
    assert rows(session, "preemptions") == [
        {"step": 2, "request_id": "R2", "computed_tokens_lost": 64, "blocks_freed": 2, "output_tokens": 1}]
    assert rows(session, "block_events") == [
        block(1, "alloc", "R1", [1, 2]),
        block(1, "alloc", "R2", [3, 4]),
        block(2, "alloc", "R1", [5]),
        block(2, "free", "R2", [4, 3]),
        block(8, "free", "R1", [5, 2, 1]),
        block(9, "alloc", "R2", [5, 2, 1]),
        block(15, "free", "R2", [1, 2, 5]),
    ]
    # R1's decode at step 2 is the one that needs a new block (its 65th token): a decode row's
    # new_blocks, kept sparse by the probe, lands on that row only.
    r1 = [r for r in rows(session, "step_requests") if r["request_id"] == "R1"]
    assert r1 == [sreq(1, "R1", 64, "prefill", 0, 0, 2, "new"), sreq(2, "R1", 1, "decode", -1, 64, 1, "running"),
                  *[sreq(s, "R1", 1, "decode", -1, 64 + s - 2, 0, "running") for s in range(3, 9)]]
    r2 = [r for r in rows(session, "step_requests") if r["request_id"] == "R2"]
    assert r2 == [sreq(1, "R2", 64, "prefill", 0, 0, 2, "new"),
                  sreq(9, "R2", 65, "prefill", 0, 0, 3, "resumed"),  # recompute: prompt + its 1 output
                  *[sreq(s, "R2", 1, "decode", -1, 65 + s - 10, 0, "running") for s in range(10, 16)]]
    assert [r for r in rows(session, "request_events") if r["request_id"] == "R2"] == [
        revent(0, "R2", "arrival", 64), revent(0, "R2", "queued", 64), revent(1, "R2", "scheduled", 0),
        revent(1, "R2", "first_token", 1), revent(2, "R2", "preempted", 64), revent(9, "R2", "resumed", 0),
        revent(15, "R2", "finished", 8, "length")]
    steps = rows(session, "steps")
    assert [(r["step"], r["admission_stop"]) for r in steps] == \
        [(1, "none"), (2, "preempted"), *[(s, "kv-insuf") for s in range(3, 9)],
         *[(s, "none") for s in range(9, 17)]]
    assert [(r["step"], r["num_preempted"], r["num_resumed_reqs"], r["num_finished"]) for r in steps
            if r["num_preempted"] or r["num_resumed_reqs"] or r["num_finished"]] == \
        [(2, 1, 0, 0), (8, 0, 0, 1), (9, 0, 1, 0), (15, 0, 0, 1)]


# ---- why admission stopped --------------------------------------------------------------------------
def _tok_budget(d):  # a 64-token budget: the first prompt's first chunk uses all of it
    d.add("R1", list(range(100, 200)), 2)
    d.add("R2", list(range(200, 300)), 2)
    d.step()


def _max_seqs(d):  # max_num_seqs=1: the second request waits behind the first
    d.add("R1", list(range(100, 110)), 2)
    d.add("R2", list(range(200, 210)), 2)
    d.step()


def _kv_insuf(d):  # 3 usable blocks: the second 2-block prompt finds 1 free
    d.add("R1", list(range(100, 164)), 2)
    d.add("R2", list(range(200, 264)), 2)
    d.step()


def _none(d):  # nothing left waiting
    d.add("R1", list(range(100, 110)), 2)
    d.step()


def _prefill_throttle(d):  # data-parallel balancing: a throttled step holds the new prompt back
    d.add("R1", list(range(100, 110)), 8)
    d.step()  # R1's prompt: it decodes from here
    d.add("R2", list(range(200, 210)), 2)
    d.step(throttle_prefills=True)


def _prefill_cadence(d):  # vLLM 0.33's prefill_schedule_interval=4: no prefill for 3 steps after one
    d.add("R1", list(range(100, 110)), 8)
    d.step()
    d.add("R2", list(range(200, 210)), 2)
    d.step()


def _skipped(d):  # stale output still in flight (async scheduling): vLLM passes the request over
    req = d.add("R1", list(range(100, 110)), 2)
    req.num_stale_output_tokens, req.drop_stale_output = 1, False
    d.step()


ADMISSION = {
    "tok-budget": (DrivenConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256), _tok_budget, 1),
    "max-seqs": (DrivenConfig(max_num_seqs=1, max_model_len=256), _max_seqs, 1),
    "kv-insuf": (DrivenConfig(num_blocks=4, enable_prefix_caching=False, max_model_len=256), _kv_insuf, 1),
    "preempted": (PREEMPT_CFG, lambda d: (two_requests(d), None)[1], 2),
    "none": (DrivenConfig(max_model_len=256), _none, 1),
    "prefill-throttle": (DrivenConfig(max_model_len=256), _prefill_throttle, 2),
    "prefill-cadence": (DrivenConfig(max_model_len=256, extra={"prefill_schedule_interval": 4}),
                        _prefill_cadence, 2),
    "skipped": (DrivenConfig(max_model_len=256), _skipped, 1),
}


@pytest.mark.parametrize("reason", list(ADMISSION))
def test_admission_stop(drive, reason):
    cfg, scenario, step = ADMISSION[reason]
    if reason == "prefill-cadence" and "local_prefill_interval" not in _scheduler_source():
        pytest.skip("this vLLM has no local prefill cadence (0.33 and later)")
    if reason in ("prefill-throttle", "skipped") and "num_stale_output_tokens" not in _scheduler_source():
        pytest.skip("this vLLM neither throttles prefills nor passes requests over (0.27 and later)")
    session, _ = drive(cfg, scenario)
    row = next(r for r in rows(session, "steps") if r["step"] == step)
    assert row["admission_stop"] == reason, row
    assert row["num_waiting"] == (0 if reason == "none" else 1)
    if reason.startswith("prefill-"):  # held back: the decoding request alone ran
        assert (row["num_prefill_reqs"], row["num_decode_reqs"]) == (0, 1), row


def _scheduler_source() -> str:
    import inspect

    from vllm.v1.core.sched import scheduler

    return inspect.getsource(scheduler)


# ---- streaming-input sessions (resumable requests) ----------------------------------------------------
def test_a_streaming_input_session_has_its_turns(drive):
    """A resumable request is a session of turns: each turn's end is a `turn_end` row (the session goes
    on, waiting for input), the next chunk an `input` row, and vLLM merging it into the session a
    `queued` row with the whole prompt so far; the session's end (a chunk that is not resumable) is its
    `finished` row. One arrival for the session; a first token per turn. (Without the streaming hook the
    second chunk was a second arrival, and no row said where a turn ended.)"""
    from vllm.v1.core.sched import scheduler

    if not hasattr(scheduler.Scheduler, "_update_request_as_session"):
        pytest.skip("this vLLM has no streaming-input sessions")
    first = list(range(100, 164))  # 64 tokens

    def scenario(d):
        s = d.add("S", first, 2, resumable=True)
        d.run()
        waiting, outputs = s.status.name, [len(s.output_token_ids)]  # the turn's, until the next merges
        d.add("S", list(range(200, 240)), 3, resumable=True)  # the next chunk: 40 tokens
        d.run()
        prompt_after = s.num_prompt_tokens
        outputs.append(len(s.output_token_ids))
        d.add("S", [1], 1)  # not resumable: the session ends
        d.run()
        return waiting, prompt_after, s.status.name, outputs

    session, (waiting, prompt_after, end, outputs) = drive(DrivenConfig(num_blocks=64), scenario)
    assert waiting == "WAITING_FOR_STREAMING_REQ" and end.startswith("FINISHED")
    assert outputs[0] == 2 and outputs[1] > 0  # (0.27 stops a later turn after 2 tokens, 0.32 after 3)
    events = [(r["event"], r["value"], r["reason"]) for r in rows(session, "request_events")]
    # turn 1 kept its one computed output token (vLLM drops the last sampled one): 64 + 1 + 40
    assert prompt_after == 105
    assert events == [
        ("arrival", 64, None), ("queued", 64, None), ("scheduled", 0, None), ("first_token", 1, None),
        ("turn_end", 2, "length"),
        # the session kept its blocks between turns: 65 tokens computed when its second turn is scheduled
        ("input", 40, None), ("queued", 105, None), ("scheduled", 65, None), ("first_token", 1, None),
        ("turn_end", outputs[1], "length"),
        ("finished", outputs[1], "abort"),  # ended while waiting for input: its last turn's outputs
    ], events
    # ... so only its first turn looked up the prefix cache
    assert [(r["query_tokens"], r["hit_tokens"]) for r in rows(session, "prefix_lookups")] == [(64, 0)]


# ---- lookahead block hashes (vLLM 0.33, EAGLE-style drafting with prefix caching) ----------------------
def test_lookahead_block_hashes_shift_full_blocks_as_vllm_hashes_them(drive):
    """With lookahead block hashes (L tokens after a block are part of its hash) vLLM hashes a block only
    once L more tokens follow it: a prompt of 3 blocks + 1 token has 2 hashed blocks, not 3. The lookup
    rows say what vLLM could look up (full_blocks = the request's hashes at the lookup, the rest in
    tail_tokens), their hits equal vLLM's own counters, and the engine config names L."""
    from vllm.config import VllmConfig

    if not hasattr(VllmConfig, "num_hash_lookahead_tokens"):
        pytest.skip("this vLLM has no lookahead block hashes (0.33 and later)")
    lookahead, prefix = 2, list(range(100, 196))  # 96 tokens = 3 blocks of 32

    def scenario(d):
        seen = []
        for rid, tail in (("A", [300]), ("B", [400]), ("C", list(range(500, 540)))):
            req = d.add(rid, prefix + tail, 2)
            seen.append(len(req.block_hashes))  # hashed at arrival: what the lookup can match
            d.run()
        stats = [s.prefix_cache_stats for s in d.stats if s.prefix_cache_stats is not None]
        return seen, sum(s.queries for s in stats), sum(s.hits for s in stats), d.sched.num_hash_lookahead_tokens

    session, (seen, vllm_queries, vllm_hits, sched_lookahead) = drive(
        DrivenConfig(num_blocks=64, hash_lookahead_tokens=lookahead), scenario, keep_stats=True)
    assert sched_lookahead == lookahead
    # A and B: 97 tokens, block 3 ends at 96 and needs 98 to be hashed; C: 136 tokens, 4 blocks hashed
    assert seen == [2, 2, 4]
    lookups = rows(session, "prefix_lookups")
    assert [(r["request_id"], r["full_blocks"], r["tail_tokens"]) for r in lookups] == \
        [("A", 2, 33), ("B", 2, 33), ("C", 4, 8)]
    # B reuses A's 2 hashed blocks; C reuses them too (its 3rd block's hash covers other tokens than A's
    # 3rd block, which was never hashed)
    assert [r["hit_tokens"] for r in lookups] == [0, 64, 64]
    assert (sum(r["query_tokens"] for r in lookups), sum(r["hit_tokens"] for r in lookups)) == \
        (vllm_queries, vllm_hits)
    (proc,) = [json.loads(p.read_text()) for p in session.glob("procs/*/proc.json")]
    assert proc["engine_config"]["hash_lookahead_tokens"] == lookahead


# ---- deferred async loads (vLLM 0.33: overlapping batches, a KV consumer, HiSparse) -----------------------
def hisparse_shaped_async_scheduler() -> type:
    """vLLM's AsyncScheduler with the KV cache config HiSparse gives it (a host block pool,
    `hisparse_host_num_blocks`) and async scheduling on (as on a GPU; vLLM's CPU platform turns it off):
    with a KV consumer and two steps in flight, vLLM then defers each async load's
    `update_state_after_alloc` until the steps in flight have finished."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    class HiSparseShapedScheduler(AsyncScheduler):
        def __init__(self, *args, vllm_config, kv_cache_config, **kwargs):
            vllm_config.scheduler_config.async_scheduling = True
            kv_cache_config.hisparse_host_num_blocks = 64
            super().__init__(*args, vllm_config=vllm_config, kv_cache_config=kv_cache_config, **kwargs)

    return HiSparseShapedScheduler


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_deferred_async_loads_keep_their_lookup_at_admission(drive, prefix_caching):
    """With deferred loads, vLLM admits a request's external tokens in one schedule() and tells the
    connector (`update_state_after_alloc`) later, in the update of a step that was in flight. The lookup
    row stays at the admission (the step of the connector's match), with the external tokens the
    connector was told later; the alloc row is at that update's step; the sums equal vLLM's own connector
    counters; nothing is kept behind."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from tests.helpers.async_load_connector import finished_output

    if not hasattr(Scheduler, "_drain_deferred_loads"):
        pytest.skip("this vLLM tells the connector at admission (deferred loads: 0.33 and later)")
    prompts = shared_prefix_prompts(12, groups=3, prefix_tokens=96, suffix_tokens=40)
    cfg = DrivenConfig(num_blocks=200, max_num_seqs=4, enable_prefix_caching=prefix_caching,
                       scheduler_cls=hisparse_shaped_async_scheduler(), worker_output=finished_output,
                       extra={"kv_transfer_config": {
                           "kv_connector": "AsyncLoadConnector", "kv_role": "kv_consumer",
                           "kv_connector_module_path": "tests.helpers.async_load_connector"}})

    def scenario(d):
        assert d.sched.defer_async_loads

        def arrivals(n):  # one request before each schedule: from the second on, a step is in flight
            if 0 < n < len(prompts):
                d.add(f"r{n}", prompts[n], 3)

        d.add("r0", prompts[0], 3)
        d.run_overlapped(arrivals)
        stats = [s.connector_prefix_cache_stats for s in d.stats if s.connector_prefix_cache_stats is not None]
        from kvtrace.probes import lifecycle

        (prefix,) = [p for p in lifecycle._installed if p.name == "prefix_cache"]
        return (list(d.sched.connector.allocs), sum(s.queries for s in stats), sum(s.hits for s in stats),
                dict(prefix.external_matches))

    session, (allocs, vllm_queries, vllm_hits, left) = drive(cfg, scenario, keep_stats=True)
    told = {rid: n for rid, n in allocs if n}
    assert len(told) == len(prompts)  # every request loaded external KV
    transfers = rows(session, "transfers")
    matched_at = {r["request_id"]: r["step"] for r in transfers if r["direction"] == "match"}
    told_at = {r["request_id"]: r["step"] for r in transfers if r["direction"] == "alloc" and r["tokens"]}
    # Told in the same schedule() as the match, or (deferred) in the update of a step in flight.
    deferred = [rid for rid in told if told_at[rid] != matched_at[rid]]
    assert len(deferred) >= len(prompts) // 2, (matched_at, told_at)  # the scenario does defer loads
    lookups = rows(session, "prefix_lookups")
    assert sorted(r["request_id"] for r in lookups) == sorted(told)  # one lookup per admission
    for r in lookups:
        rid = r["request_id"]
        assert (r["step"], r["external_hit_tokens"]) == (matched_at[rid], told[rid]), r
    assert sum(r["external_hit_tokens"] for r in lookups) == vllm_hits
    assert sum(r["query_tokens"] - r["hit_tokens"] for r in lookups) == vllm_queries
    assert left == {}


# ---- why lookups missed (canned query prefix_misses) -------------------------------------------------
def test_prefix_misses_are_classified_by_the_block_events(drive, tmp_path):
    """A 4-block prompt three times, the third after a request that takes the whole pool (8 blocks): its
    first lookup finds nothing ever cached, its second is capped (vLLM recomputes a prompt's last
    token, so the last of its 4 resident blocks is not a hit), its third finds all 4 evicted."""
    from kvtrace.ingest import ingest
    from kvtrace.queries import run_query

    prompt = list(range(100, 228))  # 128 tokens: 4 full blocks of 32

    def scenario(d):
        for rid, tokens in (("first", prompt), ("again", prompt), ("other", list(range(1000, 1256))),
                            ("late", prompt)):
            d.add(rid, tokens, 1)
            d.run()

    session, _ = drive(DrivenConfig(num_blocks=9, max_model_len=512), scenario)  # 8 usable blocks
    db = tmp_path / "misses.duckdb"
    ingest([session], db)
    con = duckdb.connect(str(db), read_only=True)
    try:
        cols, out = run_query(con, "prefix_misses", {"by": "request"})
        got = {(r["request_id"], r["reason"]): r["blocks"] for r in (dict(zip(cols, row)) for row in out)}
        cols, out = run_query(con, "prefix_misses")
        totals = {r["reason"]: (r["lookups"], r["blocks"]) for r in (dict(zip(cols, row)) for row in out)}
    finally:
        con.close()
    assert got == {("first", "never-cached"): 4, ("again", "capped"): 1, ("other", "never-cached"): 8,
                   ("late", "evicted"): 4}
    assert totals == {"never-cached": (2, 12), "capped": (1, 1), "evicted": (1, 4)}


# ---- vLLM's own KV reports against ours ----------------------------------------------------------
def derived_residencies(db: Path) -> list[tuple[float, float]]:
    """(lifetime, idle before the end) in seconds of every block allocation that ended, as kvtrace
    derives them from block_events (canned query block_lifetimes)."""
    from kvtrace.queries import run_query

    con = duckdb.connect(str(db), read_only=True)
    try:
        cols, out = run_query(con, "block_lifetimes")
    finally:
        con.close()
    i = {c: k for k, c in enumerate(cols)}
    return [(r[i["lifetime_ms"]] / 1e3, r[i["idle_before_end_ms"]] / 1e3) for r in out
            if r[i["end_event"]] in ("evict", "realloc")]


def assert_residencies_match(ours: list[tuple[float, float]], vllm: list[tuple[float, float]]) -> float:
    """Same number of ended allocations; lifetimes and idle times pair up within TOLERANCE_S (compared
    sorted: vLLM's events carry no block id, and sorting pairs any matching within a tolerance).
    Returns the largest difference seen."""
    assert len(ours) == len(vllm) > 0
    worst = 0.0
    for k, what in ((0, "lifetime"), (1, "idle before eviction")):
        for a, b in zip(sorted(x[k] for x in ours), sorted(x[k] for x in vllm)):
            assert abs(a - b) <= TOLERANCE_S, f"{what}: ours {a:.6f} s, vLLM {b:.6f} s"
            worst = max(worst, abs(a - b))
    return worst


def block_hash_counts(db: Path, event: str) -> collections.Counter:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return collections.Counter(h for (h,) in con.execute(
            "SELECT block_hash FROM block_events WHERE event = ?", [event]).fetchall())
    finally:
        con.close()


METRICS_CFG = DrivenConfig(num_blocks=24, extra={
    "kv_cache_metrics": True, "kv_cache_metrics_sample": 1.0,
    "kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"}})


@pytest.mark.parametrize("hash_mode", ["bytes", "int"])
def test_driven_kv_metrics_and_events_match(drive, tmp_path, monkeypatch, hash_mode):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if hash_mode == "int" else "0")

    def scenario(d):
        # 12 requests in 3 families sharing a 3-block prefix, one arriving per step, in a 23-block pool:
        # blocks are cached, hit, evicted and handed out again.
        seen: dict[int, int] = {}
        for i, prompt in enumerate(shared_prefix_prompts(12, 3, 96, 40)):
            req = d.add(f"q{i}", prompt, 20)
            d.step()
            time.sleep(0.002)
            for h in req.block_hashes:  # vLLM's int form of each hash -> our form (in process only)
                seen[int.from_bytes(h, "big") & (2**64 - 1)] = h64(h)
        while d.has_work():
            d.step()
        for r in list(d.sched.requests.values()):
            for h in r.block_hashes:
                seen[int.from_bytes(h, "big") & (2**64 - 1)] = h64(h)
        events = [(e.lifetime_seconds, e.idle_seconds) for e in d.eviction_events()]
        kv = [ev for batch in d.kv_event_batches for ev in batch.events]
        return events, kv, seen

    session, (vllm_events, kv_events, int_to_ours) = drive(METRICS_CFG, scenario, keep_stats=True)
    from kvtrace.ingest import ingest

    db = tmp_path / "driven.duckdb"
    ingest([session], db)
    assert_residencies_match(derived_residencies(db), vllm_events)

    def ours(h):
        if isinstance(h, (bytes, bytearray)):
            return h64(h)
        assert hash_mode == "int", "an int hash although bytes were asked for"
        return int_to_ours[h]

    stored = collections.Counter(ours(h) for e in kv_events if type(e).__name__ == "BlockStored"
                                 for h in e.block_hashes)
    removed = collections.Counter(ours(h) for e in kv_events if type(e).__name__ == "BlockRemoved"
                                  for h in e.block_hashes)
    assert removed, "the scenario is meant to evict cached blocks"
    assert set(stored) == set(block_hash_counts(db, "cache"))
    assert removed == block_hash_counts(db, "evict")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
def test_real_engine_kv_metrics_and_events_match(tiny_model, tmp_path):
    session, out, db = tmp_path / "s", tmp_path / "vllm.json", tmp_path / "s.duckdb"
    run_kvtrace("record", "-o", str(session), "--", sys.executable, str(REPO / "tests" / "helpers" / "host_exactness_engine.py"),
                "--model", tiny_model, "--out", str(out), "--port", str(_free_port()), "--num-blocks", "24",
                "--jobs", "8", "--turns", "3", env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"})
    run_kvtrace("ingest", str(session), "-o", str(db))
    got = json.loads(out.read_text())
    assert got["run"]["requests"] == 24

    # Residency metrics: every eviction event vLLM reported is one of our ended block allocations.
    vllm_events = [(life, idle) for life, idle, _gaps in got["eviction_events"]]
    ours = derived_residencies(db)
    assert_residencies_match(ours, vllm_events)
    # ... and the Prometheus histograms built from them agree with our values: count, sum, buckets
    # (a value within the tolerance of a bucket bound may fall on either side of it).
    for name, k in (("vllm:kv_block_lifetime_seconds", 0), ("vllm:kv_block_idle_before_evict_seconds", 1)):
        hist = got["histograms"][name]
        values = sorted(x[k] for x in ours)
        assert hist["count"] == len(values)
        assert abs(hist["sum"] - sum(values)) <= TOLERANCE_S * len(values)
        for le, count in hist["buckets"].items():
            if le == "+Inf":
                assert count == len(values)
                continue
            bound = float(le)
            lo = bisect.bisect_right(values, bound - TOLERANCE_S)
            hi = bisect.bisect_right(values, bound + TOLERANCE_S)
            assert lo <= count <= hi, (name, le, count, lo, hi)

    # KV events: every stored / removed hash is one of our cache / evict rows, and vice versa.
    def ours_of(h):
        assert isinstance(h, dict) and "bytes" in h, "expected bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)"
        return h64(bytes.fromhex(h["bytes"]))

    stored = collections.Counter(ours_of(h) for e in got["kv_events"] if e["kind"] == "BlockStored"
                                 for h in e["hashes"])
    removed = collections.Counter(ours_of(h) for e in got["kv_events"] if e["kind"] == "BlockRemoved"
                                  for h in e["hashes"])
    assert stored and removed, "the run is meant to cache and evict blocks"
    assert set(stored) == set(block_hash_counts(db, "cache"))
    assert removed == block_hash_counts(db, "evict")


def test_free_blocks_and_queue_lengths_are_read_in_c_only_where_vllm_does_just_that():
    """The scheduler probe reads a pool's free blocks as `free_block_queue.num_free_blocks` and a request
    queue's length with deque's own __len__ only where vLLM's methods are exactly that (vLLM 0.32 here);
    both give vLLM's own answers, and any other shape keeps vLLM's method."""
    from collections import deque

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.request_queue import FCFSRequestQueue

    from kvtrace.probes.base import returns_field_of_field
    from kvtrace.probes.vllm.scheduler import queue_lengths

    assert returns_field_of_field(BlockPool.get_num_free_blocks, "free_block_queue", "num_free_blocks")
    assert not returns_field_of_field(BlockPool.get_num_free_blocks, "free_block_queue", "num_blocks")
    assert not returns_field_of_field(BlockPool.get_usage, "free_block_queue", "num_free_blocks")
    pool = BlockPool(num_gpu_blocks=10, enable_caching=True, hash_block_size=16)
    pool.get_new_blocks(3)
    assert pool.free_block_queue.num_free_blocks == pool.get_num_free_blocks() == 6

    lengths = queue_lengths()
    assert lengths == {FCFSRequestQueue: deque.__len__}
    queue = FCFSRequestQueue()
    queue.extend([object(), object()])
    assert lengths[type(queue)](queue) == len(queue) == 2

    class Counted(FCFSRequestQueue):  # a queue whose __len__ is its own: read with len()
        def __len__(self):
            return 7

    assert Counted not in lengths


def test_steps_that_only_decode_make_the_same_rows_in_c_as_in_python(drive, monkeypatch):
    """Where `_columns.c` builds, a step in which every request decodes skips the scheduler probe's Python
    methods (`StepRows`). A workload with every kind of step (prompts admitted while others decode,
    chunked prompts, preemptions, waiting requests, finishes, idle ends) gives the same rows both ways,
    and most of its steps went through C."""
    from kvtrace.probes.vllm import scheduler
    from kvtrace.record.buffers import NATIVE_MISSING

    if NATIVE_MISSING:
        pytest.skip(f"the native module is not built here: {NATIVE_MISSING}")
    python_steps = []

    def scenario(d):
        for i, prompt in enumerate(shared_prefix_prompts(24, 3, 48, 40)):
            d.add(f"R{i}", prompt, 40 + 9 * (i % 4))
        return d.run()

    cfg = DrivenConfig(num_blocks=30, max_num_seqs=8, max_num_batched_tokens=96)  # chunks, waits, preempts
    real = scheduler.SchedulerProbe.on_schedule
    monkeypatch.setattr(scheduler.SchedulerProbe, "on_schedule",
                        lambda self, *a: python_steps.append(1) or real(self, *a))
    sessions = {}
    for native in (True, False):
        monkeypatch.setattr(scheduler, "NATIVE_STEPS", native)
        python_steps.clear()
        session, steps_run = drive(cfg, scenario)
        sessions[native] = session
        if native:
            assert len(python_steps) < steps_run / 2, (len(python_steps), steps_run)
        else:
            assert len(python_steps) == steps_run
    for table in ("steps", "step_requests", "request_events", "preemptions", "block_events"):
        got, want = rows(sessions[True], table), rows(sessions[False], table)
        if table == "request_events":  # arrivals are vLLM's wall-clock stamps, microseconds apart here
            got, want = (sorted(r, key=lambda e: (e["step"], e["request_id"], e["event"])) for r in (got, want))
        assert got == want and want, table
    steps = rows(sessions[True], "steps")
    reasons = {r["admission_stop"] for r in steps}
    assert {"none", "preempted", "kv-insuf", "max-seqs", "tok-budget"} <= reasons and any(r["num_waiting"] for r in steps), reasons
