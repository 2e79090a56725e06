"""Preemption cost and resumption, checked on the standard recorded run without the canned queries.

vLLM v1 only recomputes: a preempted request loses its blocks and, when scheduled again, comes back as a
"resumed" request that prefills everything it had (less what the prefix cache still holds), possibly in
several chunks, before it decodes again. For every row of `preemptions` the recorded `step_requests` must
show exactly that, between that preemption and the request's next one.
"""

from __future__ import annotations

import duckdb
import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def con(recorded_run):
    c = duckdb.connect(str(recorded_run["db"]), read_only=True)
    yield c
    c.close()


def test_every_preemption_is_followed_by_a_resumed_prefill(con, recorded_run):
    preempts = con.execute("""select request_id, step, computed_tokens_lost,
                                     lead(step) over (partition by request_id order by ts_ns) as next_step
                              from preemptions order by ts_ns""").fetchall()
    assert preempts, "the standard run (40-block pool) is meant to preempt"
    assert len(preempts) == recorded_run["metrics"]["vllm"]["num_preemptions"]
    for rid, step, lost, next_step in preempts:
        rows = con.execute("""select step, phase, kind, chunk_index, tokens, computed_before
                              from step_requests where request_id = ? and step > ?
                                and (? is null or step < ?) order by step""",
                           [rid, step, next_step, next_step]).fetchall()
        assert rows, f"{rid} preempted at step {step} never ran again"
        first = rows[0]
        assert (first[1], first[2], first[3]) == ("prefill", "resumed", 0), (rid, step, first)
        # The engine logged the resumption in the same step.
        assert con.execute("""select count(*) from request_events where request_id = ? and event = 'resumed'
                              and step = ?""", [rid, first[0]]).fetchone()[0] == 1
        # Prefill chunks 0, 1, 2, ... (kind 'running' after the first), then decode only.
        prefill = [r for r in rows if r[1] == "prefill"]
        assert rows[:len(prefill)] == prefill, f"{rid}: a prefill after decoding started"
        assert [r[3] for r in prefill] == list(range(len(prefill)))
        assert all(r[2] == "running" for r in prefill[1:])
        assert all(r[3] == -1 for r in rows[len(prefill):])
        # Recomputation covers at least what was lost (prefix hits count as computed).
        assert first[5] + sum(r[4] for r in prefill) >= lost, (rid, step, lost, prefill)
    # One resumption per preemption, no more, in step_requests and in the steps' counters.
    resumed = con.execute("select count(*) from step_requests where kind = 'resumed'").fetchone()[0]
    per_step = con.execute("select sum(num_resumed_reqs) from steps").fetchone()[0]
    assert resumed == per_step == len(preempts)
