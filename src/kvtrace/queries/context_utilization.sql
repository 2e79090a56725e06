-- name: context_utilization
-- description: Per step: scheduled tokens / token budget (context window utilization) and which steps carry chunked prefills (IPDPS'25 Fig. 4-5).
-- params: session: restrict to one session id (default: all sessions)
-- columns: session, rank, step, t_s (s since the session's first step), tokens (tokens scheduled), token_budget (tokens, max_num_scheduled_tokens), utilization (fraction, tokens / token_budget), prefill_tokens (tokens), decode_tokens (tokens), prefill_reqs (requests), chunked_prefill_reqs (requests whose prefill in this step is one chunk of several), chunked (true when the step carries at least one such chunk)
-- A prefill is chunked when it takes several steps: its row has chunk_index > 0, or the same
-- request's next prefill row continues it (chunk_index + 1). A resumed request's recompute counts too.
WITH origin AS (
    SELECT session, min(t_start_ns) AS t0 FROM steps
    WHERE $session IS NULL OR session = $session GROUP BY session
), p AS (
    SELECT session, rank, step, chunk_index,
        lead(chunk_index) OVER (PARTITION BY session, rank, request_id ORDER BY step) AS next_chunk
    FROM step_requests
    WHERE phase = 'prefill' AND ($session IS NULL OR session = $session)
), c AS (
    SELECT session, rank, step,
        count(*) FILTER (chunk_index > 0 OR next_chunk = chunk_index + 1) AS chunked_prefill_reqs
    FROM p GROUP BY session, rank, step
)
SELECT
    s.session,
    s.rank,
    s.step,
    round((s.t_start_ns - o.t0) / 1e9, 6) AS t_s,
    s.scheduled_tokens AS tokens,
    s.token_budget,
    s.scheduled_tokens / nullif(s.token_budget, 0) AS utilization,
    s.prefill_tokens,
    s.decode_tokens,
    s.num_prefill_reqs AS prefill_reqs,
    coalesce(c.chunked_prefill_reqs, 0) AS chunked_prefill_reqs,
    coalesce(c.chunked_prefill_reqs, 0) > 0 AS chunked
FROM steps s
JOIN origin o USING (session)
LEFT JOIN c ON c.session = s.session AND c.rank = s.rank AND c.step = s.step
ORDER BY s.session, s.rank, s.step;
