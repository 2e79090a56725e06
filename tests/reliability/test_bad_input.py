"""Bad input everywhere: every file kvtrace reads, damaged or wrong, gives one line and a non-zero exit.

The inputs are in tests/data/bad/ (made by tests/data/make_bad_corpus.py, which also lists what each
error must say); a few are made here (missing paths, a directory where a file goes, another tool's
DuckDB file). Every command runs as a subprocess, as a user runs it. See docs/reliability.md.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from tests.helpers.run import run_kvtrace

DATA = Path(__file__).resolve().parents[1] / "data"
BAD = DATA / "bad"
_spec = importlib.util.spec_from_file_location("make_bad_corpus", DATA / "make_bad_corpus.py")
corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus)


def assert_one_line_error(proc: subprocess.CompletedProcess, names: str, *words: str, code: int = 1) -> str:
    """Exit `code`, nothing on stdout, exactly one stderr line `kvtrace: error: ...` naming `names`."""
    err = proc.stderr
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert proc.returncode == code, (proc.returncode, err)
    assert lines[0].startswith("kvtrace: error: "), lines[0]
    assert names in lines[0], f"{names!r} not named in: {lines[0]}"
    for w in words:
        assert w in lines[0], f"{w!r} not in: {lines[0]}"
    assert proc.stdout.strip() == "", proc.stdout
    return lines[0]


def kv(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_kvtrace(*args, check=False, cwd=cwd, timeout=120)


def command_for(kind: str, target: str, db: Path) -> list[str]:
    if kind == "ingest":
        return ["ingest", target, "-o", str(db)]
    if kind == "nsys":
        return ["ingest", "--nsys", target, "-o", str(db)]
    return ["query", target, "summary"]


# Bugs these inputs found in files owned by others, left for their owners (docs/reliability.md).
KNOWN_BUGS: dict[str, str] = {}  # corpus file -> why it is expected to fail (strict xfail)


def _case(c: tuple):
    bug = KNOWN_BUGS.get(c[0])
    return pytest.param(*c, id=c[0], marks=[pytest.mark.xfail(reason=bug, strict=True)] if bug else [])


@pytest.mark.parametrize("name,kind,words", [_case(c) for c in corpus.CASES])
def test_corpus_input_is_refused_in_one_line(name, kind, words, tmp_path):
    target = BAD / name
    if not target.exists():
        pytest.skip(f"{target} not generated (the nsys inputs need tests/data/nsys)")
    db = tmp_path / "out.duckdb"
    proc = kv(*command_for(kind, name, db), cwd=BAD)  # relative path: the error names it as given
    line = assert_one_line_error(proc, name, *([words] if words else []))
    if kind == "ingest":  # the file at fault, not just its session directory
        assert any(f in line for f in ("manifest.json", ".arrows", ".kvframes", "proc.json")), line


@pytest.mark.parametrize("name,kind,words", corpus.ACCEPTED, ids=[c[0] for c in corpus.ACCEPTED])
def test_corpus_input_that_must_load(name, kind, words, tmp_path):
    target = BAD / name
    if not target.exists():
        pytest.skip(f"{target} not generated")
    db = tmp_path / "out.duckdb"
    proc = kv(*command_for(kind, str(target), db))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert words in proc.stdout, proc.stdout
    con = duckdb.connect(str(db), read_only=True)
    try:
        if kind == "ingest":
            assert con.execute("select status from sessions").fetchall() == [("incomplete",)]
        else:
            assert con.execute("select count(*) from nsys_exports").fetchone()[0] == 1
    finally:
        con.close()


def test_killed_mid_batch_keeps_every_whole_batch_and_reports_the_cut(tmp_path):
    db = tmp_path / "k.duckdb"
    kv("ingest", str(BAD / "killed_mid_batch"), "-o", str(db))
    con = duckdb.connect(str(db), read_only=True)
    # 3 rows from the closed shard + the first whole batch (4 rows) of the open one; the cut batch is gone.
    assert [r[0] for r in con.execute("select step from steps order by step").fetchall()] == [1, 2, 3, 4, 5, 6, 7]
    issues = con.execute("select file, problem, bytes_cut from ingest_issues").fetchall()
    assert len(issues) == 1 and issues[0][0].endswith("steps.00001.arrows.partial") and issues[0][2] == 1508
    con.close()


def test_non_utf8_names_in_an_nsys_export_load_replaced(tmp_path):
    path = BAD / "nsys_non_utf8.sqlite"
    if not path.exists():
        pytest.skip("nsys inputs not generated")
    from kvtrace.ingest.nsys import load_nsys

    con = duckdb.connect()
    load_nsys(con, path)
    names = [r[0] for r in con.execute("select name from nsys_runtime union all select name from nsys_kernels "
                                       "union all select label from nsys_nvtx").fetchall() if r[0]]
    assert any("\ufffd" in n for n in names) and not any("\x00" in n for n in names)


# ---- inputs made here: paths that do not exist, a directory for a file and the reverse -----------------
def test_paths_that_do_not_exist(tmp_path):
    db = tmp_path / "x.duckdb"
    assert_one_line_error(kv("ingest", str(tmp_path / "nope"), "-o", str(db)), "nope", "no such session")
    assert_one_line_error(kv("ingest", "--nsys", str(tmp_path / "nope.sqlite"), "-o", str(db)), "nope.sqlite",
                          "no such file")
    assert_one_line_error(kv("query", str(tmp_path / "nope.duckdb"), "summary"), "nope.duckdb", "no such")
    assert_one_line_error(kv("ingest", str(BAD / "killed_mid_batch"), "-o", str(tmp_path / "no" / "dir" / "x.duckdb")),
                          "x.duckdb")


def test_empty_session_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(kv("ingest", str(tmp_path / "empty"), "-o", str(tmp_path / "x.duckdb")), "empty",
                          "not a kvtrace session")


def test_a_job_pattern_that_is_not_a_regular_expression(tmp_path):
    """Refused before anything is loaded."""
    from kvtrace.testing import synth

    synth.generate(tmp_path / "s", 20_000, seed=3)
    db = tmp_path / "x.duckdb"
    assert_one_line_error(kv("ingest", str(tmp_path / "s"), "-o", str(db), "--job-pattern", "job(?P<job>"),
                          "--job-pattern", "not a regular expression")
    assert not db.exists()  # checked before the database is opened


@pytest.fixture
def small_session(tmp_path) -> Path:
    """A valid synthetic session of 2,000 events (kvtrace.testing.synth), in tmp_path / "s"."""
    from kvtrace.testing import synth

    synth.generate(tmp_path / "s", 2_000, seed=3)
    return tmp_path / "s"


@pytest.mark.parametrize("pattern", [r"(?P<job>\w+)(?=-t)-t(?P<turn>\d+)", r"(?P<job>\w)(?P=job)",
                                     r"(?<=job)(?P<job>\d+)", r"(?P<job>\d+)(?!x)"])
def test_a_job_pattern_duckdb_cannot_apply(tmp_path, small_session, pattern):
    """Python's re accepts lookarounds and backreferences; DuckDB's RE2, which parses the ids, does not:
    refused in one line before the database is opened (no file left behind)."""
    db = tmp_path / "x.duckdb"
    assert_one_line_error(kv("ingest", str(small_session), "-o", str(db), "--job-pattern", pattern),
                          "--job-pattern", "RE2")
    assert not db.exists()


def test_a_session_in_a_directory_whose_name_is_not_utf8_ingests(tmp_path, small_session):
    """A valid session whose directory name is not UTF-8: ingested whole, the name stored with U+FFFD."""
    import os

    odd = os.fsencode(tmp_path) + b"/run\xff\xfe"
    os.rename(os.fsencode(small_session), odd)
    db = tmp_path / "x.duckdb"
    proc = kv("ingest", os.fsdecode(odd), "-o", str(db))
    assert proc.returncode == 0, proc.stderr
    with duckdb.connect(str(db), read_only=True) as con:
        (path, status), = con.execute("SELECT session_dir, status FROM sessions").fetchall()
        (steps,), = con.execute("SELECT count(*) FROM steps").fetchall()
    assert path.endswith("run\ufffd\ufffd") and steps > 0


def test_outputs_the_machine_refuses_are_one_line_errors(tmp_path, small_session):
    """A file where report writes a folder, a place that cannot hold files, an export to a folder that
    does not exist: one line naming the path, exit 1, never an internal error."""
    db = tmp_path / "x.duckdb"
    assert kv("ingest", str(small_session), "-o", str(db)).returncode == 0
    existing = tmp_path / "existing"
    existing.write_text("mine")
    assert_one_line_error(kv("report", str(db), "-o", str(existing)), str(existing))
    assert existing.read_text() == "mine"
    for fmt, out in (("html", "/proc/kvtrace-x.html"), ("perfetto", "/proc/kvtrace-x.json"),
                     ("html", str(tmp_path / "missing" / "x.html"))):
        assert_one_line_error(kv("export", str(db), "--format", fmt, "-o", out), out)


def test_a_directory_where_a_file_is_expected(tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    assert_one_line_error(kv("ingest", "--nsys", str(d), "-o", str(tmp_path / "x.duckdb")), "adir", "is a directory")
    assert_one_line_error(kv("query", str(d), "summary"), "adir", "is a directory")
    assert_one_line_error(kv("ingest", str(BAD / "killed_mid_batch"), "-o", str(d)), "adir", "is a directory")


def test_a_file_where_a_session_directory_is_expected(tmp_path):
    f = tmp_path / "afile"
    f.write_text("hello")
    assert_one_line_error(kv("ingest", str(f), "-o", str(tmp_path / "x.duckdb")), "afile", "not a directory")


def test_record_into_a_file_and_of_a_missing_command(tmp_path):
    f = tmp_path / "afile"
    f.write_text("hello")
    assert_one_line_error(kv("record", "-o", str(f), "--", "true"), "afile", "not a directory")
    assert_one_line_error(kv("record", "-o", str(tmp_path / "s"), "--", "no-such-command-xyz"),
                          "no-such-command-xyz", "command not found")


def test_a_duckdb_file_from_another_tool(tmp_path):
    path = corpus.make_other_tool_duckdb(tmp_path / "other_tool.duckdb")
    assert_one_line_error(kv("query", str(path), "summary"), "other_tool.duckdb", "not one kvtrace wrote")


def test_truncated_duckdb_file(tmp_path):
    src = tmp_path / "good.duckdb"
    kv("ingest", str(BAD / "killed_mid_batch"), "-o", str(src))
    data = src.read_bytes()
    cut = tmp_path / "cut.duckdb"
    cut.write_bytes(data[: len(data) // 3])
    proc = kv("query", str(cut), "summary")
    assert_one_line_error(proc, "cut.duckdb")


def test_corpus_is_what_the_script_makes(tmp_path):
    """The checked-in corpus equals a fresh run of the script (so the script is the documentation)."""
    fresh = corpus.main(tmp_path / "bad")
    ours = sorted(p.relative_to(BAD) for p in BAD.rglob("*") if p.is_file())
    if not corpus.NSYS_BASE.exists():  # tests/data/nsys missing: the script skips the nsys inputs
        ours = [p for p in ours if not p.name.startswith("nsys_")]
    theirs = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
    assert ours == theirs
    for rel in ours:
        assert (BAD / rel).read_bytes() == (fresh / rel).read_bytes(), f"{rel} differs: rerun make_bad_corpus.py"
    shutil.rmtree(fresh)


# ---- the reader on its own --------------------------------------------------------------------------
def test_open_shard_closed_while_being_read(tmp_path):
    """Ingesting a live session: a shard listed as `.partial` is renamed `.arrows` before it is read."""
    from kvtrace.format.shards import ShardRead, ShardWriter, list_shards, read_shard, rows_to_batch

    w = ShardWriter(tmp_path, "steps", 1 << 30, 1e9)
    w.write(rows_to_batch("steps", corpus.step_rows(3)))
    (shard,) = list_shards(tmp_path)
    assert shard.open
    w.close()  # renamed to steps.00000.arrows
    res = ShardRead()
    assert sum(b.num_rows for b in read_shard(shard, res)) == 3 and res.problems == []


def test_open_shard_ending_with_the_end_marker_is_whole(tmp_path):
    """Killed between closing a shard and renaming it: nothing was cut."""
    from kvtrace.format.shards import ShardRead, ShardWriter, list_shards, read_shard, rows_to_batch

    w = ShardWriter(tmp_path, "steps", 1 << 30, 1e9)
    w.write(rows_to_batch("steps", corpus.step_rows(3)))
    w.close()
    closed = w.closed_shards[0][0]
    closed.rename(closed.with_name(closed.name + ".partial"))
    res = ShardRead()
    (shard,) = list_shards(tmp_path)
    assert sum(b.num_rows for b in read_shard(shard, res)) == 3
    assert res.bytes_cut == 0 and res.problems == []


@pytest.mark.parametrize("status,reported", [("running", True), ("flushed", False)])
def test_open_shard_is_reported_unless_its_process_flushed_everything(tmp_path, status, reported):
    """Killed without warning (`running`): rows it had not flushed are missing, say so. Stopped by vLLM
    right after writing everything it held when `kvtrace record` asked (`flushed`): nothing is missing."""
    import json

    from kvtrace.format.shards import ShardRead, ShardWriter, list_shards, read_shard, rows_to_batch

    (tmp_path / "proc.json").write_text(json.dumps({"pid": 1, "role": "engine", "status": status}))
    w = ShardWriter(tmp_path, "steps", 1 << 30, 1e9)
    w.write(rows_to_batch("steps", corpus.step_rows(3)))
    (shard,) = list_shards(tmp_path)
    res = ShardRead()
    assert sum(b.num_rows for b in read_shard(shard, res)) == 3 and res.bytes_cut == 0
    assert bool(res.problems) == reported
    if reported:
        assert res.problems == [f"{shard.path}: not closed (its process was killed or is still running); "
                                "read to its last whole batch, 3 rows"]


def test_another_tools_database_with_a_sessions_table_is_not_written(tmp_path):
    """A table called `sessions` does not make a database kvtrace's: ingest -o it refuses before
    writing anything, and the file keeps exactly its tables."""
    import duckdb

    path = tmp_path / "web_app.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE sessions (id INTEGER, user_name VARCHAR)")
    con.execute("INSERT INTO sessions VALUES (1, 'alice')")
    con.close()
    proc = kv("ingest", str(BAD / "killed_mid_batch"), "-o", str(path))
    assert_one_line_error(proc, "web_app.duckdb", "not one kvtrace wrote")
    con = duckdb.connect(str(path), read_only=True)
    try:
        tables = [r[0] for r in con.execute("select table_name from information_schema.tables").fetchall()]
        assert tables == ["sessions"]
        assert con.execute("select * from sessions").fetchall() == [(1, "alice")]
    finally:
        con.close()


@pytest.mark.parametrize("tables, needle", [
    ({"steps AS SELECT 1; COPY (SELECT 42) TO 'PWNED'; CREATE VIEW x": {"columns": []}}, "not a plain identifier"),
    ({"../../etc": {"columns": []}}, "not a plain identifier"),
    ({"steps": {"columns": [["step", "BIGINT) AS x, (SELECT 1); COPY (SELECT 42) TO 'PWNED'; --"]]}},
     "is not a DuckDB type name"),
    ({"steps": {"columns": [["step"]]}}, "is not [name, type]"),
    ({"steps": {"columns": "BIGINT"}}, "'columns' is not a list"),
    (["steps"], "'tables' is not an object"),
])
def test_a_dataset_description_cannot_run_sql(tmp_path, monkeypatch, tables, needle):
    """The dataset's _kvtrace_dataset.json names tables and types that go into SQL: a crafted one is
    refused with one line, and nothing it asks for (here: a COPY to a file) happens."""
    from kvtrace.export.dataset import FORMAT, META
    from kvtrace.format import schema

    root = tmp_path / "ds"
    root.mkdir()
    (root / META).write_text(json.dumps({"format": FORMAT, "schema_version": schema.SCHEMA_VERSION,
                                         "tables": tables, "sessions": {}}))
    monkeypatch.chdir(tmp_path)
    proc = kv("query", "--dataset", str(root), "summary")
    assert_one_line_error(proc, META, needle)
    assert not any(p.name == "PWNED" for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_a_manifest_that_is_not_a_small_regular_file(tmp_path, kind):
    """A manifest that is a FIFO (reading it would block forever), a link to /dev/zero (would never
    end) or a huge file: one line, exit 1, promptly."""
    import os

    session = tmp_path / "s"
    (session / "procs").mkdir(parents=True)
    manifest = session / "manifest.json"
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "dev-zero":
        manifest.symlink_to("/dev/zero")
    else:
        with open(manifest, "wb") as f:
            f.truncate(64 << 20)  # sparse: 64 MiB of zeros
    proc = kv("ingest", str(session), "-o", str(tmp_path / "out.duckdb"))  # kv() has a timeout
    assert_one_line_error(proc, "manifest.json", "unreadable manifest")


def ingest_steps_and_issues(session: Path, db: Path) -> tuple[int, list[str]]:
    """Ingest `session` into `db` (must succeed): its step rows and the problems ingest recorded."""
    proc = kv("ingest", str(session), "-o", str(db))
    assert proc.returncode == 0, proc.stderr
    with duckdb.connect(str(db), read_only=True) as con:
        ((steps,),) = con.execute("select count(*) from steps").fetchall()
        return steps, [p for p, in con.execute("select problem from ingest_issues").fetchall()]


def test_a_shard_beside_its_own_partial_copy_is_read_once(tmp_path):
    """A copy of a session taken while a shard was being closed can hold it twice, as `.arrows` and
    `.arrows.partial`: its rows are counted once and ingest says why."""
    session = tmp_path / "s"
    shutil.copytree(BAD / "killed_before_header", session)
    pdir = next((session / "procs").iterdir())
    closed = pdir / "steps.00000.arrows"
    shutil.copy(closed, pdir / "steps.00000.arrows.partial")
    steps, issues = ingest_steps_and_issues(session, tmp_path / "s.duckdb")
    assert steps == 2
    assert any("steps.00000.arrows.partial: the same shard as steps.00000.arrows" in p for p in issues), issues


def test_an_nsys_export_with_a_rowid_near_2_63_reads_in_bounded_time(tmp_path):
    """Rowids are the file's to choose: one kernel row moved to rowid 2^63 - 2 must not make ingest plan
    work for every rowid below it; the rows are read all the same."""
    import sqlite3

    path = tmp_path / "sparse.sqlite"
    shutil.copy(BAD / "nsys_small.sqlite", path)
    con = sqlite3.connect(path)
    (n,) = con.execute("SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL").fetchone()
    con.execute("UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET rowid = 9223372036854775806 "
                "WHERE rowid = (SELECT max(rowid) FROM CUPTI_ACTIVITY_KIND_KERNEL)")
    con.commit()
    con.close()
    db = tmp_path / "sparse.duckdb"
    proc = kv("ingest", "--nsys", str(path), "-o", str(db))  # kv() has a timeout
    assert proc.returncode == 0, proc.stderr
    with duckdb.connect(str(db), read_only=True) as c:
        assert c.execute("SELECT count(*) FROM nsys_kernels").fetchall() == [(n,)]


def test_a_process_folder_reachable_through_a_link_is_counted_once(tmp_path):
    session = tmp_path / "s"
    shutil.copytree(BAD / "killed_before_header", session)
    pdir = next((session / "procs").iterdir())
    (session / "procs" / "again-1").symlink_to(pdir, target_is_directory=True)
    steps, issues = ingest_steps_and_issues(session, tmp_path / "s.duckdb")
    assert steps == 2
    assert any("again-1: a link, not read" in p for p in issues), issues


def test_a_link_to_a_process_folder_outside_the_session_is_not_read_and_said(tmp_path, small_session):
    """A process folder moved elsewhere and linked back is not followed: its rows are not in the
    database, so the session is `degraded` with the link named, never `complete`."""
    procs = sorted(p for p in (small_session / "procs").iterdir())
    assert len(procs) >= 2
    moved = tmp_path / "elsewhere"
    shutil.move(str(procs[-1]), moved)
    (small_session / "procs" / procs[-1].name).symlink_to(moved, target_is_directory=True)
    db = tmp_path / "s.duckdb"
    proc = kv("ingest", str(small_session), "-o", str(db))
    assert proc.returncode == 0, proc.stderr
    with duckdb.connect(str(db), read_only=True) as con:
        ((status,),) = con.execute("select status from sessions").fetchall()
        issues = [p for p, in con.execute("select problem from ingest_issues").fetchall()]
    assert status == "degraded", (status, issues)
    assert any(f"behind links not read: {procs[-1].name}" in p for p in issues), issues
    assert any("leads outside the session's process folders" in p for p in issues), issues


def test_an_sqlite_file_as_the_database_is_refused_without_a_download(tmp_path, small_session):
    """DuckDB opens an SQLite file through its sqlite_scanner extension, which it would download: every
    connection kvtrace makes has extension auto-install and auto-load off, so an SQLite file named as
    the database is a one-line error, and the extension is never fetched."""
    import sqlite3

    from kvtrace.store.db import connect

    con = connect()
    try:
        assert con.execute("SELECT current_setting('autoinstall_known_extensions'), "
                           "current_setting('autoload_known_extensions')").fetchall() == [(False, False)]
    finally:
        con.close()
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as lite:
        lite.execute("CREATE TABLE t (a)")
    before = other.read_bytes()
    assert_one_line_error(kv("ingest", str(small_session), "-o", str(other)), str(other), "not a DuckDB database")
    assert_one_line_error(kv("query", str(other), "summary"), str(other), "not a DuckDB database")
    assert other.read_bytes() == before  # not written


def test_a_database_another_process_holds_is_named_as_such(tmp_path, small_session):
    """DuckDB lets one process open a file for writing: a database held by another process (an open
    `duckdb` shell, a running ingest) is said to be in use, not called "not a DuckDB database"."""
    db = tmp_path / "x.duckdb"
    assert kv("ingest", str(small_session), "-o", str(db)).returncode == 0
    holder = subprocess.Popen([sys.executable, "-c", "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); "
                               "print('held', flush=True); time.sleep(120)", str(db)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for args in (("query", str(db), "summary"), ("ingest", str(small_session), "-o", str(db)),
                     ("export", str(db), "--format", "perfetto", "-o", str(tmp_path / "x.json"))):
            line = assert_one_line_error(kv(*args), str(db), "in use by another process")
            assert "not a DuckDB database" not in line
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("where", ["procs", "proc_dir", "shard"])
def test_an_unreadable_folder_or_file_is_one_line(tmp_path, small_session, monkeypatch, capsys, where):
    """A folder or shard the user may not read. Tests run as root here, for whom permissions do not
    apply, so the refusal is made in the process: every way kvtrace lists a folder or opens a file fails
    with the PermissionError the kernel would raise for that path."""
    import builtins
    import os

    from kvtrace.cli import main

    proc = sorted((small_session / "procs").iterdir())[0]
    target = {"procs": small_session / "procs", "proc_dir": proc,
              "shard": sorted(proc.glob("steps.*.arrows"))[0]}[where]

    def denied(path) -> bool:
        return os.fspath(path) == os.fspath(target)

    def refuse(path):
        raise PermissionError(13, "Permission denied", os.fspath(path))

    real = {"scandir": os.scandir, "listdir": os.listdir, "open": os.open, "iterdir": Path.iterdir,
            "builtin_open": builtins.open}
    monkeypatch.setattr(os, "scandir", lambda p=".": refuse(p) if denied(p) else real["scandir"](p))
    monkeypatch.setattr(os, "listdir", lambda p=".": refuse(p) if denied(p) else real["listdir"](p))
    monkeypatch.setattr(os, "open", lambda p, *a, **k: refuse(p) if denied(p) else real["open"](p, *a, **k))
    monkeypatch.setattr(Path, "iterdir", lambda self: refuse(self) if denied(self) else real["iterdir"](self))
    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: refuse(p) if denied(p) else real["builtin_open"](p, *a, **k))
    import pyarrow as pa

    real_osfile, real_mmap = pa.OSFile, pa.memory_map
    monkeypatch.setattr(pa, "OSFile", lambda p, *a, **k: refuse(p) if denied(p) else real_osfile(p, *a, **k))
    monkeypatch.setattr(pa, "memory_map", lambda p, *a, **k: refuse(p) if denied(p) else real_mmap(p, *a, **k))
    db = tmp_path / "x.duckdb"
    with pytest.raises(SystemExit) as exit_:
        main(["ingest", str(small_session), "-o", str(db)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and len(err) == 1, err
    assert err[0].startswith("kvtrace: error: ") and target.name in err[0] and "Permission denied" in err[0], err
