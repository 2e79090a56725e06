"""KV block and prefix-cache probes (EngineCore).

`kv_blocks` patches `vllm.v1.core.block_pool.BlockPool` (get_new_blocks, free_blocks, touch,
cache_full_blocks, _maybe_evict_cached_block) and attributes each call to the request that
`KVCacheManager` was working for. One row per call, with the list of block ids (ingest unnests), so
the cost per event does not grow with the pool. The rows are kept by a `BlockLog` (record/buffers.py,
native in `_columns.c` where it builds) until they are handed to the recorder.

Attribution: `get_new_blocks` and `touch` are called by the per-group managers
(`SingleTypeKVCacheManager.allocate_new_blocks(request_id, ...)`, `add_local_computed_blocks(request_id,
...)`, ...), which name the request in their `request_id` argument: the wrapper reads it from the
calling frame (a few frames up at most), so only pool calls pay for attribution. Wrapping
`KVCacheManager.allocate_slots` instead, as this probe first did, cost every running request a wrapper
call every step (bench/bench_host_probes.py). `free_blocks` is attributed the same way
(`SingleTypeKVCacheManager.free(request_id)`); frees with no request behind them (deferred frees,
copy-on-write retentions) get none.

Cost: where the native log is built, each pool method is replaced by a `BlockHook` (`_columns.c`), a
method descriptor written in C that calls vLLM's function and then makes the row, with no Python frame
of its own: per pool call, a Python wrapper's frame (its code, globals and the probe's attributes, cold
again after vLLM's work in between) was most of the probe's cost. Elsewhere (no compiler,
KVTRACE_NATIVE=0) the methods are wrapped by `exact_wrapper` (the original's own parameter list, so
CPython keeps specialised calls), and each wrapper makes one call into the log after vLLM's method
returns. Both make the same rows (tests/unit/record/test_buffers.py).

Pools: the patch is class-wide, so a second BlockPool in the EngineCore (an offload tier's, such as
SimpleCPUOffloadConnector's CPU blocks, numbered from 0 like the GPU's) reaches the same hooks. The log
routes each call by its pool (`BlockLog.for_pool`): the engine's pool, which a wrapper of
`KVCacheManager.__init__` names, keeps `block_events`; any other gets a log of its own, whose rows go to
`offload_block_events` with the pool's name (`POOL_NAMES`, filled by the connector probe). docs/connectors.md.

`prefix_cache` patches where vLLM counts a lookup: `KVCacheManager.record_prefix_cache_stats` (vLLM 0.27
and later: at admission, with the tokens the local prefix cache hit), or in vLLM 0.26
`get_computed_blocks`, which counts inside itself. A lookup row is written when vLLM counts it, so our
totals equal vLLM's `prefix_cache_queries` / `_hits` exactly. From 0.27 the lookup itself
(`get_computed_blocks`, or `get_computed_blocks_for_connector` with some connectors) is not wrapped: it
runs for every waiting request vLLM considers, admitted or not. Hit blocks are the hit tokens over
group 0's block size (vLLM truncates every group's hit to whole blocks of a common length).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from kvtrace.probes.base import Hook, Probe, after_call, patch_exact, request_lengths_are_fields
from kvtrace.record.buffers import NATIVE_MISSING, block_hook, block_log, hashes64, native
from kvtrace.record.context import ctx

_now = time.monotonic_ns
POOL = "vllm.v1.core.block_pool"
KVM = "vllm.v1.core.kv_cache_manager"
STM = "vllm.v1.core.single_type_kv_cache_manager"


def hash_attribute() -> str:
    """The KVCacheBlock attribute to read a block's hash from: `_block_hash`, the field behind vLLM's
    `block_hash` property, where the property returns it as it is (checked on a block made here): a
    plain attribute read, where the property is a Python call per block (thousands a second). Else
    the property."""
    try:
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        block, mark = KVCacheBlock(0), object()
        block._block_hash = mark
        if block.block_hash is mark:
            return "_block_hash"
    except Exception:
        pass
    return "block_hash"


# Names of BlockPools other than the engine's own, given by whoever knows what they are (the connector
# probe names the pools a connector holds, e.g. "SimpleCPUOffloadConnector.scheduler_manager.cpu_block_pool").
# Weak: a dropped pool's name goes with it.
POOL_NAMES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def name_pools(owner: Any, prefix: str, depth: int = 3) -> int:
    """Name the BlockPools `owner` holds (breadth first, through vLLM objects and short lists of them,
    `depth` attributes deep) after their attribute path: `prefix.attr.attr`. Returns how many were named."""
    from vllm.v1.core.block_pool import BlockPool

    seen, level, named = {id(owner)}, [(owner, prefix)], 0
    for _ in range(depth):
        below = []
        for obj, path in level:
            try:
                items = list(vars(obj).items())
            except TypeError:  # no __dict__ (__slots__)
                continue
            for attr, value in items:
                listed = isinstance(value, (list, tuple))
                for i, v in enumerate(value[:16] if listed else (value,)):
                    if id(v) in seen or not type(v).__module__.startswith("vllm."):
                        continue
                    seen.add(id(v))
                    where = f"{path}.{attr}" + (f"[{i}]" if listed else "")
                    if isinstance(v, BlockPool):
                        POOL_NAMES.setdefault(v, where)
                        named += 1
                    else:
                        below.append((v, where))
        level = below
    return named


class BlockPoolProbe(Probe):
    name = "kv_blocks"

    # The engine's own pool is the block pool of the scheduler's KVCacheManager; the calls of any other
    # BlockPool (an offload tier's: its ids overlap the GPU's) go to `offload_block_events`.
    POOLS = Hook("pools", (((KVM, "KVCacheManager.__init__", ("kv_cache_config",)),),), required=False,
                 lost="which BlockPool a block event belongs to (offload tiers' pools share block_events)")

    @classmethod
    def hooks(cls):
        return [*super().hooks(), cls.POOLS]

    @classmethod
    def targets(cls):
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

        hash_attr = hash_attribute()
        self.log = log = block_log(hash_attr=hash_attr)
        self.rec.info["hot_path"] = "native" if native() else f"python ({NATIVE_MISSING or 'not built'})"
        env = {"probe": self, "log": log, "inject": self.options.get("inject_fault") == self.name}
        # Each body names vLLM's own parameters (checked by `targets()`); `{call}` calls the original.
        # Evictions inside get_new_blocks are held by the log until the allocation's row (begin_alloc).
        bodies = {
            "get_new_blocks": """
    if not probe.enabled:
        return {call}
    try:
        pool_log = log.for_pool({self})
    except Exception as exc:
        probe.fail(exc)
        return {call}
    pool_log.begin_alloc()
    try:
        blocks = {call}
    except BaseException:
        pool_log.end_alloc()
        raise
    try:
        if inject:
            probe.maybe_inject_fault()
        if pool_log.alloc(blocks):
            probe.take()
    except Exception as exc:
        probe.fail(exc)
    return blocks""",
            "_maybe_evict_cached_block": """
    if not probe.enabled:
        return {call}
    key = block.{hash}
    done = {call}
    if done:
        try:
            if log.for_pool({self}).evict(block.block_id, key):
                probe.take()
        except Exception as exc:
            probe.fail(exc)
    return done""",
            "free_blocks": """
    if not probe.enabled:
        return {call}
    ordered_blocks = list(ordered_blocks)  # may be a one-shot iterator: read it once, pass the list
    result = {call}
    try:
        if log.for_pool({self}).free({self}, ordered_blocks):
            probe.take()
    except Exception as exc:
        probe.fail(exc)
    return result""",
            "touch": after_call("""if log.for_pool({self}).touch({self}, blocks):
                probe.take()"""),
            "cache_full_blocks": after_call(
                """if log.for_pool({self}).cache(request, blocks, num_cached_blocks, num_full_blocks,
                                              kv_cache_group_id):
                probe.take()""", " and num_full_blocks > num_cached_blocks"),
        }
        bodies = {name: body.replace("{hash}", hash_attr) for name, body in bodies.items()}
        # Where the native log is in use, a BlockHook (C) stands in for each method instead: the same
        # rows with no Python frame per pool call (see buffers.block_hook). Each method whose hook
        # cannot be made (no native module, a parameter it could miss) keeps its Python wrapper.
        self.c_hooks = []
        hooked = {
            "get_new_blocks": ("alloc", ()),
            "free_blocks": ("free", ("ordered_blocks",)),
            "touch": ("touch", ("blocks",)),
            "cache_full_blocks": ("cache", ("request", "blocks", "num_cached_blocks", "num_full_blocks",
                                            "kv_cache_group_id")),
            "_maybe_evict_cached_block": ("evict", ("block",)),
        }
        for name, (kind, params) in hooked.items():
            before = self.maybe_inject_fault if env["inject"] and kind == "alloc" else None
            hook = block_hook(kind, getattr(BlockPool, name), log, params, self.take, self.fail, before)
            if hook is not None:
                self.c_hooks.append(hook)
                self.patch(BlockPool, name, lambda _orig, hook=hook: hook)
                del bodies[name]
        patch_exact(self, BlockPool, bodies, env)
        self.hash_attr = hash_attr
        self.pool_logs: list[tuple[str, Any]] = []  # (pool name, its BlockLog), pools other than the engine's
        self._log_of: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # pool -> its BlockLog
        if self.variant("pools") is not None:
            from vllm.v1.core.kv_cache_manager import KVCacheManager

            log.route = self.pool_log
            patch_exact(self, KVCacheManager, {"__init__": after_call("log.main_pool = {self}.block_pool")},
                        {"probe": self, "log": log})

    def pool_log(self, pool: Any) -> Any:
        """The BlockLog of a pool other than the engine's, made on its first row. The main log keeps only
        the last pool it routed, so calls alternating between two other pools ask again: one log each."""
        log = self._log_of.get(pool)
        if log is not None:
            return log
        name = POOL_NAMES.get(pool) or f"unnamed-{len(self.pool_logs) + 1}"
        log = self._log_of[pool] = block_log(hash_attr=self.hash_attr)
        self.pool_logs.append((name, log))
        self.rec.info.setdefault("block_pools", []).append(
            {"pool": name, "class": type(pool).__qualname__, "num_blocks": getattr(pool, "num_gpu_blocks", None)})
        return log

    def __setattr__(self, name: str, value: Any) -> None:
        # The hooks (C) cannot read `enabled` cheaply: each keeps its own copy, set wherever the probe's is
        # (install, fail, uninstall, a benchmark's "disabled" mode). Reads of `probe.enabled` stay plain.
        object.__setattr__(self, name, value)
        if name == "enabled":
            for hook in getattr(self, "c_hooks", ()):
                hook.enabled = bool(value)

    def take(self) -> None:
        """Hand the rows gathered so far to the recorder (one RecordBatch per pool)."""
        cols = self.log.take()
        if cols is not None:
            self.rec.append_columns("block_events", cols)
        for name, log in self.pool_logs:
            cols = log.take()
            if cols is not None:
                self.rec.append_columns("offload_block_events", with_pool(cols, name))

    def close(self) -> None:
        if getattr(self, "log", None) is not None:
            self.take()

    def uninstall(self) -> None:
        self.close()  # rows still held as columns would be lost otherwise
        if getattr(self, "log", None) is not None:
            self.log.route = None  # the log and this probe refer to each other through it
        super().uninstall()


def with_pool(cols: Any, name: str) -> Any:
    """A block_events batch (RecordBatch, or the Python log's dict of columns) with a `pool` column."""
    if isinstance(cols, dict):
        return {**cols, "pool": [name] * len(cols["ts_ns"])}
    import pyarrow as pa

    return cols.append_column("pool", pa.array([name] * cols.num_rows, pa.string()))


class PrefixCacheProbe(Probe):
    name = "prefix_cache"

    # Where vLLM counts a lookup: 0.27 and later in `record_prefix_cache_stats(request, num_hits)` (after
    # a connector's match, when it ran a lookup: `prefix_cache_lookup_enabled`); 0.26 inside
    # `get_computed_blocks(request)`, which returns the hit tokens second.
    LOOKUP = Hook("lookup", (
        ((KVM, "KVCacheManager.record_prefix_cache_stats", ("request", "num_hits")),
         (KVM, "KVCacheManager.prefix_cache_lookup_enabled", ("request",))),
        ((KVM, "KVCacheManager.get_computed_blocks", ("request",)),),
    ))

    @classmethod
    def hooks(cls):
        return [cls.LOOKUP]

    def install_patches(self) -> None:
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        out = self.rec.buffer("prefix_lookups")
        probe = self
        external: dict[str, int] = {}  # request -> tokens a connector matched (set by the connector probe)
        self.external_matches = external
        # Tokens per block hash and per group-0 block, for the manager they were last read from.
        sizes: list[Any] = [None, 1, 1]

        # A RowLog takes vLLM's block hashes as they are (each stored as its first 8 bytes); a list
        # of tuples needs them converted here.
        raw_hashes = not isinstance(out, list)
        inject = self.options.get("inject_fault") == self.name
        lens = request_lengths_are_fields()  # len(request._all_token_ids), not the property (base.is_len_of)

        env = {"probe": probe, "out": out, "sizes": sizes, "block_sizes": block_sizes, "raw_hashes": raw_hashes,
               "hashes64": hashes64, "inject": inject, "lens": lens, "external": external, "_now": _now, "ctx": ctx}
        # The lookup's row, inline in the wrapper: a handler call per lookup cost about as much as the row.
        row = """
                if inject:
                    probe.maybe_inject_fault()
                if {self} is not sizes[0]:
                    sizes[:] = [{self}, *block_sizes({self})]
                hash_block, block = sizes[1], sizes[2]
                hashes = request.block_hashes
                full = len(hashes)
                query = len(request._all_token_ids) if lens else request.num_tokens
                missed = hashes[num_hits // hash_block:]
                out.append((_now(), ctx.step, request.request_id, query, num_hits, num_hits // block, full,
                            query - full * hash_block, missed if raw_hashes else list(hashes64(missed)),
                            external.pop(request.request_id, None), 1 if request.num_preemptions > 0 else 0))"""
        if self.variant("lookup") == 0:
            patch_exact(self, KVCacheManager, {"record_prefix_cache_stats": after_call(
                "if {self}.prefix_cache_lookup_enabled(request):  # else vLLM did not count it" + row)}, env)
        else:  # vLLM 0.26: the same condition, inline; the hits are the second value returned
            patch_exact(self, KVCacheManager, {"get_computed_blocks": after_call(
                "if {self}.enable_caching and not request.skip_reading_prefix_cache:\n"
                "                num_hits = result[1]" + row)}, env)


def block_sizes(kvm: Any) -> tuple[int, int]:
    """(tokens per block hash, tokens per block of KV-cache group 0) of a KVCacheManager."""
    hash_block = getattr(kvm.block_pool, "hash_block_size", 0) or 1
    try:
        return hash_block, int(kvm.coordinator.single_type_managers[0].block_size) or hash_block
    except Exception:  # a coordinator without per-group managers: hashes and blocks alike
        return hash_block, hash_block
