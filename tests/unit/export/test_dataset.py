"""Many sessions as one Parquet dataset: layout, replacing sessions, and the canned queries over it giving
what each session gives alone."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from kvtrace.errors import KvtraceError
from kvtrace.export.dataset import META, export_parquet, open_dataset
from kvtrace.format import schema
from kvtrace.ingest import ingest
from kvtrace.queries import all_queries, run_query
from kvtrace.testing import synth

REPO = Path(__file__).resolve().parents[3]
N_SESSIONS = 20


@pytest.fixture(scope="module")
def twenty(tmp_path_factory) -> dict:
    """20 synthetic sessions (real shard format, 8-30 K events each), each ingested alone, all ingested
    together, and exported as one dataset from the session directories."""
    tmp = tmp_path_factory.mktemp("dataset")
    sessions = [Path(synth.generate(tmp / f"s{i:02d}", 8_000 + 1_100 * i, seed=100 + i)["dir"])
                for i in range(N_SESSIONS)]
    alone = []
    for s in sessions:
        ingest([s], tmp / f"{s.name}.duckdb")
        alone.append(tmp / f"{s.name}.duckdb")
    ingest(sessions, tmp / "all.duckdb")
    report = export_parquet([str(s) for s in sessions], tmp / "ds")
    return {"tmp": tmp, "sessions": sessions, "alone": alone, "all": tmp / "all.duckdb", "ds": tmp / "ds",
            "report": report}


def rows_of(con: duckdb.DuckDBPyConnection, name: str, params: dict | None = None) -> tuple[list, list]:
    return run_query(con, name, params)


def same(a, b) -> bool:
    """Equal, floats to 1e-9 relative (sums over Parquet may add in another order)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_layout_and_description(twenty):
    ds = twenty["ds"]
    assert twenty["report"]["sessions"] == N_SESSIONS
    meta = json.loads((ds / META).read_text())
    assert meta["schema_version"] == schema.SCHEMA_VERSION and meta["format"] == "kvtrace-dataset"
    ids = sorted(meta["sessions"])
    assert len(ids) == N_SESSIONS
    assert set(schema.TABLES) | {"sessions", "procs", "probes", "requests"} <= set(meta["tables"])
    assert meta["tables"]["steps"]["columns"][0] == ["session", "VARCHAR"]
    for sid in ids:
        part = ds / "table=steps" / f"session={sid}" / "part-0.parquet"
        assert part.exists()
        col = pq.ParquetFile(part).metadata.row_group(0).column(0)
        assert col.compression == "ZSTD"
        assert "session" not in pq.read_schema(part).names  # it is the folder's name
    files = list(ds.glob("table=*/session=*/*.parquet"))
    assert twenty["report"]["files"] == len(files)
    assert twenty["report"]["bytes"] == sum(f.stat().st_size for f in files)


def test_summary_per_session_equals_each_session_alone(twenty):
    con = open_dataset(twenty["ds"])
    try:
        cols, rows = rows_of(con, "summary")
        by_session = {r[0]: r for r in rows}
        assert len(by_session) == N_SESSIONS
        for db in twenty["alone"]:
            alone = duckdb.connect(str(db), read_only=True)
            try:
                acols, [arow] = rows_of(alone, "summary")
            finally:
                alone.close()
            assert acols == cols
            assert same(by_session[arow[0]], arow), (arow[0], by_session[arow[0]], arow)
        # One session asked for by name, as on a database.
        sid = rows[3][0]
        _, only = rows_of(con, "summary", {"session": sid})
        assert [r[0] for r in only] == [sid]
    finally:
        con.close()


def _key(row: tuple) -> tuple:
    return tuple((v is None, str(v) if not isinstance(v, float) else f"{v:.6g}") for v in row)


def test_every_canned_query_runs_unchanged_on_the_dataset(twenty):
    """Each canned query gives over the dataset what it gives over one database of the same sessions."""
    ds = open_dataset(twenty["ds"])
    db = duckdb.connect(str(twenty["all"]), read_only=True)
    ran = 0
    try:
        for name in all_queries():
            try:
                expect = rows_of(db, name)
            except KvtraceError as exc:  # e.g. needs Nsight tables this database does not have
                expect = exc
            got = rows_of(ds, name)
            if isinstance(expect, KvtraceError):
                continue  # the dataset has an (empty) view for every table, so it may run where the db cannot
            assert got[0] == expect[0], name
            assert len(got[1]) == len(expect[1]), name
            assert same(sorted(got[1], key=_key), sorted(expect[1], key=_key)), name
            ran += 1
    finally:
        ds.close()
        db.close()
    assert ran >= 5


def test_cli_export_sessions_and_query_dataset(twenty, tmp_path):
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "kvtrace"]
    proc = subprocess.run([*cmd, "export", *map(str, twenty["sessions"][:3]), "--format", "parquet", "-o", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 3 session(s)" in proc.stdout
    proc = subprocess.run([*cmd, "query", "--dataset", str(out), "summary", "--format", "json"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    ids = sorted(json.loads((s / "manifest.json").read_text())["session_id"] for s in twenty["sessions"][:3])
    assert [r["session"] for r in doc] == ids
    # Databases as sources add to the same dataset.
    proc = subprocess.run([*cmd, "export", str(twenty["alone"][5]), "-o", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([*cmd, "query", "--dataset", str(out), "summary", "--format", "json"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert len(json.loads(proc.stdout)) == 4


def test_cli_ingests_many_sessions_with_one_checkpoint(twenty, tmp_path):
    """Several sessions in one `kvtrace ingest`: one line each and one for them all; only the last
    session's COMMIT checkpoints (ingest_session's `checkpoint`), yet every session is in the file when
    the command ends (no WAL left) and stores what ingesting it alone stores. A directory among them that
    is not a session stops the command before it stores anything."""
    db = tmp_path / "three.duckdb"
    three = twenty["sessions"][:3]
    proc = subprocess.run([sys.executable, "-m", "kvtrace", "ingest", *map(str, three), "-o", str(db)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("session ") for line in lines) == 3
    events = sum(int(line.split(": ")[1].split(" events")[0].replace(",", "")) for line in lines
                 if line.startswith("session "))
    assert f"3 sessions: {events:,} events in " in lines[-1]
    assert not Path(f"{db}.wal").exists()
    # A directory that is not a session among them: its one-line error before anything is stored.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{")
    proc = subprocess.run([sys.executable, "-m", "kvtrace", "ingest", str(three[0]), str(bad), "-o",
                           str(tmp_path / "mixed.duckdb")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().startswith("kvtrace: error: ") and "manifest.json" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "mixed.duckdb").exists()
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = {r[0]: r for r in rows_of(con, "summary")[1]}
    finally:
        con.close()
    for alone_db in twenty["alone"][:3]:
        alone = duckdb.connect(str(alone_db), read_only=True)
        try:
            [row] = rows_of(alone, "summary")[1]
        finally:
            alone.close()
        assert same(rows[row[0]], row)


def test_export_replaces_a_session_and_keeps_the_others(tmp_path):
    big = synth.generate(tmp_path / "big", 30_000, seed=1, session_id="run-1")
    other = synth.generate(tmp_path / "other", 9_000, seed=2)
    ds = tmp_path / "ds"
    export_parquet([big["dir"], other["dir"]], ds)
    small = synth.generate(tmp_path / "small", 2_000, seed=3, session_id="run-1")  # the same id, re-recorded
    assert small["rows"]["preemptions"] == 0 < big["rows"]["preemptions"]
    ingest([small["dir"]], tmp_path / "small.duckdb")
    report = export_parquet([str(tmp_path / "small.duckdb")], ds)
    assert report["sessions"] == 1
    con = open_dataset(ds)
    try:
        got = dict(con.execute("SELECT session, count(*) FROM steps GROUP BY 1").fetchall())
        assert got == {"run-1": small["rows"]["steps"], other["session_id"]: other["rows"]["steps"]}
        # No stale files: the old run's preemptions are gone with it.
        assert con.execute("SELECT count(*) FROM preemptions WHERE session = 'run-1'").fetchone() == (0,)
        assert con.execute("SELECT count(*) FROM sessions").fetchone() == (2,)
    finally:
        con.close()
    assert not list(ds.glob(".kvtrace-export-*")), "scratch files left behind"


def test_session_ids_survive_the_folder_names(tmp_path):
    odd = ["a/b c=d%", "20261122"]  # escaped in folder names; digits must stay a string
    dirs = [synth.generate(tmp_path / f"s{i}", 3_000, seed=i, session_id=sid)["dir"] for i, sid in enumerate(odd)]
    export_parquet(dirs, tmp_path / "ds")
    con = open_dataset(tmp_path / "ds")
    try:
        assert sorted(r[0] for r in con.execute("SELECT session FROM sessions").fetchall()) == sorted(odd)
        assert con.execute("SELECT typeof(session) FROM steps LIMIT 1").fetchone() == ("VARCHAR",)
        _, rows = rows_of(con, "summary", {"session": "a/b c=d%"})
        assert len(rows) == 1 and rows[0][2] > 0
    finally:
        con.close()


def test_dataset_errors_are_one_line(tmp_path):
    with pytest.raises(KvtraceError, match="no such dataset"):
        open_dataset(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(KvtraceError, match="not a kvtrace dataset"):
        open_dataset(tmp_path / "plain")
    (tmp_path / "plain" / "notes.txt").write_text("mine")
    s = synth.generate(tmp_path / "s", 2_000, seed=1)["dir"]
    with pytest.raises(KvtraceError, match="not a kvtrace dataset"):
        export_parquet([s], tmp_path / "plain")
    export_parquet([s], tmp_path / "ds")
    meta = json.loads((tmp_path / "ds" / META).read_text())
    meta["schema_version"] = schema.SCHEMA_VERSION + 1
    (tmp_path / "ds" / META).write_text(json.dumps(meta))
    with pytest.raises(KvtraceError, match="newer than this kvtrace"):
        open_dataset(tmp_path / "ds")


@pytest.mark.vllm
def test_dataset_with_a_recorded_run(recorded_run, tmp_path):
    """A real vLLM recording and synthetic sessions side by side give their own summaries."""
    s = synth.generate(tmp_path / "s", 5_000, seed=9)["dir"]
    export_parquet([str(recorded_run["db"]), s], tmp_path / "ds")
    con = open_dataset(tmp_path / "ds")
    db = duckdb.connect(str(recorded_run["db"]), read_only=True)
    try:
        _, rows = rows_of(con, "summary")
        _, [real] = rows_of(db, "summary")
        assert len(rows) == 2 and same(next(r for r in rows if r[0] == real[0]), real)
    finally:
        con.close()
        db.close()
