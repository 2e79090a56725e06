"""Checks of recorded per-layer KV access against the scheduler's own blocks, shared by the CPU
(tests/integration/test_kv_access_cpu.py) and GPU (tests/gpu/test_vllm_cuda.py) tests.

The expected block tables are rebuilt independently of the attention probe, from the block pool events
the EngineCore recorded (alloc and touch append to a request's table, a free of the request empties it).
"""

from __future__ import annotations

from collections import defaultdict


def tables_by_step(con) -> dict[tuple[int, str], list[int]]:
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


def check_reads_and_writes(con, block_size: int, layers: list[int], rank: int | None = None) -> int:
    """Assert that for every scheduled (step, request) and every layer in `layers`, the blocks read are
    the first ceil(seq_len / block_size) blocks of its table and the tokens written are the ones
    scheduled that step, and that nothing is recorded for what was not scheduled. `rank`: only that
    worker's records (tensor parallel ranks each record the whole block table). Returns the number
    of (step, request, layer) checked."""
    tables = tables_by_step(con)
    sched = con.execute("select step, request_id, computed_before, tokens from step_requests").fetchall()
    where, params = ("where rank = ?", [rank]) if rank is not None else ("", [])
    access = con.execute(f"""select step, layer, request_id, op, block_id, token_offset, token_count
                             from kv_access {where}""", params).fetchall()
    (unnamed,), = con.execute(f"select count(*) from kv_access {where or 'where true'} and request_id is null",
                              params).fetchall()
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
        want_reads = set(blocks[: -(-seq_len // block_size)])
        want_writes: dict[int, int] = defaultdict(int)
        for pos in range(computed, computed + tokens):
            want_writes[blocks[pos // block_size]] += 1
        for layer in layers:
            assert got_reads[(step, layer, rid)] == want_reads, (step, layer, rid)
            assert dict(got_writes[(step, layer, rid)]) == dict(want_writes), (step, layer, rid)
            checked += 1
    # Nothing recorded for a (step, request) the scheduler did not schedule.
    assert {(s, r) for s, _, r in got_reads} <= {(s, r) for s, r, _, _ in sched}
    return checked


def expected_records(con, block_size: int, layers: int) -> int:
    """How many kv_access records a run whose every one of `layers` layers is recorded must produce: per
    scheduled (step, request) and layer, one read per block of [0, seq_len) and one write per block the
    step's tokens go to (they are consecutive)."""
    tables = tables_by_step(con)
    total = 0
    for step, rid, computed, tokens in con.execute(
            "select step, request_id, computed_before, tokens from step_requests").fetchall():
        blocks = tables[(step, rid)]
        reads = min(-(-(computed + tokens) // block_size), len(blocks))
        writes = len({blocks[pos // block_size] for pos in range(computed, computed + tokens)})
        total += (reads + writes) * layers
    return total
