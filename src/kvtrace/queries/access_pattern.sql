-- name: access_pattern
-- description: KV reads and writes of one layer as block id x time, one row per access record (IPDPS'25 Fig. 6); needs kv_access block records.
-- params: session: restrict to one session id (default: all sessions); layer: layer index (default: the lowest layer with block records in each session); op: read or write (default: both); step_from: first step (default: the first); step_to: last step (default: the last)
-- columns: session, layer, step, ts_ns (ns, host monotonic), t_ms (ms since the session's first step), op (read | write), block_id, request_id, slot (request's row in the batch), token_offset (tokens, first offset in the block), token_count (tokens read or written in the block)
-- empty: no KV access records: the attention probe was off, unsupported or recorded nothing (see summary)
-- A read covers the request's context in that block (offset 0 .. its tokens there); a write covers the
-- run of this step's tokens landing in the block. Empty when the session has no kv_access records.
WITH origin AS (
    SELECT session, min(t_start_ns) AS t0 FROM steps
    WHERE $session IS NULL OR session = $session GROUP BY session
), pick AS (
    SELECT session, coalesce($layer, min(layer)) AS layer FROM kv_access
    WHERE $session IS NULL OR session = $session GROUP BY session
)
SELECT
    k.session,
    k.layer,
    k.step,
    k.ts_ns,
    (k.ts_ns - coalesce(o.t0, k.ts_ns)) / 1e6 AS t_ms,
    CASE k.op WHEN 0 THEN 'read' WHEN 1 THEN 'write' END AS op,
    k.block_id,
    k.request_id,
    k.slot,
    k.token_offset,
    k.token_count
FROM kv_access k
JOIN pick p ON p.session = k.session AND p.layer = k.layer
LEFT JOIN origin o ON o.session = k.session
WHERE ($op IS NULL OR k.op = CASE $op WHEN 'read' THEN 0 WHEN 'write' THEN 1 END)
  AND ($step_from IS NULL OR k.step >= $step_from)
  AND ($step_to IS NULL OR k.step <= $step_to)
ORDER BY k.session, k.layer, k.ts_ns, k.op, k.block_id, k.slot;
