"""KV block and prefix-cache probes (EngineCore).

`kv_blocks` patches `vllm.v1.core.block_pool.BlockPool` (get_new_blocks, free_blocks, touch,
cache_full_blocks, _maybe_evict_cached_block) and attributes each call to the request that
`KVCacheManager` was working for. One row per call, with the list of block ids (ingest unnests), so
the cost per event does not grow with the pool.

Attribution: `get_new_blocks` and `touch` are called by the per-group managers
(`SingleTypeKVCacheManager.allocate_new_blocks(request_id, ...)`, `add_local_computed_blocks(request_id,
...)`, ...), which name the request in their `request_id` argument: the wrapper reads it from the
calling frame (a few frames up at most), so only pool calls pay for attribution. Wrapping
`KVCacheManager.allocate_slots` instead, as this probe first did, cost every running request a wrapper
call every step (bench/bench_host_probes.py). `free_blocks` is attributed the same way
(`SingleTypeKVCacheManager.free(request_id)`); frees with no request behind them (deferred frees,
copy-on-write retentions) get none.

Cost: the pool methods are wrapped by `exact_wrapper` (the original's own parameter list, so CPython
keeps specialised calls), rows hold tuples made by C-level maps, and hashes are kept as vLLM's objects
until the rows are handed over, then converted together (`hashes64_array`).

`prefix_cache` patches `KVCacheManager.get_computed_blocks` (the lookup) and
`KVCacheManager.record_prefix_cache_stats` (vLLM counts a lookup there, at admission): a lookup row is
written when vLLM counts it, so our totals equal vLLM's `prefix_cache_queries` / `_hits` exactly.
"""

from __future__ import annotations

import struct
import sys
import time
from operator import attrgetter, itemgetter
from typing import Any

from kvtrace.probes.base import Probe
from kvtrace.probes.context import ctx

_now = time.monotonic_ns
_frame = sys._getframe
POOL = "vllm.v1.core.block_pool"
KVM = "vllm.v1.core.kv_cache_manager"
STM = "vllm.v1.core.single_type_kv_cache_manager"


# id(code object) -> (code, name of its request argument: "request_id", "request" or ""). Keyed by id:
# hashing a code object hashes its constants and names, every time (~3,000 instructions).
_REQUEST_ARG: dict = {}


def _request_arg(code: Any) -> str:
    args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return "request_id" if "request_id" in args else "request" if "request" in args else ""


def caller_request_id(depth: int = 2, up: int = 3) -> str | None:
    """The `request_id` (or `request`) *argument* of the nearest of `up` callers that has one, from
    frame `depth` (2 = the caller of the function calling this); else `ctx.request_id`.

    Only arguments count, never other locals: a loop variable named `request` in a caller further up
    (update_from_output has one) says nothing about whose blocks move."""
    try:
        f = _frame(depth)
    except ValueError:
        return ctx.request_id
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
    return ctx.request_id


def hash64(block_hash: Any) -> int | None:
    """First 8 bytes of a vLLM block hash as a signed int64 (group-id suffix ignored)."""
    if block_hash is None:
        return None
    if isinstance(block_hash, (bytes, bytearray)):
        return int.from_bytes(block_hash[:8], "little", signed=True)
    return hash(block_hash)  # older vLLM: a tuple-like BlockHash


_block_id = attrgetter("block_id")
_block_hash = attrgetter("block_hash")
_first, _second = itemgetter(0), itemgetter(1)
_int64_le = struct.Struct("<q").unpack_from


def hashes64(keys: Any) -> tuple:
    """`hash64` of each hash, in C-level maps (the usual bytes hashes)."""
    keys = tuple(keys)
    try:
        return tuple(map(_first, map(_int64_le, keys)))
    except (TypeError, struct.error):  # None, or a hash that is not bytes (older vLLM)
        return tuple(map(hash64, keys))


def hashes64_array(keys: list) -> Any:
    """`hash64` of each key as an Arrow int64 array, in bulk (NumPy over the joined bytes): what
    `BlockColumns` does at hand-over, so that a block event only keeps a reference to vLLM's hash."""
    import numpy as np
    import pyarrow as pa

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


def block_ids(pool: Any, blocks: Any) -> tuple:
    """Ids of `blocks` without the null block (never really allocated, touched or freed)."""
    ids = tuple(map(_block_id, blocks))
    null = pool.null_block.block_id
    return tuple(i for i in ids if i != null) if null in ids else ids


def exact_wrapper(orig: Any, body: str, env: dict) -> Any:
    """A wrapper of `orig` with orig's own parameter list instead of `*args, **kwargs`.

    CPython (3.11+) specialises calls of plain Python functions with fixed parameters: vLLM's call into
    the wrapper and the wrapper's call of the original stay "inlined" Python calls. A `*args, **kwargs`
    wrapper makes both generic (argument tuple and dict, C-level recursion): measured with callgrind,
    ~7,000 instructions per call against ~1,000, for block-pool methods called thousands of times a
    second. `body` is the wrapper's code (it may name orig's parameters, which `targets()` checks);
    `{call}` in it becomes the call of the original forwarding every parameter as declared (keyword-only
    ones by name, `*args` / `**kwargs` when orig has them), `{self}` the first parameter's name.
    """
    import inspect

    sig = inspect.signature(orig)
    params: list[str] = []
    call: list[str] = []
    ns = dict(env)
    ns["__orig"] = orig
    star = False
    for i, p in enumerate(sig.parameters.values()):
        text = p.name
        if p.default is not inspect.Parameter.empty:
            ns[f"__d{i}"] = p.default
            text += f"=__d{i}"
        if p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            call.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            params.append(f"**{p.name}")
            call.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            if not star:
                params.append("*")
                star = True
            params.append(text)
            call.append(f"{p.name}={p.name}")
        else:
            params.append(text)
            call.append(p.name)
    first = next(iter(sig.parameters), "self")
    src = f"def wrapper({', '.join(params)}):" + body.replace("{call}", f"__orig({', '.join(call)})").replace(
        "{self}", first)
    exec(compile(src, f"<kvtrace wrapper of {getattr(orig, '__qualname__', orig)}>", "exec"), ns)
    wrapper = ns["wrapper"]
    wrapper.__name__ = getattr(orig, "__name__", "wrapper")
    wrapper.__qualname__ = getattr(orig, "__qualname__", wrapper.__name__)
    return wrapper


def patch_exact(probe: Probe, owner: Any, bodies: dict[str, str], env: dict) -> None:
    """Patch each `owner.NAME` for `probe` with `exact_wrapper(original, bodies[NAME], env)`."""
    for name, body in bodies.items():
        probe.patch(owner, name, lambda orig, body=body: exact_wrapper(orig, body, env))


def after_call(handler: str, condition: str = "") -> str:
    """The `exact_wrapper` body of a wrapper that calls the original, then (while the probe is on and
    `condition` holds) the handler call `handler`, whose errors switch the probe off, never vLLM."""
    return f"""
    result = {{call}}
    if probe.enabled{condition}:
        try:
            {handler}
        except Exception as exc:
            probe.fail(exc)
    return result"""


class BlockColumns:
    """`block_events` rows kept as columns (block ids and hashes flattened, with end offsets) until
    `take()` hands them to the recorder as one RecordBatch.

    A row is a handful of list appends: no tuple per row (tuples of tuples stay tracked by the garbage
    collector until its next pass and made ~1/4 of this probe's cost), and the Arrow conversion is done
    in bulk from flat lists instead of by the writer from nested tuples. `take()` swaps the object
    first and keeps only rows complete in every column, so a take from another thread (the
    recorder's flush on SIGUSR2, just before the process ends) never writes a torn row.
    """

    __slots__ = ("ts", "step", "event", "group", "rid", "ids", "ids_end", "hashes", "hashes_end", "hashed",
                 "since_ns")
    FLUSH_ROWS = 8192
    FLUSH_NS = 250_000_000  # hand the rows to the recorder at least this often (monotonic ns)

    def __init__(self) -> None:
        self.ts: list[int] = []
        self.step: list[int] = []
        self.event: list[str] = []
        self.group: list[int] = []
        self.rid: list[str | None] = []
        self.ids: list[int] = []
        self.ids_end: list[int] = []
        self.hashes: list = []  # vLLM's own hash objects, converted in bulk by to_columns (hashes64_array)
        self.hashes_end: list[int] = []
        self.hashed: list[bool] = []
        self.since_ns = _now()

    def add(self, t: int, event: str, group: int, rid: str | None, ids: Any, hashes: Any = None) -> bool:
        """Append a row; True when it is time to `take()`."""
        self.ts.append(t)
        self.step.append(ctx.step)
        self.event.append(event)
        self.group.append(group)
        self.rid.append(rid)
        self.ids.extend(ids)
        self.ids_end.append(len(self.ids))
        if hashes is not None:
            self.hashes.extend(hashes)
        self.hashes_end.append(len(self.hashes))
        self.hashed.append(hashes is not None)
        return len(self.ts) >= self.FLUSH_ROWS or t - self.since_ns >= self.FLUSH_NS

    def to_columns(self) -> dict | None:
        n = min(len(self.ts), len(self.step), len(self.event), len(self.group), len(self.rid),
                len(self.ids_end), len(self.hashes_end), len(self.hashed))
        if not n:
            return None
        import numpy as np
        import pyarrow as pa

        ids_end, hashes_end = self.ids_end[:n], self.hashes_end[:n]
        ids = pa.array(self.ids[:ids_end[-1]], type=pa.int32())
        hashes = hashes64_array(self.hashes[:hashes_end[-1]])
        no_hashes = pa.array(np.logical_not(np.array(self.hashed[:n], dtype=bool)))
        return {
            "ts_ns": self.ts[:n], "step": self.step[:n], "event": self.event[:n], "kv_group": self.group[:n],
            "request_id": self.rid[:n],
            "block_ids": pa.ListArray.from_arrays(pa.array([0, *ids_end], type=pa.int32()), ids),
            "block_hashes": pa.ListArray.from_arrays(pa.array([0, *hashes_end], type=pa.int32()), hashes,
                                                     mask=no_hashes),
        }


class BlockPoolProbe(Probe):
    name = "kv_blocks"

    def targets(self):
        return [
            (POOL, "BlockPool.get_new_blocks", ("num_blocks",)),
            (POOL, "BlockPool.free_blocks", ("ordered_blocks",)),
            (POOL, "BlockPool.touch", ("blocks",)),
            (POOL, "BlockPool.cache_full_blocks",
             ("request", "blocks", "num_cached_blocks", "num_full_blocks", "kv_cache_group_id")),
            (POOL, "BlockPool._maybe_evict_cached_block", ("block",)),
            # The callers whose `request_id` argument attributes get_new_blocks / touch / free_blocks.
            (STM, "SingleTypeKVCacheManager.allocate_new_blocks", ("request_id",)),
            (STM, "SingleTypeKVCacheManager.add_local_computed_blocks", ("request_id",)),
            (STM, "SingleTypeKVCacheManager.free", ("request_id",)),
        ]

    def install_patches(self) -> None:
        from vllm.v1.core.block_pool import BlockPool

        probe = self
        self.cols = BlockColumns()
        inject = self.options.get("inject_fault") == self.name
        evicted: list = []  # (block id, hash) of the evictions inside the current get_new_blocks call
        in_alloc = [False]

        def on_alloc(pool: Any, blocks: Any) -> None:
            if inject:
                probe.maybe_inject_fault()
            t = _now()
            rid = caller_request_id(3)
            cols = probe.cols
            full = False
            if evicted:
                got = evicted[:]
                evicted.clear()
                full = cols.add(t, "evict", 0, rid, map(_first, got), map(_second, got))
            if blocks:
                full = cols.add(t, "alloc", 0, rid, map(_block_id, blocks))
            if full:
                probe.take()

        def on_evict(block: Any, key: Any) -> None:
            if in_alloc[0]:
                evicted.append((block.block_id, key))
            elif probe.cols.add(_now(), "evict", 0, caller_request_id(3), (block.block_id,), (key,)):
                probe.take()  # an eviction outside allocation (evict_blocks)

        def on_free(pool: Any, blocks: Any) -> None:
            ids = block_ids(pool, blocks)
            if ids and probe.cols.add(_now(), "free", 0, caller_request_id(3), ids):
                probe.take()

        def on_touch(pool: Any, blocks: Any) -> None:
            ids = block_ids(pool, blocks)
            if ids and probe.cols.add(_now(), "touch", 0, caller_request_id(3), ids):
                probe.take()

        def on_cache(request: Any, blocks: Any, num_cached: int, num_full: int, group: int) -> None:
            new = blocks[num_cached:num_full]
            keys = tuple(map(_block_hash, new))
            if None in keys:  # null or masked-out blocks were not cached
                new = [b for b, k in zip(new, keys) if k is not None]
                keys = tuple(k for k in keys if k is not None)
            if keys and probe.cols.add(_now(), "cache", group, request.request_id, map(_block_id, new), keys):
                probe.take()

        env = {"probe": probe, "on_alloc": on_alloc, "on_evict": on_evict, "on_free": on_free,
               "on_touch": on_touch, "on_cache": on_cache, "in_alloc": in_alloc, "evicted": evicted}
        # Each body names vLLM's own parameters (checked by `targets()`); `{call}` calls the original.
        bodies = {
            "get_new_blocks": """
    if not probe.enabled:
        return {call}
    in_alloc[0] = True
    evicted.clear()
    try:
        blocks = {call}
    finally:
        in_alloc[0] = False
    try:
        on_alloc({self}, blocks)
    except Exception as exc:
        probe.fail(exc)
    return blocks""",
            "_maybe_evict_cached_block": """
    if not probe.enabled:
        return {call}
    key = block.block_hash
    done = {call}
    if done:
        try:
            on_evict(block, key)
        except Exception as exc:
            probe.fail(exc)
    return done""",
            "free_blocks": """
    if not probe.enabled:
        return {call}
    ordered_blocks = list(ordered_blocks)  # may be a one-shot iterator: read it once, pass the list
    result = {call}
    try:
        on_free({self}, ordered_blocks)
    except Exception as exc:
        probe.fail(exc)
    return result""",
            "touch": after_call("on_touch({self}, blocks)"),
            "cache_full_blocks": after_call(
                "on_cache(request, blocks, num_cached_blocks, num_full_blocks, kv_cache_group_id)",
                " and num_full_blocks > num_cached_blocks"),
        }
        patch_exact(self, BlockPool, bodies, env)

    def take(self) -> None:
        """Hand the rows gathered so far to the recorder (one RecordBatch)."""
        cols, self.cols = self.cols, BlockColumns()
        batch = cols.to_columns()
        if batch is not None:
            self.rec.append_columns("block_events", batch)

    def close(self) -> None:
        if getattr(self, "cols", None) is not None:
            self.take()

    def uninstall(self) -> None:
        self.close()  # rows still held as columns would be lost otherwise
        super().uninstall()


class PrefixCacheProbe(Probe):
    name = "prefix_cache"

    def targets(self):
        return [
            (KVM, "KVCacheManager.get_computed_blocks", ("request",)),
            (KVM, "KVCacheManager.record_prefix_cache_stats", ("request", "num_hits")),
        ]

    def install_patches(self) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        out = self.rec.buffer("prefix_lookups")
        probe = self
        last_lookup: dict[str, tuple] = {}  # request -> (ts, hit_blocks) of its latest lookup
        external: dict[str, int] = {}  # request -> tokens a connector matched (set by the connector probe)
        self.external_matches = external

        def on_lookup(request: Any, result: Any) -> None:
            blocks = result[0]
            groups = blocks.blocks if hasattr(blocks, "blocks") else blocks
            last_lookup[request.request_id] = (_now(), len(groups[0]) if groups else 0)

        def on_counted(kvm: Any, request: Any, num_hits: int) -> None:
            if kvm.prefix_cache_lookup_enabled(request):
                probe.maybe_inject_fault()
                probe.on_counted_lookup(kvm, request, num_hits, last_lookup, external, out)

        env = {"probe": probe, "on_lookup": on_lookup, "on_counted": on_counted}
        bodies = {
            "get_computed_blocks": after_call("on_lookup(request, result)"),
            "record_prefix_cache_stats": after_call("on_counted({self}, request, num_hits)"),
        }
        patch_exact(self, KVCacheManager, bodies, env)

    @staticmethod
    def on_counted_lookup(kvm, request, num_hits, last_lookup, external, out) -> None:
        rid = request.request_id
        ts, hit_blocks = last_lookup.pop(rid, (_now(), 0))
        # Hashes cover hash_block_size tokens each (the group block size on single-group models).
        hash_block = getattr(kvm.block_pool, "hash_block_size", 0) or 1
        hashes = request.block_hashes
        full = len(hashes)
        query = request.num_tokens
        tail = query - full * hash_block
        missed = list(hashes64(hashes[num_hits // hash_block:]))
        ext = external.pop(rid, None)
        out.append((ts, ctx.step, rid, query, num_hits, hit_blocks, full, tail, missed, ext,
                    1 if request.num_preemptions > 0 else 0))
