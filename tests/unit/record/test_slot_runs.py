"""Batch slots held as runs (`SlotRuns`, record/buffers.py): the attention probe keeps a batch's request
ids once for consecutive steps that hold the same requests in the same rows, and ingest expands the
`batch_slot_runs` shard rows back into exactly the `batch_slots` rows of every step."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvtrace.errors import KvtraceError
from kvtrace.format import schema
from kvtrace.format.shards import expand_batch_slot_runs, loads_into
from kvtrace.record.buffers import SlotRuns


def as_batch(cols: dict) -> pa.RecordBatch:
    sch = schema.arrow_schema("batch_slot_runs")
    return pa.RecordBatch.from_arrays([pa.array(cols[f.name], f.type) for f in sch], schema=sch)


def expanded(runs: SlotRuns) -> list[tuple]:
    cols = runs.take()
    return sorted((r["step"], r["slot"], r["request_id"]) for r in expand_batch_slot_runs(as_batch(cols)).to_pylist())


def test_runs_expand_to_every_steps_rows():
    runs = SlotRuns()
    batch = ["a", "b", "c"]
    steps = {}
    for step in range(0, 5):  # a decode batch: the same rows for five steps
        runs.add(step, batch)
        steps[step] = list(batch)
    batch.remove("b")  # vLLM changes its list in place: a request finished
    for step in (5, 6, 9):  # 9: a step the worker did not run between (a new run)
        runs.add(step, batch)
        steps[step] = list(batch)
    batch.insert(0, None)  # an empty row, as V1's input batch may have
    runs.add(10, batch)
    steps[10] = list(batch)
    want = sorted((s, i, rid) for s, ids in steps.items() for i, rid in enumerate(ids))
    assert expanded(runs) == want
    assert runs.take() is None  # all handed over, the open run too
    runs.add(11, ["x"])
    got_cols = runs.take()
    assert got_cols["step"].tolist() == [11] and got_cols["steps"].tolist() == [1]


def test_a_steady_batch_is_one_run_per_slot():
    runs = SlotRuns()
    ids = [f"req-{i}" for i in range(256)]
    for step in range(100, 400):
        runs.add(step, ids)
    cols = runs.take()
    assert len(cols["step"]) == 256 and set(cols["steps"].tolist()) == {300}
    assert cols["slot"].tolist() == list(range(256))


def test_a_batch_given_as_a_tuple_makes_the_same_runs():
    runs = SlotRuns()
    for step in range(3):
        runs.add(step, ("a", "b"))
    cols = runs.take()
    assert cols["steps"].tolist() == [3, 3] and cols["slot"].tolist() == [0, 1]


def test_add_says_when_to_take():
    runs = SlotRuns(flush_ns=0)
    assert runs.add(0, ["a"])  # due at once
    runs.take()
    runs = SlotRuns(flush_ns=10**12)
    assert not runs.add(0, ["a"])


def test_the_run_table_loads_into_batch_slots():
    assert loads_into("batch_slot_runs") == "batch_slots"


@pytest.mark.parametrize("steps, step, words", [
    (0, 1, "batch slot run of 0 steps"),
    (-3, 1, "batch slot run of -3 steps"),
    (1 << 25, 1, "batch slot run of 33554432 steps"),
    (2, None, "nulls in step"),
])
def test_damaged_runs_are_refused_in_one_line(steps, step, words):
    bad = as_batch({"step": [step], "steps": [steps], "slot": [0], "request_id": ["a"]})
    with pytest.raises(KvtraceError, match=f"{words}.*not a shard kvtrace wrote"):
        expand_batch_slot_runs(bad, "x.arrows")


def test_runs_standing_for_too_many_rows_are_refused():
    n = 1 << 4
    bad = as_batch({"step": [0] * n, "steps": [1 << 24] * n, "slot": list(range(n)), "request_id": ["a"] * n})
    with pytest.raises(KvtraceError, match="batch_slot_runs standing for 268435456 rows"):
        expand_batch_slot_runs(bad)
