"""The canned analyses in queries/, each checked against an expectation derived without its SQL.

Three sources of data:
  * `recorded_run` (conftest): the standard workload on a real vLLM engine (6 jobs x 3 turns, 40-block
    pool: prefix hits and a preemption). Expectations come from vLLM's own counters, from how the
    workload is built, or are recomputed in Python from the raw table rows.
  * `multi`: a copy of that database with a second copy of the session (`dup`) and a small hand-made
    session (`known`) whose rows have a known shape (KV access records, connector loads and saves, pins,
    block residencies), so the expected numbers are written down here. Every query must give the same
    answer for `dup` as for the real session, and `$session` must select one.
  * `rvs_runs`: the same workload recorded twice with prefix caching off and a small pool, once
    recomputing after preemption and once reloading the preempted prompts' KV through a KV connector.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import duckdb
import numpy as np
import pytest

from tests.helpers.run import JOB_PATTERN, REPO, run_kvtrace

QUERIES = ["forward_pass_throughput", "context_utilization", "access_pattern", "kv_idle_gaps",
           "recompute_vs_swap", "kv_utilization", "step_time_fit", "admission_limits", "prefix_hits", "prefix_misses",
           "turn_latency", "job_completion", "pins", "fragmentation", "block_lifetimes", "preemptions"]
APPROX = {"rel": 1e-9, "abs": 1e-9}
KNOWN = "known"


def q(con, name: str, **params) -> list[dict]:
    from kvtrace.queries import run_query

    cols, rows = run_query(con, name, params)
    return [dict(zip(cols, r)) for r in rows]


def raw(con, sql: str, *params) -> list[dict]:
    cur = con.execute(sql, list(params))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def same_rows(a: list[dict], b: list[dict]) -> None:
    """Equal rows, floats to 1e-9 (aggregates over threads may add in another order)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert close(x[k], y[k]) if isinstance(x[k], float) else x[k] == y[k], (k, x, y)


def close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a == pytest.approx(b, **APPROX)


@pytest.fixture(scope="module")
def con(recorded_run):
    c = duckdb.connect(str(recorded_run["db"]), read_only=True)
    yield c
    c.close()


@pytest.fixture(scope="module")
def sid(con) -> str:
    return con.execute("select session from sessions").fetchall()[0][0]


@pytest.fixture(scope="module")
def vllm(recorded_run) -> dict:
    return recorded_run["metrics"]["vllm"]


# ---- the hand-made session -------------------------------------------------------------------------------
S = 1_000_000_000  # 1 s in ns
MS = 1_000_000


def _insert(c, table: str, rows: list[tuple]) -> None:
    from kvtrace.store.keyed import insert_rows

    insert_rows(c, table, rows)


def add_known_session(c) -> None:
    """Three requests on a 10-block pool of 16-token blocks, 4 steps of 10 ms (see the expectations below).

    r1 and r2 are admitted at step 1; r1 is preempted at step 2 (20 computed tokens lost) and resumed at
    step 3 with 16 tokens loaded by a connector and 5 recomputed; r3 is admitted at step 3 with 16 tokens
    loaded in the same start_load_kv call. Steps take 10 ms, step 3's load call 2 ms.
    """
    k, e, w = KNOWN, 11, 12  # session, engine pid, worker pid
    _insert(c, "sessions", [(k, "/known", "complete", 1, "t", "t", "hand-made", 0, 0, 5 * S, 0, 16, 11, 4, 64,
                             True, True, "X", "m", None, "{}", 0)])
    # steps: step, t_start, t_sched_end, t_end, sched, prefill, decode, n_prefill, n_decode, running, waiting,
    # used, total, budget, max_seqs, admission_stop, n_preempted, n_new, n_resumed, n_finished, prompt_new, cached_new
    steps = [(1, 32, 32, 0, 2, 0, 2, 0, 3, "none", 0, 2, 0, 0, 32, 0),
             (2, 1, 0, 1, 0, 1, 1, 1, 1, "preempted", 1, 0, 0, 0, 0, 0),
             (3, 10, 9, 1, 2, 1, 3, 0, 5, "kv-insuf", 0, 1, 1, 0, 20, 16),
             (4, 3, 0, 3, 0, 3, 3, 0, 5, "none", 0, 0, 0, 0, 0, 0)]
    _insert(c, "steps", [(k, 0, e, st, S + (st - 1) * 10 * MS, S + (st - 1) * 10 * MS + MS, S + st * 10 * MS,
                          sch, pf, dc, npf, ndc, run, wait, used, 10, 64, 4, stop, npre, new, res, fin, pn, cn)
                         for st, sch, pf, dc, npf, ndc, run, wait, used, stop, npre, new, res, fin, pn, cn in steps])
    # step_requests: step, request, tokens, phase, chunk_index, computed_before, new_blocks, kind
    _insert(c, "step_requests", [(k, 0, e, *r) for r in [
        (1, "r1", 20, "prefill", 0, 0, 2, "new"), (1, "r2", 12, "prefill", 0, 0, 1, "new"),
        (2, "r2", 1, "decode", -1, 12, 0, "running"),
        (3, "r1", 5, "prefill", 0, 16, 2, "resumed"), (3, "r2", 1, "decode", -1, 13, 0, "running"),
        (3, "r3", 4, "prefill", 0, 16, 2, "new"),
        (4, "r1", 1, "decode", -1, 21, 0, "running"), (4, "r2", 1, "decode", -1, 14, 0, "running"),
        (4, "r3", 1, "decode", -1, 20, 0, "running")]])
    _insert(c, "preemptions", [(k, 0, e, S + 10 * MS + MS // 2, 2, "r1", 20, 2, 1)])
    _insert(c, "request_events", [(k, 0, e, *r) for r in [
        (S - MS, 1, "r1", "arrival", 20, None), (S - MS, 1, "r2", "arrival", 12, None),
        (S + MS, 1, "r1", "scheduled", 0, None), (S + MS, 1, "r2", "scheduled", 0, None),
        (S + 10 * MS + MS // 2, 2, "r1", "preempted", 20, None),
        (S + 20 * MS + MS // 5, 3, "r1", "resumed", 16, None),
        (S + 20 * MS, 3, "r3", "arrival", 20, None), (S + 20 * MS + MS // 5, 3, "r3", "scheduled", 16, None)]])
    _insert(c, "prefix_lookups", [(k, 0, e, *r) for r in [
        (S, 1, "r1", 20, 0, 0, 1, 4, [], None, 0), (S, 1, "r2", 12, 0, 0, 0, 12, [], None, 0),
        (S + 20 * MS, 3, "r1", 21, 0, 0, 1, 5, [], 16, 1), (S + 20 * MS, 3, "r3", 20, 0, 0, 1, 4, [], 16, 0)]])
    # transfers: ts_start, ts_end, step, connector, method, direction, request, layer, bytes, tokens
    t0, t1 = S + 21 * MS, S + 23 * MS
    _insert(c, "transfers", [(k, 0, w, *r) for r in [
        (S + 8 * MS, S + 8 * MS + 100, 1, "X", "save_kv_layer", "save", "r1", "l0", 320, 20),
        (S + 8 * MS, S + 8 * MS + 100, 1, "X", "save_kv_layer", "save", "r2", "l0", 192, 12),
        (t0, t1, 3, "X", "start_load_kv", "load", "r1", "l0", 100, 16),
        (t0, t1, 3, "X", "start_load_kv", "load", "r1", "l1", 100, 16),
        (t0, t1, 3, "X", "start_load_kv", "load", "r3", "l0", 150, 16),
        (t0, t1, 3, "X", "start_load_kv", "load", "r3", "l1", 150, 16),
        (t1, t1, 3, "X", "wait_for_layer_load", "load", None, "l0", None, None)]])
    # kv_access: step, layer, ts, op, slot, block, offset, count, request
    _insert(c, "kv_access", [(k, 0, w, *r) for r in [
        (1, 0, S + 5 * MS, 1, 0, 7, 0, 16, "r1"), (1, 0, S + 5 * MS + 100_000, 0, 0, 7, 0, 16, "r1"),
        (2, 0, S + 25 * MS - 10 * MS, 0, 0, 7, 0, 16, "r2"),
        (3, 0, S + 35 * MS - 10 * MS, 0, 1, 8, 0, 4, "r3"),
        (4, 0, S + 35 * MS, 0, 0, 7, 0, 16, "r1"), (4, 0, S + 35 * MS + 200_000, 0, 1, 7, 0, 16, "r2"),
        (1, 1, S + 6 * MS, 1, 0, 7, 0, 16, "r1")]])
    # block_events: ts, step, event, group, request, block, hash
    _insert(c, "block_events", [(k, 0, e, *r) for r in [
        (S, 1, "alloc", 0, "r1", 5, None), (S + 10 * MS + MS // 2, 2, "free", 0, "r1", 5, None),
        (S + 20 * MS, 3, "alloc", 0, "r3", 5, None),
        (S + 20 * MS, 3, "alloc", 0, "r3", 9, None), (S + 20 * MS + 100_000, 3, "cache", 0, "r3", 9, 42),
        (2 * S + 200 * MS, 9, "touch", 0, "r4", 9, None), (2 * S + 600 * MS, 9, "free", 0, "r3", 9, None),
        (3 * S, 10, "evict", 0, "r5", 9, 42), (3 * S, 10, "alloc", 0, "r5", 9, None)]])
    # pins: ts, step, event, request, blocks, ttl, reason
    _insert(c, "pins", [(k, 0, e, *r) for r in [
        (2 * S, 5, "pin", "r2", [7], 2 * S, "ttl-pin"), (2 * S + 500 * MS, 6, "reuse", "r2", [7], None, "ttl-pin"),
        (4 * S, 11, "expire", "r2", [7], 2 * S, "ttl-pin"),
        (2 * S + 100 * MS, 5, "hold", "r3", [8, 9], None, "connector-delay-free"),
        (2 * S + 600 * MS, 9, "release", "r3", [8, 9], None, "connector-delay-free"),
        (3 * S, 10, "pin", "r1", [5], None, "ttl-pin")]])


@pytest.fixture(scope="module")
def multi(recorded_run, sid, tmp_path_factory):
    """The recorded database plus a copy of its session ('dup') and the hand-made session."""
    from kvtrace.format import schema
    from kvtrace.store.keyed import insert_rows
    from kvtrace.store.tables import SESSION_TABLES

    path = tmp_path_factory.mktemp("multi") / "multi.duckdb"
    shutil.copy(recorded_run["db"], path)
    c = duckdb.connect(str(path))
    for table in [*schema.TABLES, *SESSION_TABLES]:
        rows = c.execute(f"SELECT * REPLACE ('dup' AS session) FROM {table} WHERE session = ?", [sid]).fetchall()
        insert_rows(c, table, rows)
    add_known_session(c)
    c.close()
    c = duckdb.connect(str(path), read_only=True)
    yield c
    c.close()


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory):
    from kvtrace.store.layout import create_tables

    path = tmp_path_factory.mktemp("empty") / "empty.duckdb"
    c = duckdb.connect(str(path))
    create_tables(c)
    c.close()
    c = duckdb.connect(str(path), read_only=True)
    yield c
    c.close()


# ---- every query -----------------------------------------------------------------------------------------

def test_every_query_is_listed_documented_and_takes_session():
    from kvtrace.queries import all_queries

    queries = all_queries()
    listing = run_kvtrace("query", "--list").stdout
    docs = (REPO / "docs" / "queries.md").read_text()
    for name in QUERIES:
        assert name in queries, name
        cq = queries[name]
        assert "session" in cq.params, name
        assert cq.columns.startswith("session"), name
        line = next(ln for ln in listing.splitlines() if ln.split()[:1] == [name])
        assert cq.description in line, name
        assert re.search(rf"^## {name}\b", docs, re.M), f"docs/queries.md has no section for {name}"


def test_summary_counts_the_same_probe_statuses_as_disabled_as_everything_else():
    """summary.sql cannot import PROBE_FINE_SQL: it spells the list out, and must say the same."""
    from kvtrace.format.schema import PROBE_FINE_SQL

    sql = (REPO / "src" / "kvtrace" / "queries" / "summary.sql").read_text()
    assert f"status NOT IN {PROBE_FINE_SQL}" in sql


@pytest.mark.parametrize("name", QUERIES)
def test_query_runs_on_an_empty_database(empty_db, name):
    assert q(empty_db, name) == []


@pytest.mark.parametrize("name", QUERIES)
def test_query_per_session(multi, sid, name):
    """All sessions at once = each session alone; the copy of the real session gives the same rows."""
    everything = q(multi, name)
    assert {r["session"] for r in everything} <= {sid, "dup", KNOWN}
    for s in (sid, "dup", KNOWN):
        alone = q(multi, name, session=s)
        assert all(r["session"] == s for r in alone)
        same_rows(alone, [r for r in everything if r["session"] == s])
    same_rows(*[[{k: v for k, v in r.items() if k != "session"} for r in q(multi, name, session=x)]
                for x in (sid, "dup")])


# ---- forward_pass_throughput -----------------------------------------------------------------------------

def phase_of(row) -> str:
    if row["num_prefill_reqs"] and row["num_decode_reqs"]:
        return "mixed"
    return "prefill-only" if row["num_prefill_reqs"] else ("decode-only" if row["num_decode_reqs"] else "empty")


def test_forward_pass_throughput(con, vllm):
    steps = raw(con, "select * from steps order by step")
    t0 = min(s["t_start_ns"] for s in steps)
    got = q(con, "forward_pass_throughput")
    assert [r["step"] for r in got] == [s["step"] for s in steps]
    for r, s in zip(got, steps):
        assert r["phase"] == phase_of(s)
        assert r["batch_size"] == s["num_prefill_reqs"] + s["num_decode_reqs"]
        assert (r["tokens"], r["prefill_tokens"], r["decode_tokens"]) == (
            s["scheduled_tokens"], s["prefill_tokens"], s["decode_tokens"])
        assert abs(r["t_s"] - (s["t_start_ns"] - t0) / 1e9) <= 1e-6  # the query rounds to µs
        assert close(r["step_ms"], (s["t_end_ns"] - s["t_start_ns"]) / 1e6)
        assert close(r["tokens_per_s"], s["scheduled_tokens"] / ((s["t_end_ns"] - s["t_sched_end_ns"]) / 1e9))
    # vLLM's counters: every generated token comes from a decode step or from a prefill that completed
    # (each request once, plus once per resumption of a request that had already produced a token).
    resumed_after_output = raw(con, """select count(*) n from preemptions p where output_tokens > 0
        and exists (select 1 from request_events e where e.request_id = p.request_id and e.event = 'resumed'
                    and e.ts_ns > p.ts_ns)""")[0]["n"]
    requests = raw(con, "select count(distinct request_id) n from request_events where event = 'finished'")[0]["n"]
    assert sum(r["decode_tokens"] for r in got) + requests + resumed_after_output == vllm["generation_tokens"]
    # Prefill tokens = the prompt tokens vLLM did not find cached + what resumed requests recomputed.
    if all(p["output_tokens"] > 0 for p in raw(con, "select output_tokens from preemptions")):
        recomputed = raw(con, """select coalesce(sum(query_tokens - hit_tokens), 0) n from prefix_lookups
                                 where after_preemption = 1""")[0]["n"]
        assert sum(r["prefill_tokens"] for r in got) == (
            vllm["prompt_tokens"] - vllm["prompt_tokens_cached"] + recomputed)
    decode = q(con, "forward_pass_throughput", phase="decode-only")
    assert decode == [r for r in got if r["phase"] == "decode-only"] and decode


# ---- context_utilization ---------------------------------------------------------------------------------

def test_context_utilization(con):
    steps = {s["step"]: s for s in raw(con, "select * from steps")}
    prefill = raw(con, """select step, request_id, chunk_index from step_requests where phase = 'prefill'
                          order by request_id, step""")
    # Split each request's prefill rows into runs (a run restarts at chunk 0); a run of 2+ rows is chunked.
    runs: list[list[dict]] = []
    for row in prefill:
        if not runs or runs[-1][-1]["request_id"] != row["request_id"] or row["chunk_index"] == 0:
            runs.append([])
        runs[-1].append(row)
    chunked = Counter(r["step"] for run in runs if len(run) > 1 for r in run)
    got = q(con, "context_utilization")
    assert [r["step"] for r in got] == sorted(steps)
    for r in got:
        s = steps[r["step"]]
        assert r["utilization"] == s["scheduled_tokens"] / s["token_budget"]
        assert r["chunked_prefill_reqs"] == chunked.get(r["step"], 0)
        assert r["chunked"] == (r["step"] in chunked)
    # The workload: job 0's first prompt (366 tokens) is longer than the 256-token budget, so it is
    # prefilled in two chunks, in steps 1 and 2, and step 1 uses the whole budget.
    first = raw(con, """select step, tokens from step_requests where request_id like 'job0-turn0%'
                        and phase = 'prefill' order by step""")
    assert [f["step"] for f in first] == [1, 2] and first[0]["tokens"] == 256
    assert got[0]["utilization"] == 1.0 and got[0]["chunked"] and got[1]["chunked"]


# ---- step_time_fit ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("phase, warmup", [(None, None), ("decode-only", None), (None, 0), (None, 5)])
def test_step_time_fit_matches_numpy(con, phase, warmup):
    first = raw(con, "select min(step) as s from steps")[0]["s"]
    steps = [s for s in raw(con, "select * from steps where t_end_ns is not null and scheduled_tokens > 0")
             if (phase is None or phase_of(s) == phase) and s["step"] >= first + (1 if warmup is None else warmup)]
    x = np.array([s["scheduled_tokens"] for s in steps], dtype=float)
    y = np.array([(s["t_end_ns"] - s["t_start_ns"]) / 1e6 for s in steps])
    (slope, intercept), *_ = np.linalg.lstsq(np.vstack([x, np.ones_like(x)]).T, y, rcond=None)
    r2 = 1 - ((y - (slope * x + intercept)) ** 2).sum() / ((y - y.mean()) ** 2).sum()
    params = {"phase": phase} if phase else {}
    if warmup is not None:
        params["warmup_steps"] = warmup
    (fit,) = q(con, "step_time_fit", **params)
    assert fit["n"] == len(steps)
    assert fit["slope_us_per_token"] == pytest.approx(slope * 1000, rel=1e-6)
    assert fit["intercept_ms"] == pytest.approx(intercept, rel=1e-6)
    assert fit["r2"] == pytest.approx(r2, rel=1e-6)
    assert fit["mean_step_ms"] == pytest.approx(y.mean(), rel=1e-9)
    assert (fit["min_tokens"], fit["max_tokens"]) == (x.min(), x.max())


# ---- admission_limits ------------------------------------------------------------------------------------

def test_admission_limits(con):
    reasons = Counter(s["admission_stop"] for s in raw(con, "select admission_stop from steps"))
    total, limited = sum(reasons.values()), sum(n for r, n in reasons.items() if r != "none")
    got = q(con, "admission_limits")
    assert {r["reason"]: r["steps"] for r in got} == dict(reasons)
    assert [r["steps"] for r in got] == sorted(reasons.values(), reverse=True)
    for r in got:
        assert r["share"] == pytest.approx(reasons[r["reason"]] / total)
        assert close(r["share_limited"], None if r["reason"] == "none" else reasons[r["reason"]] / limited)
    assert sum(r["share"] for r in got) == pytest.approx(1.0)
    # A step that preempted is labelled so (the waiting queue is skipped), as many as vLLM preempted in.
    assert reasons["preempted"] == len({p["step"] for p in raw(con, "select step from preemptions")})


# ---- prefix_hits -----------------------------------------------------------------------------------------

def test_prefix_hits_totals_equal_vllm_counters(con, vllm):
    for by in ("step", "request", "turn", "job"):
        got = q(con, "prefix_hits", by=by)
        assert sum(r["query_tokens"] for r in got) == vllm["prefix_cache_queries"], by
        assert sum(r["hit_tokens"] for r in got) == vllm["prefix_cache_hits"], by
        assert sum(r["external_hit_tokens"] for r in got) == vllm["external_prefix_cache_hits"] == 0
    assert q(con, "prefix_hits") == q(con, "prefix_hits", by="request")


def test_prefix_hits_by_request_turn_and_job(con):
    # A request's first lookup asks for its whole prompt (the arrival event's value).
    prompts = {e["request_id"]: e["value"] for e in raw(con, "select * from request_events where event = 'arrival'")}
    lookups = raw(con, "select * from prefix_lookups")
    by_req = q(con, "prefix_hits", by="request")
    assert {r["request_id"]: r["query_tokens"] for r in by_req} == prompts
    for r in by_req:
        mine = [lk for lk in lookups if lk["request_id"] == r["request_id"]]
        first = [lk for lk in mine if not lk["after_preemption"]]
        again = [lk for lk in mine if lk["after_preemption"]]
        assert r["hit_tokens"] == sum(lk["hit_tokens"] for lk in first)
        assert close(r["hit_rate"], r["hit_tokens"] / r["query_tokens"])
        assert r["resumed_lookups"] == len(again)
        assert r["resumed_hit_tokens"] == sum(lk["hit_tokens"] for lk in again)
        job, turn = re.match(JOB_PATTERN, r["request_id"]).groups()
        assert (r["job_id"], r["turn"]) == (job, int(turn))
    # The workload: 6 jobs x 3 turns, one first lookup per request; every job's later turns start with
    # its own history, so turns 1 and 2 hit at least as much as the shared system prompt of turn 0.
    by_turn = q(con, "prefix_hits", by="turn")
    assert [(r["turn"], r["lookups"]) for r in by_turn] == [(0, 6), (1, 6), (2, 6)]
    # Turn 0: job 0 comes first and finds nothing; jobs 1-5 find the system prompt job 0 just computed.
    turn0 = sorted((r["step"], r["hit_tokens"]) for r in by_req if r["turn"] == 0)
    assert turn0[0][1] == 0 and all(h > 0 for _, h in turn0[1:])
    by_job = q(con, "prefix_hits", by="job")
    assert [(r["job_id"], r["lookups"]) for r in by_job] == [(str(j), 3) for j in range(6)]
    by_step = q(con, "prefix_hits", by="step")
    assert [r["step"] for r in by_step] == sorted({lk["step"] for lk in lookups})


def test_prefix_hits_rejects_an_unknown_grouping(con):
    from kvtrace.errors import KvtraceError

    with pytest.raises(KvtraceError, match="by must be"):
        q(con, "prefix_hits", by="tokens")


# ---- prefix_misses ---------------------------------------------------------------------------------------

def test_prefix_misses_equal_a_replay_of_the_block_events(con):
    """Every missed block of every lookup, classified again here from the raw rows: the hash's last
    cache and evict before the lookup, and whether an earlier block of the lookup was not resident."""
    lookups = raw(con, "select * from prefix_lookups where missed_hashes is not null")
    events = raw(con, "select ts_ns, step, request_id, event, kv_group, block_hash from block_events")
    last: dict[tuple, list[int]] = defaultdict(list)
    own: dict[tuple, int] = {}  # (request, step) -> its first block event: the allocation after its lookup
    for e in events:
        if e["event"] in ("cache", "evict") and e["kv_group"] == 0 and e["block_hash"] is not None:
            last[(e["event"], e["block_hash"])].append(e["ts_ns"])
        key = (e["request_id"], e["step"])
        own[key] = min(own.get(key, e["ts_ns"]), e["ts_ns"])
    expected: Counter = Counter()
    for lk in lookups:
        gap = False
        at = min(lk["ts_ns"], own.get((lk["request_id"], lk["step"]), lk["ts_ns"] + 1) - 1)
        for h in lk["missed_hashes"]:
            cached = max((t for t in last[("cache", h)] if t <= at), default=None)
            evicted = max((t for t in last[("evict", h)] if t <= at), default=None)
            if cached is None:
                reason = "never-cached"
            elif evicted is not None and evicted >= cached:
                reason = "evicted"
            else:
                reason = "after-miss" if gap else "capped"
            gap = gap or reason in ("never-cached", "evicted")
            expected[(lk["request_id"], reason)] += 1
    got = q(con, "prefix_misses", by="request")
    assert {(r["request_id"], r["reason"]): r["blocks"] for r in got} == dict(expected)
    assert sum(expected.values()) == sum(len(lk["missed_hashes"]) for lk in lookups) > 0
    totals = q(con, "prefix_misses")
    assert sum(r["blocks"] for r in totals) == sum(expected.values())
    assert sum(r["share"] for r in totals) == pytest.approx(1.0, abs=1e-3)
    # The standard workload evicts cached blocks that later prompts would have hit.
    assert {r["reason"] for r in totals} >= {"never-cached", "evicted"}


def test_prefix_misses_rejects_an_unknown_grouping(con):
    from kvtrace.errors import KvtraceError

    with pytest.raises(KvtraceError, match="by must be"):
        q(con, "prefix_misses", by="tokens")


# ---- turn_latency and job_completion ---------------------------------------------------------------------

def lifecycle(con) -> dict[str, dict]:
    """Per request, from the raw lifecycle events (not from the derived `requests` table)."""
    out: dict[str, dict] = defaultdict(dict)
    for e in raw(con, "select * from request_events order by ts_ns"):
        out[e["request_id"]].setdefault(e["event"], e["ts_ns"])
        if e["event"] == "finished":
            out[e["request_id"]]["finished"] = e["ts_ns"]
    return out


def test_turn_latency(con):
    life = lifecycle(con)
    preempted = Counter(p["request_id"] for p in raw(con, "select request_id from preemptions"))
    per_turn: dict[int, list] = defaultdict(list)
    for rid, ev in life.items():
        turn = int(re.match(JOB_PATTERN, rid).group("turn"))
        per_turn[turn].append((rid, ev))
    got = q(con, "turn_latency")
    assert [(r["turn"], r["requests"]) for r in got] == [(0, 6), (1, 6), (2, 6)]  # 6 jobs x 3 turns
    for r in got:
        lat = np.array([(ev["finished"] - ev["arrival"]) / 1e6 for _, ev in per_turn[r["turn"]]])
        assert r["latency_mean_ms"] == pytest.approx(lat.mean())
        assert r["latency_p50_ms"] == pytest.approx(np.quantile(lat, 0.5))
        assert r["latency_p90_ms"] == pytest.approx(np.quantile(lat, 0.9))
        assert r["latency_max_ms"] == pytest.approx(lat.max())
        assert r["ttft_mean_ms"] == pytest.approx(np.mean([(ev["first_token"] - ev["arrival"]) / 1e6
                                                           for _, ev in per_turn[r["turn"]]]))
        assert r["queue_mean_ms"] == pytest.approx(np.mean([(ev["scheduled"] - ev["arrival"]) / 1e6
                                                            for _, ev in per_turn[r["turn"]]]))
        assert r["preemptions"] == sum(preempted[rid] for rid, _ in per_turn[r["turn"]])


def test_job_completion(con, sid):
    life = lifecycle(con)
    jobs: dict[str, list] = defaultdict(list)
    for rid, ev in life.items():
        jobs[re.match(JOB_PATTERN, rid).group("job")].append(ev)
    t0 = raw(con, "select min(t_start_ns) t from steps")[0]["t"]
    got = q(con, "job_completion")
    assert [r["job_id"] for r in got] == [str(j) for j in range(6)]
    for r in got:
        evs = jobs[r["job_id"]]
        assert (r["turns"], r["finished"]) == (3, 3)
        jct = (max(e["finished"] for e in evs) - min(e["arrival"] for e in evs)) / 1e6
        busy = sum(e["finished"] - e["arrival"] for e in evs) / 1e6
        assert r["jct_ms"] == pytest.approx(jct)
        assert r["turns_ms"] == pytest.approx(busy)
        assert r["between_turns_ms"] == pytest.approx(jct - busy)
        assert r["first_arrival_s"] == pytest.approx(round((min(e["arrival"] for e in evs) - t0) / 1e9, 6))
        # A turn is submitted when the previous one finished: turns of a job never overlap.
        assert r["between_turns_ms"] >= 0
        assert r["output_tokens"] == 3 * 32  # --max-tokens 32, ignore_eos


# ---- preemptions -----------------------------------------------------------------------------------------

def test_preemptions(con, vllm):
    rows = raw(con, "select * from preemptions order by ts_ns")
    assert len(rows) == vllm["num_preemptions"] >= 1
    resumed = raw(con, "select request_id, step, ts_ns from request_events where event = 'resumed' order by ts_ns")
    steps = {s["step"]: s for s in raw(con, "select * from steps")}
    got = q(con, "preemptions")
    seen: Counter = Counter()
    for r, p in zip(got, rows, strict=True):
        seen[p["request_id"]] += 1
        assert (r["step"], r["request_id"], r["computed_tokens_lost"], r["blocks_freed"], r["output_tokens"]) == (
            p["step"], p["request_id"], p["computed_tokens_lost"], p["blocks_freed"], p["output_tokens"])
        assert r["nth"] == seen[p["request_id"]]
        nxt = next((e for e in resumed if e["request_id"] == p["request_id"] and e["ts_ns"] >= p["ts_ns"]), None)
        assert r["resumed_step"] == (nxt and nxt["step"])
        assert close(r["wait_ms"], nxt and (nxt["ts_ns"] - p["ts_ns"]) / 1e6)
        s = steps[p["step"]]
        assert r["kv_usage_pct"] == pytest.approx(100 * s["kv_blocks_used"] / s["kv_blocks_total"])
        assert r["finished"] is True
        assert r["job_id"] == re.match(JOB_PATTERN, p["request_id"]).group("job")


# ---- recompute_vs_swap -----------------------------------------------------------------------------------

def expected_resumes(con) -> list[dict]:
    """Per preemption, recomputed from step_requests / steps / prefix_lookups in Python (no connector)."""
    steps = {s["step"]: s for s in raw(con, "select * from steps")}
    out = []
    pre = raw(con, "select * from preemptions order by ts_ns")
    for i, p in enumerate(pre):
        nxt = next((x["step"] for x in pre[i + 1:] if x["request_id"] == p["request_id"]), None)
        rows = raw(con, """select * from step_requests where request_id = ? and step > ?
                           and (? is null or step < ?) order by step""", p["request_id"], p["step"], nxt, nxt)
        catch = []
        for r in rows:
            if r["phase"] != "prefill":
                break
            catch.append(r)
        ms = sum(r["tokens"] * (steps[r["step"]]["t_end_ns"] - steps[r["step"]]["t_start_ns"])
                 / steps[r["step"]]["scheduled_tokens"] for r in catch) / 1e6
        lk = raw(con, """select * from prefix_lookups where request_id = ? and after_preemption = 1
                         and ts_ns >= ? order by ts_ns""", p["request_id"], p["ts_ns"])
        out.append({"request_id": p["request_id"], "preempt_step": p["step"],
                    "tokens_lost": p["computed_tokens_lost"], "recomputed_tokens": sum(r["tokens"] for r in catch),
                    "recompute_steps": len(catch), "recompute_ms": ms,
                    "local_hit_tokens": lk[0]["hit_tokens"] if lk else None,
                    "resumed": bool(rows)})
    return out


def test_recompute_vs_swap_on_the_recorded_run(con):
    got = q(con, "recompute_vs_swap")
    want = expected_resumes(con)
    assert len(got) == len(want) >= 1
    for r, w in zip(got, want):
        for key, value in w.items():
            assert close(r[key], value) if isinstance(value, float) else r[key] == value, (key, r, w)
        assert (r["load_bytes"], r["load_ms"]) == (0, 0)
        assert r["overhead_ms"] == pytest.approx(r["recompute_ms"])
        assert r["evicted_bin"] == 2 ** int(math.log2(r["tokens_lost"]))
        # With prefix caching on, the resumed request finds its freed blocks still cached: it recomputes
        # only what the cache does not hold (here the last, partial block).
        assert r["recomputed_tokens"] == r["tokens_lost"] + 1 - r["local_hit_tokens"]
    bins = q(con, "recompute_vs_swap", by="bin")
    assert sum(b["preemptions"] for b in bins) == len(got)
    assert sum(b["recompute_ms"] for b in bins) == pytest.approx(sum(r["recompute_ms"] for r in got))
    assert [b["evicted_bin"] for b in q(con, "recompute_vs_swap", by="bin", bin_tokens=100)] == sorted(
        {r["tokens_lost"] // 100 * 100 for r in got})


def test_recompute_vs_swap_known_session(multi):
    (r,) = q(multi, "recompute_vs_swap", session=KNOWN)
    # r1 lost 20 tokens; resumed at step 3 with 16 tokens from the connector and 5 recomputed; step 3 took
    # 10 ms with 10 tokens scheduled and a 2 ms load call that loaded r1 (200 bytes) and r3 (300 bytes).
    assert (r["request_id"], r["preempt_step"], r["tokens_lost"], r["evicted_bin"]) == ("r1", 2, 20, 16)
    assert (r["external_hit_tokens"], r["local_hit_tokens"], r["recomputed_tokens"]) == (16, 0, 5)
    assert r["recompute_ms"] == pytest.approx(5 * (10 - 2) / 10)
    assert (r["load_bytes"], r["load_ms"]) == (200, pytest.approx(2 * 200 / 500))
    assert r["overhead_ms"] == pytest.approx(4.0 + 0.8)
    assert r["wait_ms"] == pytest.approx(20.2 - 10.5)
    assert r["catch_up_ms"] == pytest.approx(30 - 20.2)


def kv_bytes_per_token(model: str) -> int:
    """K and V of every layer for one token: 2 x layers x kv heads x head size x 4 bytes (float32)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * 4


# ExampleConnector (vLLM 0.32) cannot reload a preempted request: it saves a prompt's KV under the prompt's
# tokens but looks a resumed request up under prompt + generated tokens (FileNotFoundError in the worker;
# "shape mismatch" when the prompt was prefilled in chunks). The subclass below looks the prompt up, which
# is what was saved; prompts are kept in one chunk (--max-batched-tokens 1024) since the saved KV of a
# chunked prompt covers only its first chunk.
RESUMABLE_CONNECTOR = '''
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector, ExampleConnectorMetadata)


class ResumableExampleConnector(ExampleConnector):
    def build_connector_meta(self, scheduler_output):
        meta = ExampleConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            tokens, mm = new.prompt_token_ids or [], [f.identifier for f in new.mm_features]
            if new.req_id in self._requests_need_load:
                meta.add_request(token_ids=tokens, block_ids=new.block_ids[0], block_size=self._block_size,
                                 is_store=False, mm_hashes=mm)
            elif not self._found_match_for_prompt(tokens, mm):
                meta.add_request(token_ids=tokens, block_ids=new.block_ids[0], block_size=self._block_size,
                                 is_store=True, mm_hashes=mm)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids and rid in self._requests_need_load:
                req = self._requests_need_load[rid]
                meta.add_request(token_ids=list(req.prompt_token_ids or []), block_ids=cached.new_block_ids[i][0],
                                 block_size=self._block_size, is_store=False,
                                 mm_hashes=[f.identifier for f in req.mm_features])
        self._requests_need_load.clear()
        return meta
'''
RESUMABLE_DRIVER = '''
import json, sys
from kvtrace.demo.workload import make_engine, run_jobs, vllm_counters

if __name__ == "__main__":
    model, store, out, blocks, batched = sys.argv[1:6]
    llm = make_engine(model, int(blocks), 8, int(batched), prefix_caching=False, extra={"kv_transfer_config": {
        "kv_connector": "ResumableExampleConnector", "kv_connector_module_path": "resumable_example_connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"shared_storage_path": store}}})
    runs = [run_jobs(llm, 6, 3, 32)]
    with open(out, "w") as f:
        json.dump({"runs": runs, "vllm": vllm_counters(llm)}, f)
'''
# 33 blocks of 32 tokens: the fewest vLLM accepts for max_model_len 1024 (the brief's 24 is refused at startup).
RVS_BLOCKS, RVS_BATCH = 33, 1024


@pytest.fixture(scope="module")
def rvs_runs(tiny_model, tmp_path_factory):
    """The same workload twice, in parallel: recomputing after preemption, and reloading through a connector."""
    from tests.helpers.run import record_workload

    tmp = tmp_path_factory.mktemp("rvs")
    (tmp / "resumable_example_connector.py").write_text(RESUMABLE_CONNECTOR)
    (tmp / "drive.py").write_text(RESUMABLE_DRIVER)

    def recompute():
        return record_workload(tmp, "recompute", tiny_model, ["--no-prefix-caching", "--num-blocks",
                                                              str(RVS_BLOCKS), "--max-batched-tokens", str(RVS_BATCH)])

    def connector():
        session, metrics, db, store = tmp / "reload", tmp / "reload-metrics.json", tmp / "reload.duckdb", tmp / "kv"
        env = {"PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
        run_kvtrace("record", "-o", str(session), "--job-pattern", JOB_PATTERN, "--", sys.executable,
                    str(tmp / "drive.py"), tiny_model, str(store), str(metrics), str(RVS_BLOCKS), str(RVS_BATCH),
                    env=env)
        run_kvtrace("ingest", str(session), "-o", str(db))
        return {"session": session, "db": db, "metrics": json.loads(metrics.read_text())}

    with ThreadPoolExecutor(2) as pool:
        jobs = pool.submit(recompute), pool.submit(connector)
        out = {}
        for name, job in zip(("recompute", "reload"), jobs):
            try:
                out[name] = job.result()
            except AssertionError as exc:  # the run failed: the tests that need it xfail with the reason
                out[name] = {"error": str(exc)[-2000:]}
    return out


def _run(rvs_runs, name):
    run = rvs_runs[name]
    if "error" in run:
        pytest.xfail(f"the {name} run failed: {run['error'][-400:]}")
    return run


@pytest.mark.vllm
def test_recompute_vs_swap_recomputing_run(rvs_runs):
    run = _run(rvs_runs, "recompute")
    with duckdb.connect(str(run["db"]), read_only=True) as c:
        got = q(c, "recompute_vs_swap")
        assert len(got) == run["metrics"]["vllm"]["num_preemptions"] >= 1
        assert all(math.isfinite(v) for r in got for v in r.values() if isinstance(v, float))
        for r, w in zip(got, expected_resumes(c)):
            assert r["recompute_ms"] == pytest.approx(w["recompute_ms"])
            # No prefix cache, no connector: everything is computed again, the lost tokens plus the last
            # sampled token (a request preempted while decoding has computed all but that one).
            assert r["recomputed_tokens"] == w["recomputed_tokens"] == r["tokens_lost"] + 1
            assert (r["load_bytes"], r["load_ms"], r["external_hit_tokens"]) == (0, 0, None)
        assert sum(r["ext_saved_bytes"] for r in q(c, "kv_utilization")) == 0


@pytest.mark.vllm
def test_recompute_vs_swap_reloading_run(rvs_runs, tiny_model):
    run = _run(rvs_runs, "reload")
    with duckdb.connect(str(run["db"]), read_only=True) as c:
        got = q(c, "recompute_vs_swap")
        assert len(got) == run["metrics"]["vllm"]["num_preemptions"] >= 1
        if not c.execute("select count(*) from transfers").fetchall()[0][0]:
            pytest.xfail("transfers is empty: the connector probe did not record this run")
        per_token = kv_bytes_per_token(tiny_model)
        for r in got:
            # The connector offered the prompt's full blocks; vLLM recomputed the rest (lost + 1 - loaded).
            assert r["external_hit_tokens"] > 0, r
            assert r["recomputed_tokens"] == r["tokens_lost"] + 1 - r["external_hit_tokens"]
            # What it loaded: the prompt's KV in whole blocks, every layer (within one block of the offer).
            assert r["load_bytes"] % per_token == 0
            assert abs(r["load_bytes"] // per_token - r["external_hit_tokens"]) <= 32
            assert r["load_ms"] > 0
        util = q(c, "kv_utilization")
        saved = c.execute("select sum(bytes) from transfers where direction = 'save'").fetchall()[0][0]
        assert sum(r["ext_saved_bytes"] for r in util) == saved == util[-1]["ext_stored_bytes"] > 0
        cap = util[-1]["ext_stored_bytes"] * 2
        assert q(c, "kv_utilization", external_capacity_bytes=cap)[-1]["ext_usage_pct"] == pytest.approx(50.0)


@pytest.mark.vllm
def test_recompute_vs_swap_side_by_side(rvs_runs):
    from kvtrace.export.report import compare

    rec, rel = _run(rvs_runs, "recompute"), _run(rvs_runs, "reload")
    columns, rows = compare([rec["db"], rel["db"]])
    assert columns == ["metric", "unit", "recompute", "reload"]
    table = {r[0]: r[2:] for r in rows}
    assert table["preemptions"] == (rec["metrics"]["vllm"]["num_preemptions"], rel["metrics"]["vllm"]["num_preemptions"])
    assert table["resume: bytes loaded"][0] == 0 < table["resume: bytes loaded"][1]
    assert table["resume: connector load time"][0] == 0 < table["resume: connector load time"][1]
    with duckdb.connect(str(rec["db"]), read_only=True) as a, duckdb.connect(str(rel["db"]), read_only=True) as b:
        per_lost = [sum(r["recomputed_tokens"] for r in q(c, "recompute_vs_swap"))
                    / sum(r["tokens_lost"] for r in q(c, "recompute_vs_swap")) for c in (a, b)]
    assert per_lost[1] < per_lost[0]  # reloading through the connector recomputes less per token lost


# ---- kv_utilization --------------------------------------------------------------------------------------

def test_kv_utilization(con, multi):
    steps = raw(con, "select * from steps order by step")
    got = q(con, "kv_utilization")
    assert [r["step"] for r in got] == [s["step"] for s in steps]
    for r, s in zip(got, steps):
        assert r["usage_pct"] == pytest.approx(100 * s["kv_blocks_used"] / s["kv_blocks_total"])
        assert (r["num_running"], r["num_waiting"], r["num_preempted"]) == (
            s["num_running"], s["num_waiting"], s["num_preempted"])
        assert (r["ext_saved_bytes"], r["ext_loaded_bytes"], r["ext_stored_bytes"], r["ext_usage_pct"]) == (0, 0, 0, None)
    assert max(r["usage_pct"] for r in got) > 90  # the 40-block pool fills up (the run preempts)
    known = q(multi, "kv_utilization", session=KNOWN, external_capacity_bytes=1024)
    assert [(r["usage_pct"], r["ext_saved_bytes"], r["ext_loaded_bytes"], r["ext_stored_bytes"]) for r in known] == [
        (30.0, 512, 0, 512), (10.0, 0, 0, 512), (50.0, 0, 500, 512), (50.0, 0, 0, 512)]
    assert [r["ext_usage_pct"] for r in known] == [50.0] * 4


# ---- fragmentation ---------------------------------------------------------------------------------------

def test_fragmentation_against_block_events(con):
    """Blocks held per request replayed from the block pool's own events (alloc, prefix-hit touch, free)
    at the end of each step's schedule(); tokens from the scheduler rows; waste from vLLM's allocation
    rule (a request holds ceil(tokens / block_size) blocks)."""
    bs = raw(con, "select block_size from sessions")[0]["block_size"]
    steps = raw(con, "select step, t_sched_end_ns from steps order by step")
    events = raw(con, """select ts_ns, event, request_id from block_events
                         where event in ('alloc', 'touch', 'free') order by ts_ns""")
    rows = raw(con, "select * from step_requests order by step")
    held: Counter = Counter()
    stored: dict[str, int] = {}
    i = 0
    got = {r["step"]: r for r in q(con, "fragmentation")}
    assert sorted(got) == [s["step"] for s in steps]
    for s in steps:
        while i < len(events) and events[i]["ts_ns"] <= s["t_sched_end_ns"]:
            e = events[i]
            held[e["request_id"]] += -1 if e["event"] == "free" else 1
            i += 1
        for r in rows:
            if r["step"] == s["step"]:
                stored[r["request_id"]] = r["computed_before"] + r["tokens"]
        holders = [rid for rid, n in held.items() if n > 0]
        g = got[s["step"]]
        assert g["requests"] == len(holders), s
        assert g["blocks_held"] == sum(held[rid] for rid in holders), s
        assert g["tokens_stored"] == sum(stored[rid] for rid in holders), s
        assert g["blocks_held"] == sum(-(-stored[rid] // bs) for rid in holders), s
        assert g["allocated_slots"] == g["blocks_held"] * bs
        assert g["wasted_slots"] == g["allocated_slots"] - g["tokens_stored"]
        assert 0 <= g["wasted_slots"] < bs * max(g["requests"], 1)
        assert close(g["waste_pct"], 100 * g["wasted_slots"] / g["allocated_slots"] if g["allocated_slots"] else None)


def test_fragmentation_known_session(multi):
    got = q(multi, "fragmentation", session=KNOWN)
    assert [(r["step"], r["requests"], r["tokens_stored"], r["blocks_held"], r["wasted_slots"]) for r in got] == [
        (1, 2, 32, 3, 16), (2, 1, 13, 1, 3), (3, 3, 55, 5, 25), (4, 3, 58, 5, 22)]


# ---- block_lifetimes -------------------------------------------------------------------------------------

ORDER = {"evict": 0, "alloc": 1, "cache": 2, "touch": 3, "free": 4}


def replay_residencies(con, session: str) -> list[dict]:
    """Every block's residencies replayed in Python from its events, with vLLM's definitions."""
    events = raw(con, """select * from block_events where session = ? and event in
                         ('alloc', 'touch', 'free', 'evict', 'cache')""", session)
    by_block: dict[tuple, list] = defaultdict(list)
    for e in sorted(events, key=lambda e: (e["ts_ns"], ORDER[e["event"]])):
        by_block[(e["rank"], e["block_id"])].append(e)
    out = []
    for (rank, block), evs in by_block.items():
        res: list[dict] = []
        for e in evs:
            if e["event"] == "alloc":
                if res:
                    res[-1]["next_alloc"] = e["ts_ns"]
                res.append({"block_id": block, "rank": rank, "alloc": e, "touch": [], "free": [], "evict": None,
                            "cached": False, "next_alloc": None})
            elif res:
                cur = res[-1]
                if e["event"] == "evict":
                    cur["evict"] = cur["evict"] or e["ts_ns"]
                elif e["event"] == "cache":
                    cur["cached"] = True
                else:
                    cur[e["event"]].append(e["ts_ns"])
        for n, r in enumerate(res, 1):
            a = r["alloc"]["ts_ns"]
            end = r["evict"] or r["next_alloc"]
            last_access = max([a, *r["touch"]])
            out.append({
                "block_id": block, "rank": rank, "residency": n, "alloc_step": r["alloc"]["step"], "alloc_ns": a,
                "cached": r["cached"], "touches": len(r["touch"]),
                "end_event": "evict" if r["evict"] else ("realloc" if r["next_alloc"] else "open"),
                "lifetime_ms": end and (end - a) / 1e6,
                "idle_before_end_ms": end and (end - last_access) / 1e6,
                "held_ms": (max(r["free"]) - a) / 1e6 if r["free"] and max(r["free"]) > last_access else None,
                "first_reuse_ms": (min(r["touch"]) - a) / 1e6 if r["touch"] else None,
                "reuse_gap_mean_ms": float(np.mean(np.diff(sorted(r["touch"])))) / 1e6 if len(r["touch"]) > 1 else None})
    return sorted(out, key=lambda r: (r["rank"], r["block_id"], r["residency"]))


def test_block_lifetimes_against_a_replay(con, sid):
    want = replay_residencies(con, sid)
    got = q(con, "block_lifetimes")
    assert len(got) == len(want) == raw(con, "select count(*) n from block_events where event = 'alloc'")[0]["n"]
    for g, w in zip(got, want):
        for key, value in w.items():
            assert close(g[key], value) if isinstance(value, float) else g[key] == value, (key, g, w)
    # vLLM evicts a block's hash only when the block was cached, and only when it hands the block out again.
    evictions = raw(con, "select count(*) n from block_events where event = 'evict'")[0]["n"]
    assert sum(r["end_event"] == "evict" for r in got) == evictions > 0
    assert all(r["cached"] for r in got if r["end_event"] == "evict")
    assert q(con, "block_lifetimes", block_id=got[0]["block_id"]) == [r for r in got if r["block_id"] == got[0]["block_id"]]


def test_block_lifetimes_known_session(multi):
    got = {(r["block_id"], r["residency"]): r for r in q(multi, "block_lifetimes", session=KNOWN)}
    assert sorted(got) == [(5, 1), (5, 2), (9, 1), (9, 2)]
    b5, b9 = got[(5, 1)], got[(9, 1)]
    assert (b5["end_event"], b5["lifetime_ms"], b5["held_ms"], b5["cached"]) == ("realloc", 20.0, 10.5, False)
    assert (b9["end_event"], b9["cached"], b9["touches"]) == ("evict", True, 1)
    assert b9["lifetime_ms"] == pytest.approx(1980.0)  # 1.02 s -> 3.0 s
    assert b9["idle_before_end_ms"] == pytest.approx(800.0)  # hit at 2.2 s
    assert b9["held_ms"] == pytest.approx(1580.0)  # freed at 2.6 s
    assert b9["first_reuse_ms"] == pytest.approx(1180.0)
    assert got[(9, 2)]["end_event"] == got[(5, 2)]["end_event"] == "open"
    assert got[(9, 2)]["alloc_step"] == 10 and got[(9, 2)]["alloc_ns"] == 3 * S and got[(9, 2)]["lifetime_ms"] is None


# ---- pins ------------------------------------------------------------------------------------------------

def test_pins_known_session(multi, con):
    assert q(con, "pins") == []  # the standard run pins nothing
    got = q(multi, "pins", session=KNOWN)
    assert [(r["request_id"], r["kind"], r["end_event"]) for r in got] == [
        ("r2", "pin", "expire"), ("r3", "hold", "release"), ("r1", "pin", None)]
    pin, hold, open_pin = got
    assert (pin["held_ms"], pin["ttl_ms"], pin["blocks"], pin["reuse_events"], pin["hit_requests"]) == (
        2000.0, 2000.0, 1, 1, 0)
    assert (pin["reused"], pin["expired"], pin["first_reuse_ms"]) == (True, True, 500.0)
    assert (hold["held_ms"], hold["blocks"], hold["reuse_events"], hold["hit_requests"]) == (500.0, 2, 0, 1)
    assert (hold["reused"], hold["expired"], hold["first_reuse_ms"]) == (True, False, 100.0)
    assert (open_pin["held_ms"], open_pin["reused"], open_pin["expired"]) == (None, False, False)


# ---- access_pattern and kv_idle_gaps ---------------------------------------------------------------------

def test_access_pattern_known_session(multi):
    got = q(multi, "access_pattern", session=KNOWN)
    assert {r["layer"] for r in got} == {0}  # default: the lowest layer
    assert [(r["step"], r["op"], r["block_id"], r["t_ms"]) for r in got] == [
        (1, "write", 7, 5.0), (1, "read", 7, 5.1), (2, "read", 7, 15.0), (3, "read", 8, 25.0),
        (4, "read", 7, 35.0), (4, "read", 7, 35.2)]
    assert [r["step"] for r in q(multi, "access_pattern", session=KNOWN, op="write", layer=1)] == [1]
    assert [r["step"] for r in q(multi, "access_pattern", session=KNOWN, step_from=2, step_to=3)] == [2, 3]


def test_access_pattern_recorded(con):
    if not raw(con, "select count(*) n from kv_access")[0]["n"]:
        pytest.skip("no kv_access records in this run (attention probe off)")
    layer0 = raw(con, "select count(*) n from kv_access where layer = 0")[0]["n"]
    got = q(con, "access_pattern")
    assert len(got) == layer0 and {r["layer"] for r in got} == {0}
    # Every scheduled token is written once per layer; every request reads its whole context.
    writes, reads = Counter(), Counter()
    for r in got:
        if r["op"] == "write":
            writes[r["step"]] += r["token_count"]
        else:
            reads[(r["step"], r["request_id"])] += r["token_count"]
    steps = {s["step"]: s["scheduled_tokens"] for s in raw(con, "select * from steps")}
    assert writes == Counter({s: n for s, n in steps.items() if n > 0})
    ctx = {(r["step"], r["request_id"]): r["computed_before"] + r["tokens"]
           for r in raw(con, "select * from step_requests")}
    assert reads == ctx


def idle_gaps(records: list[dict], key) -> dict:
    """kv_idle_gaps recomputed: visits = steps, gaps between visits, spans inside them."""
    out = {}
    groups: dict = defaultdict(list)
    for r in records:
        groups[key(r)].append(r)
    for k, recs in groups.items():
        visits: dict = defaultdict(list)
        for r in recs:
            visits[r["step"]].append(r["ts_ns"])
        spans = sorted((min(v), max(v)) for v in visits.values())
        gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
        window = spans[-1][1] - spans[0][0]
        busy = sum(b - a for a, b in spans)
        out[k] = {"visits": len(spans), "gaps": len(gaps), "reads": sum(r["op"] == 0 for r in recs),
                  "writes": sum(r["op"] == 1 for r in recs),
                  "gap_mean_ms": np.mean(gaps) / 1e6 if gaps else None,
                  "gap_p50_ms": float(np.quantile(gaps, 0.5)) / 1e6 if gaps else None,
                  "gap_max_ms": max(gaps) / 1e6 if gaps else None, "busy_ms": busy / 1e6, "window_ms": window / 1e6,
                  "idle_share": 1 - busy / window if window else None}
    return out


def test_kv_idle_gaps_recorded(con):
    records = raw(con, "select * from kv_access")
    if not records:
        pytest.skip("no kv_access records in this run (attention probe off)")
    for params, key, pick in ((dict(), lambda r: (r["layer"], r["block_id"]), lambda r: r["layer"] == 0),
                              (dict(layer="all"), lambda r: (r["layer"], r["block_id"]), lambda r: True),
                              (dict(by="layer"), lambda r: (r["layer"], None), lambda r: True)):
        want = idle_gaps([r for r in records if pick(r)], key)
        got = q(con, "kv_idle_gaps", **params)
        assert sorted((r["layer"], r["block_id"]) for r in got) == sorted(want), params
        for r in got:
            w = want[(r["layer"], r["block_id"])]
            for col, value in w.items():
                assert close(r[col], value), (params, col, r, w)


def test_kv_idle_gaps_known_session(multi):
    (b7, b8), layer = q(multi, "kv_idle_gaps", session=KNOWN), q(multi, "kv_idle_gaps", session=KNOWN, by="layer")
    assert (b7["block_id"], b7["visits"], b7["reads"], b7["writes"], b7["gaps"]) == (7, 3, 4, 1, 2)
    assert b7["gap_mean_ms"] == pytest.approx((9.9 + 20) / 2)  # 5.1 ms -> 15 ms -> 35 ms
    assert (b7["gap_max_ms"], b7["busy_ms"], b7["window_ms"]) == (pytest.approx(20.0), pytest.approx(0.3),
                                                                  pytest.approx(30.2))
    assert b7["idle_share"] == pytest.approx(1 - 0.3 / 30.2)
    assert (b8["visits"], b8["gaps"], b8["gap_mean_ms"], b8["idle_share"]) == (1, 0, None, None)
    assert [(r["layer"], r["visits"]) for r in layer] == [(0, 4), (1, 1)]
    assert layer[0]["gap_max_ms"] == pytest.approx(10.0) and layer[0]["gap_p50_ms"] == pytest.approx(10.0)
    assert layer[0]["gap_mean_ms"] == pytest.approx((9.9 + 10 + 10) / 3)
    with pytest.raises(Exception, match="by must be"):
        q(multi, "kv_idle_gaps", by="step")
