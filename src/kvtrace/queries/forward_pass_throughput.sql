-- name: forward_pass_throughput
-- description: Per engine step (forward pass): phase (prefill-only, decode-only, mixed), batch size, tokens, duration and tokens/s (IPDPS'25 Fig. 3).
-- params: session: restrict to one session id (default: all sessions); phase: only steps of this phase: prefill-only, decode-only, mixed or empty (default: all)
-- columns: session, rank, step, t_s (s since the session's first step), phase (prefill-only | decode-only | mixed | empty), batch_size (requests), prefill_reqs (requests), decode_reqs (requests), tokens (tokens scheduled), prefill_tokens (tokens), decode_tokens (tokens), step_ms (ms, schedule() entered -> update_from_output() returned), forward_ms (ms, schedule() returned -> update_from_output() returned), tokens_per_s (tokens / forward_ms, tokens/s)
-- A step whose update_from_output() never came (engine stopped) has null durations.
WITH origin AS (
    SELECT session, min(t_start_ns) AS t0 FROM steps
    WHERE $session IS NULL OR session = $session GROUP BY session
), s AS (
    SELECT st.*, o.t0,
        CASE WHEN num_prefill_reqs > 0 AND num_decode_reqs > 0 THEN 'mixed'
             WHEN num_prefill_reqs > 0 THEN 'prefill-only'
             WHEN num_decode_reqs > 0 THEN 'decode-only'
             ELSE 'empty' END AS phase
    FROM steps st JOIN origin o USING (session)
)
SELECT
    session,
    rank,
    step,
    round((t_start_ns - t0) / 1e9, 6) AS t_s,
    phase,
    num_prefill_reqs + num_decode_reqs AS batch_size,
    num_prefill_reqs AS prefill_reqs,
    num_decode_reqs AS decode_reqs,
    scheduled_tokens AS tokens,
    prefill_tokens,
    decode_tokens,
    (t_end_ns - t_start_ns) / 1e6 AS step_ms,
    (t_end_ns - t_sched_end_ns) / 1e6 AS forward_ms,
    scheduled_tokens * 1e9 / nullif(t_end_ns - t_sched_end_ns, 0) AS tokens_per_s
FROM s
WHERE $phase IS NULL OR phase = $phase
ORDER BY session, rank, step;
