"""Rows the host probes keep as columns until they hand them to the recorder: the hot path.

Two logs, each with a pure-Python class here (the reference) and a native twin in `_columns.c`, built
with the package where a C compiler is at hand; `block_log()` and `decode_log()` give the native one
when it imports and the Python one otherwise (or when `KVTRACE_NATIVE=0`). Both give the same rows
(tests/unit/record/test_buffers.py), and `take()` of either hands a dict of whole columns to
`Recorder.append_columns`.

- `BlockLog`: `block_events` rows of the block-pool probe (probes/vllm/kv_blocks.py), one per pool call with
  its list of block ids (and hashes), named after the request the call was made for.
- `DecodeLog`: `step_requests` rows of decoding requests (probes/vllm/scheduler.py): most rows of that
  table, one per running request per step, handed over as `decode_runs` (a row per run of a request's
  consecutive decode steps; ingest expands them).

Why columns: a row is a handful of appends, with no tuple per row (tuples of tuples stay tracked by the
garbage collector until its next pass) and no transposition by the writer; Arrow arrays are made in bulk
at `take()`. The native twin goes further: a pool call costs ~0.2 us instead of ~2-5 us (naming the
request from the caller's frame without `f_locals`, appends into C arrays), and its columns reach Arrow
as bytes (bench/bench_host_probes.py, docs/performance.md).

Thread safety: `take()` swaps the columns out before converting them, and keeps only rows complete in
every column, so a take from another thread (the recorder's flush on SIGUSR2) never writes a torn row.
"""

from __future__ import annotations

import importlib
import os
import struct
import sys
import time
import weakref
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np
import pyarrow as pa

from kvtrace.record.context import ctx

_now = time.monotonic_ns
_frame = sys._getframe
# Hand the rows to the recorder at least this often (monotonic ns): half the writer's flush interval
# (record/recorder.py FLUSH_INTERVAL_S), so a row is on disk within ~1.5 flush intervals. Each hand-over
# costs the engine's thread a take (Arrow columns from the log's buffers, ~0.2 ms on a slow machine),
# and each batch handed over one more piece for the writer to join.
FLUSH_NS = 1_000_000_000
BLOCK_FLUSH_ROWS = 8192
DECODE_FLUSH_ROWS = 16384


# ---- naming the request a block-pool call is made for ---------------------------------------------
# id(code object) -> (code, name of its request argument: "request_id", "request" or ""). Keyed by id:
# hashing a code object hashes its constants and names, every time (~3,000 instructions).
_REQUEST_ARG: dict = {}


def _request_arg(code: Any) -> str:
    args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return "request_id" if "request_id" in args else "request" if "request" in args else ""


def caller_request_id(depth: int = 2, up: int = 3) -> str | None:
    """The `request_id` (or `request`) *argument* of the nearest of `up` callers that has one, from
    frame `depth` (2 = the caller of the function calling this); else None.

    Only arguments count, never other locals: a loop variable named `request` in a caller further up
    (update_from_output has one) says nothing about whose blocks move."""
    try:
        f = _frame(depth)
    except ValueError:
        return None
    while f is not None and up > 0:
        code = f.f_code
        entry = _REQUEST_ARG.get(id(code))
        if entry is None or entry[0] is not code:
            entry = _REQUEST_ARG[id(code)] = (code, _request_arg(code))
        arg = entry[1]
        if arg:
            value = f.f_locals.get(arg)  # f_locals costs ~0.5 us: only where the argument exists
            if arg == "request":
                value = getattr(value, "request_id", None)
            if isinstance(value, str):
                return value
        f = f.f_back
        up -= 1
    return None


# ---- block hashes ----------------------------------------------------------------------------------
def hash64(block_hash: Any) -> int | None:
    """First 8 bytes of a vLLM block hash as a signed int64 (group-id suffix ignored)."""
    if block_hash is None:
        return None
    if isinstance(block_hash, (bytes, bytearray)):
        return int.from_bytes(block_hash[:8], "little", signed=True)
    return hash(block_hash)  # older vLLM: a tuple-like BlockHash


_first = itemgetter(0)
_int64_le = struct.Struct("<q").unpack_from


def hashes64(keys: Any) -> tuple:
    """`hash64` of each hash, in C-level maps (the usual bytes hashes)."""
    keys = tuple(keys)
    try:
        return tuple(map(_first, map(_int64_le, keys)))
    except (TypeError, struct.error):  # None, or a hash that is not bytes (older vLLM)
        return tuple(map(hash64, keys))


def hashes64_array(keys: list) -> pa.Array:
    """`hash64` of each key as an Arrow int64 array, in bulk (NumPy over the joined bytes)."""
    n = len(keys)
    try:
        joined = b"".join(keys)
    except TypeError:  # None, or a hash that is not bytes (older vLLM)
        return pa.array(list(map(hash64, keys)), pa.int64())
    lens = np.fromiter(map(len, keys), np.int64, n)
    if n and lens.min() < 8:  # no vLLM hash is this short; hash64 says what such a key gives
        return pa.array(list(map(hash64, keys)), pa.int64())
    raw = np.frombuffer(joined, np.uint8)
    if n and (lens == lens[0]).all():  # the usual case: every hash of one length
        first8 = raw.reshape(n, int(lens[0]))[:, :8]
    else:
        first8 = raw[(np.cumsum(lens) - lens)[:, None] + np.arange(8)]
    return pa.array(np.ascontiguousarray(first8).view("<i8").reshape(n))


_block_id = attrgetter("block_id")


def _ids_without(blocks: Any, null: Any) -> list[int]:
    """Ids of `blocks` without the pool's null block (never really allocated, touched or freed)."""
    return [b.block_id for b in blocks if b is not null]


# ---- block_events ----------------------------------------------------------------------------------
# A touch or free made inside a KV connector's method (`ctx.connector` set by the connector probe) is
# the connector holding blocks during a transfer, or letting them go: not a prefix-cache hit, not a
# request's free.
HELD_AS = {"touch": "hold", "free": "release"}


class BlockLog:
    """`block_events` rows, one per block-pool call, as columns (block ids and hashes flattened, with
    end offsets). The request is named from the caller's frame (`caller_request_id`), else
    `ctx.request_id` (set by the scheduler probe around frees it makes); the step is `ctx.step`.

    Each method is called by a block-pool wrapper (probes/vllm/kv_blocks.py) right after vLLM's method and
    returns True when it is time to `take()`.

    Pools: with a `route` set, only the engine's own pool (`main_pool`, or the first pool seen when none
    was named) logs here; the wrapper asks `for_pool(pool)` for the log of any other pool (a CPU offload
    tier's BlockPool has block ids of its own), which `route(pool)` makes. Both held weakly."""

    __slots__ = ("ts", "step", "event", "group", "rid", "ids", "ids_end", "hashes", "hashes_end", "hashed",
                 "since_ns", "in_alloc", "evicted", "flush_rows", "flush_ns", "hash_of", "ctx", "_route",
                 "_main", "_last", "__weakref__")

    def __init__(self, ctx: Any = ctx, fallback: Any = None, flush_rows: int = BLOCK_FLUSH_ROWS,
                 flush_ns: int | None = None, hash_attr: str = "block_hash") -> None:
        """`hash_attr`: the KVCacheBlock attribute that holds its hash (see kv_blocks.hash_attribute)."""
        self.flush_rows, self.flush_ns = flush_rows, FLUSH_NS if flush_ns is None else flush_ns
        self.hash_of = attrgetter(hash_attr)
        self.ctx = ctx
        self.in_alloc = False
        self.evicted: list[tuple[int, Any]] = []  # (block id, hash) evicted inside get_new_blocks
        self._route: Any = None
        self._main: Any = None  # weakref to the main pool
        self._last: tuple | None = None  # (weakref to a pool, its log): the last other pool routed
        self._clear()

    @property
    def route(self) -> Any:
        return self._route

    @route.setter
    def route(self, fn: Any) -> None:
        if fn is not None and not callable(fn):
            raise TypeError("route must be callable or None")
        self._route, self._last = fn, None

    @property
    def main_pool(self) -> Any:
        return self._main() if self._main is not None else None

    @main_pool.setter
    def main_pool(self, pool: Any) -> None:
        self._main = weakref.ref(pool) if pool is not None else None

    def for_pool(self, pool: Any) -> BlockLog:
        """The log for rows of `pool`'s calls (see the class docstring)."""
        if self._route is None:
            return self
        main = self.main_pool
        if main is pool:
            return self
        if main is None:
            self.main_pool = pool
            return self
        if self._last is not None and self._last[0]() is pool:
            return self._last[1]
        log = self._route(pool)
        if not isinstance(log, BlockLog):
            raise TypeError("BlockLog.route returned no BlockLog")
        self._last = (weakref.ref(pool), log)
        return log

    def _clear(self) -> None:
        self.ts: list[int] = []
        self.step: list[int] = []
        self.event: list[str] = []
        self.group: list[int] = []
        self.rid: list[str | None] = []
        self.ids: list[int] = []
        self.ids_end: list[int] = []
        self.hashes: list = []  # vLLM's own hash objects, converted in bulk by take() (hashes64_array)
        self.hashes_end: list[int] = []
        self.hashed: list[bool] = []
        self.since_ns = _now()

    @property
    def rows(self) -> int:
        return len(self.ts)

    def _add(self, t: int, event: str, group: int, rid: str | None, ids: Any, hashes: Any = None) -> None:
        self.ts.append(t)
        self.step.append(self.ctx.step)
        self.event.append(event)
        self.group.append(group)
        self.rid.append(rid)
        self.ids.extend(ids)
        self.ids_end.append(len(self.ids))
        if hashes is not None:
            self.hashes.extend(hashes)
        self.hashes_end.append(len(self.hashes))
        self.hashed.append(hashes is not None)

    def _due(self, t: int) -> bool:
        return len(self.ts) >= self.flush_rows or t - self.since_ns >= self.flush_ns

    def _request(self) -> str | None:
        # Frames: 0 caller_request_id, 1 _request, 2 the log's method, 3 the wrapper, 4 vLLM's caller.
        rid = caller_request_id(4)
        return rid if rid is not None else getattr(self.ctx, "request_id", None)

    # get_new_blocks: evictions it makes wait for its own row (they are attributed to its request).
    def begin_alloc(self) -> None:
        self.in_alloc = True
        self.evicted.clear()

    def end_alloc(self) -> None:
        self.in_alloc = False
        self.evicted.clear()

    def alloc(self, blocks: Any) -> bool:
        """get_new_blocks returned `blocks`: a row of its evictions, then one of the allocation."""
        self.in_alloc = False
        t = _now()
        rid = self._request()
        if self.evicted:
            got = self.evicted[:]
            self.evicted.clear()
            self._add(t, "evict", 0, rid, [i for i, _ in got], [k for _, k in got])
        if blocks:
            self._add(t, "alloc", 0, rid, map(_block_id, blocks))
        return self._due(t)

    def evict(self, block_id: int, key: Any) -> bool:
        """_maybe_evict_cached_block evicted `block_id`, whose hash was `key`."""
        if self.in_alloc:
            self.evicted.append((block_id, key))
            return False
        t = _now()  # an eviction outside allocation (evict_blocks)
        self._add(t, "evict", 0, self._request(), (block_id,), (key,))
        return self._due(t)

    def free(self, pool: Any, blocks: Any) -> bool:
        return self._ids_row("free", pool, blocks)

    def touch(self, pool: Any, blocks: Any) -> bool:
        return self._ids_row("touch", pool, blocks)

    def _ids_row(self, event: str, pool: Any, blocks: Any) -> bool:
        ids = _ids_without(blocks, pool.null_block)
        if not ids:
            return False
        if getattr(self.ctx, "connector", None) is not None:  # inside a KV connector's method: its hold
            event = HELD_AS[event]
        t = _now()
        rid = caller_request_id(4)
        self._add(t, event, 0, rid if rid is not None else getattr(self.ctx, "request_id", None), ids)
        return self._due(t)

    def cache(self, request: Any, blocks: Any, num_cached: int, num_full: int, group: int) -> bool:
        """cache_full_blocks: blocks[num_cached:num_full] that have a hash (null or masked-out blocks
        were not cached), with their hashes."""
        new = blocks[num_cached:num_full]
        keys = tuple(map(self.hash_of, new))
        if None in keys:
            new = [b for b, k in zip(new, keys) if k is not None]
            keys = tuple(k for k in keys if k is not None)
        if not keys:
            return False
        t = _now()
        self._add(t, "cache", group, request.request_id, map(_block_id, new), keys)
        return self._due(t)

    def take(self) -> dict | None:
        """The rows so far as columns for `Recorder.append_columns`, and an empty log; None if none."""
        ts, step, event, group, rid = self.ts, self.step, self.event, self.group, self.rid
        ids, ids_end, hashes, hashes_end, hashed = self.ids, self.ids_end, self.hashes, self.hashes_end, self.hashed
        self._clear()
        n = min(len(ts), len(step), len(event), len(group), len(rid), len(ids_end), len(hashes_end), len(hashed))
        if not n:
            return None
        ids_end, hashes_end = ids_end[:n], hashes_end[:n]
        values = pa.array(ids[:ids_end[-1]], type=pa.int32())
        keys = hashes64_array(hashes[:hashes_end[-1]])
        no_hashes = pa.array(np.logical_not(np.array(hashed[:n], dtype=bool)))
        return {
            "ts_ns": ts[:n], "step": step[:n], "event": event[:n], "kv_group": group[:n], "request_id": rid[:n],
            "block_ids": pa.ListArray.from_arrays(pa.array([0, *ids_end], type=pa.int32()), values),
            "block_hashes": pa.ListArray.from_arrays(pa.array([0, *hashes_end], type=pa.int32()), keys,
                                                     mask=no_hashes),
        }


# ---- step_requests rows of decoding requests, as decode runs -------------------------------------
class SlotRuns:
    """`batch_slots` rows held as runs (schema.RUN_TABLES `batch_slot_runs`): a run is the batch's request
    ids in row order, unchanged over consecutive steps, kept once. A decode batch keeps its rows for many
    steps, and a row per (step, slot) cost 7.5-19 us a step for 256 requests on the engine's thread
    (bench/bench_batch_slots.py); here a step that changes nothing costs a copy and a compare of the id
    list. `take()` hands the runs over as
    columns, which ingest expands back into their rows (`kvtrace.format.shards.expand_batch_slot_runs`)."""

    __slots__ = ("runs", "ids", "first", "last", "since_ns", "flush_ns")

    def __init__(self, flush_ns: int | None = None) -> None:
        self.flush_ns = FLUSH_NS if flush_ns is None else flush_ns
        self.runs: list[tuple[int, int, list]] = []  # closed runs: (first step, steps, request ids)
        self.ids: list | None = None  # the open run's ids, from step `first` to step `last`
        self.first = self.last = -1
        self.since_ns = _now()

    def add(self, step: int, ids: Any) -> bool:
        """The batch of `step` held request `ids[i]` in row i. True: time to take()."""
        if type(ids) is not list:
            ids = list(ids)
        # compared before any copy: the same batch as the last step (the usual case) costs no list
        if step == self.last + 1 and ids == self.ids:
            self.last = step
        else:
            if self.ids is not None:
                self.runs.append((self.first, self.last - self.first + 1, self.ids))
            self.ids, self.first, self.last = ids.copy(), step, step  # a copy: vLLM changes its list in place
        return _now() - self.since_ns >= self.flush_ns

    def take(self) -> dict | None:
        """The runs since the last take, the open one closed, as `batch_slot_runs` columns; None if none."""
        runs, self.runs = self.runs, []
        if self.ids is not None:
            runs.append((self.first, self.last - self.first + 1, self.ids))
            self.ids = None
        self.since_ns = _now()
        runs = [r for r in runs if r[2]]  # a step with an empty batch has no rows
        if not runs:
            return None
        n = len(runs)
        lens = np.fromiter((len(r[2]) for r in runs), np.int64, n)
        first = np.cumsum(lens) - lens  # each run's first row
        return {
            "step": np.repeat(np.fromiter((r[0] for r in runs), np.int64, n), lens),
            "steps": np.repeat(np.fromiter((r[1] for r in runs), np.int32, n), lens),
            "slot": (np.arange(int(lens.sum())) - np.repeat(first, lens)).astype(np.int32),
            # a list: the recorder converts it to Arrow at its flush, on the writer's thread
            "request_id": list(chain.from_iterable(r[2] for r in runs)),
        }


class DecodeLog:
    """`step_requests` rows of decoding requests (phase decode, chunk -1, kind running), handed over as
    `decode_runs`: one row per run of a request's consecutive decode steps (step s+1, the same tokens,
    computed_before grown by those tokens, no new block), which ingest expands back into its rows
    (`kvtrace.format.shards.expand_decode_runs`). Kept here as one segment per step (copies of the
    SchedulerOutput's own lists, None standing for the usual values: 1 token, 0 new blocks), the runs
    found in bulk at `take()`; the native twin keeps an open run per request as rows come."""

    __slots__ = ("segs", "rows", "since_ns", "flush_rows", "flush_ns")

    def __init__(self, flush_rows: int = DECODE_FLUSH_ROWS, flush_ns: int | None = None) -> None:
        self.flush_rows, self.flush_ns = flush_rows, FLUSH_NS if flush_ns is None else flush_ns
        self.segs: list[tuple] = []
        self.rows = 0
        self.since_ns = _now()

    def add(self, step: int, ids: list, computed: list, new_block_ids: list, skip: list | None,
            num_scheduled: dict | None) -> bool:
        """A row for each position of the SchedulerOutput's cached requests (`ids`, their
        `num_computed_tokens` and `new_block_ids`) not in `skip` (sorted positions of prefill rows);
        tokens 1 each when `num_scheduled` is None, else `num_scheduled[id]`. True: time to take()."""
        if len(computed) != len(ids) or len(new_block_ids) != len(ids):
            raise ValueError("ids, computed and new_block_ids differ in length")
        if skip:
            ids, computed, new_block_ids = list(ids), list(computed), list(new_block_ids)
            for i in reversed(skip):
                del ids[i], computed[i], new_block_ids[i]
        else:
            ids, computed = list(ids), list(computed)
        tokens = None if num_scheduled is None else list(map(num_scheduled.__getitem__, ids))
        blocks = None
        if new_block_ids.count(None) != len(new_block_ids):
            nz = [i for i, nb in enumerate(new_block_ids) if nb]
            blocks = (nz, [len(new_block_ids[i][0]) for i in nz])
        self.segs.append((step, ids, computed, tokens, blocks))
        self.rows += len(ids)
        return self.rows >= self.flush_rows or _now() - self.since_ns >= self.flush_ns

    def take(self) -> dict | None:
        """The runs of the rows added since the last take, as `decode_runs` columns; None if none."""
        segs, self.segs = self.segs, []
        self.rows, self.since_ns = 0, _now()
        lens = [len(seg[1]) for seg in segs]
        n = sum(lens)
        if not n:
            return None
        tokens = np.concatenate([np.ones(k, dtype=np.int32) if seg[3] is None else np.asarray(seg[3], np.int32)
                                 for seg, k in zip(segs, lens)])
        new_blocks = np.zeros(n, dtype=np.int32)
        start = 0
        for seg, k in zip(segs, lens):
            if seg[4] is not None:
                positions, counts = seg[4]
                new_blocks[np.asarray(positions, dtype=np.int64) + start] = counts
            start += k
        step = np.repeat(np.array([seg[0] for seg in segs], dtype=np.int64), lens)
        rid = pa.array(list(chain.from_iterable(seg[1] for seg in segs)), pa.string())
        computed = np.fromiter(chain.from_iterable(seg[2] for seg in segs), np.int64, n)
        if computed.min() < 0 or computed.max() > np.iinfo(np.int32).max:
            raise OverflowError("decode row out of int32 range")
        return decode_runs(step, rid, computed.astype(np.int32), tokens, new_blocks)


def decode_runs(step: np.ndarray, rid: pa.Array, computed: np.ndarray, tokens: np.ndarray,
                new_blocks: np.ndarray) -> dict:
    """The `decode_runs` columns of decode rows given in any order: a run is a request's rows of
    consecutive steps with the same tokens, each `computed` its predecessor's plus those tokens, and
    no new block after its first row (the native DecodeLog's rule, and what ingest expands)."""
    codes = rid.dictionary_encode().indices.to_numpy(zero_copy_only=False)
    order = np.lexsort((step, codes))  # by request, then step
    k, s, c, t, b = codes[order], step[order], computed[order], tokens[order], new_blocks[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = ((k[1:] != k[:-1]) | (s[1:] != s[:-1] + 1) | (t[1:] != t[:-1])
                  | (c[1:].astype(np.int64) != c[:-1].astype(np.int64) + t[:-1]) | (b[1:] != 0))
    first = np.flatnonzero(starts)
    return {"step": s[first], "steps": np.diff(np.append(first, len(order))).astype(np.int32),
            "request_id": rid.take(pa.array(order[first])), "tokens": t[first], "computed_before": c[first],
            "new_blocks": b[first]}


# ---- the native twins ------------------------------------------------------------------------------
def _schema(table: str) -> pa.Schema:
    from kvtrace.format import schema

    return schema.arrow_schema(table)


def _imported(rows: int, spec: list, sch: pa.Schema) -> pa.RecordBatch:
    """A record batch of `sch` over the logs' column bytes (`spec`, see `_columns.arrow_batch`), imported
    through Arrow's C data interface: one call where pa.Array.from_buffers per column cost ~6 us each
    (steps has 22 columns; the writer and the hand-overs make hundreds of columns a second). Arrow's
    cheap validation then checks the layout, as from_buffers did."""
    capsule, address = _columns.arrow_batch(rows, spec)
    batch = pa.RecordBatch._import_from_c(address, sch)
    del capsule  # the structs: Arrow has moved what it needs out of them
    batch.validate()
    return batch


def _string(parts: tuple) -> tuple:
    """A native string column's (offsets, data, validity) as an arrow_batch spec."""
    offsets, data, valid = parts
    return ("s", valid, offsets, data)


def import_native(name: str) -> tuple[Any, str]:
    """kvtrace's C extension `name` (its full module name) and ""; or None and why it is not there: not
    built (no compiler at install time) or switched off (KVTRACE_NATIVE=0). The Python code serves then."""
    if os.environ.get("KVTRACE_NATIVE", "1") == "0":
        return None, "KVTRACE_NATIVE=0"
    try:
        return importlib.import_module(name), ""
    except ImportError as exc:
        return None, f"{exc}"


_columns, NATIVE_MISSING = import_native("kvtrace.record._columns")
if _columns is not None:
    class NativeBlockLog(_columns.BlockLog):
        """`BlockLog` in C (`_columns.c`); `take()` makes a `block_events` RecordBatch from its buffers
        (indexable by column name, as the Python twin's dict of columns is)."""

        def take(self) -> pa.RecordBatch | None:
            raw = self.take_raw()
            if raw is None:
                return None
            return _imported(raw["rows"], [
                ("f", 8, None, raw["ts_ns"]), ("f", 8, None, raw["step"]), _string(raw["event"]),
                ("f", 2, None, raw["kv_group"]), _string(raw["request_id"]),
                ("l", None, raw["ids_end"], 4, raw["ids"]), ("l", raw["hashed"], raw["hashes_end"], 8, raw["hashes"]),
            ], _schema("block_events"))

    class NativeDecodeLog(_columns.DecodeLog):
        """`DecodeLog` in C (`_columns.c`): an open run per request as rows come; `take()` ends them
        and makes a `decode_runs` RecordBatch from its buffers."""

        def take(self) -> pa.RecordBatch | None:
            raw = self.take_raw()
            if raw is None:
                return None
            return _imported(raw["runs"], [
                ("f", 8, None, raw["step"]), ("f", 4, None, raw["steps"]), _string(raw["request_id"]),
                ("f", 4, None, raw["tokens"]), ("f", 4, None, raw["computed_before"]),
                ("f", 4, None, raw["new_blocks"]),
            ], _schema("decode_runs"))


# ---- any table's rows, appended as tuples (the recorder's buffers) ----------------------------------
_KINDS = {pa.int8(): "b", pa.int16(): "h", pa.int32(): "i", pa.int64(): "q", pa.string(): "s",
          pa.list_(pa.int32()): "I", pa.list_(pa.int64()): "Q"}


def row_kinds(table: str) -> str | None:
    """The native RowLog's column kinds of `table`, or None when a column's type is not one it keeps."""
    from kvtrace.format import schema

    kinds = [_KINDS.get(c.type) for c in schema.TABLES[table]]
    return None if None in kinds else "".join(kinds)


def row_log(table: str, max_rows: int) -> Any:
    """A native RowLog for `table` (the recorder's buffer for row tuples), or None where the native
    logs are not built (the recorder then keeps the tuples in a list, as before)."""
    kinds = row_kinds(table)
    if _columns is None or kinds is None:
        return None
    return NativeRowLog(table, kinds, max_rows)


def _positions(seq: list, members: Any) -> list[int]:
    """The indices of `seq`'s items that are in `members`, in order (Python twin of `_columns.positions`):
    list.index per member, the cheaper way in Python when the members are few."""
    at = []
    for item in members:
        try:
            at.append(seq.index(item))
        except ValueError:
            pass
    at.sort()
    return at


positions = _columns.positions if _columns is not None else _positions


if _columns is not None:
    class NativeRowLog(_columns.RowLog):
        """A table's rows, appended as tuples (`append(row_tuple)`, like a list's) and kept in C as one
        record each (row-major: an append writes a few contiguous cache lines, not the tail of every
        column); `take()` (the recorder's writer thread) makes the columns in one pass and the Arrow
        batch from their bytes instead of converting Python objects. No tuple outlives its append, so
        holding rows until the writer's next flush puts nothing in the garbage collector's way. A row
        that does not fit the table's schema is counted, not stored, and never raises into the probe
        that appended it."""

        def __init__(self, table: str, kinds: str, max_rows: int) -> None:
            super().__init__(kinds, max_rows)
            from kvtrace.format import schema

            self.schema = schema.arrow_schema(table)
            # Each column's arrow_batch kind ("f" fixed width, "s" string, "l" list) and its (items')
            # width in bytes, read from the schema once.
            self.layout = [("s", 0) if pa.types.is_string(f.type)
                           else ("l", f.type.value_type.byte_width) if pa.types.is_list(f.type)
                           else ("f", f.type.byte_width) for f in self.schema]

        def take(self) -> tuple[pa.RecordBatch | None, int, int]:
            """(the rows as one batch or None, rows that did not fit, rows past max_rows)."""
            n, cols, bad, over = self.take_raw()
            if not n:
                return None, bad, over
            spec = [("f", width, valid, values) if kind == "f" else ("s", valid, offsets, data) if kind == "s"
                    else ("l", valid, offsets, width, values)
                    for (kind, width), (valid, values, offsets, data) in zip(self.layout, cols)]
            return _imported(n, spec, self.schema), bad, over


def native() -> bool:
    """Whether the native logs are in use in this process."""
    return _columns is not None


def block_log(hash_attr: str = "block_hash") -> Any:
    """A BlockLog (the native one where it imports) that reads a block's hash from `hash_attr`."""
    if _columns is not None:
        return NativeBlockLog(ctx, caller_request_id, BLOCK_FLUSH_ROWS, FLUSH_NS, hash_attr)
    return BlockLog(hash_attr=hash_attr)


def block_hook(kind: str, orig: Any, log: Any, params: tuple[str, ...], on_full: Any, on_error: Any,
               before: Any = None) -> Any:
    """A native `BlockHook` standing in for the BlockPool method `orig` (`_columns.c`): vLLM's function is
    called, then the `kind` row ("alloc", "free", "touch", "cache", "evict") is made in C, from the
    parameters named in `params` (read by position or keyword). None where it cannot stand in: no native
    module, a Python log, or a parameter it could miss (one with a default, or `*args`-style); the probe
    then uses its Python wrapper, which does the same."""
    import inspect

    if _columns is None or not isinstance(log, _columns.BlockLog):
        return None
    try:
        sig = list(inspect.signature(orig).parameters.values())
    except (TypeError, ValueError):
        return None
    positions = []
    for name in params:
        p = next((p for p in sig if p.name == name), None)
        if p is None or p.default is not p.empty or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return None
        positions.append(sig.index(p) if p.kind is p.POSITIONAL_OR_KEYWORD else sys.maxsize)
    return _columns.BlockHook(kind, orig, log, tuple(positions), tuple(params), on_full, on_error, before)


def decode_log() -> Any:
    """A DecodeLog: the native one where it imports."""
    return NativeDecodeLog(DECODE_FLUSH_ROWS, FLUSH_NS) if _columns is not None else DecodeLog()


def step_rows(probe: Any, decode_log: Any, steps: Any, ctx: Any, queue_lengths: dict) -> Any:
    """The scheduler probe's per-step rows of a step that only decodes, in C (`_columns.StepRows`, over the
    probe's own `pending_steps`, `prefill_chunks` and `first_token_due`); None where it is not built or
    the decode log is not native (the probe's Python methods do every step)."""
    if _columns is None or not isinstance(decode_log, _columns.DecodeLog):
        return None
    return _columns.StepRows(probe, decode_log, probe.pending_steps, probe.prefill_chunks, probe.first_token_due,
                             steps, ctx, queue_lengths)
