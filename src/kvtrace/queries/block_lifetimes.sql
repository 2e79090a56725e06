-- name: block_lifetimes
-- description: Every KV block residency (allocation -> eviction or reallocation): lifetime, idle time before it ended, prefix-cache reuses and the gaps between them; the full-fidelity version of vLLM's sampled kv_cache_metrics.
-- params: session: restrict to one session id (default: all sessions); block_id: only this block (default: all)
-- columns: session, rank, block_id, residency (n-th allocation of this block id), alloc_step, alloc_ns (ns, the allocation: block_events' alloc row at this time names the request), alloc_t_s (s since the session's first step), cached (true when the block held a prefix-cache hash: it ended by eviction, or is open and was cached after its allocation), touches (prefix-cache hits on it), end_event (evict: its cached content was evicted | realloc: handed out again without a hash | open: still resident at the end of the trace), lifetime_ms (ms, alloc -> end; null when open), idle_before_end_ms (ms, last access (alloc or hit) -> end; null when open), held_ms (ms, alloc -> last free, the time requests referenced it; null while still referenced), first_reuse_ms (ms, alloc -> first hit), reuse_gap_mean_ms (ms, mean time between consecutive hits: (last hit - first hit) / (touches - 1))
-- Definitions follow vLLM's KVCacheMetricsCollector (birth = allocation, access = touch/prefix hit,
-- end = the block handed out again or evicted), but every block and every hit is kept (vLLM samples
-- blocks and keeps the last 4 accesses). Rows are ordered by block, then residency.
WITH sn AS (  -- sessions as small integers (sorting and partitioning on strings is much slower)
    SELECT session, row_number() OVER (ORDER BY session) AS sno
    FROM (SELECT DISTINCT session FROM block_events WHERE $session IS NULL OR session = $session)
), e AS (  -- narrow rows, as the window sorts every column it carries: k = time and event in one integer;
           -- an eviction is logged at the instant of the allocation that caused it and ends the previous residency
    SELECT
        -- one integer per (session, rank, block): session < 2048 (past it the shift raises), rank < 2^20
        (sn.sno << 52) | (CASE WHEN b.rank BETWEEN 0 AND 1048575 THEN b.rank
                               ELSE error('block_lifetimes: rank out of range') END::BIGINT << 32) | b.block_id AS blk,
        b.step, b.ts_ns * 8 + CASE b.event WHEN 'evict' THEN 0 WHEN 'alloc' THEN 1 WHEN 'touch' THEN 3 ELSE 4 END AS k
    FROM block_events b JOIN sn USING (session)
    WHERE b.event IN ('alloc', 'touch', 'free', 'evict') AND ($block_id IS NULL OR b.block_id = $block_id)
), r AS (  -- each event's residency = the block's latest allocation (k); nk = the block's next event
    SELECT *, last_value(CASE WHEN k % 8 = 1 THEN k END IGNORE NULLS) OVER w AS alloc_k,
        lead(k) OVER w AS nk
    FROM e
    WINDOW w AS (PARTITION BY blk ORDER BY k ROWS UNBOUNDED PRECEDING)
), a AS (
    SELECT blk, blk >> 52 AS sno, ((blk >> 32) & 1048575)::INTEGER AS rank, (blk & 4294967295)::INTEGER AS block_id,
        alloc_k, min(step) FILTER (k = alloc_k) AS alloc_step,
        count(*) FILTER (k % 8 = 3) AS touches,
        min(k) FILTER (k % 8 = 3) // 8 AS first_touch_ns,
        max(k) FILTER (k % 8 = 3) // 8 AS last_touch_ns,
        max(k) FILTER (k % 8 = 4) // 8 AS last_free_ns,
        min(k) FILTER (k % 8 = 0) // 8 AS evict_ns,
        max(nk) FILTER (nk % 8 = 1) // 8 AS next_alloc_ns  -- the residency's last event is followed by the next alloc
    FROM r
    WHERE alloc_k IS NOT NULL  -- not the events before the block's first allocation in the trace
    GROUP BY blk, alloc_k
), ca AS (  -- when each block last got a prefix-cache hash
    SELECT sn.sno, b.rank, b.block_id, max(b.ts_ns) AS cache_ns
    FROM block_events b JOIN sn USING (session)
    WHERE b.event = 'cache' AND ($block_id IS NULL OR b.block_id = $block_id)
    GROUP BY ALL
), c AS (
    -- cached: vLLM evicts a block's hash exactly when it hands out a block that has one, so an ended
    -- residency was cached iff it ended by eviction; an open one iff the block got a hash after its
    -- allocation (the 'cache' rows then need not go through the sort above)
    SELECT a.*, a.alloc_k // 8 AS alloc_ns, row_number() OVER (PARTITION BY a.blk ORDER BY a.alloc_k) AS residency,
        coalesce(a.evict_ns, a.next_alloc_ns) AS end_ns,
        a.evict_ns IS NOT NULL OR coalesce(ca.cache_ns >= a.alloc_k // 8, false) AS cached
    FROM a
    LEFT JOIN ca ON ca.sno = a.sno AND ca.rank = a.rank AND ca.block_id = a.block_id
     AND a.evict_ns IS NULL AND a.next_alloc_ns IS NULL
), origin AS (
    SELECT session, min(t_start_ns) AS t0 FROM steps
    WHERE $session IS NULL OR session = $session GROUP BY session
)
SELECT
    sn.session, c.rank, c.block_id, c.residency, c.alloc_step, c.alloc_ns,
    round((c.alloc_ns - o.t0) / 1e9, 6) AS alloc_t_s, c.cached, c.touches,
    CASE WHEN c.evict_ns IS NOT NULL THEN 'evict' WHEN c.next_alloc_ns IS NOT NULL THEN 'realloc' ELSE 'open' END AS end_event,
    (c.end_ns - c.alloc_ns) / 1e6 AS lifetime_ms,
    (c.end_ns - greatest(c.alloc_ns, coalesce(c.last_touch_ns, c.alloc_ns))) / 1e6 AS idle_before_end_ms,
    CASE WHEN c.last_free_ns > coalesce(c.last_touch_ns, c.alloc_ns) THEN (c.last_free_ns - c.alloc_ns) / 1e6 END AS held_ms,
    (c.first_touch_ns - c.alloc_ns) / 1e6 AS first_reuse_ms,
    (c.last_touch_ns - c.first_touch_ns) / nullif(c.touches - 1, 0) / 1e6 AS reuse_gap_mean_ms
FROM c
JOIN sn USING (sno)
LEFT JOIN origin o ON o.session = sn.session
ORDER BY c.blk, c.alloc_k;
