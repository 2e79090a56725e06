"""The host probes' logs (record/buffers.py): the native twins (`_columns.c`) give the same rows as the
Python reference, call for call, and a real driven vLLM scheduler records the same tables with either."""

from __future__ import annotations

import shutil
import sysconfig
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pytest

from kvtrace.record import buffers
from kvtrace.record.context import ctx

native_only = pytest.mark.skipif(buffers._columns is None, reason=f"native logs not built: {buffers.NATIVE_MISSING}")


def test_native_logs_are_built_where_a_compiler_is():
    """The extension is optional at install (no compiler: the Python logs serve), so nothing else would
    notice a build that silently failed where it should not."""
    if buffers.NATIVE_MISSING == "KVTRACE_NATIVE=0":
        pytest.skip("native logs switched off (KVTRACE_NATIVE=0)")
    if not (shutil.which(str(sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which("cc")):
        pytest.skip("no C compiler here: the Python logs serve")
    assert buffers.native(), buffers.NATIVE_MISSING


# ---- stand-ins for vLLM's objects ------------------------------------------------------------------
@dataclass(slots=True)
class Block:
    block_id: int
    block_hash: Any = None


@dataclass
class Pool:
    null_block: Block


@dataclass
class Request:
    request_id: str


NULL = Block(0)
POOL = Pool(NULL)
H = [bytes([i] * 8) + b"\x00" * 24 for i in range(1, 10)]  # vLLM-like 32-byte hashes


# Frames as vLLM's make them: a manager method with a `request_id` argument calls the pool, whose
# wrapper calls the log (the log names the request from the wrapper's caller).
def wrapper(fn, *args):
    return fn(*args)


def manager(request_id, fn, *args):
    return wrapper(fn, *args)


def manager_of_request(request, fn, *args):
    return wrapper(fn, *args)


def no_request(fn, *args):
    request = "a local, not an argument"  # noqa: F841 - must not name the request
    return wrapper(fn, *args)


def block_script(log) -> list:
    """Every kind of BlockLog call, in vLLM's order; returns what each call returned."""
    ctx.step, ctx.request_id = 7, None
    got = []
    log.begin_alloc()
    got.append(log.evict(5, H[0]))  # held: inside get_new_blocks
    got.append(log.evict(6, bytearray(H[1])))
    got.append(manager("req-a", log.alloc, [Block(5), Block(6), Block(9)]))
    log.begin_alloc()
    got.append(manager("req-a", log.alloc, []))  # no blocks, no evictions: no row
    ctx.step = 8
    got.append(manager_of_request(Request("req-b"), log.touch, POOL, [NULL, Block(3), Block(4)]))
    got.append(manager("req-b", log.touch, POOL, [NULL]))  # only the null block: no row
    got.append(log.cache(Request("req-b"), [Block(3, H[2]), Block(4, None), Block(8, H[3]), Block(2, H[4])], 0, 3, 1))
    got.append(log.cache(Request("req-b"), [Block(3, None)], 0, 1, 0))  # nothing hashed: no row
    ctx.request_id = "held-by-ctx"  # the scheduler probe's fallback (frees it makes itself)
    got.append(no_request(log.free, POOL, [Block(9), NULL, Block(6)]))
    ctx.request_id = None
    got.append(wrapper(log.evict, 11, b"\xff\x01"))  # outside allocation; a short hash, sign-extended
    got.append(wrapper(log.evict, 12, (1, 2, 3)))  # older vLLM: a tuple hash, as hash() gives it
    got.append(manager("caf\u00e9-\u00fc", log.free, POOL, [Block(1)]))  # non-ASCII request id
    log.begin_alloc()
    log.evict(13, H[5])
    log.end_alloc()  # get_new_blocks raised: its evictions are forgotten with it
    got.append(manager("req-c", log.alloc, [Block(14)]))
    return got


def table(cols: dict, name: str) -> pa.Table:
    from kvtrace.format import schema

    sch = schema.arrow_schema(name)
    return pa.Table.from_arrays([pa.array(cols[f.name], type=f.type) for f in sch], schema=sch)


def expected_block_rows() -> list[dict]:
    def row(step, event, group, rid, ids, hashes=None):
        return {"step": step, "event": event, "kv_group": group, "request_id": rid, "block_ids": ids,
                "block_hashes": hashes}

    h = [int.from_bytes(k[:8], "little", signed=True) for k in H]
    return [
        row(7, "evict", 0, "req-a", [5, 6], [h[0], h[1]]),
        row(7, "alloc", 0, "req-a", [5, 6, 9]),
        row(8, "touch", 0, "req-b", [3, 4]),
        row(8, "cache", 1, "req-b", [3, 8], [h[2], h[3]]),
        row(8, "free", 0, "held-by-ctx", [9, 6]),
        row(8, "evict", 0, None, [11], [int.from_bytes(b"\xff\x01", "little", signed=True)]),
        row(8, "evict", 0, None, [12], [hash((1, 2, 3))]),
        row(8, "free", 0, "caf\u00e9-\u00fc", [1]),
        row(8, "alloc", 0, "req-c", [14]),
    ]


@pytest.mark.parametrize("kind", ["python", "native"])
def test_block_log_rows(kind):
    if kind == "native" and buffers._columns is None:
        pytest.skip(f"native logs not built: {buffers.NATIVE_MISSING}")
    log = buffers.BlockLog() if kind == "python" else buffers.NativeBlockLog(ctx, buffers.caller_request_id)
    returned = block_script(log)
    assert returned == [False] * len(returned)  # nothing due: few rows, well within 250 ms
    assert log.rows == 9
    rows = table(log.take(), "block_events").to_pylist()
    assert [{k: v for k, v in r.items() if k != "ts_ns"} for r in rows] == expected_block_rows()
    ts = [r["ts_ns"] for r in rows]
    assert ts == sorted(ts) and ts[0] == ts[1]  # an allocation's evictions share its time
    assert log.rows == 0 and log.take() is None


class PlainBlock:  # a block type without __slots__ (the native log reads its attributes generically)
    def __init__(self, block_id, block_hash=None):
        self.block_id, self.block_hash = block_id, block_hash


@native_only
def test_native_block_log_reads_blocks_of_any_type_and_each_pools_null_block():
    """The native log reads a slots block's attributes at their offsets, learnt from the first block; a
    block of another type, and a pool other than the last one (its own null block), still give their
    rows."""
    log = buffers.NativeBlockLog(ctx, buffers.caller_request_id)
    other_null = PlainBlock(0)
    other_pool = Pool(other_null)
    ctx.step, ctx.request_id = 3, None
    manager("r", log.touch, POOL, [NULL, Block(4), PlainBlock(5)])
    manager("r", log.free, other_pool, [other_null, NULL, PlainBlock(6)])  # NULL is not this pool's
    manager("r", log.touch, POOL, [NULL, Block(7)])
    log.cache(Request("r"), [PlainBlock(8, H[0]), Block(9, H[1])], 0, 2, 0)
    rows = table(log.take(), "block_events").to_pylist()
    assert [(r["event"], r["block_ids"]) for r in rows] == [
        ("touch", [4, 5]), ("free", [0, 6]), ("touch", [7]), ("cache", [8, 9])]
    assert rows[3]["block_hashes"] == [int.from_bytes(k[:8], "little", signed=True) for k in H[:2]]


@native_only
def test_block_log_native_and_python_agree_on_time_and_size_limits():
    for cls in (buffers.BlockLog, buffers.NativeBlockLog):
        log = cls(ctx, buffers.caller_request_id, flush_rows=3)
        ctx.step = 1
        assert [manager("r", log.touch, POOL, [Block(i)]) for i in range(1, 5)] == [False, False, True, True]
        log.take()
        log = cls(ctx, buffers.caller_request_id, flush_ns=0)  # everything is due at once
        assert manager("r", log.touch, POOL, [Block(1)]) is True


@native_only
def test_block_log_errors_leave_whole_rows():
    log = buffers.NativeBlockLog(ctx, buffers.caller_request_id)
    ctx.step = 3
    manager("r", log.touch, POOL, [Block(1)])
    with pytest.raises(AttributeError):
        manager("r", log.touch, POOL, [Block(2), object()])  # a block without an id
    with pytest.raises(AttributeError):
        log.cache(Request("r"), [Block(2, H[0]), object()], 0, 2, 0)
    with pytest.raises(TypeError):
        wrapper(log.evict, 5, [])  # an unhashable key
    manager("r", log.free, POOL, [Block(3)])  # its row has its own ids only, none of the failed calls'
    rows = table(log.take(), "block_events").to_pylist()
    assert [(r["event"], r["block_ids"]) for r in rows] == [("touch", [1]), ("free", [3])]


class HookedPool:
    """vLLM's BlockPool methods as far as the hooks see them: their parameter names, their results, and
    what they do to a block's hash (allocation evicts a cached block; caching sets hashes)."""

    def __init__(self):
        self.null_block = NULL
        self.free_queue = [Block(5, H[0]), Block(6), Block(7, H[1])]
        self.freed = None

    def get_new_blocks(self, num_blocks):
        if num_blocks > len(self.free_queue):
            raise ValueError("Cannot get blocks")
        out, self.free_queue = self.free_queue[:num_blocks], self.free_queue[num_blocks:]
        for block in out:
            self._maybe_evict_cached_block(block)
        return out

    def _maybe_evict_cached_block(self, block):
        if block.block_hash is None:
            return False
        block.block_hash = None
        return True

    def free_blocks(self, ordered_blocks):
        self.freed = ordered_blocks

    def touch(self, blocks):
        return None

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                          block_mask=None):
        for i in range(num_cached_blocks, num_full_blocks):
            blocks[i].block_hash = H[2 + i]


def allocate_new_blocks(request_id, pool, n):  # a manager method: its `request_id` names the request
    return pool.get_new_blocks(n)


def free(request_id, pool, blocks):
    return pool.free_blocks(blocks)


@native_only
def test_block_hooks_make_the_wrappers_rows_from_any_call_and_never_raise_their_own_errors(monkeypatch):
    """A BlockHook (C) stands in for a BlockPool method: vLLM's function runs, then the row is made with no
    Python frame of the hook's own, so the request is its caller's. Arguments may come by position or
    keyword, the blocks to free as a one-shot iterator (vLLM then gets a list). vLLM's errors reach its
    caller; the log's own go to on_error, which the hook calls once before it stops making rows."""
    log = buffers.block_log(hash_attr="block_hash")
    taken, faults = [], []
    params = {"alloc": ("get_new_blocks", ()), "evict": ("_maybe_evict_cached_block", ("block",)),
              "free": ("free_blocks", ("ordered_blocks",)), "touch": ("touch", ("blocks",)),
              "cache": ("cache_full_blocks", ("request", "blocks", "num_cached_blocks", "num_full_blocks",
                                              "kv_cache_group_id"))}
    hooks = {}
    for kind, (name, names) in params.items():
        hooks[kind] = buffers.block_hook(kind, getattr(HookedPool, name), log, names, lambda: taken.append(1),
                                         faults.append)
        monkeypatch.setattr(HookedPool, name, hooks[kind])
    pool = HookedPool()
    ctx.step, ctx.request_id = 4, None
    got = allocate_new_blocks("req-a", pool, 2)  # evicts block 5, allocates 5 and 6
    assert [b.block_id for b in got] == [5, 6] and got[0].block_hash is None
    with pytest.raises(ValueError, match="Cannot get blocks"):  # vLLM's own error: no row, nothing held
        allocate_new_blocks("req-a", pool, 9)
    HookedPool.touch(pool, [NULL, Block(3)])  # through the class: the pool is the first argument
    blocks = [Block(8), Block(9), Block(10)]
    pool.cache_full_blocks(request=Request("req-b"), blocks=blocks, num_cached_blocks=0, num_full_blocks=2,
                           block_size=16, kv_cache_group_id=1)  # keywords only
    pool.cache_full_blocks(Request("req-b"), blocks, 2, 2, 16, 0)  # nothing newly full: no row
    free("req-b", pool, iter(blocks[:2]))
    assert pool.freed == blocks[:2] and isinstance(pool.freed, list)
    pool._maybe_evict_cached_block(Block(11, H[5]))  # outside an allocation: a row of its own
    assert not taken and not faults

    assert HookedPool.touch(pool, [Block(12), object()]) is None  # a block without an id: the log raises
    assert len(faults) == 1 and isinstance(faults[0], AttributeError) and not hooks["touch"].enabled
    HookedPool.touch(pool, [Block(13)])  # switched off: vLLM's call only
    hooks["touch"].enabled = True  # (the probe switches every hook of it at once; see kv_blocks.py)
    HookedPool.touch(pool, [Block(14)])

    h = [int.from_bytes(k[:8], "little", signed=True) for k in H]
    rows = table(log.take(), "block_events").to_pylist()
    assert [(r["event"], r["kv_group"], r["request_id"], r["block_ids"], r["block_hashes"]) for r in rows] == [
        ("evict", 0, "req-a", [5], [h[0]]),
        ("alloc", 0, "req-a", [5, 6], None),
        ("touch", 0, None, [3], None),
        ("cache", 1, "req-b", [8, 9], [h[2], h[3]]),
        ("free", 0, "req-b", [8, 9], None),
        ("evict", 0, None, [11], [h[5]]),
        ("touch", 0, None, [14], None),
    ]
    assert all(r["step"] == 4 for r in rows)

    # No hook where a parameter it reads could be left out (a default), or for the Python log.
    assert buffers.block_hook("touch", lambda self, blocks=(): None, log, ("blocks",), list, list) is None
    assert buffers.block_hook("touch", lambda self, blocks: None, buffers.BlockLog(), ("blocks",), list, list) is None


@pytest.mark.parametrize("kind", ["python", "native"])
def test_block_log_routes_other_pools_to_their_own_logs(kind):
    """With a route, the main pool's rows stay in the log and each other pool's go to the log route(pool)
    returns, asked once per pool while calls on it follow each other; the first pool seen is the main one
    until one is named. Without a route every pool logs to the log itself."""
    if kind == "native" and buffers._columns is None:
        pytest.skip(f"native logs not built: {buffers.NATIVE_MISSING}")
    make = (lambda: buffers.BlockLog()) if kind == "python" else (lambda: buffers.NativeBlockLog(ctx, buffers.caller_request_id))
    log, gpu, cpu, disk = make(), Pool(NULL), Pool(Block(0)), Pool(Block(0))
    assert log.route is None and log.for_pool(cpu) is log and log.main_pool is None
    asked = []
    others = {}

    def route(pool):
        asked.append(pool)
        return others.setdefault(id(pool), make())

    log.route = route
    assert log.for_pool(gpu) is log and log.main_pool is gpu  # the first pool seen
    log.main_pool = gpu
    cpu_log = log.for_pool(cpu)
    assert cpu_log is not log and log.for_pool(cpu) is cpu_log and asked == [cpu]
    disk_log = log.for_pool(disk)
    assert disk_log not in (log, cpu_log) and log.for_pool(cpu) is cpu_log and asked == [cpu, disk, cpu]
    ctx.step = 2
    log.for_pool(gpu).touch(gpu, [Block(3)])
    log.for_pool(cpu).touch(cpu, [Block(3), cpu.null_block])
    assert [r["block_ids"] for r in table(log.take(), "block_events").to_pylist()] == [[3]]
    assert [r["block_ids"] for r in table(cpu_log.take(), "block_events").to_pylist()] == [[3]]
    log.route = lambda pool: "not a log"
    with pytest.raises(TypeError, match="route returned no BlockLog"):
        log.for_pool(cpu)
    log.route = None
    assert log.for_pool(cpu) is log


@pytest.mark.parametrize("kind", ["python", "native"])
def test_touch_and_free_inside_a_connector_are_its_holds(kind):
    if kind == "native" and buffers._columns is None:
        pytest.skip(f"native logs not built: {buffers.NATIVE_MISSING}")
    log = buffers.BlockLog() if kind == "python" else buffers.NativeBlockLog(ctx, buffers.caller_request_id)
    ctx.step = 3
    log.touch(POOL, [Block(4)])
    ctx.connector = "SimpleCPUOffloadConnector"
    try:
        log.touch(POOL, [Block(5)])
        log.free(POOL, [Block(5)])
    finally:
        ctx.connector = None
    log.free(POOL, [Block(4)])
    rows = table(log.take(), "block_events").to_pylist()
    assert [(r["event"], r["block_ids"]) for r in rows] == [("touch", [4]), ("hold", [5]), ("release", [5]),
                                                             ("free", [4])]


@native_only
def test_block_hooks_route_by_the_pool_they_are_called_on(monkeypatch):
    """A BlockHook writes a call's row to the log of the pool it is called on; a route that fails is the
    log's error (on_error, the hook stops), never vLLM's."""
    log, other, faults = buffers.block_log(hash_attr="block_hash"), buffers.block_log(hash_attr="block_hash"), []
    hook = buffers.block_hook("touch", HookedPool.touch, log, ("blocks",), list, faults.append)
    monkeypatch.setattr(HookedPool, "touch", hook)
    gpu, cpu, disk = HookedPool(), HookedPool(), HookedPool()
    log.route = lambda pool: other if pool is cpu else "not a log"
    log.main_pool = gpu
    ctx.step = 1
    gpu.touch([Block(1)])
    cpu.touch([Block(2)])
    HookedPool.touch(cpu, blocks=[Block(3)])
    assert not faults
    assert disk.touch([Block(4)]) is None  # vLLM's result, though the route failed
    assert len(faults) == 1 and isinstance(faults[0], TypeError) and not hook.enabled
    assert [r["block_ids"] for r in table(log.take(), "block_events").to_pylist()] == [[1]]
    assert [r["block_ids"] for r in table(other.take(), "block_events").to_pylist()] == [[2], [3]]


def test_caller_request_id_reads_arguments_only():
    # Frames seen by the Python one: 0 itself, 1 wrapper, 2 the function that called wrapper.
    def direct(request_id):
        return wrapper(buffers.caller_request_id, 2)

    def cell(request_id):
        def inner():
            return request_id
        return wrapper(buffers.caller_request_id, 2)

    assert direct("r1") == "r1" and cell("r2") == "r2"
    assert no_request(buffers.caller_request_id, 2) is None
    if buffers._columns is not None:
        fn = buffers._columns.caller_request_id
        assert manager("r3", fn) == "r3"
        assert manager_of_request(Request("r4"), fn) == "r4"
        assert no_request(fn) is None
        assert manager(42, fn) is None  # not a str: not a request id

        def deep(request_id):
            return a()

        def a():
            return b()

        def b():
            return c()

        def c():
            return wrapper(fn)

        assert deep("r5") is None  # beyond `up` (3) frames
        assert manager("r6", lambda: fn(2, 1)) == "r6"  # skip the lambda and wrapper, look at one frame
        assert manager("r7", lambda: fn(1, 1)) is None  # only wrapper, which names no request


# ---- decode rows, kept as runs --------------------------------------------------------------------
def decode_script(log) -> list:
    ids = ["a", "b", "c", "d"]
    got = [log.add(5, ids, [10, 20, 30, 40], [None, ([7, 8],), None, ([],)], None, None)]
    got.append(log.add(6, ids, [11, 21, 31, 41], [None, None, ([9],), None], [0, 2], None))
    got.append(log.add(7, ["b", "d"], [22, 42], [None, None], None, {"b": 1, "d": 3}))
    got.append(log.add(8, [], [], [], None, None))
    got.append(log.add(9, ["b", "d"], [30, 45], [None, None], None, {"b": 1, "d": 3}))  # b jumped: preempted
    got.append(log.add(10, ["b", "d"], [31, 48], [None, None], None, {"b": 1, "d": 3}))
    return got


# The rows the script adds (step, request, tokens, computed_before, new_blocks), and the runs they make:
# a run ends at a gap in steps, other tokens, a new block, or a computed count that is not the last plus
# its tokens.
DECODE_ROWS = [
    (5, "a", 1, 10, 0), (5, "b", 1, 20, 2), (5, "c", 1, 30, 0), (5, "d", 1, 40, 0),
    (6, "b", 1, 21, 0), (6, "d", 1, 41, 0),
    (7, "b", 1, 22, 0), (7, "d", 3, 42, 0),
    (9, "b", 1, 30, 0), (9, "d", 3, 45, 0),
    (10, "b", 1, 31, 0), (10, "d", 3, 48, 0),
]
DECODE_RUNS = [  # (step, steps, request, tokens, computed_before, new_blocks)
    (5, 1, "a", 1, 10, 0), (5, 3, "b", 1, 20, 2), (9, 2, "b", 1, 30, 0), (5, 1, "c", 1, 30, 0),
    (5, 2, "d", 1, 40, 0), (7, 1, "d", 3, 42, 0), (9, 2, "d", 3, 45, 0),
]


def expanded(cols: dict) -> list[tuple]:
    """The step_requests rows decode_runs columns stand for, as ingest expands them, sorted."""
    from kvtrace.format.shards import expand_decode_runs

    batch = table(cols, "decode_runs").to_batches()[0]
    rows = expand_decode_runs(batch).to_pylist()
    assert {(r["phase"], r["chunk_index"], r["kind"]) for r in rows} == {("decode", -1, "running")}
    return sorted((r["step"], r["request_id"], r["tokens"], r["computed_before"], r["new_blocks"]) for r in rows)


@pytest.mark.parametrize("kind", ["python", "native"])
def test_decode_log_keeps_runs_that_expand_to_every_row(kind):
    if kind == "native" and buffers._columns is None:
        pytest.skip(f"native logs not built: {buffers.NATIVE_MISSING}")
    log = buffers.DecodeLog() if kind == "python" else buffers.NativeDecodeLog()
    assert decode_script(log) == [False] * 6
    assert log.rows == len(DECODE_ROWS)
    cols = log.take()
    runs = table(cols, "decode_runs").to_pylist()
    assert sorted((r["request_id"], r["step"], r["steps"], r["tokens"], r["computed_before"], r["new_blocks"])
                  for r in runs) == sorted((rid, st, n, t, c, b) for st, n, rid, t, c, b in DECODE_RUNS)
    assert expanded(cols) == sorted(DECODE_ROWS)
    assert log.rows == 0 and log.take() is None


@native_only
def test_decode_log_runs_end_at_a_take_and_go_on_after_it():
    """take() ends every open run (its rows reach the recorder); the next step starts new ones. Requests
    with equal ids in different str objects, and a table that grows past its first size, keep their runs."""
    log = buffers.NativeDecodeLog()
    ids = [f"req-{i}" for i in range(700)]  # more open runs than the first 256 slots hold
    log.add(1, ids, list(range(700)), [None] * 700, None, None)
    log.add(2, ids, [c + 1 for c in range(700)], [None] * 700, None, None)
    first = table(log.take(), "decode_runs").to_pylist()
    assert len(first) == 700 and {(r["step"], r["steps"]) for r in first} == {(1, 2)}
    same_text = ["".join(["req-", str(i)]) for i in range(700)]  # equal ids, other objects
    log.add(3, same_text, [c + 2 for c in range(700)], [None] * 700, None, None)
    log.add(4, ids, [c + 3 for c in range(700)], [None] * 700, None, None)
    rows = expanded(log.take())
    assert rows == sorted((s, f"req-{i}", 1, i + s - 1, 0) for i in range(700) for s in (3, 4))


@pytest.mark.parametrize("kind", ["python", "native"])
@pytest.mark.parametrize("seed", range(6))
def test_decode_log_runs_expand_to_exactly_the_rows_added(kind, seed):
    """Steps shaped like vLLM's (requests leave from anywhere, join at the end, come back preempted,
    sometimes out of order; a step skipped; speculative token counts; new blocks; takes in between):
    the runs handed over expand to exactly the rows added, whatever they were cut into."""
    import random

    if kind == "native" and buffers._columns is None:
        pytest.skip(f"native logs not built: {buffers.NATIVE_MISSING}")
    rng = random.Random(seed)
    log = buffers.DecodeLog() if kind == "python" else buffers.NativeDecodeLog()
    running: list[str] = []
    computed: dict[str, int] = {}
    added, got, step, next_id, runs = [], [], 0, 0, 0
    for _ in range(300):
        step += 2 if rng.random() < 0.03 else 1  # now and then a step with no decode rows
        for rid in list(running):
            if rng.random() < 0.05:
                running.remove(rid)  # finished or preempted
        while len(running) < 40 and rng.random() < 0.7:
            rid = f"req-{next_id}" if rng.random() < 0.9 or not computed else rng.choice(list(computed))
            next_id += 1
            if rid not in running:
                running.append(rid)
                computed[rid] = computed.get(rid, rng.randrange(100)) + rng.randrange(3)
        if rng.random() < 0.05 and len(running) > 2:  # out of order, past the walk's lookahead too
            i, k = rng.randrange(len(running)), rng.randrange(len(running))
            running[i], running[k] = running[k], running[i]
        ids = [(r + "#")[:-1] for r in running] if rng.random() < 0.02 else list(running)  # other str objects
        skip = sorted(rng.sample(range(len(ids)), k=min(len(ids), rng.randrange(3)))) or None
        sched = {r: rng.choice((1, 1, 1, 3)) for r in ids} if rng.random() < 0.2 else None
        news = [([7] * rng.randrange(1, 3),) if rng.random() < 0.05 else None for _ in ids]
        comps = [computed[r] for r in ids]
        for i, rid in enumerate(ids):
            if skip and i in skip:
                continue
            t = sched[rid] if sched else 1
            added.append((step, rid, t, comps[i], len(news[i][0]) if news[i] else 0))
        log.add(step, ids, comps, news, skip, sched)
        for rid in ids:
            computed[rid] += sched[rid] if sched else 1
        if rng.random() < 0.05:
            cols = log.take()
            if cols is not None:
                got += expanded(cols)
                runs += len(cols["step"])
    cols = log.take()
    if cols is not None:
        got += expanded(cols)
        runs += len(cols["step"])
    assert sorted(got) == sorted(added) and len(added) > 5000
    assert runs < len(added) / 2  # runs, not a row each (this workload cuts them often)


class DecodeRunsModel:
    """The native DecodeLog's runs by its rule: a request's row goes on with the run of its row in the last
    call (the same str object: the log matches ids by identity) when this call's step follows that one,
    with the same tokens, computed grown by them and no new block; any other row opens a run. take() hands
    every run over and forgets the last call."""

    def __init__(self):
        self.runs: list[list] = []  # [request id, first step, steps, tokens, computed before, new blocks]
        self.last: dict[int, tuple] = {}  # id(request id object) -> (run, computed, tokens)
        self.last_step = None

    def add(self, step, ids, comps, news, sched):
        cur = {}
        for i, rid in enumerate(ids):
            tokens = sched[rid] if sched else 1
            blocks = len(news[i][0]) if news[i] else 0
            last = self.last.get(id(rid))
            if (last is not None and self.last_step == step - 1 and blocks == 0 and tokens == last[2]
                    and comps[i] == last[1] + last[2]):
                run = last[0]
                self.runs[run][2] += 1
            else:
                run = len(self.runs)
                self.runs.append([rid, step, 1, tokens, comps[i], blocks])  # (holds the id object, as the log)
            cur[id(rid)] = (run, comps[i], tokens)
        self.last, self.last_step = cur, step

    def take(self) -> list[tuple]:
        runs, self.runs, self.last = self.runs, [], {}
        return sorted(map(tuple, runs))


@native_only
@pytest.mark.parametrize("seed", range(4))
def test_decode_log_steady_steps_cut_the_runs_of_its_rule(seed):
    """A busy engine's steps: mostly the same requests in the same order a token each (the native log's
    in-place path), now and then a new block, a computed count that jumps, a speculative step, a step
    skipped, a request leaving or joining, an equal id in another str object, a take. The native log cuts
    exactly the runs of its rule (DecodeRunsModel), and they expand to the rows added."""
    import random

    rng = random.Random(seed)
    log, model = buffers.NativeDecodeLog(), DecodeRunsModel()
    running = [f"req-{i}" for i in range(64)]
    computed = {r: 500 + 7 * i for i, r in enumerate(running)}
    added, got, want = [], [], []
    step, next_id = 0, 64

    def take():
        cols = log.take()
        runs = table(cols, "decode_runs").to_pylist() if cols is not None else []
        got.extend(sorted((r["request_id"], r["step"], r["steps"], r["tokens"], r["computed_before"], r["new_blocks"])
                          for r in runs))
        want.extend(model.take())

    for _ in range(400):
        step += 2 if rng.random() < 0.01 else 1
        if rng.random() < 0.03:
            running.pop(rng.randrange(len(running)))
        if rng.random() < 0.03:
            running.append(f"req-{next_id}")
            computed[running[-1]] = rng.randrange(1000)
            next_id += 1
        for r in running:
            if rng.random() < 0.005:
                computed[r] += 5  # a jump (a chunk this log did not see): a new run
        ids = [(r + "#")[:-1] for r in running] if rng.random() < 0.01 else list(running)
        news = [([3],) if rng.random() < 0.04 else None for _ in ids]
        sched = {r: 2 for r in ids} if rng.random() < 0.02 else None
        comps = [computed[r] for r in ids]
        for i, rid in enumerate(ids):
            added.append((step, rid, sched[rid] if sched else 1, comps[i], len(news[i][0]) if news[i] else 0))
        log.add(step, ids, list(comps), news, None, sched)
        model.add(step, ids, comps, news, sched)
        for r in ids:
            computed[r] += sched[r] if sched else 1
        if rng.random() < 0.02:
            take()
    take()
    assert got == want and len(got) < len(added) / 5
    rows = sorted((first + j, rid, tokens, before + j * tokens, blocks if j == 0 else 0)
                  for rid, first, steps, tokens, before, blocks in got for j in range(steps))
    assert rows == sorted(added) and len(added) > 20000


@native_only
def test_decode_log_steady_step_errors_change_nothing():
    """A step with the same requests in the same order whose values the in-place path cannot take: the
    general path raises as for any step, and the log is as before."""
    log = buffers.NativeDecodeLog()
    log.add(1, ["a", "b"], [1, 2], [None, None], None, None)
    with pytest.raises(TypeError):
        log.add(2, ["a", "b"], [2, "x"], [None] * 2, None, None)
    with pytest.raises(OverflowError):
        log.add(2, ["a", "b"], [2, 1 << 40], [None] * 2, None, None)
    with pytest.raises(OverflowError):
        log.add(2, ["a", "b"], [2, -1], [None] * 2, None, None)
    with pytest.raises(TypeError):
        log.add(2, ["a", "b"], [2, 3], [None, 7], None, None)  # new block ids that are no sequence
    assert log.rows == 2
    log.add(2, ["a", "b"], [2, 3], [None, ([5, 6],)], None, None)
    assert expanded(log.take()) == [(1, "a", 1, 1, 0), (1, "b", 1, 2, 0), (2, "a", 1, 2, 0), (2, "b", 1, 3, 2)]


@pytest.mark.parametrize("kind", ["python", "native"])
def test_decode_log_errors_change_nothing(kind):
    if kind == "native" and buffers._columns is None:
        pytest.skip(f"native logs not built: {buffers.NATIVE_MISSING}")
    log = buffers.DecodeLog() if kind == "python" else buffers.NativeDecodeLog()
    log.add(1, ["a", "b"], [1, 2], [None, None], None, None)
    with pytest.raises(ValueError):
        log.add(2, ["a"], [1, 2], [None], None, None)
    with pytest.raises(KeyError):
        log.add(2, ["a", "b"], [2, 3], [None] * 2, None, {"a": 1})
    if kind == "native":  # the Python log converts at take(); the native one reads each value now
        with pytest.raises(TypeError):
            log.add(2, ["a", "b", "c"], [2, 3, "x"], [None] * 3, None, None)  # fails at its third row
        with pytest.raises(TypeError):
            log.add(2, ["a", 7], [2, 3], [None] * 2, None, None)  # an id that is not a str
        with pytest.raises(UnicodeEncodeError):
            log.add(2, ["a", "b\udcff"], [2, 3], [None] * 2, None, None)  # an id with no UTF-8
    assert log.rows == 2
    log.add(2, ["a", "c"], [2, 5], [None, None], None, None)
    assert expanded(log.take()) == [(1, "a", 1, 1, 0), (1, "b", 1, 2, 0), (2, "a", 1, 2, 0), (2, "c", 1, 5, 0)]


def test_damaged_decode_runs_are_refused_in_one_line():
    from kvtrace.errors import KvtraceError
    from kvtrace.format.shards import expand_decode_runs

    def batch(steps, computed=0):
        return table({"step": [1], "steps": [steps], "request_id": ["r"], "tokens": [1],
                      "computed_before": [computed], "new_blocks": [0]}, "decode_runs").to_batches()[0]

    assert expand_decode_runs(batch(3)).num_rows == 3
    for bad in (batch(0), batch(-4), batch(1 << 30), batch(3, computed=2**31 - 2), batch(3, computed=None)):
        with pytest.raises(KvtraceError, match="decode_runs.*not a shard kvtrace wrote"):
            expand_decode_runs(bad)


# ---- a real driven scheduler: the same tables with either log ---------------------------------------
@pytest.mark.vllm
@native_only
def test_native_and_python_logs_record_the_same_run(tmp_path, monkeypatch):
    """bench_host_probes' workload (shared prefixes, preemptions), smaller: every row of block_events
    and step_requests equal between the two, timestamps aside."""
    from kvtrace.demo.model import ensure_tiny_model
    from tests.helpers.driven_scheduler import DrivenConfig, read_rows, record_driven, shared_prefix_prompts

    model = str(ensure_tiny_model())
    cfg = DrivenConfig(num_blocks=64, max_num_seqs=32, max_num_batched_tokens=512)
    prompts = shared_prefix_prompts(48, 4, 256, 40)

    def scenario(d):
        for i, p in enumerate(prompts):
            d.add(f"r{i}", p, 64)  # 296 prompt tokens fill 10 blocks; decoding needs 2 more each
        return d.run()

    results = {}
    for kind in ("native", "python"):
        make = {"native": (buffers.block_log, buffers.decode_log),
                "python": (buffers.BlockLog, buffers.DecodeLog)}[kind]
        monkeypatch.setattr("kvtrace.probes.vllm.kv_blocks.block_log", make[0])
        monkeypatch.setattr("kvtrace.probes.vllm.scheduler.decode_log", make[1])
        session = tmp_path / kind
        steps = record_driven(session, model, cfg, scenario)
        results[kind] = {t: [{k: v for k, v in r.items() if k != "ts_ns"} for r in read_rows(session, t)]
                         for t in ("block_events", "step_requests", "preemptions")}
        results[kind]["steps_run"] = steps
    native, python = results["native"], results["python"]
    assert len(native["preemptions"]) > 0  # the workload preempts
    assert {r["event"] for r in native["block_events"]} >= {"alloc", "free", "touch", "cache", "evict"}
    # Decode rows come as runs, which the two logs end in different orders: compared by step and request.
    for t in ("step_requests",):
        for kind in (native, python):
            kind[t].sort(key=lambda r: (r["step"], r["request_id"]))
    for t in ("block_events", "step_requests"):
        assert len(native[t]) == len(python[t]) > 0
        assert native[t] == python[t], t


@pytest.mark.vllm
@native_only
def test_a_block_hook_that_raises_switches_its_probe_off_and_vllm_finishes(tmp_path):
    """The kv_blocks probe's fault injection runs inside its BlockHook (C): the first allocation raises in
    the probe, which is switched off (every hook of it), counted and recorded; vLLM's calls go on, every
    request finishes, and the other probes keep recording."""
    import json

    from kvtrace.demo.model import ensure_tiny_model
    from tests.helpers.driven_scheduler import DrivenConfig, read_rows, record_driven

    left = []

    def scenario(d):
        from vllm.v1.core.block_pool import BlockPool

        assert type(BlockPool.get_new_blocks).__name__ == "BlockHook"
        for i in range(6):
            d.add(f"r{i}", list(range(100 + i, 160 + i)), 4)
        out = d.run()
        left.extend(d.sched.requests)  # vLLM drops a request once it has finished
        assert not BlockPool.get_new_blocks.enabled and not BlockPool.touch.enabled
        return out

    record_driven(tmp_path, str(ensure_tiny_model()), DrivenConfig(num_blocks=64), scenario,
                  options={"inject_fault": "kv_blocks"})
    assert left == []  # every request ran to its end
    proc = json.loads(next((tmp_path / "procs").glob("*/proc.json")).read_text())
    assert proc["probes"]["kv_blocks"]["status"] == "failed" and "injected fault" in proc["probes"]["kv_blocks"]["reason"]
    assert proc["probe_faults"] == {"kv_blocks": 1}
    assert read_rows(tmp_path, "block_events") == []  # the first row was the one that raised
    assert {r["request_id"] for r in read_rows(tmp_path, "request_events") if r["event"] == "finished"} == {
        f"r{i}" for i in range(6)}


# ---- the recorder's row logs: the same batches as the tuples' conversion ---------------------------
def _value_strategy(t: pa.DataType, nullable: bool = True):
    """Values of Arrow type `t`; list items are never null. (Not a filter on a nullable strategy:
    rejecting half the draws fails Hypothesis' health check at random, 1 run in ~10.)"""
    from hypothesis import strategies as st

    if pa.types.is_string(t):
        values = st.text(max_size=12)
    elif pa.types.is_list(t):
        values = st.lists(_value_strategy(t.value_type, nullable=False), max_size=5)
    else:
        bits = t.bit_width
        values = st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
    return st.one_of(st.none(), values) if nullable else values


@native_only
@pytest.mark.parametrize("table", [t for t in __import__("kvtrace.format.schema", fromlist=["TABLES"]).TABLES if t != "drops"])
def test_row_log_batches_equal_the_tuples_conversion(table):
    """For every table: any rows that fit its schema (nulls, empty and non-ASCII text, lists, each
    integer width's limits) give the batch `rows_to_batch` makes of the same tuples."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvtrace.format import schema
    from kvtrace.format.shards import rows_to_batch

    row = st.tuples(*(_value_strategy(c.type) for c in schema.TABLES[table]))

    @settings(max_examples=60, deadline=None)
    @given(st.lists(row, min_size=1, max_size=20))
    def check(rows):
        log = buffers.row_log(table, 1 << 20)
        for r in rows:
            log.append(r)
        assert len(log) == len(rows)
        batch, bad, over = log.take()
        assert (bad, over) == (0, 0)
        assert batch.equals(rows_to_batch(table, rows))
        assert len(log) == 0 and log.take() == (None, 0, 0)

    check()


@native_only
def test_row_log_counts_rows_that_do_not_fit_and_keeps_the_others_whole():
    from kvtrace.format.shards import rows_to_batch

    log = buffers.row_log("request_events", max_rows=5)
    good = [(1, 2, "r1", "queued", 16, None), (3, 4, None, "arrival", -5, "x")]
    log.append(good[0])
    log.append((1, 2, "r", "queued"))  # too short
    log.append((1, 2, "r", "queued", 2**70, None))  # out of int64's range, at the 5th column
    log.append((1, 2, "r", "queued", 16, 7))  # not a str, in the last column
    log.append(["not", "a", "tuple", 1, 2, 3])
    log.extend([good[1]])
    batch, bad, over = log.take()
    assert (bad, over) == (4, 0)
    assert batch.equals(rows_to_batch("request_events", good))  # no partial row left behind
    for i in range(7):
        log.append((i, i, "r", "e", i, None))
    batch, bad, over = log.take()
    assert (batch.num_rows, bad, over) == (5, 0, 2)  # past max_rows: counted, not stored
    lists = buffers.row_log("prefix_lookups", 10)
    lists.append((1, 1, "r", 1, 1, 1, 1, 1, [1, "x"], None, 0))  # a bad list item
    lists.append((1, 1, "r", 1, 1, 1, 1, 1, [H[0], 5], None, 0))  # a block hash stands for its hash64
    batch, bad, _ = lists.take()
    assert bad == 1 and batch.column("missed_hashes").to_pylist() == [[buffers.hash64(H[0]), 5]]


@native_only
def test_row_log_stages_rows_and_keeps_its_limits():
    """Rows staged between takes come out in order after many takes (the stage is reused), a null in
    every column position is kept, and a log of more columns than a row's null mask holds is refused."""
    from kvtrace.format.shards import rows_to_batch
    from kvtrace.record import _columns

    log = buffers.row_log("request_events", max_rows=1 << 20)
    for take in range(3):
        rows = [(t, take, None if t % 3 else f"r{t}", "e" * (t % 5), None if t % 2 else t, None)
                for t in range(1000 * take, 1000 * take + 700)]
        log.extend(rows)
        batch, bad, over = log.take()
        assert (bad, over) == (0, 0) and batch.equals(rows_to_batch("request_events", rows))
    # Ints of one, two and three 30-bit digits, either sign (the native log reads up to two directly).
    edges = [0, 1, -1, 2**30 - 1, 2**30, -(2**30), 2**60 - 1, 2**60, -(2**60) + 1, -(2**60), 2**63 - 1, -(2**63)]
    rows = [(x, ~x, "r", "e", None, None) for x in edges]
    log.extend(rows)
    batch, bad, over = log.take()
    assert (bad, over) == (0, 0) and batch.equals(rows_to_batch("request_events", rows))
    _columns.RowLog("q" * 64)
    with pytest.raises(ValueError, match="at most 64 columns"):
        _columns.RowLog("q" * 65)


def test_recorder_counts_a_bad_row_as_dropped(tmp_path, capsys):
    """A probe's row that does not fit its table (a kvtrace bug) is dropped and counted, with or
    without the native logs, and the rest of the table is written."""
    from kvtrace.record.recorder import Recorder

    rec = Recorder(tmp_path, "engine", {"flush_interval_s": 3600})
    try:
        events = rec.buffer("request_events")
        events.append((1, 2, "r1", "queued", 16, None))
        events.append((1, 2, "r1", "queued", "sixteen", None))
        rec.flush()
        assert rec.rows_written["request_events"] == (1 if buffers.native() else 0)
        assert rec.dropped["request_events"]["bad-row"] == (1 if buffers.native() else 2)
    finally:
        rec.close()
    assert "do not fit the schema" in capsys.readouterr().err


# ---- reading vLLM's objects quickly, and falling back ------------------------------------------------
class LooseContext:
    """A ctx that is not EngineContext (no slots): the native log reads it by name."""

    def __init__(self) -> None:
        self.step, self.request_id = 0, None


@pytest.mark.parametrize("kind", ["python", "native"])
@pytest.mark.parametrize("ctx_kind", ["engine", "loose"])
def test_block_log_reads_the_current_step_and_fallback_request_from_ctx(kind, ctx_kind):
    if kind == "native" and buffers._columns is None:
        pytest.skip(f"native logs not built: {buffers.NATIVE_MISSING}")
    from kvtrace.record.context import EngineContext

    c = EngineContext() if ctx_kind == "engine" else LooseContext()
    log = buffers.BlockLog(c) if kind == "python" else buffers.NativeBlockLog(c, buffers.caller_request_id)
    c.step = 4
    manager("r1", log.touch, POOL, [Block(1)])
    c.step, c.request_id = 5, "from-ctx"
    no_request(log.touch, POOL, [Block(2)])  # no request argument above: ctx.request_id names it
    del c.request_id  # an empty slot (or no attribute): no request at all, not an error
    c.step = 6
    no_request(log.touch, POOL, [Block(3)])
    rows = table(log.take(), "block_events").to_pylist()
    assert [(r["step"], r["request_id"], r["block_ids"]) for r in rows] == [
        (4, "r1", [1]), (5, "from-ctx", [2]), (6, None, [3])]


@dataclass
class PrivateHashBlock:
    """Like vLLM's KVCacheBlock: the hash in `_block_hash`, `block_hash` a property over it."""

    block_id: int
    _block_hash: Any = None

    @property
    def block_hash(self) -> Any:
        raise AssertionError("read through the property: hash_attr was not used")


@pytest.mark.parametrize("kind", ["python", "native"])
def test_block_log_reads_hashes_from_the_attribute_it_is_given(kind):
    if kind == "native" and buffers._columns is None:
        pytest.skip(f"native logs not built: {buffers.NATIVE_MISSING}")
    if kind == "python":
        log = buffers.BlockLog(ctx, hash_attr="_block_hash")
    else:
        log = buffers.NativeBlockLog(ctx, buffers.caller_request_id, hash_attr="_block_hash")
    blocks = [PrivateHashBlock(1, H[0]), PrivateHashBlock(2, None), PrivateHashBlock(3, H[1])]
    log.cache(Request("r"), blocks, 0, 3, 0)
    rows = table(log.take(), "block_events").to_pylist()
    assert [(r["event"], r["block_ids"], r["block_hashes"]) for r in rows] == [
        ("cache", [1, 3], [buffers.hash64(H[0]), buffers.hash64(H[1])])]


def test_hash_attribute_is_what_vllms_block_hash_returns():
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvtrace.probes.vllm.kv_blocks import hash_attribute

    attr = hash_attribute()
    block = KVCacheBlock(5)
    block._block_hash = H[2]
    assert getattr(block, attr) is block.block_hash
    assert attr == "_block_hash"  # vLLM 0.32: the property returns the field as it is


def test_admission_watch_forwards_every_attribute_to_the_manager():
    from kvtrace.probes.vllm.scheduler import _AdmissionWatch

    class Manager:
        def __init__(self) -> None:
            self.block_pool = "pool"

        def get_computed_blocks(self, request):
            return ("blocks of", request)

    watch = type("Watch", (_AdmissionWatch,), {})()
    with pytest.raises(AttributeError):
        getattr(watch, "block_pool")  # noqa: B009 - not armed: no manager to forward to
    kvm = Manager()
    object.__setattr__(watch, "_kvm", kvm)
    for _ in range(2):  # the first read makes a forwarding property, the second goes through it
        assert watch.block_pool == "pool"
        assert watch.get_computed_blocks("r") == ("blocks of", "r")
    assert isinstance(type(watch).__dict__["block_pool"], property)
    watch.block_pool = "new pool"  # a write goes to the manager too
    assert kvm.block_pool == "new pool" and watch.block_pool == "new pool"
    kvm.prefix_cache_stats = 1  # rebound on the manager: seen through the watch
    assert watch.prefix_cache_stats == 1
    kvm.prefix_cache_stats = 2
    assert watch.prefix_cache_stats == 2
    for _ in range(2):  # also once the forwarding property exists
        with pytest.raises(AttributeError):
            getattr(watch, "no_such_name")  # noqa: B009


def test_proc_json_is_rewritten_when_more_than_its_counts_changed(tmp_path, monkeypatch):
    """A flush rewrites proc.json only when something besides the row counts changed (a drop, a probe's
    status, a warning; not a status set again to what it was) or PROC_REFRESH_S after the last write;
    its counts lag the shards, never lead."""
    import json

    from kvtrace.record import recorder as recorder_module
    from kvtrace.record.recorder import Recorder

    monkeypatch.setattr(recorder_module, "PROC_REFRESH_S", 3600.0)
    rec = Recorder(tmp_path / "s", "engine", {"flush_interval_s": 3600})
    proc = rec.dir / "proc.json"

    def written(table):
        return json.loads(proc.read_text())["rows_written"][table]

    rec.flush()
    rec.buffer("steps").append(tuple([1] + [None] * 21))
    rec.flush()
    assert written("steps") == 0 and rec.rows_written["steps"] == 1  # only a count changed: not rewritten
    rec.set_probe_status("scheduler", "attached")
    rec.flush()
    assert written("steps") == 1 and json.loads(proc.read_text())["probes"]["scheduler"]["status"] == "attached"
    rec.buffer("steps").append(tuple([2] + [None] * 21))
    rec.set_probe_status("scheduler", "attached")  # installed again, as it was: nothing new to say
    rec.flush()
    assert written("steps") == 1 and rec.rows_written["steps"] == 2
    rec.count_drop("steps", 3, "buffer-cap")
    rec.flush()
    assert written("steps") == 2 and json.loads(proc.read_text())["dropped"] == {"steps": {"buffer-cap": 3}}
    rec.buffer("steps").append(tuple([3] + [None] * 21))
    monkeypatch.setattr(recorder_module, "PROC_REFRESH_S", 0.0)  # the refresh interval is over
    rec.flush()
    assert written("steps") == 3
    rec.buffer("steps").append(tuple([4] + [None] * 21))
    monkeypatch.setattr(recorder_module, "PROC_REFRESH_S", 3600.0)
    rec.close()  # closing always writes it
    assert written("steps") == 4 and json.loads(proc.read_text())["status"] == "complete"


def test_recorder_writes_a_flushs_hand_overs_as_one_batch(tmp_path):
    """The logs hand a table's rows over several times between two flushes: the flush writes them as one
    IPC batch (one message and one write() instead of one per hand-over), rows in their order, and never
    more than the recorder's batch size in one batch."""
    import numpy as np
    import pyarrow.ipc as ipc

    from kvtrace.record import recorder as recorder_mod
    from kvtrace.record.recorder import Recorder

    def runs(first_step: int, n: int) -> dict:
        return {"step": np.arange(first_step, first_step + n, dtype=np.int64), "steps": np.ones(n, np.int32),
                "request_id": pa.array([f"r{first_step + i}" for i in range(n)]),
                "tokens": np.ones(n, np.int32), "computed_before": np.zeros(n, np.int32),
                "new_blocks": np.zeros(n, np.int32)}

    rec = Recorder(tmp_path, "engine", {"flush_interval_s": 3600})
    try:
        for first in (0, 10, 30):
            rec.append_columns("decode_runs", runs(first, 10 if first < 30 else 5))
        rec.flush()
    finally:
        rec.close()
    (shard,) = sorted(rec.dir.glob("decode_runs.*.arrows"))
    batches = list(ipc.open_stream(pa.OSFile(str(shard))))
    assert [b.num_rows for b in batches] == [25]
    assert batches[0].column("step").to_pylist() == [*range(0, 20), *range(30, 35)]

    # Batches are joined only while they fit the batch size; a bigger one is cut, order kept.
    parts = [pa.RecordBatch.from_pydict({"x": list(range(a, b))}) for a, b in ((0, 3), (3, 5), (5, 9), (9, 10))]
    joined = recorder_mod._joined(parts, max_rows=5)
    assert [b.num_rows for b in joined] == [5, 5]
    assert [v for b in joined for v in b.column("x").to_pylist()] == list(range(10))


@native_only
def test_arrow_batch_imports_the_logs_bytes_as_they_lie():
    """`_columns.arrow_batch` hands column bytes to Arrow through its C data interface: every kind of
    column (fixed width, string, list; with and without a validity bitmap) reads back as built with
    pa.Array.from_buffers, and buffers too short for the rows are refused before Arrow sees them."""
    import numpy as np

    sch = pa.schema([("a", pa.int64()), ("b", pa.int16()), ("s", pa.string()), ("l", pa.list_(pa.int32()))])
    rows = 3
    ints = bytearray(np.array([1, -2, 3], np.int64).tobytes())
    valid = bytearray([0b101])  # row 1 null
    shorts = bytearray(np.array([7, 8, 9], np.int16).tobytes())
    offsets = bytearray(np.array([0, 2, 2, 5], np.int32).tobytes())
    text = bytearray(b"r1r22")
    list_ends = bytearray(np.array([0, 1, 1, 3], np.int32).tobytes())
    items = bytearray(np.array([10, 11, 12], np.int32).tobytes())
    spec = [("f", 8, None, ints), ("f", 2, valid, shorts), ("s", valid, offsets, text), ("l", None, list_ends, 4, items)]
    batch = buffers._imported(rows, spec, sch)
    assert batch.schema.equals(sch)
    assert batch.to_pylist() == [
        {"a": 1, "b": 7, "s": "r1", "l": [10]},
        {"a": -2, "b": None, "s": None, "l": []},
        {"a": 3, "b": 9, "s": "r22", "l": [11, 12]},
    ]
    del spec, ints, items  # the batch keeps the bytes it points into
    assert batch.column("l").to_pylist() == [[10], [], [11, 12]] and batch.column("a").to_pylist() == [1, -2, 3]

    with pytest.raises(ValueError, match="column 0: buffers shorter than 3 rows"):
        buffers._columns.arrow_batch(rows, [("f", 8, None, bytearray(16))])
    with pytest.raises(ValueError, match="column 0: buffers shorter"):  # offsets past the text
        buffers._columns.arrow_batch(rows, [("s", None, offsets, bytearray(b"r1"))])
    with pytest.raises(ValueError, match="column 1: unknown kind"):
        buffers._columns.arrow_batch(rows, [("f", 8, None, bytearray(24)), ("x", None)])
    with pytest.raises(TypeError, match="not a bytearray"):
        buffers._columns.arrow_batch(rows, [("f", 8, None, b"\0" * 24)])
    capsule, _ = buffers._columns.arrow_batch(rows, [("f", 8, None, bytearray(24))])
    del capsule  # never imported: the capsule releases the structs itself


def test_proc_json_says_what_the_writer_thread_spent(tmp_path):
    """The writer thread reads its own CPU clock after each flush, and the closed proc.json keeps it
    (what writing shards took from the recorded process; bench/profile_engine_thread.py reads it)."""
    import json
    import time

    from kvtrace.record.recorder import Recorder

    rec = Recorder(tmp_path / "s", "engine", {"flush_interval_s": 0.01})
    for i in range(2000):
        rec.buffer("steps").append(tuple([i] + [None] * 21))
    deadline = time.monotonic() + 10
    while rec.writer_cpu_s == 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    rec.close()
    spent = json.loads((rec.dir / "proc.json").read_text())["writer_cpu_s"]
    assert 0 < spent < 10 and spent == round(rec.writer_cpu_s, 6)
