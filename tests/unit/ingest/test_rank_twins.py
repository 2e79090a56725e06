"""Tensor-parallel workers write byte-identical shards of tables whose rows carry no time (the same batch
rows in every rank): ingest must read each rank's, while a copied process folder is still read once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from kvtrace.ingest import ingest
from kvtrace.testing.synth import generate


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("twins") / "s"
    generate(out, 20_000, seed=3)
    return out


def worker_dir(session: Path) -> Path:
    (d,) = [p.parent for p in session.glob("procs/*/proc.json")
            if json.loads(p.read_text()).get("role") == "worker"]
    return d


def add_rank(session: Path, dst_name: str, shift_times: bool) -> Path:
    """A second worker: the first's folder copied with another pid and rank; with `shift_times` its
    timed rows move by 1 ns (another process's own times), as a real tensor-parallel twin's would."""
    src = worker_dir(session)
    dst = src.parent / dst_name
    shutil.copytree(src, dst)
    doc = json.loads((dst / "proc.json").read_text())
    doc.update(pid=doc["pid"] + 1, rank=1)
    (dst / "proc.json").write_text(json.dumps(doc))
    if shift_times:
        for shard in dst.glob("*.arrows"):
            with pa.ipc.open_stream(pa.BufferReader(shard.read_bytes())) as reader:
                schema, batches = reader.schema, list(reader)
            if "ts_ns" not in schema.names:
                continue
            i = schema.get_field_index("ts_ns")
            batches = [b.set_column(i, schema.field(i), pa.compute.add(b.column(i), 1)) for b in batches]
            with pa.ipc.new_stream(str(shard), schema) as writer:
                for b in batches:
                    writer.write_batch(b)
    return dst


def counts(db: Path) -> dict:
    con = duckdb.connect(str(db), read_only=True)
    try:
        q = lambda sql: dict(con.execute(sql).fetchall())  # noqa: E731
        return {"slots": q("select rank, count(*) from batch_slots group by 1"),
                "named": q("select rank, count(request_id) from kv_access group by 1"),
                "access": q("select rank, count(*) from kv_access group by 1")}
    finally:
        con.close()


def as_slot_runs(session: Path) -> None:
    """The worker's batch_slots shards rewritten as the attention probe writes them: batch_slot_runs
    (runs of one step each)."""
    from kvtrace.format import schema

    sch = schema.arrow_schema("batch_slot_runs")
    for shard in worker_dir(session).glob("batch_slots.*.arrows"):
        with pa.ipc.open_stream(pa.BufferReader(shard.read_bytes())) as reader:
            batches = list(reader)
        with pa.ipc.new_stream(str(shard.with_name(shard.name.replace("batch_slots", "batch_slot_runs"))), sch) as w:
            for b in batches:
                w.write_batch(pa.RecordBatch.from_arrays(
                    [b.column("step"), pa.array([1] * b.num_rows, pa.int32()), b.column("slot"), b.column("request_id")],
                    schema=sch))
        shard.unlink()


@pytest.mark.parametrize("runs", [False, True], ids=["rows", "runs"])
def test_each_rank_keeps_its_own_identical_batch_rows(session, tmp_path, runs):
    s = tmp_path / "tp"
    shutil.copytree(session, s)
    if runs:
        as_slot_runs(s)
        assert list(worker_dir(s).glob("batch_slot_runs.*.arrows"))
    add_rank(s, "worker-rank1", shift_times=True)
    ingest([s], tmp_path / "tp.duckdb")
    got = counts(tmp_path / "tp.duckdb")
    assert set(got["slots"]) == {0, 1} and got["slots"][0] == got["slots"][1] > 0, got
    assert got["named"] == got["access"] and got["access"][0] == got["access"][1] > 0, got


def test_a_copied_worker_folder_is_still_read_once(session, tmp_path):
    s = tmp_path / "copy"
    shutil.copytree(session, s)
    add_rank(s, "worker-copy", shift_times=False)
    ingest([s], tmp_path / "copy.duckdb")
    ingest([session], tmp_path / "base.duckdb")
    got, base = counts(tmp_path / "copy.duckdb"), counts(tmp_path / "base.duckdb")
    assert sum(got["slots"].values()) == sum(base["slots"].values()), (got, base)
    assert sum(got["access"].values()) == sum(base["access"].values()), (got, base)
