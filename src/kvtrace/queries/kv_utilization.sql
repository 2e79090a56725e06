-- name: kv_utilization
-- description: Device KV-cache usage (% of blocks in use) per step over time and, with a KV connector, the bytes saved to and loaded from the external tier (IPDPS'25 Fig. 11).
-- params: session: restrict to one session id (default: all sessions); external_capacity_bytes: size of the external tier, to express it in % (default: no %)
-- columns: session, rank, step, t_s (s since the session's first step), kv_blocks_used (blocks, after schedule(), excl. the null block), kv_blocks_total (blocks), usage_pct (%, used / total), num_running (requests), num_waiting (requests), num_preempted (requests preempted in this step), ext_saved_bytes (bytes saved through the connector in this step), ext_loaded_bytes (bytes loaded in this step), ext_stored_bytes (bytes, cumulative saves: what the external tier holds when it never drops anything, e.g. ExampleConnector), ext_usage_pct (%, ext_stored_bytes / external_capacity_bytes, null without the parameter)
-- Sessions without a connector (or without the connector probe) have 0 external bytes.
WITH origin AS (
    SELECT session, min(t_start_ns) AS t0 FROM steps
    WHERE $session IS NULL OR session = $session GROUP BY session
), x AS (
    SELECT session, rank // 1000 AS dp, step,
        sum(bytes) FILTER (direction = 'save') AS saved,
        sum(bytes) FILTER (direction = 'load') AS loaded
    FROM transfers
    WHERE ($session IS NULL OR session = $session) AND step >= 0
    GROUP BY ALL
), j AS (
    SELECT s.session, s.rank, s.step, s.t_start_ns - o.t0 AS t_ns, s.kv_blocks_used, s.kv_blocks_total,
        s.num_running, s.num_waiting, s.num_preempted,
        coalesce(x.saved, 0) AS saved, coalesce(x.loaded, 0) AS loaded
    FROM steps s
    JOIN origin o USING (session)
    LEFT JOIN x ON x.session = s.session AND x.dp = s.rank // 1000 AND x.step = s.step
)
SELECT
    session,
    rank,
    step,
    round(t_ns / 1e9, 6) AS t_s,
    kv_blocks_used,
    kv_blocks_total,
    100.0 * kv_blocks_used / nullif(kv_blocks_total, 0) AS usage_pct,
    num_running,
    num_waiting,
    num_preempted,
    saved::BIGINT AS ext_saved_bytes,
    loaded::BIGINT AS ext_loaded_bytes,
    sum(saved) OVER (PARTITION BY session, rank ORDER BY step)::BIGINT AS ext_stored_bytes,
    100.0 * sum(saved) OVER (PARTITION BY session, rank ORDER BY step) / $external_capacity_bytes AS ext_usage_pct
FROM j
ORDER BY session, rank, step;
