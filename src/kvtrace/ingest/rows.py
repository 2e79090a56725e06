"""The bulk path of an ingest: shard batches gathered into chunks, keyed, unnested and inserted.

Shard batches (a recorder flush each, often a few hundred rows) are gathered into one INSERT of up to
`INSERT_ROWS` rows / `INSERT_BYTES` bytes, because DuckDB's cost per statement (~5 ms: planning,
registering the Arrow data) would otherwise dwarf the rows. The main thread reads and prepares chunks
while one helper thread (`Inserter`) stores them, in order, through the session's one connection.
Memory is bounded by the chunks queued there (`QUEUE_ROWS`), a worker's batch slots kept for its device
accesses (`SlotIndex.MAX_ROWS`) and DuckDB's own buffers, never by the session's size.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.store import compression
from kvtrace.store.keyed import create_keyed_views, give_label_codes, insert_labels
from kvtrace.store.tables import (
    KEYED_TABLES,
    LABEL_COLUMNS,
    NULL_REQUEST_KEY,
    REQUEST_KEYED,
    STORE,
    UNNESTED,
    has_seq,
    sql_str,
    table_ddl,
)

# Shard rows gathered into one INSERT (block_events rows unnest to ~10 database rows each).
INSERT_ROWS = 1_000_000

INSERT_BYTES = 192 << 20


ROW_GROUP = compression.ROW_GROUP


class SessionKeys:
    """Turns one session's request ids and labels into the keys the store holds, in bulk (Arrow
    compute, no Python per row), remembering the keys it gave; the new ones are inserted with the
    chunk that first uses them (`take_new`)."""

    def __init__(self, con: duckdb.DuckDBPyConnection, sid: str):
        self.sid = sid
        # The session's keys were deleted with its rows: its requests get keys after every other's.
        self.first_key = con.execute(f"SELECT coalesce(max(request_key), 0) + 1 FROM {STORE}.request_keys"
                                     ).fetchall()[0][0]
        self.request_ids: dict[str, None] = {}  # in key order: key = first_key + position
        self.known_ids = pa.array([], pa.string())
        self.new_ids: list[str] = []
        self.labels = dict(con.execute(f"SELECT text, label FROM {STORE}.labels").fetchall())
        self.known_labels = self._label_array()
        self.new_labels: list[tuple[int, str]] = []

    def _label_array(self) -> pa.Array:
        return pa.array([t for t, _ in sorted(self.labels.items(), key=lambda kv: kv[1])], pa.string())

    def encode(self, table: str, data: pa.Table) -> pa.Table:
        """`data` (shard columns) with the columns the store keeps as keys replaced by those keys."""
        if table in REQUEST_KEYED and "request_id" in data.column_names:
            i = data.column_names.index("request_id")
            data = data.set_column(i, "request_key", self._request_keys(data.column(i)))
        for name in LABEL_COLUMNS.get(table, ()):
            if name in data.column_names:
                i = data.column_names.index(name)
                data = data.set_column(i, name, self._label_codes(table, name, data.column(i)))
        return data

    def _request_keys(self, ids: pa.ChunkedArray) -> pa.ChunkedArray:
        pos = pc.index_in(ids, value_set=self.known_ids)
        if pos.null_count > ids.null_count:  # ids this session has not given a key yet
            for rid in pc.unique(ids).to_pylist():
                if rid is not None and rid not in self.request_ids:
                    self.request_ids[rid] = None
                    self.new_ids.append(rid)
            self.known_ids = pa.array(list(self.request_ids), pa.string())
            pos = pc.index_in(ids, value_set=self.known_ids)
        return pc.fill_null(pc.add(pos, pa.scalar(self.first_key, pa.int32())), NULL_REQUEST_KEY)

    def _label_codes(self, table: str, name: str, texts: pa.ChunkedArray) -> pa.ChunkedArray:
        pos = pc.index_in(texts, value_set=self.known_labels)
        if pos.null_count > texts.null_count:
            self.new_labels += give_label_codes(self.labels, pc.unique(texts).to_pylist())
            self.known_labels = self._label_array()
            pos = pc.index_in(texts, value_set=self.known_labels)
        return pc.cast(pc.add(pos, pa.scalar(1, pa.int32())), pa.uint8())

    def take_new(self) -> tuple[list[str], list[tuple[int, str]], int]:
        """The request ids and labels given keys since the last call, and the first new request key."""
        first = self.first_key + len(self.request_ids) - len(self.new_ids)
        ids, labels = self.new_ids, self.new_labels
        self.new_ids, self.new_labels = [], []
        return ids, labels, first


class Inserter:
    """Runs a session's INSERTs in order, in one helper thread, while the caller reads the next chunks.

    DuckDB lets go of the GIL while it inserts, so reading shards (main thread) and storing them
    (DuckDB's threads) overlap. The caller runs ahead across tables and processes until `QUEUE_ROWS`
    rows wait besides the chunk being inserted, so DuckDB is not left idle while the first chunk of the
    next table is read (with one chunk in flight and a wait before the next, as before, it was idle a
    quarter of the time); memory stays bounded by about two chunks. Counted in rows, not chunks, so
    the few-row chunks of small tables never hold the reader up. One transaction, hence one connection:
    it is the helper's until `wait()` returns; `wait()` and `submit()` re-raise an INSERT's error, after
    which the remaining work is skipped.
    """

    QUEUE_ROWS = 2 * INSERT_ROWS

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.con = con
        self.work: collections.deque = collections.deque()  # (rows, fn, args); None stops the helper
        self.queued_rows = 0
        self.busy = False
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.cancelled = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="kvtrace-insert")
        self.thread.start()

    def submit(self, rows: int, fn: Any, *args: Any) -> None:
        """Queue `fn(con, *args)`, which stores `rows` rows; blocks while too many rows wait."""
        with self.cond:
            while self.work and self.queued_rows + rows > self.QUEUE_ROWS and self.error is None:
                self.cond.wait()
            self._raise()
            self.work.append((rows, fn, args))
            self.queued_rows += rows
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.work:
                    self.cond.wait()
                item = self.work.popleft()
                if item is None:
                    return
                rows, fn, args = item
                self.queued_rows -= rows
                self.busy = True
                skip = self.error is not None or self.cancelled
                self.cond.notify_all()
            try:
                if not skip:
                    fn(self.con, *args)
            except BaseException as exc:  # handed to the caller by wait() / submit()
                with self.cond:
                    self.error = exc
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def wait(self) -> None:
        """Until everything queued is done; re-raises its error."""
        with self.cond:
            while (self.work or self.busy) and self.error is None:
                self.cond.wait()
            self._raise()

    def close(self, cancel: bool = False) -> None:
        """Stop the helper after the queued work (skipped with `cancel`); the connection is the caller's
        again when this returns."""
        with self.cond:
            self.cancelled = self.cancelled or cancel
            self.work.append(None)
            self.cond.notify_all()
        self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            self.cancelled = True
            raise error


class SlotIndex:
    """One process's batch slots (step, slot, request key) in memory, for the request ids of its device
    access rows, which name only the step and the slot.

    batch_slots is read before kv_access (`_load_shards`), so the index is complete when the first
    access row arrives. Without it each kv_access chunk read its batch slots back from DuckDB (~0.3 s of
    a 10 M-event ingest). Bounded: past `MAX_ROWS` rows (16 bytes each) it is dropped and the access rows
    are matched against the database instead (`_access_request_keys`)."""

    MAX_ROWS = 16_000_000

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.rows = 0
        self.overflow = False

    def add(self, data: pa.Table) -> None:
        """Remember a chunk of encoded batch_slots rows (columns step, slot, request_key)."""
        if self.overflow:
            return
        self.rows += data.num_rows
        if self.rows > self.MAX_ROWS:
            self.overflow, self.parts = True, []
            return
        self.parts.append(_slot_columns(data))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(steps, slots, keys), sorted by (step, slot); None when the index overflowed."""
        if self.overflow:
            return None
        if not self.parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32)
        if len(self.parts) > 1:
            self.parts = [_sorted_slots(*(np.concatenate(c) for c in zip(*self.parts)))]
        return self.parts[0]


def _slot_columns(data: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps int64, slots int32, request keys int32) of batch_slots rows that have a slot, sorted."""
    slot = data.column("slot")
    if slot.null_count:  # rows without a slot never match an access row
        data = data.filter(pc.is_valid(slot))
    return _sorted_slots(pc.cast(data.column("step"), pa.int64()).to_numpy(),
                         pc.cast(data.column("slot"), pa.int32()).to_numpy(),
                         pc.cast(pc.fill_null(data.column("request_key"), NULL_REQUEST_KEY), pa.int32()).to_numpy())


def _sorted_slots(steps: np.ndarray, slots: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                                   np.ndarray]:
    """The batch slots in (step, slot) order (as recorded, usually: then nothing is copied)."""
    pairs = _step_slot(steps, slots)
    if not (pairs[1:] >= pairs[:-1]).all():
        order = np.argsort(pairs, kind="stable")
        steps, slots, keys = steps[order], slots[order], keys[order]
    return steps, slots, keys


class Gather:
    """Gathers one process's batches of one table into big INSERTs (see the module docstring), and
    hands them to the session's `Inserter`."""

    def __init__(self, inserter: Inserter, consts: tuple, keys: SessionKeys, undecided: set[str]):
        self.inserter, self.consts, self.keys = inserter, consts, keys
        self.undecided = undecided  # the session's keyed tables whose compression is not chosen yet
        self.seq = 0  # block_events' next `seq` (this process's calls, in recording order)
        self.slots = SlotIndex()
        self.table: str | None = None
        self.batches: list[pa.RecordBatch] = []
        self.rows = self.nbytes = 0

    def add(self, table: str, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if table != self.table or (self.batches and not batch.schema.equals(self.batches[0].schema)):
            self.flush()
            self.table = table
        self.batches.append(batch)
        # Counted as stored: a block_events row per block (unnested in flush), not per call.
        self.rows += _block_count(batch, table) if table in UNNESTED else batch.num_rows
        self.nbytes += batch.get_total_buffer_size()  # `nbytes` costs 50 us a batch on slices
        if self.rows >= INSERT_ROWS or self.nbytes >= INSERT_BYTES:
            self.flush()

    def flush(self) -> None:
        """Queue the INSERT of what is gathered."""
        if not self.batches:
            return
        table = self.table
        data = pa.Table.from_batches(self.batches)
        self.batches, self.rows, self.nbytes = [], 0, 0
        if table in KEYED_TABLES:  # before the copy: the key columns are smaller than the text
            data = self.keys.encode(table, data)
        if table == "batch_slots":
            self.slots.add(data)
        if has_seq(table):
            data = data.append_column("seq", pa.array(np.arange(self.seq, self.seq + data.num_rows)))
            self.seq += data.num_rows
        if table in UNNESTED:
            data = unnest_blocks(table, data)
        if table == "kv_access":
            have = self.slots.arrays()
            if have is not None:  # else _insert reads the batch slots back from the database
                data = data.append_column("request_key", _match_slots(*have, data))
        if table in self.undecided:  # the table's first chunk in this database
            self.undecided.discard(table)
            methods = compression.choose(data)
            if methods:
                self.inserter.submit(0, _set_compression, table, methods)
        # DuckDB pays per Arrow batch as well: copy the small batches into ones of a row group's size
        # (a third less CPU than scanning recorder-sized batches), still enough of them to scan in
        # parallel.
        data = data.combine_chunks()
        data = pa.Table.from_batches(data.to_batches(max_chunksize=ROW_GROUP))
        self.inserter.submit(data.num_rows, _insert_chunk, self.keys.sid, self.keys.take_new(), table, data,
                             self.consts)


def _block_count(batch: pa.RecordBatch, table: str) -> int:
    """The rows `batch` (shard rows of an UNNESTED table) will be once unnested: its block ids, or its
    calls where that is more (a call with no block still takes a slot in the chunk's accounting)."""
    ids = batch.column(UNNESTED[table][0])
    offsets = ids.offsets
    return max(batch.num_rows, offsets[len(ids)].as_py() - offsets[0].as_py()) if len(ids) else 0


def unnest_blocks(table: str, data: pa.Table) -> pa.Table:
    """`data` (a chunk of shard rows, one per call) with its block lists unnested: one row per block,
    the store's columns in the store's order. Done here, in the reading thread, instead of by DuckDB's
    UNNEST in the INSERT: DuckDB's thread is the one every chunk waits for, and a flat chunk costs it
    ~15-25% less (docs/performance.md, "Ingest").

    As DuckDB's `SELECT UNNEST(block_ids), UNNEST(block_hashes)` does: the two lists of a call side by
    side, the shorter padded with nulls (a call's hashes are usually its blocks' or none); a call whose
    lists are both empty or null gives no row."""
    list_col, hash_col, id_def, hash_def = UNNESTED[table]
    data = data.combine_chunks()
    ids, hashes = data.column(list_col).chunk(0), data.column(hash_col).chunk(0)
    n_ids, n_hashes = _list_lengths(ids), _list_lengths(hashes)
    n_rows = np.maximum(n_ids, n_hashes)
    cols = {}
    for name in data.column_names:
        if name == list_col:
            cols[id_def.split()[0]] = _padded(pc.list_flatten(ids), n_ids, n_rows)
        elif name == hash_col:
            cols[hash_def.split()[0]] = _padded(pc.list_flatten(hashes), n_hashes, n_rows)
        else:
            cols[name] = _repeated(data.column(name).chunk(0), n_rows)
    return pa.table(cols)


def _repeated(values: pa.Array, counts: np.ndarray) -> pa.Array:
    """Each value `counts` times (NumPy's repeat where it can: ~10x Arrow's take by index)."""
    if pa.types.is_integer(values.type) and not values.null_count:
        return pa.array(np.repeat(values.to_numpy(), counts))
    return values.take(pa.array(np.repeat(np.arange(len(values), dtype=np.int64), counts)))


def _list_lengths(lists: pa.Array) -> np.ndarray:
    """Values in each list (0 for a null list), as int64."""
    return pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _padded(values: pa.Array, lengths: np.ndarray, n_rows: np.ndarray) -> pa.Array:
    """The flattened `values` of lists of `lengths`, each list followed by nulls up to its `n_rows`."""
    if np.array_equal(lengths, n_rows):
        return values
    if pa.types.is_integer(values.type) and not values.null_count and ((lengths == 0) | (lengths == n_rows)).all():
        # The usual odd case: a call has a value for each of its rows (a cache, an evict) or none.
        has = np.repeat(lengths > 0, n_rows)
        out = np.zeros(len(has), values.type.to_pandas_dtype())
        out[has] = values.to_numpy()
        return pa.array(out, mask=~has)
    total = int(n_rows.sum())
    starts = np.repeat(np.cumsum(n_rows) - n_rows, n_rows)
    valid = (np.arange(total) - starts) < np.repeat(lengths, n_rows)
    index = np.zeros(total, np.int64)
    index[valid] = np.arange(len(values))
    return values.take(pa.array(index, mask=~valid))


def _set_compression(con: duckdb.DuckDBPyConnection, table: str, methods: dict[str, str]) -> None:
    """Make the (empty) stored `table` again with `methods` declared (in the inserter's thread)."""
    methods = {"proc": "rle", **methods}  # one process's rows at a time: one run a chunk
    con.execute(f"DROP TABLE {STORE}.{table}")
    con.execute(table_ddl(table, methods))


def _insert_chunk(con: duckdb.DuckDBPyConnection, sid: str, new_keys: tuple, table: str, data: pa.Table,
                  consts: tuple) -> None:
    """The keys a chunk is the first to use, then the chunk (in the inserter's thread)."""
    _insert_keys(con, sid, *new_keys)
    insert_batch(con, table, data, consts)


def _insert_keys(con: duckdb.DuckDBPyConnection, sid: str, request_ids: list[str],
                 labels: list[tuple[int, str]], first_key: int) -> None:
    """INSERT the request keys (consecutive from `first_key`) and labels a chunk is the first to use."""
    if request_ids:
        kvtrace_keys = pa.table({  # noqa: F841 - read by name (DuckDB's replacement scan, see insert_batch)
            "request_key": pa.array(range(first_key, first_key + len(request_ids)), pa.int32()),
            "request_id": pa.array(request_ids, pa.string())})
        con.execute(f"INSERT INTO {STORE}.request_keys SELECT request_key, '{sql_str(sid)}', request_id "
                    "FROM kvtrace_keys")
    insert_labels(con, labels)
    if labels:
        create_keyed_views(con)


def insert_batch(con: duckdb.DuckDBPyConnection, table: str, batch: pa.RecordBatch | pa.Table, consts: tuple) -> None:
    """INSERT one gathered chunk of `table`'s shard rows (a RecordBatch or a Table of many), keys
    given (`SessionKeys.encode`)."""
    n = batch.num_rows
    if n == 0:
        return
    sid, rank, pid, key = consts
    data = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    if table == "kv_access" and "request_key" not in data.column_names:  # SlotIndex overflowed
        data = data.append_column("request_key", _access_request_keys(con, key, data))
    # The statements read the chunk as `kvtrace_batch`, this local variable, through DuckDB's replacement
    # scan: bound for the one statement, no catalog entry. Not con.register(): a registered view is a
    # catalog entry, and a dropped one lives on, with the Arrow data it holds, until the transaction
    # ends (memory would grow with the session). Not `con.from_arrow(data).query(...)` either: the
    # relation and its view cost ~1.5 ms more a statement, ~10% of a 1 M-event ingest's INSERTs.
    kvtrace_batch = data  # noqa: F841 - read by name
    head = f"'{sql_str(sid)}' AS session, {rank}::INTEGER AS rank, {pid}::INTEGER AS pid"
    if table in KEYED_TABLES:  # keyed, block lists unnested and numbered (`seq`) in Gather.flush
        con.execute(f"INSERT INTO {STORE}.{table} SELECT {key}::INTEGER, * FROM kvtrace_batch")
    else:
        con.execute(f"INSERT INTO {table} SELECT {head}, * FROM kvtrace_batch")


def _access_request_keys(con: duckdb.DuckDBPyConnection, proc: int, data: pa.Table) -> pa.Array:
    """`_match_slots` against the process's batch slots stored in the database, those of the chunk's
    steps only (loaded in step order, so DuckDB's min/max per row group skips the rest). For processes
    with more batch slots than `SlotIndex` keeps in memory."""
    steps = pc.fill_null(data.column("step"), -1).to_numpy()
    lo, hi = int(steps.min()), int(steps.max())
    have = con.sql(f"SELECT step, slot, request_key FROM {STORE}.batch_slots WHERE proc = {int(proc)} AND step "
                   f"BETWEEN {lo} AND {hi} AND slot IS NOT NULL").to_arrow_table()
    return _match_slots(*_slot_columns(have), data)


def _match_slots(have_steps: np.ndarray, have_slots: np.ndarray, keys: np.ndarray, data: pa.Table) -> pa.Array:
    """For each device access row of `data`, the request key of the batch slot with the same step and
    slot; NULL_REQUEST_KEY without one.

    `have_*`: batch slots sorted by (step, slot). In numpy rather than a SQL join, which cost as much and
    did not keep the rows' order (by step: stored out of order they compress 3x worse). A step's slots
    are consecutive rows, so a row's position is its step's first row plus its slot; checked, and
    searched where not."""
    steps = pc.fill_null(data.column("step"), -1).to_numpy()
    slots = pc.fill_null(data.column("slot"), -1).to_numpy()
    lo, hi = int(steps.min()), int(steps.max())
    a, b = np.searchsorted(have_steps, [lo, hi + 1])  # the chunk's steps only
    have_steps, have_slots, keys = have_steps[a:b], have_slots[a:b], keys[a:b]
    if not len(have_steps):
        return _int32_array(np.full(len(steps), NULL_REQUEST_KEY, np.int32))
    pairs = _step_slot(have_steps, have_slots)
    wanted = _step_slot(steps, slots)
    if hi - lo < 4 * (len(steps) + len(have_steps)) + 4096:
        # Steps are dense (the usual case): a table of each step's first row, then direct indexing.
        starts = np.flatnonzero(np.r_[True, have_steps[1:] != have_steps[:-1]])
        first_row = np.full(hi - lo + 1, -1, dtype=np.int64)
        first_row[have_steps[starts] - lo] = starts
        row = first_row[steps - lo]
        at = (row + slots - have_slots[row]).clip(0, len(pairs) - 1)
        off = pairs[at] != wanted
        if off.any():
            at[off] = np.searchsorted(pairs, wanted[off]).clip(0, len(pairs) - 1)
    else:  # steps far apart (a row with a huge step): a table over their range would not fit memory
        at = np.searchsorted(pairs, wanted).clip(0, len(pairs) - 1)
    return _int32_array(np.where(pairs[at] == wanted, keys[at], NULL_REQUEST_KEY).astype(np.int32, copy=False))


def _int32_array(values: np.ndarray) -> pa.Array:
    """An int32 NumPy array as an Arrow array, without a copy."""
    return pa.Array.from_buffers(pa.int32(), len(values), [None, pa.py_buffer(values)])


def _step_slot(steps: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """(step, slot) pairs as one sortable int64 (slots are rows of a batch: far below 2^31)."""
    return (steps.astype(np.int64) << 32) | (slots.astype(np.int64) & 0xFFFFFFFF)
