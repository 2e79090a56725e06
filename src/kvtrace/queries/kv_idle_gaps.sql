-- name: kv_idle_gaps
-- description: Idle time between KV accesses: per (layer, block) the gaps between the steps that access it, or per layer the share of time with no KV access (IPDPS'25 Sec. VI-B); needs kv_access.
-- params: session: restrict to one session id (default: all sessions); by: block (one row per layer and block, default) or layer (one row per layer); layer: a layer index, or all (default: by=block the lowest layer with block records in each session, as access_pattern; by=layer all layers)
-- columns: session, layer, block_id (null when by=layer), visits (steps with at least one access), reads (records), writes (records), gaps (count, visits - 1), gap_mean_ms (ms), gap_p50_ms (ms), gap_max_ms (ms), busy_ms (ms, summed visit spans), window_ms (ms, first access -> last access), idle_share (fraction of the window with no access, 1 - busy_ms / window_ms)
-- empty: no KV access records: the attention probe was off, unsupported or recorded nothing (see summary)
-- A visit is one step's accesses to the block (or to any block of the layer); it spans from its first to
-- its last record, at the recorder's timestamp resolution (the CPU ring stamps a layer call once, so
-- spans are 0 and idle_share is 1 there). A gap runs from a visit's last record to the next visit's first.
WITH chk AS (
    SELECT CASE WHEN coalesce($by, 'block') NOT IN ('block', 'layer')
        THEN error('kv_idle_gaps: by must be block or layer') END AS bad
), pick AS (  -- layers to look at, per session
    SELECT DISTINCT k.session, k.layer
    FROM kv_access k
    WHERE (SELECT bad FROM chk) IS NULL AND ($session IS NULL OR k.session = $session)
      AND CASE WHEN $layer IS NOT NULL THEN $layer::VARCHAR = 'all' OR k.layer = TRY_CAST($layer::VARCHAR AS INTEGER)
               WHEN coalesce($by, 'block') = 'layer' THEN true
               ELSE k.layer = (SELECT min(m.layer) FROM kv_access m WHERE m.session = k.session) END
), v AS (  -- visits: one step's records of a block (by=block) or of the whole layer (by=layer)
    SELECT k.session, k.layer, CASE WHEN coalesce($by, 'block') = 'block' THEN k.block_id END AS block_id, k.step,
        min(k.ts_ns) AS t_first, max(k.ts_ns) AS t_last,
        count(*) FILTER (k.op = 0) AS reads, count(*) FILTER (k.op = 1) AS writes
    FROM kv_access k JOIN pick p ON p.session = k.session AND p.layer = k.layer
    GROUP BY ALL
), g AS (
    SELECT *, t_first - lag(t_last) OVER (PARTITION BY session, layer, block_id ORDER BY t_first, step) AS gap
    FROM v
)
SELECT
    session,
    layer,
    block_id,
    count(*) AS visits,
    sum(reads)::BIGINT AS reads,
    sum(writes)::BIGINT AS writes,
    count(gap) AS gaps,
    avg(gap) / 1e6 AS gap_mean_ms,
    quantile_cont(gap, 0.5) / 1e6 AS gap_p50_ms,
    max(gap) / 1e6 AS gap_max_ms,
    sum(t_last - t_first) / 1e6 AS busy_ms,
    (max(t_last) - min(t_first)) / 1e6 AS window_ms,
    1 - sum(t_last - t_first) / nullif(max(t_last) - min(t_first), 0) AS idle_share
FROM g
GROUP BY session, layer, block_id
ORDER BY session, layer, block_id;
