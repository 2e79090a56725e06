"""Property tests: mutated shards and mutated Nsight exports never crash ingest.

Whatever the bytes, reading a shard or loading an export ends in data or in a `KvtraceError` (one line
in the CLI): never another exception, never a crash of the process. Thousands of cases, small inputs,
well under a minute together. See docs/reliability.md.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrace.errors import KvtraceError
from kvtrace.format.shards import Shard, ShardRead, ShardWriter, pad_batch, read_shard, rows_to_batch


def fuzz(examples: int) -> settings:
    """Fixed seed (same cases every run, so a failure reproduces), no deadline, no example database."""
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                    derandomize=True, database=None)


def _rows(table: str, n: int, k: int) -> list[tuple]:
    """n rows of `table` with strings, lists and nulls (k varies them between batches)."""
    if table == "steps":
        return [(k * 100 + i, i, i + 1, None if i % 3 == 0 else i + 2, 64, 32, 32, 1, 1, 2, 0, 10, 40, 256, 8,
                 "kv-insuf" if i % 2 else "none", 0, 1, 0, 0, 32, 0) for i in range(n)]
    if table == "request_events":
        return [(i, k, f"job{k}-turn{i}-ü", "finished", i * 7, None if i % 2 else "length") for i in range(n)]
    if table == "block_events":
        return [(i, k, "cache", 0, f"r{i}", list(range(i % 5)), [(-1) ** j * j << 40 for j in range(i % 5)] or None)
                for i in range(n)]
    return [(i, k, f"r{i}", 128, 64, 2, 4, 0, [i, -i, 1 << 62], None if i % 2 else 32, i % 2) for i in range(n)]


TABLES = ("steps", "request_events", "block_events", "prefix_lookups")


@pytest.fixture(scope="module")
def shard_bytes(tmp_path_factory) -> dict[str, bytes]:
    """One closed shard per table, three batches each, written by kvtrace's own writer."""
    out = {}
    d = tmp_path_factory.mktemp("shards")
    for t in TABLES:
        w = ShardWriter(d, t, 1 << 30, 1e9)
        for k in range(3):
            w.write(rows_to_batch(t, _rows(t, 3 + k, k)))
        w.close()
        out[t] = w.closed_shards[0][0].read_bytes()
    return out


@st.composite
def mutations(draw, size: int) -> list[tuple]:
    """1-3 edits of a byte string of length `size`: truncate, flip a bit, overwrite, insert, delete, repeat."""
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "insert", "delete", "repeat"]))
        pos = draw(st.integers(0, max(size - 1, 0)))
        if kind == "flip":
            ops.append((kind, pos, draw(st.integers(0, 7))))
        elif kind in ("overwrite", "insert"):
            ops.append((kind, pos, draw(st.sampled_from([b"\x00", b"\xff" * 4, b"\xff\xff\xff\xff\x00\x00\x00\x00"])
                                        | st.binary(min_size=1, max_size=16))))
        else:
            ops.append((kind, pos, draw(st.integers(1, 256))))
    return ops


def mutate(data: bytes, ops: list[tuple]) -> bytes:
    b = bytearray(data)
    for kind, pos, arg in ops:
        pos = min(pos, len(b))
        if kind == "truncate":
            del b[pos:]
        elif kind == "flip" and pos < len(b):
            b[pos] ^= 1 << arg
        elif kind == "overwrite":
            b[pos:pos + len(arg)] = arg
        elif kind == "insert":
            b[pos:pos] = arg
        elif kind == "delete":
            del b[pos:pos + arg]
        elif kind == "repeat":
            b[pos:pos] = b[pos:pos + arg]
    return bytes(b)


def read_all(path: Path, table: str, is_open: bool, con: duckdb.DuckDBPyConnection | None = None) -> ShardRead:
    """Read a shard to its end, as ingest does; every batch also goes through DuckDB when `con` is given."""
    res = ShardRead()
    for batch in read_shard(Shard(path, table, is_open), res):
        padded = pad_batch(batch, table)
        if con is not None:
            con.from_arrow(padded).aggregate("count(*)").fetchall()  # DuckDB scans every value
    return res


def fuzz_reads(path: Path, data: bytes, is_open: bool, read) -> dict[str, int]:
    """300 mutations of `data` written to `path`, each read by `read(path)` (-> ShardRead): data or a
    one-line KvtraceError naming the file, a cut only in an open file and always reported. The outcomes."""
    outcomes = {"read": 0, "error": 0, "cut": 0}

    @fuzz(300)
    @given(ops=mutations(len(data)))
    def check(ops):
        path.write_bytes(mutate(data, ops))
        try:
            res = read(path)
        except KvtraceError as exc:
            assert "\n" not in str(exc) and str(path) in str(exc)
            outcomes["error"] += 1
            return
        outcomes["read"] += 1
        outcomes["cut"] += bool(res.bytes_cut)
        if res.bytes_cut:
            assert is_open and res.problems  # a cut is reported, and only an open file may have one

    check()
    assert outcomes["error"] + outcomes["read"] >= 300
    if not is_open:
        assert outcomes["cut"] == 0
    return outcomes


@pytest.mark.parametrize("is_open", [False, True], ids=["closed", "open"])
@pytest.mark.parametrize("table", TABLES)
def test_mutated_shard_reads_or_fails_cleanly(shard_bytes, table, is_open, tmp_path):
    path = tmp_path / (f"{table}.00000.arrows" + (".partial" if is_open else ""))
    con = duckdb.connect()
    fuzz_reads(path, shard_bytes[table], is_open, lambda p: read_all(p, table, is_open, con))
    con.close()


def test_truncated_open_shard_never_fails(shard_bytes, tmp_path):
    """An open shard cut at any byte (a kill) reads its whole batches and reports the rest as cut."""
    data = shard_bytes["block_events"]
    path = tmp_path / "block_events.00000.arrows.partial"
    whole = [0]
    for cut in range(0, len(data) + 1, 2):  # every other byte: ~1,500 cases
        path.write_bytes(data[:cut])
        res = read_all(path, "block_events", True)
        assert res.bytes_cut == 0 or res.problems
        assert res.rows >= whole[-1]
        whole.append(res.rows)
    path.write_bytes(data)
    assert read_all(path, "block_events", True).rows == 3 + 4 + 5


@pytest.fixture(scope="module")
def frame_bytes(tmp_path_factory) -> bytes:
    """A closed KV record frame file of three drains (a device clock fit, layer copies), written by
    kvtrace's own writer."""
    import numpy as np

    from kvtrace.format.kv_frames import FrameWriter
    from kvtrace.format.kv_records import REC_DTYPE

    d = tmp_path_factory.mktemp("frames")
    w = FrameWriter(d, 1 << 30, 1e9)
    for k, (n, clock, copies) in enumerate([(5, (10**12, 10**15, 1.00001), ()), (3, (0, 0, 1.0), (2, 0, 3, 1)),
                                            (4, (7, 9, 0.99), (1, 0))]):
        recs = np.zeros(n, REC_DTYPE)
        recs["step"], recs["ts"] = np.arange(n) + k, np.arange(n, dtype=np.uint64) * 1000 + 10**12
        recs["block_id"], recs["meta"] = np.arange(n) * 7, np.arange(n, dtype=np.uint32) % 2
        w.write_frame(recs, clock, copies)
    w.close()
    return w.closed_shards[0][0].read_bytes()


def read_frames_to_rows(path: Path, is_open: bool) -> tuple[ShardRead, int]:
    """A frame file read as ingest reads it: its batches expanded into kv_access rows."""
    from kvtrace.format.shards import loaded_batches

    res, rows = ShardRead(), 0
    for batch in read_shard(Shard(path, "kv_access_records", is_open), res):
        rows += sum(b.num_rows for b in loaded_batches("kv_access_records", batch, path))
    return res, rows


@pytest.mark.parametrize("is_open", [False, True], ids=["closed", "open"])
def test_mutated_frame_file_reads_or_fails_cleanly(frame_bytes, is_open, tmp_path):
    path = tmp_path / ("kv_access_records.00000.kvframes" + (".partial" if is_open else ""))
    outcomes = fuzz_reads(path, frame_bytes, is_open, lambda p: read_frames_to_rows(p, is_open)[0])
    assert outcomes["error"] and outcomes["read"]


def test_an_open_frame_file_cut_at_any_byte_reads_its_whole_frames(frame_bytes, tmp_path):
    """A kill can stop a frame file anywhere: every cut reads the frames before it, never fails."""
    path = tmp_path / "kv_access_records.00000.kvframes.partial"
    seen = [0]
    for cut in range(len(frame_bytes) + 1):
        path.write_bytes(frame_bytes[:cut])
        res, rows = read_frames_to_rows(path, True)
        assert res.rows >= seen[-1] and (res.bytes_cut == 0 or res.problems)
        seen.append(res.rows)
    assert seen[-1] == 5 + 3 + 4


def test_mutated_session_ingests_or_fails_cleanly(shard_bytes, tmp_path):
    """Whole ingests of a session whose shards (closed and open) are mutated together."""
    import json

    from kvtrace.ingest.load import ingest_session

    session = tmp_path / "s"
    proc = session / "procs" / "h-1"
    proc.mkdir(parents=True)
    (session / "manifest.json").write_text(json.dumps({"schema_version": 1, "session_id": "fuzz",
                                                       "status": "complete"}))
    (proc / "proc.json").write_text(json.dumps({"pid": 1, "role": "engine", "status": "complete"}))
    con = duckdb.connect()
    seen = {"ok": 0, "error": 0}

    @fuzz(100)
    @given(st.lists(st.tuples(st.sampled_from(TABLES), st.booleans(), mutations(1500)), min_size=1, max_size=3))
    def check(edits):
        for p in proc.glob("*.arrows*"):
            p.unlink()
        for i, (table, is_open, ops) in enumerate(edits):
            name = f"{table}.{i:05d}.arrows" + (".partial" if is_open else "")
            (proc / name).write_bytes(mutate(shard_bytes[table], ops))
        try:
            report = ingest_session(con, session)
        except KvtraceError as exc:
            assert "\n" not in str(exc)
            seen["error"] += 1
            return
        seen["ok"] += 1
        cut = con.execute("select count(*) from ingest_issues where session = 'fuzz' and file <> ''").fetchone()[0]
        if cut:  # a cut batch is reported in ingest_issues and marks the session incomplete
            assert report["status"] == "incomplete" and report["issues"]

    check()
    con.close()
    assert seen["ok"] and seen["error"]


# ---- Nsight exports -----------------------------------------------------------------------------------
NSYS_SMALL = Path(__file__).resolve().parents[1] / "data" / "bad" / "nsys_small.sqlite"


def _nsys():
    try:
        from kvtrace.ingest import nsys
    except ImportError:
        return None
    return nsys


needs_nsys = pytest.mark.skipif(_nsys() is None or not NSYS_SMALL.exists(),
                                reason="kvtrace.ingest.nsys or tests/data/bad/nsys_small.sqlite missing")


class _Loader:
    """load_nsys on a fresh in-memory database; counts clean outcomes."""

    def __init__(self, path: Path):
        self.path, self.seen = path, {"ok": 0, "error": 0}

    def __call__(self) -> None:
        con = duckdb.connect()
        try:
            _nsys().load_nsys(con, self.path)
            self.seen["ok"] += 1
        except KvtraceError as exc:
            assert "\n" not in str(exc) and self.path.name in str(exc)
            self.seen["error"] += 1
        finally:
            con.close()


@needs_nsys
def test_mutated_nsys_export_bytes_load_or_fail_cleanly(tmp_path):
    """Byte edits of a small real export: SQLite header, pages, schema. (One bug this found is kept as
    a fixed case, nsys_non_utf8_schema.sqlite in tests/data/bad/.)"""
    data = NSYS_SMALL.read_bytes()
    load = _Loader(tmp_path / "fuzz.sqlite")

    @fuzz(100)
    @given(ops=mutations(len(data)))
    def check(ops):
        load.path.write_bytes(mutate(data, ops))
        load()

    check()
    assert load.seen["ok"] and load.seen["error"]


@needs_nsys
def test_edited_nsys_tables_load_or_fail_cleanly(tmp_path):
    """Edits of a small real export's tables: dropped tables and columns, values of the wrong type,
    NULLs, extreme numbers, non-UTF-8 and very long text."""
    load = _Loader(tmp_path / "fuzz.sqlite")
    tables = ["NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME", "StringIds",
              "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET", "TARGET_INFO_SESSION_START_TIME",
              "META_DATA_EXPORT", "ThreadNames", "ENUM_CUDA_MEM_KIND"]
    values = st.sampled_from([None, -1, 0, 1 << 62, -(1 << 63), 2 ** 63 - 1, 1.5e300, float("nan"), "text",
                              "", b"\xff\xfe\x00", "名前", "x" * 3000])

    @fuzz(80)
    @given(edits=st.lists(st.tuples(st.sampled_from(tables), st.sampled_from(["drop_table", "drop_col", "set"]),
                                    st.integers(0, 40), values), min_size=1, max_size=3))
    def check(edits):
        shutil.copyfile(NSYS_SMALL, load.path)
        con = sqlite3.connect(load.path)
        for table, what, n, value in edits:
            cols = [r[1] for r in con.execute(f'PRAGMA table_info("{table}")')]
            if not cols:
                continue
            col = cols[n % len(cols)]
            try:
                if what == "drop_table":
                    con.execute(f'DROP TABLE "{table}"')
                elif what == "drop_col":
                    con.execute(f'ALTER TABLE "{table}" DROP COLUMN "{col}"')
                else:
                    con.execute(f'UPDATE "{table}" SET "{col}" = ? WHERE rowid % 2 = ?', [value, n % 2])
            except sqlite3.DatabaseError:
                pass  # SQLite refused the edit itself (a NOT NULL column, a PRIMARY KEY): try the next
        con.commit()
        con.close()
        load()

    check()
    assert load.seen["ok"] and load.seen["error"]
