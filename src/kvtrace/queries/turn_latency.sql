-- name: turn_latency
-- description: Per-turn latency by turn index for requests carrying a job/turn id: arrival -> finish, time to first token, queueing (agentic studies' per-turn latency).
-- params: session: restrict to one session id (default: all sessions)
-- columns: session, turn (turn index), requests (count finished), latency_mean_ms (ms, arrival -> finished), latency_p50_ms (ms), latency_p90_ms (ms), latency_max_ms (ms), ttft_mean_ms (ms, arrival -> first token), queue_mean_ms (ms, arrival -> first scheduled), prompt_tokens_mean (tokens), cached_tokens_mean (tokens, prefix hits at first admission), preemptions (count)
-- empty: needs job/turn ids in request ids: ingest with --job-pattern (or record with it)
-- Needs job/turn ids (`kvtrace record/ingest --job-pattern`); requests without a turn or that never
-- finished are left out.
WITH r AS (
    SELECT session, turn, (finish_ns - arrival_ns) / 1e6 AS latency_ms,
        (first_token_ns - arrival_ns) / 1e6 AS ttft_ms, (first_scheduled_ns - arrival_ns) / 1e6 AS queue_ms,
        prompt_tokens, cached_tokens, num_preemptions
    FROM requests
    WHERE turn IS NOT NULL AND finish_ns IS NOT NULL AND arrival_ns IS NOT NULL
      AND ($session IS NULL OR session = $session)
)
SELECT
    session,
    turn,
    count(*) AS requests,
    avg(latency_ms) AS latency_mean_ms,
    quantile_cont(latency_ms, 0.5) AS latency_p50_ms,
    quantile_cont(latency_ms, 0.9) AS latency_p90_ms,
    max(latency_ms) AS latency_max_ms,
    avg(ttft_ms) AS ttft_mean_ms,
    avg(queue_ms) AS queue_mean_ms,
    avg(prompt_tokens) AS prompt_tokens_mean,
    avg(cached_tokens) AS cached_tokens_mean,
    sum(num_preemptions)::BIGINT AS preemptions
FROM r
GROUP BY session, turn
ORDER BY session, turn;
