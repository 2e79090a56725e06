"""Disk trouble: the session's file system fills up during a recorded real vLLM run.

How: the session lives on a 2 MiB tmpfs mounted for the test, most of it taken by a filler file (real
ENOSPC, which root cannot wave through, unlike file permissions). When the first process warns that it
stopped recording, the filler is deleted, as a user freeing space would, so that the counts of what was
lost can be written (proc.json, manifest). Where mounting is not allowed, the recorded command runs
under RLIMIT_FSIZE instead (`prlimit --fsize`: writes past the limit fail with EFBIG; Python ignores
SIGXFSZ, so the process is not killed). A read-only file system cannot be made mid-run (a remount is
refused while shards are open for writing); a read-only session directory at start is tested without
vLLM, with the writer's error path (EROFS) in-process. See docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import time

import pytest

from tests.helpers.reliability_util import (
    STARTUP_S,
    ingest,
    kvtrace_warnings,
    manifest,
    procs,
    query,
    start_record,
    wait_until,
    workload_cmd,
)
from tests.helpers.run import run_kvtrace

TMPFS_BYTES = 4 << 20
# Room for ~1 s of this run's rows on a fast machine: every process writes (at --flush-interval 0.1) several
# times before the worker's kv_access rows fill the disk, on a slow machine too (CI failed with 320 KiB:
# the worker's first flush filled it before the engine core had written a single step).
FREE_BYTES = 1 << 20
FSIZE_BYTES = 256 << 10
JOBS, TURNS, REPEAT = 4, 2, 8


def can_mount(where) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(where)],
                         capture_output=True)
    return res.returncode == 0


def umount(where) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture(scope="module")
def full_disk(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disk")
    mnt = tmp / "mnt"
    mode = "tmpfs" if can_mount(mnt) else "rlimit"
    filler = mnt / "filler"
    cmd = workload_cmd(tiny_model, "--jobs", str(JOBS), "--turns", str(TURNS), "--repeat", str(REPEAT),
                       "--max-tokens", "32")
    if mode == "tmpfs":
        with open(filler, "wb") as f:
            f.write(b"\0" * (TMPFS_BYTES - FREE_BYTES))
        session = mnt / "s"
    else:
        session = tmp / "s"
        cmd = ["prlimit", f"--fsize={FSIZE_BYTES}", "--", *cmd]
    # Lots of rows (KV accesses of every layer) so the disk fills while vLLM still has work to do.
    rec = start_record(session, cmd, ["--kv-granularity", "blocks", "--kv-layers", "all", "--flush-interval", "0.1"], log_dir=tmp)
    try:
        wait_until(lambda: "stopped recording" in rec.stderr, STARTUP_S, "a writer to stop", rec)
        stopped_at = time.monotonic()
        if mode == "tmpfs":
            filler.unlink()  # space again: the counts can be written from now on
        code = rec.wait(timeout=300)
        db = tmp / "disk.duckdb"
        yield {"mode": mode, "rec": rec, "code": code, "session": session, "db": db, "ingest": ingest(session, db),
               "stopped_at": stopped_at}
    finally:
        rec.kill_all()
        if mode == "tmpfs":
            # Keep the session for a look after a failure: copy it off the tmpfs before unmounting.
            subprocess.run(["cp", "-a", str(session), str(tmp / "session-copy")], capture_output=True)
            umount(mnt)


@pytest.mark.vllm
def test_vllm_finishes_its_work_when_the_disk_fills(full_disk):
    rec = full_disk["rec"]
    assert full_disk["code"] == 0, rec.stderr[-4000:]
    result = json.loads(next(line for line in reversed(rec.stdout.splitlines()) if line.startswith('{"requests"')))
    assert result["requests"] == JOBS * TURNS * REPEAT


@pytest.mark.vllm
def test_one_warning_per_process_and_every_lost_row_counted(full_disk):
    rec = full_disk["rec"]
    warnings = [w for w in kvtrace_warnings(rec.stderr) if "stopped recording" in w]
    assert warnings
    pids = [w.rsplit("(pid ", 1)[1].rstrip(")") for w in warnings]
    assert len(pids) == len(set(pids)), warnings  # one line per process, not one per failed write
    errname = "No space left on device" if full_disk["mode"] == "tmpfs" else "File too large"
    assert all(errname in w for w in warnings), warnings
    stopped = [d for d in procs(full_disk["session"]) if d.get("stopped_reason")]
    assert {str(d["pid"]) for d in stopped} == set(pids)
    for d in stopped:
        assert d["stopped_reason"] == "writer-error"
        lost = {t: c["writer-error"] for t, c in d["dropped"].items() if "writer-error" in c}
        assert sum(lost.values()) > 0, d["dropped"]
    totals = manifest(full_disk["session"])["dropped"]
    assert any(k.endswith(":writer-error") and v > 0 for k, v in totals.items()), totals


@pytest.mark.vllm
def test_what_was_written_before_the_disk_filled_ingests(full_disk):
    res = full_disk["ingest"]
    assert res.returncode == 0, res.stderr
    db = full_disk["db"]
    assert query(db, "select count(*) from steps")[0][0] > 0
    # The counts are in the database too (procs.dropped, from each proc.json).
    stopped = {d["pid"]: d["dropped"] for d in procs(full_disk["session"]) if d.get("stopped_reason")}
    in_db = {pid: json.loads(dropped) for pid, dropped in query(db, "select pid, dropped from procs")}
    for pid, dropped in stopped.items():
        assert in_db[pid] == dropped


@pytest.mark.vllm
def test_summary_reports_the_rows_lost(full_disk):
    """The stopped writer keeps its drop counts and writes them to the drops table when it closes."""
    out = run_kvtrace("query", str(full_disk["db"]), "summary", "--format", "json").stdout
    lost = sum(n for c in (d["dropped"] for d in procs(full_disk["session"])) for t in c.values() for n in t.values())
    assert json.loads(out)[0]["dropped_events"] == lost > 0


# ---- without vLLM -------------------------------------------------------------------------------------
def test_read_only_session_directory_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    if not can_mount(ro):
        pytest.skip("cannot mount a tmpfs here")
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True, capture_output=True)
        res = run_kvtrace("record", "-o", str(ro / "s"), "--", "true", check=False)
        assert res.returncode == 1 and "Traceback" not in res.stderr
        lines = res.stderr.strip().splitlines()
        assert lines == [f"kvtrace: error: {ro / 's'}: cannot create the session directory (Read-only file system)"]
    finally:
        umount(ro)


def test_writer_error_stops_recording_once_and_counts_every_row(tmp_path, monkeypatch, capsys):
    """The recorder's side of a read-only or full disk, in-process: the first failing write warns and
    stops the writer; every later row is counted as lost, per table, in proc.json and in memory."""
    from kvtrace.format.shards import ShardWriter
    from kvtrace.record.recorder import Recorder

    rec = Recorder(tmp_path, "engine", {"flush_interval_s": 3600})
    try:
        steps = rec.buffer("steps")
        row = (1, 1, 2, 3, 64, 32, 32, 1, 1, 2, 0, 10, 40, 256, 8, "none", 0, 1, 0, 0, 32, 0)
        steps.extend([row] * 5)
        rec.flush()

        def erofs(self, batch):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        monkeypatch.setattr(ShardWriter, "write", erofs)
        steps.extend([row] * 7)
        rec.flush()
        steps.extend([row] * 11)
        rec.flush()
        rec.close()
    finally:
        with contextlib.suppress(Exception):
            rec.close()
    err = capsys.readouterr().err
    warnings = kvtrace_warnings(err)
    assert len(warnings) == 1 and "stopped recording" in warnings[0] and "Read-only file system" in warnings[0]
    doc = json.loads((rec.dir / "proc.json").read_text())
    assert doc["stopped_reason"] == "writer-error"
    assert doc["dropped"]["steps"] == {"writer-error": 18}
    assert doc["rows_written"]["steps"] == 5


PARTIAL_WRITE = r"""
import json, resource, sys
from kvtrace.record.recorder import Recorder
rec = Recorder(sys.argv[1], "engine", {"flush_interval_s": 3600})
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, hard))  # the disk fills in the middle of a batch
row = (1, 1, 2, 3, 64, 32, 32, 1, 1, 2, 0, 10, 40, 256, 8, "none", 0, 1, 0, 0, 32, 0)
appended = 0
while rec.stopped_reason is None:
    rec.buffer("steps").extend([row] * 400)
    appended += 400
    rec.flush()
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space again before the process ends
rec.close()
print(json.dumps({"appended": appended, "written": rec.rows_written["steps"], "dropped": rec.dropped, "dir": str(rec.dir)}))
"""


def run_until_the_disk_fills(code: str, tmp_path) -> tuple[dict, dict]:
    """Run a recorder script that writes until its file size limit stops it; (its printed summary,
    {table: (rows or records read back from its files, problems)})."""
    import sys
    from pathlib import Path

    from kvtrace.format.shards import ShardRead, list_shards, read_shard

    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    read: dict = {}
    for shard in list_shards(Path(out["dir"])):
        r = ShardRead()
        n = sum(b.column("records_count").to_numpy().sum() if shard.table == "kv_access_records" else b.num_rows
                for b in read_shard(shard, r))
        got, problems = read.get(shard.table, (0, []))
        read[shard.table] = (got + n, problems + r.problems)
    return out, read


def test_a_batch_cut_by_a_full_disk_is_either_written_or_counted_lost(tmp_path):
    """Every row appended ends up exactly once: in a shard, or in the writer-error count."""
    out, read = run_until_the_disk_fills(PARTIAL_WRITE, tmp_path)
    rows = read["steps"][0]
    lost = out["dropped"]["steps"]["writer-error"]
    assert rows == out["written"] and rows + lost == out["appended"], (rows, out)


FRAMES_CUT = r"""
import json, resource, sys
import numpy as np
from kvtrace.format.kv_records import REC_DTYPE
from kvtrace.record.recorder import Recorder
rec = Recorder(sys.argv[1], "worker", {"flush_interval_s": 3600})
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, hard))  # the disk fills in the middle of a frame
appended = 0
while rec.stopped_reason is None:
    rec.append_kv_records(np.zeros(700, REC_DTYPE), (0, 0, 1.0))  # 22 KB a drain
    appended += 700
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
rec.close()
print(json.dumps({"appended": appended, "dropped": rec.dropped, "dir": str(rec.dir)}))
"""


def test_a_frame_cut_by_a_full_disk_is_either_written_or_counted_lost(tmp_path):
    """The drains' frame files: every record ends up exactly once, in a whole frame of a file that
    ingests, or in the writer-error count."""
    out, read = run_until_the_disk_fills(FRAMES_CUT, tmp_path)
    records, problems = read["kv_access_records"]
    assert not problems, problems
    lost = out["dropped"]["kv_access"]["writer-error"]
    assert records > 0 and lost > 0 and records + lost == out["appended"], (records, out)


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="no SIGXFSZ here")
def test_python_ignores_sigxfsz_so_a_file_size_limit_is_an_error_not_a_kill(tmp_path):
    """Why the RLIMIT_FSIZE fallback is safe for the recorded processes."""
    code = ("import signal, resource; assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN;"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000));"
            f"f = open({str(tmp_path / 'f')!r}, 'wb', buffering=0)\n"
            "try:\n f.write(b'x' * 5000); f.write(b'x')\nexcept OSError as e: print(e.errno)")
    import sys

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == str(errno.EFBIG), res.stderr


def _ingest_limited(args: list[str], fsize_bytes: int) -> subprocess.CompletedProcess:
    """`kvtrace ingest ARGS` with writes past `fsize_bytes` refused (RLIMIT_FSIZE: EFBIG, as a full disk
    refuses with ENOSPC; Python ignores SIGXFSZ)."""
    import resource
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))

    return subprocess.run([sys.executable, "-m", "kvtrace", "ingest", *args], capture_output=True, text=True,
                          preexec_fn=limit, timeout=300)


def test_ingest_on_a_full_disk_says_what_was_stored(tmp_path):
    """The disk refuses the second session's write: one line that names it as not stored and the first
    as stored; the database holds the first whole (its WAL beside it), and a later ingest with room
    stores both."""
    from kvtrace.testing import synth
    from tests.helpers.run import query

    a, b, db = tmp_path / "a", tmp_path / "b", tmp_path / "x.duckdb"
    ra, rb = synth.generate(a, 2000, seed=1), synth.generate(b, 2000, seed=2)
    proc = _ingest_limited([str(a), str(b), "-o", str(db)], 1_000_000)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvtrace: error: {db}: the disk refused a write") and "Traceback" not in proc.stderr
    assert f"session {rb['session_id']} was not stored" in lines[0]
    assert f"stored before it in this run: {ra['session_id']}" in lines[0]
    assert query(db, "select session, (select count(*) from steps s where s.session = x.session) from sessions x") \
        == [(ra["session_id"], ra["rows"]["steps"])]
    assert run_kvtrace("ingest", str(a), str(b), "-o", str(db), check=False).returncode == 0
    assert sorted(query(db, "select session from sessions")) == sorted([(ra["session_id"],), (rb["session_id"],)])


def test_ingest_of_one_session_on_a_full_disk_stores_none_of_it(tmp_path):
    from kvtrace.testing import synth
    from tests.helpers.run import query

    s, db = tmp_path / "s", tmp_path / "x.duckdb"
    r = synth.generate(s, 2000, seed=1)
    proc = _ingest_limited([str(s), "-o", str(db)], 600_000)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert f"session {r['session_id']} was not stored and the database holds what it held before it" in lines[0]
    assert "stored before it" not in lines[0]
    assert query(db, "select count(*) from sessions") == [(0,)]
