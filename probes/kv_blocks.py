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
call every step (~0.4 us each, ~4% of a 256-request scheduling step; bench/bench_host_probes.py).
`free_blocks` is attributed the same way (`SingleTypeKVCacheManager.free(request_id)`); frees with no
request behind them (deferred frees, copy-on-write retentions) get none.

`prefix_cache` patches `KVCacheManager.get_computed_blocks` (the lookup) and
`KVCacheManager.record_prefix_cache_stats` (vLLM counts a lookup there, at admission): a lookup row is
written when vLLM counts it, so our totals equal vLLM's `prefix_cache_queries` / `_hits` exactly.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kvtrace.probes.base import Probe
from kvtrace.probes.context import ctx

_now = time.monotonic_ns
_frame = sys._getframe
POOL = "vllm.v1.core.block_pool"
KVM = "vllm.v1.core.kv_cache_manager"
STM = "vllm.v1.core.single_type_kv_cache_manager"


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
        args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        if "request_id" in args:  # checked on the code object first: f_locals costs ~0.5 us
            rid = f.f_locals.get("request_id")
            if isinstance(rid, str):
                return rid
        elif "request" in args:
            rid = getattr(f.f_locals.get("request"), "request_id", None)
            if isinstance(rid, str):
                return rid
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

        out = self.rec.buffer("block_events")
        probe = self
        evicted: list | None = None  # collects evictions made inside one get_new_blocks call

        def get_new_blocks(orig):
            def wrapper(pool, num_blocks, *args, **kwargs):
                nonlocal evicted
                if not probe.enabled:
                    return orig(pool, num_blocks, *args, **kwargs)
                evicted = []
                try:
                    blocks = orig(pool, num_blocks, *args, **kwargs)
                    got, evicted = evicted, None
                except BaseException:
                    evicted = None
                    raise
                try:
                    probe.maybe_inject_fault()
                    t = _now()
                    rid = caller_request_id()
                    if got:
                        out.append((t, ctx.step, "evict", 0, rid, [b for b, _ in got], [h for _, h in got]))
                    out.append((t, ctx.step, "alloc", 0, rid, [b.block_id for b in blocks], None))
                except Exception as exc:
                    probe.fail(exc)
                return blocks
            return wrapper

        def maybe_evict(orig):  # once per block handed out: keep it lean
            def wrapper(pool, block, *args, **kwargs):
                if not probe.enabled:
                    return orig(pool, block, *args, **kwargs)
                key = block.block_hash
                done = orig(pool, block, *args, **kwargs) if args or kwargs else orig(pool, block)
                if done:
                    h = hash64(key)
                    if evicted is not None:
                        evicted.append((block.block_id, h))
                    else:  # eviction outside allocation (evict_blocks, reset_prefix_cache)
                        out.append((_now(), ctx.step, "evict", 0, caller_request_id(), [block.block_id], [h]))
                return done
            return wrapper

        def free_blocks(orig):
            def wrapper(pool, ordered_blocks, *args, **kwargs):
                if not probe.enabled:
                    return orig(pool, ordered_blocks, *args, **kwargs)
                blocks = list(ordered_blocks)  # may be a one-shot iterator: read it once, pass the list
                result = orig(pool, blocks, *args, **kwargs)
                ids = [b.block_id for b in blocks if not b.is_null]
                if ids:
                    out.append((_now(), ctx.step, "free", 0, caller_request_id(), ids, None))
                return result
            return wrapper

        def touch(orig):
            def wrapper(pool, blocks, *args, **kwargs):
                result = orig(pool, blocks, *args, **kwargs)
                if probe.enabled:
                    ids = [b.block_id for b in blocks if not b.is_null]
                    if ids:
                        out.append((_now(), ctx.step, "touch", 0, caller_request_id(), ids, None))
                return result
            return wrapper

        def cache_full_blocks(orig):
            def wrapper(pool, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs):
                result = orig(pool, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
                if probe.enabled and num_full_blocks > num_cached_blocks:
                    try:
                        group = kwargs.get("kv_cache_group_id", args[1] if len(args) > 1 else 0)
                        new = [b for b in blocks[num_cached_blocks:num_full_blocks]
                               if not b.is_null and b.block_hash is not None]
                        if new:
                            out.append((_now(), ctx.step, "cache", group, request.request_id,
                                        [b.block_id for b in new], [hash64(b.block_hash) for b in new]))
                    except Exception as exc:
                        probe.fail(exc)
                return result
            return wrapper

        self.patch(BlockPool, "get_new_blocks", get_new_blocks)
        self.patch(BlockPool, "_maybe_evict_cached_block", maybe_evict)
        self.patch(BlockPool, "free_blocks", free_blocks)
        self.patch(BlockPool, "touch", touch)
        self.patch(BlockPool, "cache_full_blocks", cache_full_blocks)


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

        def get_computed_blocks(orig):
            def wrapper(kvm, request, *args, **kwargs):
                result = orig(kvm, request, *args, **kwargs)
                if probe.enabled:
                    blocks = result[0]
                    groups = blocks.blocks if hasattr(blocks, "blocks") else blocks
                    last_lookup[request.request_id] = (_now(), len(groups[0]) if groups else 0)
                return result
            return wrapper

        def record_stats(orig):
            def wrapper(kvm, request, num_hits, *args, **kwargs):
                result = orig(kvm, request, num_hits, *args, **kwargs)
                if probe.enabled and kvm.prefix_cache_lookup_enabled(request):
                    try:
                        probe.maybe_inject_fault()
                        probe.on_counted_lookup(kvm, request, num_hits, last_lookup, external, out)
                    except Exception as exc:
                        probe.fail(exc)
                return result
            return wrapper

        self.patch(KVCacheManager, "get_computed_blocks", get_computed_blocks)
        self.patch(KVCacheManager, "record_prefix_cache_stats", record_stats)

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
        missed = [hash64(h) for h in hashes[num_hits // hash_block:]]
        ext = external.pop(rid, None)
        out.append((ts, ctx.step, rid, query, num_hits, hit_blocks, full, tail, missed, ext,
                    1 if request.num_preemptions > 0 else 0))
