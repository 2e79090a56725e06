-- name: step_time_fit
-- description: Least-squares fit of step duration = slope x forward tokens + intercept, per session (agentic study's step-time model).
-- params: session: restrict to one session id (default: all sessions); phase: fit only steps of this phase: prefill-only, decode-only or mixed (default: all)
-- columns: session, n (steps fitted), slope_us_per_token (us/token), intercept_ms (ms), r2 (coefficient of determination), mean_step_ms (ms), min_tokens (tokens), max_tokens (tokens)
-- Rows: finished steps that scheduled at least one token; duration = schedule() entered ->
-- update_from_output() returned (t_end_ns - t_start_ns), forward tokens = scheduled_tokens.
WITH s AS (
    SELECT session, scheduled_tokens::DOUBLE AS x, (t_end_ns - t_start_ns) / 1e6 AS y,
        CASE WHEN num_prefill_reqs > 0 AND num_decode_reqs > 0 THEN 'mixed'
             WHEN num_prefill_reqs > 0 THEN 'prefill-only'
             ELSE 'decode-only' END AS phase
    FROM steps
    WHERE t_end_ns IS NOT NULL AND scheduled_tokens > 0
      AND ($session IS NULL OR session = $session)
)
SELECT
    session,
    count(*) AS n,
    regr_slope(y, x) * 1000 AS slope_us_per_token,
    regr_intercept(y, x) AS intercept_ms,
    regr_r2(y, x) AS r2,
    avg(y) AS mean_step_ms,
    min(x)::BIGINT AS min_tokens,
    max(x)::BIGINT AS max_tokens
FROM s
WHERE $phase IS NULL OR phase = $phase
GROUP BY session
ORDER BY session;
