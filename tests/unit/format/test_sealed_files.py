"""The file life that shards and KV record frame files share (format/sealed_files.py), on the shard writer:
a piece cut by disk trouble is cut back and the next lands whole after the last whole one; a file whose
header did not fit is not left for pieces to follow. (tests/unit/format/test_kv_frames.py has the same on
the frame writer.)"""

from __future__ import annotations

import os

import pytest

from kvtrace.format.shards import ShardRead, ShardWriter, list_shards, read_shard, rows_to_batch


def anchors(n: int, first: int) -> list[tuple]:
    return [(first + i, 2 * (first + i), None, "host") for i in range(n)]


def read_back(folder) -> list[int]:
    """The clock_anchors rows' monotonic stamps of every shard in `folder`, in order."""
    out = []
    for shard in list_shards(folder, "complete"):
        for batch in read_shard(shard, ShardRead()):
            out += batch.column(0).to_pylist()
    return out


def no_room(fd, views):
    raise OSError(28, "No space left on device")


def cut_after(n_bytes: int):
    """An os.writev that writes the first `n_bytes` of a piece, then finds the disk full."""
    real = os.writev

    def half_then_full(fd, views):
        real(fd, [bytes(memoryview(views[0])[:n_bytes])])
        return no_room(fd, views)

    return half_then_full


def test_a_failed_batch_is_cut_back_and_the_next_lands_whole(tmp_path, monkeypatch):
    w = ShardWriter(tmp_path, "clock_anchors", 1 << 30, 1e9)
    w.write(rows_to_batch("clock_anchors", anchors(3, 0)))
    real = os.writev
    monkeypatch.setattr(os, "writev", cut_after(7))
    with pytest.raises(OSError):
        w.write(rows_to_batch("clock_anchors", anchors(4, 10)))
    monkeypatch.setattr(os, "writev", real)
    w.write(rows_to_batch("clock_anchors", anchors(2, 20)))
    w.close()
    assert read_back(tmp_path) == [0, 1, 2, 20, 21]
    assert w.closed_shards == [(tmp_path / "clock_anchors.00000.arrows", 5)]


def test_a_shard_whose_header_did_not_fit_is_not_left_for_batches(tmp_path, monkeypatch):
    w = ShardWriter(tmp_path, "clock_anchors", 1 << 30, 1e9)
    real = os.writev
    monkeypatch.setattr(os, "writev", no_room)
    with pytest.raises(OSError):
        w.write(rows_to_batch("clock_anchors", anchors(3, 0)))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(os, "writev", real)
    w.write(rows_to_batch("clock_anchors", anchors(2, 5)))
    w.close()
    assert read_back(tmp_path) == [5, 6]
