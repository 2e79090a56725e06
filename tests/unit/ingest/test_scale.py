"""Scale: the synthetic session generator, streaming ingest, long recordings (rotation, --max-size,
ingest while a recorder is still writing). Small sessions (10-50 K events) so this stays fast; the
figures at 1 M / 10 M events come from bench/bench_scale.py."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from kvtrace.format import schema
from kvtrace.format.session import proc_dirs, read_proc, session_size_bytes
from kvtrace.format.shards import ShardRead, list_shards, read_shard
from kvtrace.ingest import ingest
from kvtrace.ingest import rows as ingest_rows
from kvtrace.record.launch import finalize_session, prepare_session
from kvtrace.store import compression, keyed, layout, tables
from kvtrace.testing import synth
from tests.helpers.run import query as q

REPO = Path(__file__).resolve().parents[3]

# A recording process: a real Recorder whose rows come from a loop instead of vLLM. Appends `steps`
# rows with step ids 0, 1, 2, ... (and step_requests rows to make bytes) in bursts, until `rows`
# or until the stop file appears; prints what it appended.
WRITER = r"""
import json, os, sys, time
from kvtrace.format import schema
from kvtrace.record.recorder import Recorder
args = json.loads(sys.argv[1])
rec = Recorder(args["session"], "engine", args["options"])
steps, reqs = rec.buffer("steps"), rec.buffer("step_requests")
def row(table, i):
    return tuple("none" if c.type == schema.s else i for c in schema.TABLES[table])
n = 0
while n < args["rows"] and not os.path.exists(args["stop"]):
    for _ in range(args["burst"]):
        steps.append(row("steps", n))
        reqs.append((n, f"req-{n:08d}-{'x' * 24}", 1, "decode", -1, n, 0, "running"))
        n += 1
    time.sleep(args["sleep"])
rec.close()
print(json.dumps({"appended": n, "rows_written": rec.rows_written, "dropped": rec.dropped,
                  "stopped_reason": rec.stopped_reason}))
"""


def start_writer(session: Path, options: dict, rows: int, burst: int = 200, sleep: float = 0.0,
                 stop: Path | None = None) -> subprocess.Popen:
    args = {"session": str(session), "options": options, "rows": rows, "burst": burst, "sleep": sleep,
            "stop": str(stop or session / "STOP")}
    return subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


def finish_writer(proc: subprocess.Popen, timeout: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.arrows"))}


def shard_rows(session: Path) -> dict[str, int]:
    rows = {t: 0 for t in schema.TABLES}
    for p in proc_dirs(session):
        for shard in list_shards(p):
            res = ShardRead()
            for _ in read_shard(shard, res):
                pass
            rows[shard.table] += res.rows
    return rows


# ---- the synthetic generator ---------------------------------------------------------------------
def test_synth_is_deterministic_and_exact(tmp_path):
    a = synth.generate(tmp_path / "a", 20_000, seed=7)
    b = synth.generate(tmp_path / "b", 20_000, seed=7)
    c = synth.generate(tmp_path / "c", 20_000, seed=8)
    assert a["events"] == b["events"] == c["events"] == 20_000
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")  # byte for byte
    assert tree_digest(tmp_path / "a") != tree_digest(tmp_path / "c")
    assert a["session_id"] == b["session_id"] != c["session_id"]
    # What the shards hold is what the report and proc.json say, by table.
    rows = shard_rows(tmp_path / "a")
    assert rows == a["rows"] and sum(rows.values()) == 20_000
    written = {t: 0 for t in schema.SHARD_TABLES}
    for p in proc_dirs(tmp_path / "a"):
        doc = read_proc(p)
        assert doc["status"] == "complete" and set(doc["rows_written"]) == set(schema.SHARD_TABLES)
        for t, n in doc["rows_written"].items():
            written[t] += n
    assert written == {t: rows.get(t, 0) for t in schema.SHARD_TABLES}


def test_synth_cli_writes_a_session(tmp_path):
    out = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-m", "kvtrace.testing.synth", "-o", str(out), "--events", "12345",
                           "--seed", "3"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["events"] == 12345
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["schema_version"] == schema.SCHEMA_VERSION and manifest["status"] == "complete"
    assert manifest["synthetic"] == {"events": 12345, "seed": 3, "generator": "kvtrace.testing.synth"}
    assert sorted(read_proc(p)["role"] for p in proc_dirs(out)) == ["engine", "worker"]


def test_synth_shape(tmp_path):
    """The tables agree with each other the way a real recording's do."""
    report = synth.generate(tmp_path / "s", 50_000, seed=3)
    db = tmp_path / "s.duckdb"
    [r] = ingest([tmp_path / "s"], db)
    assert r["status"] == "complete" and r["events"] == 50_000 and r["rows"] == report["rows"]
    for table in ("steps", "step_requests", "request_events", "block_events", "prefix_lookups",
                  "preemptions", "batch_slots", "kv_access", "layer_timings", "clock_anchors"):
        assert report["rows"][table] > 0, table
    kinds = {e for (e,) in q(db, "SELECT DISTINCT event FROM block_events")}
    assert kinds == {"alloc", "free", "cache", "touch", "evict"}
    assert {e for (e,) in q(db, "SELECT DISTINCT event FROM request_events")} == {
        "arrival", "queued", "scheduled", "first_token", "preempted", "resumed", "finished"}
    # Each step's token count is the sum of its requests'; every KV access has its request (batch_slots).
    assert q(db, """SELECT count(*) FROM steps s JOIN (SELECT step, sum(tokens) t, count(*) n FROM step_requests
                    GROUP BY step) r USING (step) WHERE s.scheduled_tokens != r.t OR s.num_running != r.n""") \
        == [(0,)]
    assert q(db, "SELECT count(*) - count(request_id) FROM kv_access") == [(0,)]
    # Lifecycles in order; job and turn parsed from the request ids (the manifest's job pattern).
    assert q(db, """SELECT count(*) FROM requests WHERE finish_ns IS NOT NULL AND NOT (arrival_ns <= queued_ns
                    AND queued_ns <= first_scheduled_ns AND first_scheduled_ns <= first_token_ns
                    AND first_token_ns <= finish_ns)""") == [(0,)]
    assert q(db, "SELECT count(*) FROM requests WHERE job_id IS NULL OR turn IS NULL") == [(0,)]
    # Timestamps rise with the step; block ids stay inside the pool.
    assert q(db, "SELECT count(*) FROM steps WHERE NOT (t_start_ns < t_sched_end_ns AND t_sched_end_ns < t_end_ns)") \
        == [(0,)]
    assert q(db, f"SELECT min(block_id) >= 0, max(block_id) < {synth.POOL} FROM block_events") == [(True, True)]
    [(rate,)] = q(db, "SELECT sum(hit_tokens) / sum(query_tokens) FROM prefix_lookups WHERE after_preemption = 0")
    assert 0.05 < rate < 0.9


# ---- streaming ingest ----------------------------------------------------------------------------
def table_digests(db: Path, where: str = "") -> dict[str, tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        out = {}
        for t in [*schema.TABLES, "requests"]:
            # All columns but block_events.seq, which orders rows without being a value (block_event_order).
            cols = [r[0] for r in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = 'main' AND table_name = ? "
                "AND NOT (table_name = 'block_events' AND column_name = 'seq') ORDER BY ordinal_position", [t]
            ).fetchall()]
            out[t] = con.execute(f"SELECT count(*), sum(hash({', '.join(cols)})) FROM {t} {where}").fetchone()
        return out
    finally:
        con.close()


def test_ingest_gathers_batches_into_few_inserts(tmp_path, monkeypatch):
    """Recorder-sized batches are gathered into big INSERTs; where the chunks are cut changes nothing."""
    synth.generate(tmp_path / "s", 40_000, seed=5)
    batches = sum(1 for p in proc_dirs(tmp_path / "s") for s in list_shards(p) for _ in read_shard(s, ShardRead()))
    calls: list[int] = []
    real_insert = ingest_rows.insert_batch
    monkeypatch.setattr(ingest_rows, "insert_batch", lambda con, t, data, *rest: (calls.append(data.num_rows),
                                                                             real_insert(con, t, data, *rest)))
    [report] = ingest([tmp_path / "s"], tmp_path / "big.duckdb")
    # Every shard row is read; every stored row came in one of the few INSERTs (block_events' rows
    # unnested before theirs: one per block, not per call).
    stored = sum(q(tmp_path / "big.duckdb", f"SELECT count(*) FROM {t}")[0][0] for t in schema.TABLES)
    assert report["events"] == 40_000 and sum(calls) == stored
    assert len(calls) <= len(schema.TABLES) * 2 < batches
    big = len(calls)
    monkeypatch.setattr(ingest_rows, "INSERT_ROWS", 1_000)  # many small chunks
    calls.clear()
    ingest([tmp_path / "s"], tmp_path / "small.duckdb")
    assert len(calls) > big
    assert table_digests(tmp_path / "big.duckdb") == table_digests(tmp_path / "small.duckdb")


def test_block_lists_unnested_in_arrow_as_duckdb_unnests_them():
    """_unnest_blocks gives the rows DuckDB's `SELECT UNNEST(ids), UNNEST(hashes)` gives, for the usual
    calls (hashes for every block, or none) and the odd ones (lists of different lengths, null or empty
    lists, a null inside a list)."""
    chunk = pa.table({
        "ts_ns": pa.array([1, 2, 3, 4, 5, 6, 7, 8], pa.int64()),
        "event": pa.array(["alloc", "cache", "free", "evict", "touch", "cache", "free", "alloc"]),
        "block_ids": pa.array([[1, 2], [3, 4], [], None, [5], [6, 7, 8], [9, None], [10]], pa.list_(pa.int32())),
        "block_hashes": pa.array([None, [30, 40], None, None, [], [60], [90, 91, 92], None],
                                 pa.list_(pa.int64())),
        "seq": pa.array(range(8), pa.int64()),
    })
    flat = ingest_rows.unnest_blocks("block_events", chunk)
    assert flat.column_names == ["ts_ns", "event", "block_id", "block_hash", "seq"]
    con = duckdb.connect()
    expected = con.execute("SELECT ts_ns, event, UNNEST(block_ids), UNNEST(block_hashes), seq FROM chunk").fetchall()
    got = con.execute("SELECT * FROM flat").fetchall()
    assert sorted(got, key=repr) == sorted(expected, key=repr)
    assert [r[4] for r in got] == sorted(r[4] for r in got)  # the calls' order is kept
    assert len(got) == 2 + 2 + 1 + 3 + 3 + 1


def test_access_request_ids_from_memory_or_from_the_database(tmp_path, monkeypatch):
    """kv_access rows get their request id from the worker's batch slots kept in memory; past the
    index's bound, from the batch slots already stored: the same rows either way, and every access row
    of a scheduled slot named."""
    synth.generate(tmp_path / "s", 60_000, seed=9)
    ingest([tmp_path / "s"], tmp_path / "memory.duckdb")
    monkeypatch.setattr(ingest_rows.SlotIndex, "MAX_ROWS", 100)  # overflows: matched in the database
    monkeypatch.setattr(ingest_rows, "INSERT_ROWS", 5_000)  # several kv_access chunks, each its own lookup
    ingest([tmp_path / "s"], tmp_path / "database.duckdb")
    assert table_digests(tmp_path / "memory.duckdb") == table_digests(tmp_path / "database.duckdb")
    con = duckdb.connect(str(tmp_path / "memory.duckdb"), read_only=True)
    try:
        total, named, unmatched = con.execute("""
            SELECT count(*), count(a.request_id), count(*) FILTER (a.request_id IS NULL AND b.request_id IS NOT NULL)
            FROM kv_access a LEFT JOIN batch_slots b USING (session, pid, step, slot)""").fetchone()
    finally:
        con.close()
    assert total > 0 and named > 0 and unmatched == 0


def _fail_kv_access_inserts(monkeypatch) -> object:
    """Make every INSERT of kv_access rows raise (in the inserter's thread); returns the real `_insert`."""
    real_insert = ingest_rows.insert_batch

    def failing_insert(con, table, *rest):
        if table == "kv_access":
            raise duckdb.ConversionException("injected: kv_access does not fit")
        return real_insert(con, table, *rest)

    monkeypatch.setattr(ingest_rows, "insert_batch", failing_insert)
    return real_insert


def _declared_methods(db: Path) -> dict[tuple[str, str], str]:
    """{(keyed table, column): method} declared with USING COMPRESSION."""
    found = {}
    for table, sql in q(db, f"SELECT table_name, sql FROM duckdb_tables() WHERE schema_name = '{tables.STORE}'"):
        for column, method in re.findall(r'"?(\w+)"? \w+ USING COMPRESSION (\w+)', sql):
            found[(table, column)] = method.lower()
    return found


def test_keyed_tables_take_their_compression_from_their_first_chunk(tmp_path, monkeypatch):
    """A new database's keyed tables declare each column's compression, chosen from their first chunk
    with DuckDB's own size estimates: the method DuckDB picks itself (where the two estimates are not
    close), the same rows, a choice later sessions keep. Tables whose first chunk is under a row group
    keep DuckDB's choice per segment."""
    synth.generate(tmp_path / "s", 60_000, seed=11)
    synth.generate(tmp_path / "t", 20_000, seed=12)
    auto = tmp_path / "auto.duckdb"
    ingest([tmp_path / "s"], auto)
    assert _declared_methods(auto) == {}  # every first chunk under a row group
    monkeypatch.setattr(compression, "MIN_ROWS", 4096)
    monkeypatch.setattr(compression, "SAMPLE_ROWS", 8192)
    db = tmp_path / "chosen.duckdb"
    ingest([tmp_path / "s"], db)
    declared = _declared_methods(db)
    assert {t for t, _ in declared} == set(tables.KEYED_TABLES)
    for table in tables.KEYED_TABLES:  # every column (all integers)
        assert {c for t, c in declared if t == table} == {c.split()[0] for c in tables.stored_columns(table)}
    assert table_digests(db) == table_digests(auto)
    con = duckdb.connect(str(auto), read_only=True)
    agree = close = 0
    for table in tables.KEYED_TABLES:
        rows = con.sql(f"SELECT * FROM {tables.STORE}.{table} LIMIT 8192").to_arrow_table()
        picked = dict(con.execute(
            f"SELECT column_name, mode(compression) FROM pragma_storage_info('{tables.STORE}.{table}') "
            "WHERE segment_type <> 'VALIDITY' GROUP BY 1").fetchall())
        for column in rows.column_names:
            rle, packed = compression.estimated_bytes(rows.column(column))
            if picked[column] not in ("RLE", "BitPacking") or max(rle, packed) < 1.25 * min(rle, packed):
                close += 1  # a constant column, or a close call either way
                continue
            assert declared[(table, column)] == picked[column].lower(), (table, column, rle, packed)
            agree += 1
    con.close()
    assert agree > 2 * close
    ingest([tmp_path / "t"], db)
    assert _declared_methods(db) == declared
    # A first ingest that fails after the tables were made again rolls that back too.
    real_insert = _fail_kv_access_inserts(monkeypatch)
    with pytest.raises(duckdb.ConversionException, match="injected"):
        ingest([tmp_path / "s"], tmp_path / "failed.duckdb")
    assert _declared_methods(tmp_path / "failed.duckdb") == {}
    monkeypatch.setattr(ingest_rows, "insert_batch", real_insert)
    ingest([tmp_path / "s"], tmp_path / "failed.duckdb")
    assert _declared_methods(tmp_path / "failed.duckdb") == declared


def test_compression_estimates():
    """Long runs cost RLE less than bit packing; values that change every row the other way round;
    nulls neither break runs nor widen groups; no values, no estimate."""
    runs = pa.array(np.repeat(np.arange(100, dtype=np.int64) * 10**9, 100))
    rle, packed = compression.estimated_bytes(runs)
    assert rle == 100 * (8 + 2) and packed > 5 * rle
    changing = pa.array(np.arange(10_000, dtype=np.int32) % 97)
    rle, packed = compression.estimated_bytes(changing)
    assert packed < rle / 4
    with_nulls = pa.array(np.repeat(np.arange(100, dtype=np.int64), 100), mask=np.arange(10_000) % 3 == 0)
    assert compression.estimated_bytes(with_nulls)[0] == 100 * (8 + 2)
    assert compression.estimated_bytes(pa.nulls(5000, pa.int64())) is None
    assert compression.choose(pa.table({"x": changing.slice(0, 100)})) == {}  # under MIN_ROWS


@pytest.mark.parametrize("where", ["reading", "inserting", "re-ingest"])
def test_a_failed_ingest_leaves_the_database_as_it_was(tmp_path, monkeypatch, where):
    """An error while the shards are read (a closed shard cut short, met after earlier chunks were
    queued) or inside an INSERT (the helper thread's) ends the ingest with that error and rolls the
    whole session back; a session ingested before is untouched, also when the failed ingest was to
    replace it (re-ingest), and the database takes the next ingest."""
    synth.generate(tmp_path / "a", 20_000, seed=3)
    if where == "re-ingest":  # b: a cut copy of session a, whose rows it would replace
        shutil.copytree(tmp_path / "a", tmp_path / "b")
    else:
        synth.generate(tmp_path / "b", 60_000, seed=4)
    db = tmp_path / "t.duckdb"
    ingest([tmp_path / "a"], db)
    before = table_digests(db)
    monkeypatch.setattr(ingest_rows, "INSERT_ROWS", 5_000)  # many chunks in flight when it fails
    if where in ("reading", "re-ingest"):
        last = sorted(p for d in proc_dirs(tmp_path / "b") for p in d.glob("layer_timings.*.arrows"))[-1]
        last.write_bytes(last.read_bytes()[:-100])
        error = r"layer_timings.*corrupt shard"
    else:
        _fail_kv_access_inserts(monkeypatch)
        error = "injected"
    with pytest.raises(Exception, match=error):
        ingest([tmp_path / "b"], db)
    assert table_digests(db) == before
    monkeypatch.undo()
    synth.generate(tmp_path / "c", 20_000, seed=5)
    ingest([tmp_path / "c"], db)
    assert table_digests(db) != before


def _make_older_layout(db: Path, layout: str) -> None:
    """Rewrite a database into an older kvtrace's layout of the keyed tables: "plain" (tables with the
    process columns) or "proc_key" (the four per-step tables with a process key, request ids and labels
    as text; block_events plain), or "text_ids" (all keyed, kv_access and block_events with their request
    ids as text). A plain block_events had no `seq`: its row order was the recording order. Such a
    kvtrace noted no layout in `kvtrace_meta` either."""
    store = tables.STORE
    with duckdb.connect(str(db)) as con:
        con.execute("DELETE FROM kvtrace_meta WHERE key LIKE 'layout%'")
    if layout == "text_ids":
        con = duckdb.connect(str(db))
        for t in ("kv_access", "block_events"):
            cols = ", ".join("q.request_id" if c.split()[0] == "request_key" else f"r.{c.split()[0]}"
                             for c in tables.stored_columns(t))
            con.execute(f"CREATE TABLE {store}.old_{t} AS SELECT {cols} FROM {store}.{t} r "
                        f"JOIN {store}.request_keys q USING (request_key)")
            con.execute(f"DROP VIEW {t}")
            con.execute(f"DROP TABLE {store}.{t}")
            con.execute(f"ALTER TABLE {store}.old_{t} RENAME TO {t}")
        con.execute(f"CREATE VIEW kv_access AS SELECT k.session, k.rank, k.pid, r.* EXCLUDE (proc) "
                    f"FROM {store}.kv_access r JOIN {store}.proc_keys k USING (proc)")
        con.execute(f"CREATE VIEW block_events AS SELECT k.session, k.rank, k.pid, r.* EXCLUDE (proc) "
                    f"REPLACE (l.text AS event) FROM {store}.block_events r JOIN {store}.proc_keys k USING (proc) "
                    f"JOIN {store}.labels l ON l.label = r.event")
        con.close()
        return
    keyed_then = ("step_requests", "batch_slots", "kv_access", "layer_timings") if layout == "proc_key" else ()
    con = duckdb.connect(str(db))
    for t in tables.KEYED_TABLES:
        select = f"* EXCLUDE (seq) FROM {t} ORDER BY session, pid, seq" if t == "block_events" else f"* FROM {t}"
        con.execute(f"CREATE TABLE old_{t} AS SELECT {select}")
        con.execute(f"DROP VIEW {t}")
        con.execute(f"DROP TABLE {store}.{t}")
        if t not in keyed_then:
            con.execute(f"ALTER TABLE old_{t} RENAME TO {t}")
            continue
        con.execute(f"CREATE TABLE {store}.{t} AS SELECT k.proc, o.* EXCLUDE (session, rank, pid) FROM old_{t} o "
                    f"JOIN {store}.proc_keys k USING (session, rank, pid)")
        con.execute(f"DROP TABLE old_{t}")
        con.execute(f"CREATE VIEW {t} AS SELECT k.session, k.rank, k.pid, r.* EXCLUDE (proc) FROM {store}.{t} r "
                    f"JOIN {store}.proc_keys k USING (proc)")
    for key_table in ("request_keys", "labels", *(["proc_keys"] if layout == "plain" else [])):
        con.execute(f"DROP TABLE {store}.{key_table}")
    con.close()


def test_a_database_laid_out_already_is_not_laid_out_again(tmp_path, monkeypatch):
    """create_tables does nothing on a database this code laid out (it checked and remade ~70 tables and
    views before every session); a table or view dropped since, or a layout from other code, is made
    again."""
    synth.generate(tmp_path / "a", 5_000, seed=3)
    db = tmp_path / "l.duckdb"
    ingest([tmp_path / "a"], db)

    class Statements:  # create_tables' connection, counting what it runs
        def __init__(self, con):
            self.con, self.run = con, []

        def execute(self, sql, *args):
            self.run.append(sql)
            return self.con.execute(sql, *args)

    with duckdb.connect(str(db)) as con:
        watched = Statements(con)
        layout.create_tables(watched)
        assert not [s for s in watched.run if not s.lstrip().upper().startswith("SELECT")]
        con.execute("DROP VIEW block_events")
        layout.create_tables(watched)
        assert con.execute("SELECT count(*) FROM block_events").fetchone()[0] > 0
        monkeypatch.setattr(layout, "_layout_digest", lambda: "other code")
        watched.run.clear()
        layout.create_tables(watched)
        assert any(s.startswith("CREATE TABLE IF NOT EXISTS") for s in watched.run)
    monkeypatch.undo()
    digests = table_digests(db)
    ingest([tmp_path / "a"], db)  # a re-ingest through the quick way stores the same rows
    assert table_digests(db) == digests


def block_event_order(db: Path, where: str = "") -> list[tuple]:
    """block_events as each process recorded them: ordered by `seq` (the rows of one call share a place)."""
    return q(db, f"SELECT session, pid, list((ts_ns, event, request_id) ORDER BY seq, ts_ns, event, request_id) "
                 f"FROM block_events {where} GROUP BY ALL ORDER BY ALL")


@pytest.mark.parametrize("layout", ["plain", "proc_key", "text_ids"])
def test_keyed_tables_read_like_tables_and_older_databases_are_migrated(tmp_path, layout):
    """The per-step tables are stored with keys (tables.KEYED_TABLES: process, request, labels) and
    read through views with the process columns and texts; re-ingest replaces a session's keyed rows and
    keys; a database written before (`_make_older_layout`) has its rows moved into the store on the next
    ingest."""
    synth.generate(tmp_path / "a", 20_000, seed=7)
    synth.generate(tmp_path / "b", 10_000, seed=8)
    db = tmp_path / "k.duckdb"
    ingest([tmp_path / "a"], db)
    con = duckdb.connect(str(db))
    store = tables.STORE
    for t in tables.KEYED_TABLES:
        view_cols = con.execute(f"DESCRIBE {t}").fetchall()
        assert [c[0] for c in view_cols[:3]] == ["session", "rank", "pid"]
        assert [f"{c[0]} {c[1]}" for c in view_cols] == tables.view_columns(t)
    sid_a, pids = con.execute("SELECT any_value(session), list(DISTINCT pid ORDER BY pid) FROM kv_access").fetchone()
    [(n_keys,)] = con.execute(f"SELECT count(*) FROM {store}.proc_keys").fetchall()
    assert n_keys == len(proc_dirs(tmp_path / "a"))
    # One key per request id of the session (plus key 0, the null id), labels as their codes.
    assert con.execute(f"SELECT count(*), count(DISTINCT request_id) FROM {store}.request_keys WHERE session = ?",
                       [sid_a]).fetchall() == con.execute(
        "SELECT count(DISTINCT request_id), count(DISTINCT request_id) FROM (SELECT request_id FROM step_requests "
        "UNION ALL SELECT request_id FROM batch_slots)").fetchall()
    assert con.execute(f"SELECT request_id FROM {store}.request_keys WHERE request_key = 0").fetchall() == [(None,)]
    assert dict(con.execute("SELECT phase, count(*) FROM step_requests GROUP BY 1").fetchall()).keys() == \
        {"prefill", "decode"}
    con.close()
    before, order_before = table_digests(db), block_event_order(db)
    _make_older_layout(db, layout)
    assert table_digests(db) == before  # what queries see is the same in both layouts (but block_events.seq)
    [rb] = ingest([tmp_path / "b"], db)
    assert rb["status"] == "complete"
    con = duckdb.connect(str(db), read_only=True)
    kinds = dict(con.execute("SELECT table_schema || '.' || table_name, table_type FROM information_schema.tables "
                             "WHERE table_name LIKE 'kv_access%'").fetchall())
    assert kinds == {"main.kv_access": "VIEW", f"{store}.kv_access": "BASE TABLE"}
    got = con.execute("SELECT session, list(DISTINCT pid ORDER BY pid) FROM kv_access GROUP BY 1").fetchall()
    con.close()
    assert (sid_a, pids) in got and len(got) == 2
    alone = tmp_path / "b.duckdb"
    ingest([tmp_path / "b"], alone)
    [(sid_b,)] = q(alone, "SELECT session FROM sessions")
    assert table_digests(db, f"WHERE session = '{sid_a}'") == before  # the moved rows, unchanged
    assert block_event_order(db, f"WHERE session = '{sid_a}'") == order_before  # seq from the row order
    assert table_digests(db, f"WHERE session = '{sid_b}'") == table_digests(alone)  # the new, as if alone
    # Re-ingest replaces the session's rows, keys included.
    ingest([tmp_path / "b"], db)
    assert q(db, f"SELECT count(*) FROM {store}.proc_keys WHERE session = '{sid_b}'") == \
        [(len(proc_dirs(tmp_path / "b")),)]
    assert q(db, f"SELECT count(*) FROM {store}.request_keys WHERE session = '{sid_b}'") == \
        q(alone, f"SELECT count(*) FROM {store}.request_keys WHERE session IS NOT NULL")
    assert table_digests(db, f"WHERE session = '{sid_b}'") == table_digests(alone)


def test_labels_and_request_ids_new_to_the_database_get_keys(tmp_path, monkeypatch):
    """Label codes are given as labels are met (a database that knows none but `decode` reads the same
    as one seeded with all), by ingest and by rows written by hand, and so are request keys."""
    synth.generate(tmp_path / "s", 20_000, seed=3)
    ingest([tmp_path / "s"], tmp_path / "seeded.duckdb")
    monkeypatch.setattr(layout, "KNOWN_LABELS", ("decode",))
    db = tmp_path / "grown.duckdb"
    ingest([tmp_path / "s"], db)
    assert table_digests(db) == table_digests(tmp_path / "seeded.duckdb")
    con = duckdb.connect(str(db))
    texts = [t for t, in con.execute(f"SELECT text FROM {tables.STORE}.labels ORDER BY label").fetchall()]
    used = con.execute("SELECT DISTINCT phase FROM step_requests UNION SELECT DISTINCT kind FROM step_requests "
                       "UNION SELECT DISTINCT event FROM block_events").fetchall()
    assert texts[0] == "decode" and sorted(texts) == sorted(t for t, in used) and len(texts) >= 4
    sid, pid = con.execute("SELECT session, pid FROM step_requests LIMIT 1").fetchone()
    keyed.insert_rows(con, "step_requests", [(sid, 0, pid, 10**9, "by-hand", 3, "prefill", 0, 0, 1, "odd")])
    assert con.execute("SELECT tokens, phase, kind FROM step_requests WHERE request_id = 'by-hand'").fetchall() == \
        [(3, "prefill", "odd")]
    con.close()


def test_ingest_reports_progress_and_throughput(tmp_path, capsys):
    synth.generate(tmp_path / "s", 20_000, seed=2)
    [r] = ingest([tmp_path / "s"], tmp_path / "s.duckdb")
    assert r["events"] == 20_000 and r["events_per_s"] > 0 and r["seconds"] > 0
    proc = subprocess.run([sys.executable, "-m", "kvtrace", "ingest", str(tmp_path / "s"), "-o",
                           str(tmp_path / "cli.duckdb"), "--progress"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "20,000 events in" in proc.stdout and "/s)" in proc.stdout


# `kvtrace ingest` in a fresh process, then: was pandas imported, and can pyarrow still use it when asked?
CLI_INGEST_THEN_PANDAS = r"""
import json, sys
from kvtrace.cli import main
try:
    main(["ingest", sys.argv[1], "-o", sys.argv[2], "--no-progress"])
except SystemExit as exc:
    assert not exc.code, exc.code
imported = "pandas" in sys.modules
import pyarrow as pa
frame = pa.table({"a": [1, 2]}).to_pandas()  # an explicit pandas call imports it as usual
print(json.dumps({"imported_by_ingest": imported, "to_pandas": frame["a"].tolist()}))
"""


def test_cli_ingest_does_not_import_pandas(tmp_path):
    synth.generate(tmp_path / "s", 20_000, seed=2)
    proc = subprocess.run([sys.executable, "-c", CLI_INGEST_THEN_PANDAS, str(tmp_path / "s"),
                           str(tmp_path / "cli.duckdb")], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"imported_by_ingest": False, "to_pandas": [1, 2]}
    ingest([tmp_path / "s"], tmp_path / "api.duckdb")  # the same rows as through the API
    assert table_digests(tmp_path / "cli.duckdb") == table_digests(tmp_path / "api.duckdb")


# ---- long recordings -----------------------------------------------------------------------------
def test_shard_writer_rotates_by_size_and_age(tmp_path):
    from kvtrace.format.shards import ShardWriter, rows_to_batch

    w = ShardWriter(tmp_path, "steps", rotate_bytes=20_000, rotate_s=3600)
    batch = rows_to_batch("steps", [tuple("none" if c.type == schema.s else i for c in schema.TABLES["steps"])
                                    for i in range(50)])
    sizes = [w.write(batch) for _ in range(20)]
    w.close()
    assert len(set(sizes)) == 1 and len(w.closed_shards) >= 3
    for path, _rows in w.closed_shards[:-1]:  # each shard ends with the first batch past the limit
        size = path.stat().st_size
        assert 20_000 <= size - 8 < 20_000 + sizes[0]  # (8: the end-of-stream marker)
    assert [p.name for p, _ in w.closed_shards] == [f"steps.{i:05d}.arrows" for i in range(len(w.closed_shards))]
    assert sum(rows for _, rows in w.closed_shards) == 1000 and w.bytes_total == sum(
        p.stat().st_size for p, _ in w.closed_shards)
    aged = ShardWriter(tmp_path, "drops", rotate_bytes=1 << 30, rotate_s=0.2)
    aged.write(rows_to_batch("drops", [(1, "steps", 1, "buffer-cap")]))
    aged.rotate_if_old()
    assert aged.open_rows == 1 and not aged.closed_shards
    time.sleep(0.3)
    aged.rotate_if_old()  # no new batch needed: a quiet table's shard is closed by age
    assert aged.open_rows == 0 and len(aged.closed_shards) == 1


def test_recorder_rotates_shards(tmp_path):
    session, _ = prepare_session(tmp_path / "rot", ["writer"], {})
    w = start_writer(session, {"flush_interval_s": 0.05, "rotate_bytes": 32 << 10, "rotate_s": 0.5},
                     rows=6_000, burst=100, sleep=0.03)
    res = finish_writer(w)
    [proc_dir] = proc_dirs(session)
    shards = [s for s in list_shards(proc_dir) if s.table == "steps"]
    assert len(shards) >= 2 and not any(s.open for s in shards)
    assert [s.path.name for s in shards] == [f"steps.{i:05d}.arrows" for i in range(len(shards))]
    assert shard_rows(session)["steps"] == res["rows_written"]["steps"] == 6_000
    # By age: one burst, then idle: the writer thread closes the shard without a new batch.
    session2, _ = prepare_session(tmp_path / "age", ["writer"], {})
    w = start_writer(session2, {"flush_interval_s": 0.05, "rotate_s": 0.2}, rows=200, burst=200, sleep=5.0)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            dirs = proc_dirs(session2)
            if dirs and any(s.table == "steps" and not s.open for s in list_shards(dirs[0])):
                break
            time.sleep(0.1)
        else:
            pytest.fail("shard not closed by age")
    finally:
        finish_writer(w)


def test_ingest_while_recording(tmp_path):
    """A recording can be ingested while its writer still appends: every complete batch (closed shards
    and the complete part of the open ones) is loaded, nothing twice, nothing out of order."""
    session, _ = prepare_session(tmp_path / "live", ["writer"], {})
    stop = tmp_path / "STOP"
    w = start_writer(session, {"flush_interval_s": 0.02, "rotate_bytes": 48 << 10}, rows=10**9,
                     burst=100, sleep=0.005, stop=stop)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            dirs = proc_dirs(session)
            if dirs and len([s for s in list_shards(dirs[0]) if s.table == "steps" and not s.open]) >= 3:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the writer closed no shards")
        rounds = []
        for i in range(3):  # ingest three times while it runs
            before = read_proc(proc_dirs(session)[0])["rows_written"]["steps"]
            closed = sum(1 for s in list_shards(proc_dirs(session)[0]) if s.table == "steps" and not s.open)
            db = tmp_path / f"live{i}.duckdb"
            [r] = ingest([session], db)
            got = q(db, "SELECT count(*), count(DISTINCT step), min(step), max(step) FROM steps")[0]
            rounds.append((before, closed, got))
            assert r["status"] == "incomplete"
            n = got[0]
            assert got == (n, n, 0, n - 1), "steps must be a gap-free prefix: every complete batch, once"
            assert n >= before  # everything flushed before the ingest started is in
            assert q(db, "SELECT count(*) FROM step_requests")[0][0] >= before
            assert dict(q(db, "SELECT status, count(*) FROM sessions GROUP BY 1")) == {"incomplete": 1}
        assert rounds[-1][2][0] > rounds[0][2][0], "the writer kept writing between ingests"
    finally:
        stop.touch()
        res = finish_writer(w)
    finalize_session(session, 0)
    [r] = ingest([session], tmp_path / "final.duckdb")
    assert r["status"] == "complete" and r["rows"]["steps"] == res["appended"] == res["rows_written"]["steps"]


def test_max_size_stop(tmp_path):
    cap = 256 << 10
    session, _ = prepare_session(tmp_path / "stop", ["writer"], {})
    w = start_writer(session, {"flush_interval_s": 0.05, "max_size_bytes": cap, "max_size_policy": "stop"},
                     rows=40_000, burst=400, sleep=0.01)
    res = finish_writer(w)
    assert res["stopped_reason"] == "max-size"
    lost = res["dropped"]["steps"]["max-size"]
    assert lost > 0 and res["rows_written"]["steps"] + lost == res["appended"] == 40_000
    # The forecast stops before the cap; only the closing drops batch and proc.json may pass it.
    assert session_size_bytes(session) <= cap + 8 << 10
    finalize_session(session, 0)
    db = tmp_path / "stop.duckdb"
    [r] = ingest([session], db)
    assert r["rows"]["steps"] == res["rows_written"]["steps"]
    assert q(db, "SELECT sum(dropped) FROM drops WHERE table_name = 'steps' AND cause = 'max-size'") == [(lost,)]
    [(dropped_events,)] = q(db, "SELECT sum(dropped) FROM drops")
    assert dropped_events == sum(n for causes in res["dropped"].values() for n in causes.values())
    summary = duckdb.connect(str(db), read_only=True)
    try:
        from kvtrace.queries import run_query

        cols, rows = run_query(summary, "summary")
        assert dict(zip(cols, rows[0], strict=True))["dropped_events"] == dropped_events
    finally:
        summary.close()


def test_max_size_drop_oldest(tmp_path):
    cap = 384 << 10
    session, _ = prepare_session(tmp_path / "drop", ["writer"], {})
    w = start_writer(session, {"flush_interval_s": 0.05, "max_size_bytes": cap, "max_size_policy": "drop-oldest"},
                     rows=60_000, burst=500, sleep=0.01)
    res = finish_writer(w)
    assert res["stopped_reason"] is None and res["rows_written"]["steps"] == res["appended"] == 60_000
    lost = res["dropped"]["steps"]["max-size"]
    assert 0 < lost < 60_000
    assert session_size_bytes(session) <= cap + (64 << 10) * 3  # the cap, give or take the open shards
    [proc_dir] = proc_dirs(session)
    tables = {s.table for s in list_shards(proc_dir)}
    assert {"drops", "clock_anchors"} <= tables  # never dropped
    finalize_session(session, 0)
    db = tmp_path / "drop.duckdb"
    [r] = ingest([session], db)
    # What is left is the newest part of the run, gap-free, and the loss is on record.
    n = 60_000 - lost
    assert q(db, "SELECT count(*), min(step), max(step) FROM steps") == [(n, lost, 59_999)]
    assert q(db, "SELECT sum(dropped) FROM drops WHERE table_name = 'steps' AND cause = 'max-size'") == [(lost,)]
    assert json.loads(q(db, "SELECT dropped FROM procs")[0][0])["steps"]["max-size"] == lost


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs a POSIX system")
def test_ingest_memory_does_not_grow_with_the_session(tmp_path):
    """Peak RSS of an ingest of 4x the rows stays close to that of 1x (gathering bounds memory)."""
    code = ("import resource, sys; from kvtrace.ingest import ingest; ingest([sys.argv[1]], sys.argv[2]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    peaks = []
    for n in (100_000, 400_000):
        synth.generate(tmp_path / f"s{n}", n, seed=1)
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"s{n}"), str(tmp_path / f"{n}.duckdb")],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
        assert out.returncode == 0, out.stderr
        peaks.append(int(out.stdout.split()[-1]))
    assert peaks[1] < peaks[0] * 1.8, peaks
