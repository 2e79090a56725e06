-- name: prefix_misses
-- description: Why prefix-cache lookups missed: every full block after a lookup's hit, classified by what the block events say about its hash when the lookup ran (never cached, evicted, resident but capped, resident behind an earlier miss).
-- params: session: restrict to one session id (default: all sessions); by: reason (default: one row per reason) or request (one row per request and reason)
-- columns: session, request_id (by=request), reason (never-cached: no block held this hash before the lookup | evicted: it was cached, then evicted before the lookup | capped: resident, but the lookup stopped before it: vLLM recomputes at least a prompt's last token, so a prompt cached to its end leaves its last full block out, and 0.33's max_cache_hit_length caps a hit | after-miss: resident, but behind an earlier block of the same lookup that missed: a hit ends at its first miss), lookups (count, lookups with a missed block of this reason), blocks (count, missed blocks), share (fraction of all missed blocks of the session)
-- empty: no lookup missed a full block, or prefix caching was off
-- Reads prefix_lookups.missed_hashes (KV-cache group 0) against block_events' cache and evict rows of the
-- same engine (session, rank), as of the lookup's time. Lookups after a preemption are included. A model
-- whose hash block size differs from its block size (hybrid models) has hashes that the block events do
-- not carry: its blocks read as never-cached.
WITH own AS (  -- the request's first block event in the step of its lookup: its allocation
    SELECT session, rank, step, request_id, min(ts_ns) AS ts_ns FROM block_events
    WHERE request_id IS NOT NULL AND ($session IS NULL OR session = $session)
    GROUP BY ALL
), l AS (
    -- As of the lookup itself: vLLM 0.27+ counts it (our row's time) after allocating the request's
    -- blocks, which caches them, so what the request's own allocation did is left out.
    SELECT row_number() OVER () AS lookup, p.session, p.rank, p.request_id,
        least(p.ts_ns, coalesce(own.ts_ns - 1, p.ts_ns)) AS ts_ns, p.missed_hashes
    FROM prefix_lookups p
    LEFT JOIN own ON own.session = p.session AND own.rank = p.rank AND own.step = p.step
        AND own.request_id = p.request_id
    WHERE p.missed_hashes IS NOT NULL AND len(p.missed_hashes) > 0
        AND ($session IS NULL OR p.session = $session)
), m AS (
    SELECT lookup, session, rank, request_id, ts_ns,
        unnest(missed_hashes) AS block_hash, generate_subscripts(missed_hashes, 1) AS pos
    FROM l
), cached AS (
    SELECT session, rank, block_hash, ts_ns FROM block_events
    WHERE event = 'cache' AND kv_group = 0 AND block_hash IS NOT NULL
        AND ($session IS NULL OR session = $session)
), evicted AS (
    SELECT session, rank, block_hash, ts_ns FROM block_events
    WHERE event = 'evict' AND kv_group = 0 AND block_hash IS NOT NULL
        AND ($session IS NULL OR session = $session)
), state AS (
    SELECT m.*, c.ts_ns AS cached_ns, e.ts_ns AS evicted_ns
    FROM m
    ASOF LEFT JOIN cached c
        ON c.session = m.session AND c.rank = m.rank AND c.block_hash = m.block_hash AND m.ts_ns >= c.ts_ns
    ASOF LEFT JOIN evicted e
        ON e.session = m.session AND e.rank = m.rank AND e.block_hash = m.block_hash AND m.ts_ns >= e.ts_ns
), classed AS (
    SELECT *,
        CASE
            WHEN cached_ns IS NULL THEN 'never-cached'
            WHEN evicted_ns >= cached_ns THEN 'evicted'
            -- resident: behind a block of the same lookup that was not, or the lookup was cut short
            WHEN coalesce(bool_or(cached_ns IS NULL OR evicted_ns >= cached_ns) OVER (
                PARTITION BY lookup ORDER BY pos ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), false)
                THEN 'after-miss'
            ELSE 'capped'
        END AS reason
    FROM state
), counted AS (
    SELECT session,
        CASE coalesce($by, 'reason')
            WHEN 'reason' THEN NULL WHEN 'request' THEN request_id
            ELSE error('prefix_misses: by must be reason or request') END AS request_id,
        reason, count(DISTINCT lookup) AS lookups, count(*) AS blocks
    FROM classed
    GROUP BY ALL
)
SELECT session, request_id, reason, lookups, blocks,
    round(blocks / sum(blocks) OVER (PARTITION BY session), 4) AS share
FROM counted
ORDER BY session, request_id NULLS FIRST,
    CASE reason WHEN 'never-cached' THEN 0 WHEN 'evicted' THEN 1 WHEN 'capped' THEN 2 ELSE 3 END;
