-- name: step_time_fit
-- description: Least-squares fit of step duration = slope x forward tokens + intercept, per session (agentic study's step-time model).
-- params: session: restrict to one session id (default: all sessions); phase: fit only steps of this phase: prefill-only, decode-only or mixed (default: all); warmup_steps: leave out each engine's first N steps (default 1: the first forward pass pays one-off costs: compilation, allocator and cache warm-up)
-- columns: session, n (steps fitted), slope_us_per_token (us/token), intercept_ms (ms), r2 (coefficient of determination), mean_step_ms (ms), min_tokens (tokens), max_tokens (tokens)
-- Rows: finished steps that scheduled at least one token, after each engine's (session, rank) first
-- warmup_steps steps; duration = schedule() entered -> update_from_output() returned
-- (t_end_ns - t_start_ns), forward tokens = scheduled_tokens.
WITH first AS (
    SELECT session, rank, min(step) AS step FROM steps
    WHERE $session IS NULL OR session = $session GROUP BY ALL
), s AS (
    SELECT t.session, t.scheduled_tokens::DOUBLE AS x, (t.t_end_ns - t.t_start_ns) / 1e6 AS y,
        CASE WHEN t.num_prefill_reqs > 0 AND t.num_decode_reqs > 0 THEN 'mixed'
             WHEN t.num_prefill_reqs > 0 THEN 'prefill-only'
             ELSE 'decode-only' END AS phase
    FROM steps t JOIN first f ON f.session = t.session AND f.rank = t.rank
    WHERE t.t_end_ns IS NOT NULL AND t.scheduled_tokens > 0
      AND t.step >= f.step + coalesce($warmup_steps, 1)
      AND ($session IS NULL OR t.session = $session)
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
