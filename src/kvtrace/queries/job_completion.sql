-- name: job_completion
-- description: Job completion time per job (first turn's arrival -> last turn's finish) with its turns' summed latency and the time between turns.
-- params: session: restrict to one session id (default: all sessions)
-- columns: session, job_id, turns (requests of the job), finished (turns finished), first_arrival_s (s since the session's first step), jct_ms (ms, first arrival -> last finish; null until every turn finished), turns_ms (ms, summed arrival -> finish of its turns), between_turns_ms (ms, jct_ms - turns_ms: client/tool time between turns), prompt_tokens (tokens), cached_tokens (tokens), output_tokens (tokens), preemptions (count)
-- empty: needs job/turn ids in request ids: ingest with --job-pattern (or record with it)
-- Needs job ids (`kvtrace record/ingest --job-pattern`); requests without one are left out.
WITH origin AS (
    SELECT session, min(t_start_ns) AS t0 FROM steps
    WHERE $session IS NULL OR session = $session GROUP BY session
)
SELECT
    r.session,
    r.job_id,
    count(*) AS turns,
    count(r.finish_ns) AS finished,
    round((min(r.arrival_ns) - any_value(o.t0)) / 1e9, 6) AS first_arrival_s,
    CASE WHEN count(r.finish_ns) = count(*) THEN (max(r.finish_ns) - min(r.arrival_ns)) / 1e6 END AS jct_ms,
    sum(r.finish_ns - r.arrival_ns) / 1e6 AS turns_ms,
    CASE WHEN count(r.finish_ns) = count(*)
        THEN (max(r.finish_ns) - min(r.arrival_ns) - sum(r.finish_ns - r.arrival_ns)) / 1e6 END AS between_turns_ms,
    sum(r.prompt_tokens)::BIGINT AS prompt_tokens,
    sum(r.cached_tokens)::BIGINT AS cached_tokens,
    sum(r.output_tokens)::BIGINT AS output_tokens,
    sum(r.num_preemptions)::BIGINT AS preemptions
FROM requests r
LEFT JOIN origin o ON o.session = r.session
WHERE r.job_id IS NOT NULL AND ($session IS NULL OR r.session = $session)
GROUP BY r.session, r.job_id
ORDER BY r.session, TRY_CAST(r.job_id AS BIGINT), r.job_id;
