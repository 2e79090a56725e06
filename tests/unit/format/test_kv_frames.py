"""Frame files (format/kv_frames.py): a recorder's ring drains written as frames by the drain's thread read
back as the `kv_access_records` batches, and so the kv_access rows, that the same drains make as shard
rows; files cut by a kill read to their last whole frame; anything else that is not what kvtrace writes
is one error naming the file."""

from __future__ import annotations

import os
import threading

import numpy as np
import pyarrow as pa
import pytest

from kvtrace.errors import KvtraceError
from kvtrace.format import schema
from kvtrace.format.kv_frames import END_MAGIC, FILE_HEADER, FRAME_HEADER, FrameWriter
from kvtrace.format.kv_records import BATCH_BYTES, REC_DTYPE, PackedRecords, expand_kv_records, packed_batches
from kvtrace.format.shards import ShardRead, list_shards, read_shard
from kvtrace.record.recorder import Recorder
from tests.unit.format.test_kv_records import records
from tests.unit.format.test_sealed_files import cut_after, no_room

FIT = (1_500_000_000_000, 9_000_000_000_000, 1.0000123)
HOST = (0, 0, 1.0)


def kv_rows(batches) -> dict:
    return pa.Table.from_batches([expand_kv_records(b) for b in batches]).to_pydict()


def read_all(path, status="complete"):
    shards = [s for s in list_shards(path, status) if s.table == "kv_access_records"]
    res = {s.path.name: ShardRead() for s in shards}
    batches = [b for s in shards for b in read_shard(s, res[s.path.name])]
    return shards, batches, res


def written(tmp_path, drains, rotate_bytes=1 << 30, close=True):
    w = FrameWriter(tmp_path, rotate_bytes, 1e9)
    for recs, clock, copies in drains:
        w.write_frame(recs, clock, copies)
    if close:
        w.close()
    return w


def test_frames_read_back_as_the_rows_the_same_drains_make_as_shard_rows(tmp_path):
    """Three drains (a device clock fit, the host clock, layer copies, one larger than a batch): the same
    kv_access rows as the packed shard rows of the same drains, in batches of at most BATCH_BYTES."""
    big = records(BATCH_BYTES // REC_DTYPE.itemsize + 1000, 3)
    drains = [(records(1000, 1), FIT, ()), (records(7, 2), HOST, (5, 1, 6, 1)), (big, FIT, ())]
    w = written(tmp_path, drains)
    assert [p.name for p, _ in w.closed_shards] == ["kv_access_records.00000.kvframes"]
    assert w.closed_shards[0][1] == 1007 + len(big) and w.open_rows == 0
    shards, batches, res = read_all(tmp_path)
    assert [(s.table, s.open) for s in shards] == [("kv_access_records", False)]
    assert all(b.schema.equals(schema.arrow_schema("kv_access_records"), check_metadata=False) for b in batches)
    assert max(b.column("records_count")[0].as_py() for b in batches) * REC_DTYPE.itemsize <= BATCH_BYTES
    assert len(batches) == 4  # the large drain as two
    want = kv_rows(b for r, c, k in drains for b in packed_batches(
        [PackedRecords(r, c, k, len(r))], schema.arrow_schema("kv_access_records")))
    assert kv_rows(batches) == want
    only = res[shards[0].path.name]
    assert only.rows == 1007 + len(big) and not only.problems and not only.bytes_cut
    assert os.path.getsize(w.closed_shards[0][0]) == w.bytes_total


def test_files_rotate_by_size_and_each_is_closed(tmp_path):
    w = written(tmp_path, [(records(100, i), HOST, ()) for i in range(5)], rotate_bytes=2 * 100 * 32)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"kv_access_records.{i:05d}.kvframes" for i in range(3)]
    assert [rows for _, rows in w.closed_shards] == [200, 200, 100]
    assert len(kv_rows(read_all(tmp_path)[1])["step"]) == 500


def test_a_killed_writers_open_file_reads_to_its_last_whole_frame(tmp_path):
    """A `.partial` file cut inside its last frame: the whole frames read, the cut reported with its bytes;
    one not cut but never closed: reported as not closed, unless its process said it had flushed."""
    written(tmp_path, [(records(50, 1), HOST, ()), (records(60, 2), HOST, ())], close=False)
    (path,) = tmp_path.iterdir()
    assert path.name.endswith(".kvframes.partial")
    _, batches, res = read_all(tmp_path, "running")
    assert len(kv_rows(batches)["step"]) == 110
    assert any("not closed" in p for p in res[path.name].problems)
    assert not read_all(tmp_path, "flushed")[2][path.name].problems
    path.write_bytes(path.read_bytes()[:-100])
    _, batches, res = read_all(tmp_path, "flushed")
    assert len(kv_rows(batches)["step"]) == 50
    assert res[path.name].bytes_cut == 60 * 32 + FRAME_HEADER.size - 100
    assert any("last frame cut" in p for p in res[path.name].problems)
    for size in (0, 5):  # killed before or while its header was written
        path.write_bytes(path.read_bytes()[:size])
        problems = read_all(tmp_path, "running")[2][path.name].problems
        assert problems and ("empty" in problems[0] or "header cut" in problems[0])


def damaged(data: bytes) -> list[tuple[str, bytes, str]]:
    """(what, the closed file's bytes, words of the error) for each damage."""
    first = FILE_HEADER.size
    head = bytearray(data)
    return [
        ("cut inside a frame", data[:-100], "runs past the end of the file"),
        ("no end marker", data[:-len(END_MAGIC)], "no end marker"),
        ("bytes after the end marker", data + b"xx", "unexpected bytes after the end marker"),
        ("not a frame file", b"PAR1" + data[4:], "not a kvtrace frame file"),
        ("another version", data[:8] + (9).to_bytes(4, "little") + data[12:], "version 9"),
        ("a frame's magic", data[:first] + b"XXXX" + data[first + 4:], "where a frame starts"),
        ("odd copies", bytes(head[:first + 4]) + (3).to_bytes(4, "little") + data[first + 8:], "copy ints"),
        ("a count past the file", data[:first + 32] + (1 << 60).to_bytes(8, "little") + data[first + 40:],
         "past the end of the file"),
        ("empty", b"", "empty frame file"),
        ("a header cut", data[:5], "not a kvtrace frame file"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_a_damaged_closed_file_is_one_error_naming_it(tmp_path, case):
    written(tmp_path, [(records(40, 1), HOST, (2, 0)), (records(30, 2), FIT, ())])
    (path,) = tmp_path.iterdir()
    what, data, words = damaged(path.read_bytes())[case]
    path.write_bytes(data)
    with pytest.raises(KvtraceError) as err:
        read_all(tmp_path)
    assert str(path) in str(err.value) and words in str(err.value), (what, str(err.value))
    assert "\n" not in str(err.value)


def test_a_frame_file_of_another_table_is_refused(tmp_path):
    (tmp_path / "steps.00000.kvframes").write_bytes(b"")
    with pytest.raises(KvtraceError, match="only kv_access_records"):
        list_shards(tmp_path, "complete")


def test_a_failed_write_is_cut_back_and_the_next_frame_lands_whole(tmp_path, monkeypatch):
    """Disk trouble halfway through a frame: the partial frame is cut off, the error raised; the next
    frame (room again) follows the last whole one."""
    w = FrameWriter(tmp_path, 1 << 30, 1e9)
    w.write_frame(records(10, 1), HOST)
    real = os.writev
    monkeypatch.setattr(os, "writev", cut_after(7))
    with pytest.raises(OSError):
        w.write_frame(records(20, 2), HOST)
    monkeypatch.setattr(os, "writev", real)
    w.write_frame(records(30, 3), HOST)
    w.close()
    assert len(kv_rows(read_all(tmp_path)[1])["step"]) == 40


def test_a_file_whose_header_did_not_fit_is_not_left_for_frames(tmp_path, monkeypatch):
    w = FrameWriter(tmp_path, 1 << 30, 1e9)
    real = os.writev
    monkeypatch.setattr(os, "writev", no_room)
    with pytest.raises(OSError):
        w.write_frame(records(10, 1), HOST)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "writev", real)
    w.write_frame(records(10, 2), HOST)
    w.close()
    assert kv_rows(read_all(tmp_path)[1])["step"] == records(10, 2)["step"].tolist()


def test_the_recorder_writes_each_drain_at_once_from_any_memory(tmp_path):
    """Recorder.append_kv_records: a frame written before it returns (the caller's memory may be reused
    at once), counted as a drain in proc.json's rows_written; from several threads, whole frames; after
    writing stopped, the records are counted as lost; at close the file is sealed."""
    rec = Recorder(tmp_path, "worker", {"flush_interval_s": 1e9})
    staging = records(100, 1)
    rec.append_kv_records(staging, HOST)
    staging[:] = records(100, 2)  # reused by the ring: what was written stays
    threads = [threading.Thread(target=lambda i=i: [rec.append_kv_records(records(50, i), FIT) for _ in range(20)])
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rec.rows_written["kv_access_records"] == 81
    rec._stop_writing("max-size", "test")
    rec.append_kv_records(records(70, 3), HOST)
    assert rec.dropped["kv_access"] == {"max-size": 70}
    rec.close()
    proc_dir = rec.dir
    files = [p.name for p in proc_dir.iterdir() if "kv_access_records" in p.name]
    assert files == ["kv_access_records.00000.kvframes"]
    rows = kv_rows(read_all(proc_dir)[1])
    first = records(100, 1)
    assert rows["step"][:100] == first["step"].tolist()
    assert len(rows["step"]) == 100 + 80 * 50


@pytest.mark.parametrize("policy", ["drop-oldest", "stop"])
def test_the_size_cap_counts_frames_and_their_losses(tmp_path, policy):
    """--max-size: frame files count towards the session's size like shards. drop-oldest deletes the
    oldest closed ones, their records counted as lost kv_access rows; stop stops writing them, the rest
    counted as lost. Either way records written + lost = records drained, and what is left ingests."""
    cap = 200 << 10
    rec = Recorder(tmp_path, "worker", {"flush_interval_s": 1e9, "rotate_bytes": 32 << 10,
                                        "max_size_bytes": cap, "max_size_policy": policy})
    drained = 0
    for i in range(60):
        recs = records(250, i)  # 8 KB a drain
        rec.append_kv_records(recs, HOST)
        drained += len(recs)
        if i % 4 == 3:
            rec.flush()
    rec.close()
    lost = rec.dropped["kv_access"]["max-size"]
    left = kv_rows(read_all(rec.dir)[1])
    assert 0 < lost < drained and len(left["step"]) + lost == drained
    if policy == "drop-oldest":
        newest = np.concatenate([records(250, i) for i in range(60)])["step"][-len(left["step"]):]
        assert left["step"] == newest.tolist()  # the newest, without a gap
    assert sum(p.stat().st_size for p in rec.dir.iterdir()) <= cap + (64 << 10)
