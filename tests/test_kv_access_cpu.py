"""Per-layer KV access records from a real vLLM run (CPU backend, the CPU ring) against the scheduler's
own blocks: for every step and layer, the blocks read are the first ceil(seq_len / block_size) blocks of
each request's block table, and the slots written are the tokens scheduled that step.

The expected block tables are rebuilt independently of the attention probe, from the block pool events
the EngineCore recorded (alloc and touch append to a request's table, a free of the request empties it).
"""

from __future__ import annotations

from collections import defaultdict

import duckdb
import pytest

pytestmark = pytest.mark.vllm
BLOCK = 32


def _tables_by_step(con):
    """(step, request) -> the request's block table as the scheduler left it when `step` was scheduled.

    Events are replayed in recording order up to the end of each step's schedule() (a request that
    finishes in that step frees its blocks later, in update_from_output)."""
    events = con.execute("""select ts_ns, request_id, event, block_id, step from block_events
                            where event in ('alloc', 'touch', 'free') and request_id is not null
                            order by seq""").fetchall()
    steps = con.execute("select step, t_sched_end_ns from steps order by step").fetchall()
    scheduled: dict[int, list[str]] = defaultdict(list)
    for step, rid in con.execute("select step, request_id from step_requests").fetchall():
        scheduled[step].append(rid)
    table: dict[str, list[int]] = defaultdict(list)
    snapshots: dict[tuple[int, str], list[int]] = {}
    last_free: dict[str, tuple] = {}
    i = 0
    for step, sched_end in steps:
        while i < len(events) and events[i][0] <= sched_end:
            ts, rid, event, block, ev_step = events[i]
            i += 1
            if event == "free":
                if last_free.get(rid) != (ts, ev_step):  # one free call = one row per block
                    table[rid] = []
                    last_free[rid] = (ts, ev_step)
            else:
                table[rid].append(block)
        for rid in scheduled.get(step, []):
            snapshots[(step, rid)] = list(table[rid])
    return snapshots


def test_reads_and_writes_match_scheduler_blocks(recorded_run):
    con = duckdb.connect(str(recorded_run["db"]), read_only=True)
    try:
        tables = _tables_by_step(con)
        layers = [r[0] for r in con.execute("select distinct layer from kv_access order by 1").fetchall()]
        assert layers == [0, 1]  # the tiny model's two attention layers, all recorded
        sched = con.execute("select step, request_id, computed_before, tokens from step_requests").fetchall()
        access = con.execute("""select step, layer, request_id, op, block_id, token_offset, token_count
                                from kv_access""").fetchall()
        (unnamed,), = con.execute("select count(*) from kv_access where request_id is null").fetchall()
    finally:
        con.close()
    assert unnamed == 0, "every record is attributed to a request through batch_slots"
    got_reads: dict[tuple, set] = defaultdict(set)
    got_writes: dict[tuple, dict] = defaultdict(lambda: defaultdict(int))
    for step, layer, rid, op, block, offset, count in access:
        if op == 0:
            got_reads[(step, layer, rid)].add(block)
            assert offset == 0
        else:
            got_writes[(step, layer, rid)][block] += count
    checked = 0
    for step, rid, computed, tokens in sched:
        blocks = tables[(step, rid)]
        seq_len = computed + tokens
        want_reads = set(blocks[: -(-seq_len // BLOCK)])
        want_writes: dict[int, int] = defaultdict(int)
        for pos in range(computed, computed + tokens):
            want_writes[blocks[pos // BLOCK]] += 1
        for layer in layers:
            assert got_reads[(step, layer, rid)] == want_reads, (step, layer, rid)
            assert dict(got_writes[(step, layer, rid)]) == dict(want_writes), (step, layer, rid)
            checked += 1
    assert checked > 500
    # Nothing recorded for a (step, request) the scheduler did not schedule.
    assert {(s, r) for s, _, r in got_reads} <= {(s, r) for s, r, _, _ in sched}
