-- name: admission_limits
-- description: Share of steps by why admission from the waiting queue stopped (tok-budget, max-seqs, kv-insuf, preempted, blocked, lora, prefill-throttle, prefill-cadence, skipped, none).
-- params: session: restrict to one session id (default: all sessions)
-- columns: session, reason (admission_stop), steps (count), share (fraction of all steps), share_limited (fraction of the steps whose reason is not 'none', null for 'none'), mean_waiting (requests waiting after schedule(), mean over those steps)
-- 'none' = nothing was waiting; 'preempted' = the step preempted a running request, which skips the
-- waiting queue entirely.
WITH s AS (
    SELECT session, admission_stop AS reason, num_waiting FROM steps
    WHERE $session IS NULL OR session = $session
), g AS (
    SELECT session, coalesce(reason, 'unknown') AS reason, count(*) AS steps, avg(num_waiting) AS mean_waiting
    FROM s GROUP BY ALL
)
SELECT
    session,
    reason,
    steps,
    steps / sum(steps) OVER (PARTITION BY session) AS share,
    CASE WHEN reason <> 'none' THEN steps / sum(steps) FILTER (reason <> 'none') OVER (PARTITION BY session) END
        AS share_limited,
    mean_waiting
FROM g
ORDER BY session, steps DESC, reason;
