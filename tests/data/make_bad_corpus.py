"""Generate tests/data/bad/: inputs that kvtrace must refuse with one line (or accept, where noted).

    python tests/data/make_bad_corpus.py          # rewrites tests/data/bad/ (deterministic)

Every input is small and made the way the real thing is made: shards by kvtrace's own `ShardWriter`,
Nsight exports from a real export in tests/data/nsys (cut down to a few rows per table, nsys's
own CREATE TABLE statements kept), DuckDB files by DuckDB. `CASES` below says, for each input, which
command reads it and what the one-line error must mention; tests/reliability/test_bad_input.py runs
them. The outputs are checked in.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BAD = HERE / "bad"
REPO = HERE.parents[1]
NSYS_BASE = HERE / "nsys" / "fuser__report1_2024-12.sqlite"
SESSION_ID = "20261122T120000-badc0rp5"

sys.path.insert(0, str(REPO))

# (input under bad/, command ("ingest" a session, "nsys" = ingest --nsys, "query" a database),
#  words the error line must contain besides the file's name). Inputs made by the tests themselves
# (empty directory, missing path, directory for a file) are in the test module.
CASES = [
    ("future_schema", "ingest", "schema_version 99 is newer"),
    ("manifest_not_json", "ingest", "unreadable manifest"),
    ("manifest_non_utf8", "ingest", "unreadable manifest"),
    ("manifest_no_version", "ingest", "no schema_version"),
    ("shard_truncated", "ingest", "corrupt shard"),
    ("shard_no_end_marker", "ingest", "no end-of-stream marker after row 8"),
    ("shard_bitflip", "ingest", "corrupt shard"),
    ("shard_garbage", "ingest", "not an Arrow IPC stream"),
    ("shard_empty", "ingest", "empty shard"),
    ("shard_other_table", "ingest", "holds table 'request_events'"),
    ("shard_foreign_arrow", "ingest", "not a steps shard"),
    ("shard_future_schema", "ingest", "newer than this kvtrace reads"),
    ("shard_non_utf8", "ingest", "Invalid UTF8"),
    ("shard_is_directory", "ingest", "not a file"),
    ("manifest_is_directory", "ingest", "unreadable manifest"),
    ("shard_unknown_table", "ingest", "unknown table"),
    ("decode_runs_zero_steps", "ingest", "decode run of 0 steps"),
    ("batch_slot_runs_zero_steps", "ingest", "batch slot run of 0 steps"),
    ("kv_records_wrong_size", "ingest", "holds 40 bytes for 2 records"),
    ("manifest_procs_not_a_list", "ingest", "field 'procs' is \"x\", not list"),
    ("manifest_options_job_pattern_number", "ingest", "field 'job_pattern' is 5, not str or null"),
    ("manifest_version_string", "ingest", "schema_version \"2\" is not a number"),
    ("manifest_version_bool", "ingest", "schema_version true is not a number"),
    ("manifest_job_pattern_lookahead", "ingest", "RE2"),
    ("manifest_job_pattern_backreference", "ingest", "RE2"),
    ("manifest_clock_not_a_dict", "ingest", "field 'clock' is"),
    ("proc_pid_text", "ingest", "field 'pid' is \"x\", not int"),
    ("proc_rank_list", "ingest", "field 'rank' is [1], not int"),
    ("proc_rank_bool", "ingest", "field 'rank' is true, not int"),
    ("proc_probes_list", "ingest", "field 'probes' is"),
    ("proc_rows_written_text", "ingest", "field 'rows_written' is"),
    ("kv_records_bad_clock", "ingest", "clock slope outside"),
    ("kv_records_bad_copies", "ingest", "layer_copies is not (layer, source) pairs"),
    ("kv_frames_cut", "ingest", "runs past the end of the file"),
    ("kv_frames_not_frames", "ingest", "not a kvtrace frame file"),
    ("kv_frames_bad_clock", "ingest", "clock slope outside"),
    ("kv_frames_of_steps", "ingest", "only kv_access_records is written as frames"),
    ("random_bytes.sqlite", "nsys", "not an SQLite database"),
    ("empty.sqlite", "nsys", "empty file"),
    ("not_nsys.sqlite", "nsys", "not an Nsight Systems export"),
    ("nsys_missing_tables.sqlite", "nsys", "nothing kvtrace can load"),
    ("nsys_missing_column.sqlite", "nsys", "has no column start"),
    ("nsys_truncated.sqlite", "nsys", "truncated SQLite file"),
    ("nsys_corrupt_page.sqlite", "nsys", ""),
    ("nsys_non_utf8_schema.sqlite", "nsys", "unreadable SQLite database"),
    ("nsys_time_near_int64_min.sqlite", "nsys", "out of range for kvtrace's clock"),
    ("random_bytes.db", "query", "not a DuckDB database"),
]
# Inputs that must be accepted (exit 0), with what ingest must report.
ACCEPTED = [
    ("killed_mid_batch", "ingest", "last batch cut"),       # an open shard cut inside a batch
    ("killed_before_header", "ingest", "incomplete"),        # an open shard of 0 bytes
    ("proc_json_cut", "ingest", "incomplete"),               # proc.json cut mid-write (not atomic)
    ("nsys_small.sqlite", "nsys", ""),                       # the cut-down real export itself
    ("nsys_non_utf8.sqlite", "nsys", ""),                    # StringIds with non-UTF-8 bytes and NULs
    ("nsys_time_near_int64_max.sqlite", "nsys", ""),         # far-future starts: loaded, nothing overflows
]


def manifest(**over) -> dict:
    doc = {"schema_version": 1, "session_id": SESSION_ID, "kvtrace_version": "0.1.0", "vllm_version": "0.32.0",
           "command": ["python", "-m", "kvtrace.demo.workload"], "options": {}, "status": "complete", "exit_code": 0,
           "clock": {"start_monotonic_ns": 1_000_000_000, "start_utc_ns": 1_795_000_000_000_000_000}}
    doc.update(over)
    return doc


def step_rows(n: int, first: int = 1) -> list[tuple]:
    return [(s, 1_000_000_000 + s * 1000, 1_000_000_100 + s * 1000, 1_000_000_900 + s * 1000, 64, 32, 32, 1, 1,
             2, 0, 10, 40, 256, 8, "none", 0, 1, 0, 0, 32, 0) for s in range(first, first + n)]


def event_rows(n: int) -> list[tuple]:
    return [(1_000_000_000 + i, i, f"job{i}-turn0", "arrival", 100, None) for i in range(n)]


def write_shard(proc_dir: Path, table: str, batches: list[list[tuple]], close: bool = True) -> Path:
    """A shard written by kvtrace's own writer: returns its path (.arrows, or .arrows.partial if open).
    Numbered after the table's shards already in `proc_dir`, as one process's writer numbers them."""
    from kvtrace.format.shards import ShardWriter, rows_to_batch

    w = ShardWriter(proc_dir, table, rotate_bytes=1 << 30, rotate_s=1e9)
    w.seq = len(list(proc_dir.glob(f"{table}.*.arrows*")))
    for rows in batches:
        w.write(rows_to_batch(table, rows))
    if close:
        w.close()
        return w.closed_shards[-1][0]
    os.close(w._fd)  # as if the process was killed: no end-of-stream marker, name still .partial
    return w._path


def session(name: str, doc: dict | None = None, proc: dict | None = None) -> Path:
    """A session directory with a manifest and one process folder (returned)."""
    root = BAD / name
    pdir = root / "procs" / "host-4242"
    pdir.mkdir(parents=True)
    if doc is not None:
        (root / "manifest.json").write_text(json.dumps(doc, indent=1, sort_keys=True))
    p = {"schema_version": 1, "role": "engine", "pid": 4242, "host": "host", "rank": 0, "status": "complete",
         "rows_written": {}, "dropped": {}, "stopped_reason": None, "probes": {}}
    p.update(proc or {})
    (pdir / "proc.json").write_text(json.dumps(p, indent=1, sort_keys=True))
    return pdir


def make_sessions() -> None:
    import pyarrow as pa

    from kvtrace.format import schema

    pdir = session("future_schema", manifest(schema_version=99))
    write_shard(pdir, "steps", [step_rows(3)])

    session("manifest_not_json").parent.parent.joinpath("manifest.json").write_text('{"schema_version": 1, "sess')
    session("manifest_non_utf8").parent.parent.joinpath("manifest.json").write_bytes(
        json.dumps(manifest()).encode().replace(b"kvtrace.demo.workload", b"kvtrace.\xff\xfeworkload"))
    session("manifest_no_version").parent.parent.joinpath("manifest.json").write_text('["not", "a", "manifest"]')

    # A closed shard cut in the middle of its second batch (a copy that stopped half-way).
    p = write_shard(session("shard_truncated", manifest()), "steps", [step_rows(4), step_rows(4, 5)])
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 8 - 200])
    # A closed shard cut exactly at a batch boundary: every batch reads, but the end-of-stream marker
    # that closing writes is missing, so rows may be missing too.
    p = write_shard(session("shard_no_end_marker", manifest()), "steps", [step_rows(4), step_rows(4, 5)])
    p.write_bytes(p.read_bytes()[:-8])
    # One flipped bit in the second batch's message length prefix (IPC has no checksums: a flip inside
    # column values cannot be seen; one in the framing must be).
    p = write_shard(session("shard_bitflip", manifest()), "steps", [step_rows(4), step_rows(4, 5)])
    data = bytearray(p.read_bytes())
    first = _message_ends(bytes(data))[1]  # end of the first batch = start of the second message
    data[first + 5] ^= 0x40  # the 4-byte metadata length after the 0xFFFFFFFF continuation marker
    p.write_bytes(bytes(data))
    (session("shard_garbage", manifest()) / "steps.00000.arrows").write_bytes(
        random.Random(7).randbytes(3000))
    (session("shard_empty", manifest()) / "steps.00000.arrows").write_bytes(b"")
    # request_events rows in a file named as a steps shard (kvtrace metadata says which table).
    p = write_shard(session("shard_other_table", manifest()), "request_events", [event_rows(3)])
    p.rename(p.with_name("steps.00000.arrows"))
    # An Arrow stream some other program wrote (no kvtrace metadata), named as a steps shard.
    pdir = session("shard_foreign_arrow", manifest())
    foreign = pa.record_batch([pa.array(["a", "b"]), pa.array([1.5, 2.5])], names=["name", "score"])
    with pa.OSFile(str(pdir / "steps.00000.arrows"), "wb") as f, pa.ipc.new_stream(f, foreign.schema) as w:
        w.write_batch(foreign)
    # A shard a newer kvtrace wrote (schema_version 99 in its metadata).
    pdir = session("shard_future_schema", manifest())
    newer = schema.arrow_schema("steps").with_metadata({b"kvtrace.table": b"steps",
                                                        b"kvtrace.schema_version": b"99"})
    from kvtrace.format.shards import rows_to_batch

    batch = rows_to_batch("steps", step_rows(2)).replace_schema_metadata(newer.metadata)
    with pa.OSFile(str(pdir / "steps.00000.arrows"), "wb") as f, pa.ipc.new_stream(f, newer) as w:
        w.write_batch(batch)
    # Request ids with bytes that are not UTF-8 in a `string` column (Arrow does not check on write).
    pdir = session("shard_non_utf8", manifest())
    good = rows_to_batch("request_events", event_rows(2))
    ids = pa.array([b"job0-turn0", b"job1-\xff\xfe"], pa.binary())
    bad_ids = pa.Array.from_buffers(pa.string(), 2, ids.buffers())
    cols = [bad_ids if f.name == "request_id" else good.column(i) for i, f in enumerate(good.schema)]
    write_raw(pdir / "request_events.00000.arrows", pa.RecordBatch.from_arrays(cols, schema=good.schema))

    # Decode runs of no step (each stands for `steps` step_requests rows: ingest cannot expand it).
    run = {"step": [3], "steps": [0], "request_id": ["job0-turn0"], "tokens": [1], "computed_before": [40],
           "new_blocks": [0]}
    write_shard(session("decode_runs_zero_steps", manifest()), "decode_runs",
                [[tuple(run[f.name][0] for f in schema.arrow_schema("decode_runs"))]])
    # Batch slot runs of no step, likewise (each stands for `steps` batch_slots rows).
    write_shard(session("batch_slot_runs_zero_steps", manifest()), "batch_slot_runs", [[(3, 0, 0, "job0-turn0")]])

    # JSON fields of another type than kvtrace writes (hand-edited, or another tool's files), and job
    # patterns Python's re accepts but DuckDB's RE2, which applies them, does not.
    for name, over in (("manifest_procs_not_a_list", {"procs": "x"}),
                       ("manifest_options_job_pattern_number", {"options": {"job_pattern": 5}}),
                       ("manifest_version_string", {"schema_version": "2"}),
                       ("manifest_version_bool", {"schema_version": True}),
                       ("manifest_job_pattern_lookahead", {"options": {"job_pattern": r"(?P<job>\w+)(?=-t)-t(?P<turn>\d+)"}}),
                       ("manifest_job_pattern_backreference", {"options": {"job_pattern": r"(?P<job>\w)(?P=job)"}}),
                       ("manifest_clock_not_a_dict", {"clock": [1, 2]})):
        write_shard(session(name, manifest(**over)), "steps", [step_rows(3)])
    for name, over in (("proc_pid_text", {"pid": "x"}), ("proc_rank_list", {"rank": [1]}),
                       ("proc_rank_bool", {"rank": True}), ("proc_probes_list", {"probes": ["scheduler"]}),
                       ("proc_rows_written_text", {"rows_written": "many"})):
        write_shard(session(name, manifest(), over), "steps", [step_rows(3)])

    # Packed KV access records (each row a ring drain, 32 bytes a record): bytes that are not the
    # records they claim, and a clock mapping no clock has (ingest would make up timestamps).
    for name, count, nbytes, slope, copies in (("kv_records_wrong_size", 2, 40, 1.0, []),
                                               ("kv_records_bad_clock", 1, 32, 1e300, []),
                                               ("kv_records_bad_copies", 1, 32, 1.0, [1, 0, 2])):
        write_shard(session(name, manifest()), "kv_access_records",
                    [[(0, 0, slope, count, bytes(range(nbytes)), copies)]])
    # The same records as the drains write them (frame files): a closed one cut inside its last frame,
    # another file under a frame file's name, a frame whose clock no clock has, a frame file of a table
    # that is never written as frames.
    import numpy as np

    from kvtrace.format.kv_frames import FrameWriter
    from kvtrace.format.kv_records import REC_DTYPE

    for name, clock in (("kv_frames_cut", (0, 0, 1.0)), ("kv_frames_not_frames", (0, 0, 1.0)),
                        ("kv_frames_bad_clock", (0, 0, 1e300)), ("kv_frames_of_steps", (0, 0, 1.0))):
        pdir = session(name, manifest())
        w = FrameWriter(pdir, 1 << 30, 1e9)
        w.write_frame(np.zeros(3, REC_DTYPE), clock)
        w.write_frame(np.zeros(2, REC_DTYPE), clock)
        w.close()
        path = pdir / "kv_access_records.00000.kvframes"
        if name == "kv_frames_cut":
            path.write_bytes(path.read_bytes()[:-20])
        elif name == "kv_frames_not_frames":
            path.write_bytes(b"PAR1" + bytes(60))
        elif name == "kv_frames_of_steps":
            path.rename(pdir / "steps.00000.kvframes")

    # Directories where files are expected (a `.keep` inside, as git keeps no empty directories).
    pdir = session("shard_is_directory", manifest())
    (pdir / "steps.00000.arrows").mkdir()
    (pdir / "steps.00000.arrows" / ".keep").write_text("")
    root = session("manifest_is_directory").parent.parent
    (root / "manifest.json").mkdir()
    (root / "manifest.json" / ".keep").write_text("")
    write_shard(session("shard_unknown_table", manifest()), "steps", [step_rows(2)]).rename(
        BAD / "shard_unknown_table" / "procs" / "host-4242" / "gpu_bubbles.00000.arrows")

    # Accepted: killed mid-batch (an open shard whose last batch is cut), and killed before the header.
    pdir = session("killed_mid_batch", manifest(status="incomplete", exit_code=-9), {"status": "running"})
    write_shard(pdir, "steps", [step_rows(3)])  # a closed shard from before the kill
    p = write_shard(pdir, "steps", [step_rows(4, 4), step_rows(4, 8)], close=False)
    p.write_bytes(p.read_bytes()[:-100])
    pdir = session("killed_before_header", manifest(status="incomplete", exit_code=-9), {"status": "running"})
    write_shard(pdir, "steps", [step_rows(2)])
    (pdir / "request_events.00000.arrows.partial").write_bytes(b"")
    pdir = session("proc_json_cut", manifest())
    write_shard(pdir, "steps", [step_rows(2)])
    (pdir / "proc.json").write_text('{"schema_version": 1, "role": "eng')


def write_raw(path: Path, batch) -> None:
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, batch.schema) as w:
        w.write_batch(batch)


def _message_ends(data: bytes) -> list[int]:
    """Byte offsets where each IPC message of a stream ends (schema first, then each batch)."""
    import pyarrow as pa

    reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(data))
    ends, pos = [], 0
    while True:
        try:
            msg = reader.read_next_message()
        except StopIteration:
            return ends
        pos += len(msg.serialize().to_pybytes())
        ends.append(pos)


# ---- SQLite / DuckDB ---------------------------------------------------------------------------------
KEEP_TABLES = ("StringIds", "TARGET_INFO_SESSION_START_TIME", "META_DATA_EXPORT", "NVTX_EVENTS",
               "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY",
               "CUPTI_ACTIVITY_KIND_MEMSET", "ThreadNames", "ENUM_CUDA_MEM_KIND")
ROWS_PER_TABLE = 6


def cut_down_export(dst: Path, drop: tuple[str, ...] = (), rows: int = ROWS_PER_TABLE) -> None:
    """A small copy of a real nsys export: nsys's CREATE statements, the first `rows` rows of each table
    kvtrace reads (all of StringIds and the metadata), 512-byte pages."""
    src = sqlite3.connect(f"file:{NSYS_BASE}?mode=ro", uri=True)
    out = sqlite3.connect(dst)
    out.execute("PRAGMA page_size = 512")
    for name, sql in src.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"):
        if name not in KEEP_TABLES or name in drop:
            continue
        out.execute(sql)
        limit = "" if name in ("StringIds", "META_DATA_EXPORT", "TARGET_INFO_SESSION_START_TIME",
                               "ENUM_CUDA_MEM_KIND") else f" LIMIT {rows}"
        found = src.execute(f'SELECT * FROM "{name}" ORDER BY rowid{limit}').fetchall()
        if found:
            out.executemany(f'INSERT INTO "{name}" VALUES ({",".join("?" * len(found[0]))})', found)
    out.commit()
    out.execute("VACUUM")
    out.close()
    src.close()


def make_sqlite() -> None:
    rnd = random.Random(11)
    (BAD / "random_bytes.sqlite").write_bytes(rnd.randbytes(4096))
    (BAD / "empty.sqlite").write_bytes(b"")
    con = sqlite3.connect(BAD / "not_nsys.sqlite")
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO users VALUES (1, 'ada')")
    con.commit()
    con.close()
    if not NSYS_BASE.exists():
        print(f"skipping the nsys inputs: {NSYS_BASE} not found", file=sys.stderr)
        return
    cut_down_export(BAD / "nsys_small.sqlite")
    # An export of nsys's kind, but with none of the tables kvtrace loads.
    cut_down_export(BAD / "nsys_missing_tables.sqlite",
                    drop=tuple(t for t in KEEP_TABLES if t not in ("StringIds", "TARGET_INFO_SESSION_START_TIME",
                                                                   "META_DATA_EXPORT")))
    # NVTX_EVENTS without its `start` column.
    path = BAD / "nsys_missing_column.sqlite"
    cut_down_export(path)
    con = sqlite3.connect(path)
    con.execute("ALTER TABLE NVTX_EVENTS DROP COLUMN start")
    con.commit()
    con.execute("VACUUM")
    con.close()
    data = (BAD / "nsys_small.sqlite").read_bytes()
    (BAD / "nsys_truncated.sqlite").write_bytes(data[: len(data) // 2])
    # Same size as the header says, but one page of a table overwritten with noise.
    corrupt = bytearray(data)
    page = 512
    pages = len(data) // page
    for i in range(pages // 2, pages // 2 + 3):
        corrupt[i * page: (i + 1) * page] = rnd.randbytes(page)
    (BAD / "nsys_corrupt_page.sqlite").write_bytes(bytes(corrupt))
    # A non-UTF-8 byte in a CREATE TABLE statement: SQLite's own error message then holds that byte.
    (BAD / "nsys_non_utf8_schema.sqlite").write_bytes(
        data.replace(b"CREATE TABLE NVTX_EVENTS (", b"CREATE TABLE NVTX_EVENTS \x80", 1))
    # Timestamps at the ends of int64 (nsys writes ns since its session start): the clock arithmetic
    # would overflow.
    for name, value in (("nsys_time_near_int64_min.sqlite", -(2**63) + 1000),
                        ("nsys_time_near_int64_max.sqlite", 2**63 - 1000)):
        path = BAD / name
        shutil.copyfile(BAD / "nsys_small.sqlite", path)
        con = sqlite3.connect(path)
        for table in ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL", "NVTX_EVENTS"):
            con.execute(f"UPDATE {table} SET start = ? WHERE rowid IN (SELECT rowid FROM {table} LIMIT 3)", [value])
        con.commit()
        con.close()
    # Non-UTF-8 bytes and NULs in names (seen in real exports): must load, with U+FFFD in their place.
    path = BAD / "nsys_non_utf8.sqlite"
    shutil.copyfile(BAD / "nsys_small.sqlite", path)
    con = sqlite3.connect(path)
    ids = [r[0] for r in con.execute("SELECT nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME UNION "
                                     "SELECT shortName FROM CUPTI_ACTIVITY_KIND_KERNEL")]
    for i in ids:
        con.execute("UPDATE StringIds SET value = CAST(? AS TEXT) WHERE id = ?", [b"kern\xff\xfe\x00el", i])
    con.commit()
    con.close()


def make_duckdb() -> None:
    (BAD / "random_bytes.db").write_bytes(random.Random(13).randbytes(8192))


def make_other_tool_duckdb(path: Path) -> Path:
    """A DuckDB database another program wrote (half a megabyte of mostly zeros: made by the tests, not
    checked in; `*.duckdb` is git-ignored anyway)."""
    import duckdb

    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE users (id INTEGER, name VARCHAR)")
    con.execute("INSERT INTO users VALUES (1, 'ada')")
    con.close()
    return path


def main(out: Path | None = None) -> Path:
    """Write the corpus to `out` (default tests/data/bad/, replaced); returns the directory."""
    global BAD
    BAD = Path(out) if out is not None else HERE / "bad"
    if BAD.exists():
        shutil.rmtree(BAD)
    BAD.mkdir(parents=True)
    make_sessions()
    make_sqlite()
    make_duckdb()
    total = sum(p.stat().st_size for p in BAD.rglob("*") if p.is_file())
    print(f"wrote {sum(1 for p in BAD.rglob('*') if p.is_file())} files, {total:,} bytes under {BAD}")
    return BAD


if __name__ == "__main__":
    main()
