-- name: preemptions
-- description: Every preemption: the request, what it lost (computed tokens, blocks), the KV usage when it happened, and when the request was scheduled again.
-- params: session: restrict to one session id (default: all sessions)
-- columns: session, rank, step, t_s (s since the session's first step), request_id, job_id, turn, nth (its request's n-th preemption), computed_tokens_lost (tokens), blocks_freed (blocks), output_tokens (tokens generated before it), kv_usage_pct (%, device KV usage after the step's schedule()), num_running (requests running after it), resumed_step (step it was scheduled again; null if never), wait_ms (ms, preempted -> scheduled again), finished (true when the request finished later)
-- empty: no request was preempted
WITH origin AS (
    SELECT session, min(t_start_ns) AS t0 FROM steps
    WHERE $session IS NULL OR session = $session GROUP BY session
), p AS (
    SELECT *, row_number() OVER (PARTITION BY session, rank, request_id ORDER BY ts_ns) AS nth
    FROM preemptions WHERE $session IS NULL OR session = $session
), res AS (
    SELECT session, request_id, ts_ns, step FROM request_events
    WHERE event = 'resumed' AND ($session IS NULL OR session = $session)
), j AS (
    SELECT p.*, res.step AS resumed_step, res.ts_ns AS resumed_ns
    FROM p ASOF LEFT JOIN res ON res.session = p.session AND res.request_id = p.request_id AND res.ts_ns >= p.ts_ns
)
SELECT
    j.session,
    j.rank,
    j.step,
    round((j.ts_ns - o.t0) / 1e9, 6) AS t_s,
    j.request_id,
    r.job_id,
    r.turn,
    j.nth,
    j.computed_tokens_lost,
    j.blocks_freed,
    j.output_tokens,
    100.0 * s.kv_blocks_used / nullif(s.kv_blocks_total, 0) AS kv_usage_pct,
    s.num_running,
    j.resumed_step,
    (j.resumed_ns - j.ts_ns) / 1e6 AS wait_ms,
    r.finish_ns IS NOT NULL AS finished
FROM j
LEFT JOIN origin o ON o.session = j.session
LEFT JOIN requests r ON r.session = j.session AND r.request_id = j.request_id
LEFT JOIN steps s ON s.session = j.session AND s.rank = j.rank AND s.step = j.step
ORDER BY j.session, j.ts_ns;
