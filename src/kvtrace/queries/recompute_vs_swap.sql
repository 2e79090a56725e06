-- name: recompute_vs_swap
-- description: Cost of each preemption's resume: tokens thrown away, recompute time attributed to the resumed request's prefill, and KV reloaded through a connector; per preemption or by evicted-token bins (IPDPS'25 Fig. 8-10).
-- params: session: restrict to one session id (default: all sessions); by: preemption (one row each, default) or bin (aggregated per evicted-token bin); bin_tokens: bin width in tokens (default: powers of two, [2^k, 2^(k+1)))
-- columns: session, evicted_bin (tokens, lower bound of the bin of tokens_lost), request_id (by=preemption), preempt_step (by=preemption), preemptions (count), tokens_lost (tokens, computed tokens thrown away), resumed (preemptions whose request was scheduled again), local_hit_tokens (tokens found in the local prefix cache at resume), external_hit_tokens (tokens a connector could load at resume), recomputed_tokens (prefill tokens scheduled until caught up), recompute_steps (steps), recompute_ms (ms attributed), load_bytes (bytes loaded through the connector), load_ms (ms attributed), overhead_ms (recompute_ms + load_ms), wait_ms (ms, preempted -> scheduled again), catch_up_ms (ms, scheduled again -> end of its last prefill step)
-- empty: no request was preempted
-- Caught up = the request's prefill rows from its resumption until its first decode step (or its next
-- preemption). Recompute time: sum over those steps of its prefill tokens x the step's duration
-- (t_end_ns - t_start_ns, less the step's connector load time, counted in load_ms) / the step's
-- scheduled tokens. Load: connector calls with direction 'load' in the steps after the preemption
-- (before the next one) whose rows name the request (get_finished rows only where they carry bytes: a
-- connector whose copies start there, not a completion); each step's load-call time (distinct calls: the
-- per-request rows of one call are counted once) is split among the requests loaded in that step by
-- their bytes. Sessions without a connector have load_bytes = 0. With by=bin, wait_ms and catch_up_ms
-- are means over the bin's preemptions, the other columns sums.
WITH chk AS (
    SELECT CASE WHEN coalesce($by, 'preemption') NOT IN ('preemption', 'bin')
        THEN error('recompute_vs_swap: by must be preemption or bin') END AS bad
), p AS (
    SELECT session, rank, request_id, step, ts_ns, computed_tokens_lost,
        lead(step) OVER (PARTITION BY session, rank, request_id ORDER BY ts_ns) AS next_step
    FROM preemptions
    WHERE (SELECT bad FROM chk) IS NULL AND ($session IS NULL OR session = $session)
), w AS (  -- the request's scheduled rows after the preemption, before its next one
    SELECT p.session, p.rank, p.request_id, p.step AS pstep, sr.step, sr.tokens, sr.phase
    FROM p JOIN step_requests sr
      ON sr.session = p.session AND sr.rank = p.rank AND sr.request_id = p.request_id
     AND sr.step > p.step AND (p.next_step IS NULL OR sr.step < p.next_step)
), fd AS (
    SELECT session, rank, request_id, pstep, min(step) AS resumed_step,
        min(step) FILTER (phase = 'decode') AS first_decode
    FROM w GROUP BY ALL
), lc AS (  -- per step: time in load calls (a call's per-request rows share one start and end)
    SELECT session, dp, step, sum(ts_end_ns - ts_start_ns) AS call_ns
    FROM (SELECT DISTINCT session, rank // 1000 AS dp, pid, step, method, ts_start_ns, ts_end_ns
          FROM transfers WHERE direction = 'load' AND (method <> 'get_finished' OR bytes IS NOT NULL)  -- completions carry no bytes
            AND ($session IS NULL OR session = $session))
    GROUP BY ALL
), rc AS (  -- catch-up rows with their share of the step's time, less the step's connector loads
    SELECT w.session, w.rank, w.request_id, w.pstep, count(*) AS recompute_steps,
        sum(w.tokens) AS recomputed_tokens,
        sum(w.tokens * greatest(s.t_end_ns - s.t_start_ns - coalesce(lc.call_ns, 0), 0)
            / nullif(s.scheduled_tokens, 0)) / 1e6 AS recompute_ms,
        max(s.t_end_ns) AS caught_up_ns
    FROM w JOIN fd USING (session, rank, request_id, pstep)
    JOIN steps s ON s.session = w.session AND s.rank = w.rank AND s.step = w.step
    LEFT JOIN lc ON lc.session = w.session AND lc.dp = w.rank // 1000 AND lc.step = w.step
    WHERE w.phase = 'prefill' AND (fd.first_decode IS NULL OR w.step < fd.first_decode)
    GROUP BY ALL
), rs AS (  -- when it was scheduled again
    SELECT p.session, p.rank, p.request_id, p.step AS pstep, min(e.ts_ns) AS resumed_ns
    FROM p JOIN request_events e
      ON e.session = p.session AND e.request_id = p.request_id AND e.event = 'resumed'
     AND e.ts_ns >= p.ts_ns AND (p.next_step IS NULL OR e.step < p.next_step)
    GROUP BY ALL
), lk AS (  -- the prefix-cache lookup made for the resumption
    SELECT p.session, p.rank, p.request_id, p.step AS pstep,
        arg_min(l.hit_tokens, l.ts_ns) AS local_hit_tokens,
        arg_min(l.external_hit_tokens, l.ts_ns) AS external_hit_tokens
    FROM p JOIN prefix_lookups l
      ON l.session = p.session AND l.request_id = p.request_id AND l.after_preemption = 1
     AND l.ts_ns >= p.ts_ns AND (p.next_step IS NULL OR l.step < p.next_step)
    GROUP BY ALL
), lr AS (  -- per (step, request): bytes loaded
    SELECT t.session, t.rank // 1000 AS dp, t.step, t.request_id, sum(coalesce(t.bytes, 0)) AS bytes
    FROM transfers t
    WHERE t.direction = 'load' AND (t.method <> 'get_finished' OR t.bytes IS NOT NULL) AND t.request_id IS NOT NULL
      AND ($session IS NULL OR t.session = $session)
    GROUP BY ALL
), ls AS (
    SELECT lr.*, lr.bytes / nullif(sum(lr.bytes) OVER (PARTITION BY lr.session, lr.dp, lr.step), 0) AS share,
        count(*) OVER (PARTITION BY lr.session, lr.dp, lr.step) AS reqs, lc.call_ns
    FROM lr JOIN lc USING (session, dp, step)
), ld AS (
    SELECT p.session, p.rank, p.request_id, p.step AS pstep, sum(ls.bytes) AS load_bytes,
        sum(ls.call_ns * coalesce(ls.share, 1.0 / ls.reqs)) / 1e6 AS load_ms
    FROM p JOIN ls
      ON ls.session = p.session AND ls.dp = p.rank // 1000 AND ls.request_id = p.request_id
     AND ls.step > p.step AND (p.next_step IS NULL OR ls.step < p.next_step)
    GROUP BY ALL
), per AS (
    SELECT
        p.session,
        CASE WHEN p.computed_tokens_lost <= 0 THEN 0
             WHEN $bin_tokens IS NOT NULL THEN (p.computed_tokens_lost // $bin_tokens) * $bin_tokens
             ELSE (2 ** floor(log2(p.computed_tokens_lost)))::BIGINT END AS evicted_bin,
        p.request_id,
        p.step AS preempt_step,
        p.computed_tokens_lost AS tokens_lost,
        fd.resumed_step IS NOT NULL AS resumed,
        lk.local_hit_tokens,
        lk.external_hit_tokens,
        coalesce(rc.recomputed_tokens, 0) AS recomputed_tokens,
        coalesce(rc.recompute_steps, 0) AS recompute_steps,
        coalesce(rc.recompute_ms, 0) AS recompute_ms,
        coalesce(ld.load_bytes, 0) AS load_bytes,
        coalesce(ld.load_ms, 0) AS load_ms,
        (rs.resumed_ns - p.ts_ns) / 1e6 AS wait_ms,
        (rc.caught_up_ns - rs.resumed_ns) / 1e6 AS catch_up_ms
    FROM p
    LEFT JOIN fd ON fd.session = p.session AND fd.rank = p.rank AND fd.request_id = p.request_id AND fd.pstep = p.step
    LEFT JOIN rc ON rc.session = p.session AND rc.rank = p.rank AND rc.request_id = p.request_id AND rc.pstep = p.step
    LEFT JOIN rs ON rs.session = p.session AND rs.rank = p.rank AND rs.request_id = p.request_id AND rs.pstep = p.step
    LEFT JOIN lk ON lk.session = p.session AND lk.rank = p.rank AND lk.request_id = p.request_id AND lk.pstep = p.step
    LEFT JOIN ld ON ld.session = p.session AND ld.rank = p.rank AND ld.request_id = p.request_id AND ld.pstep = p.step
)
SELECT
    session,
    evicted_bin,
    CASE WHEN coalesce($by, 'preemption') = 'preemption' THEN any_value(request_id) END AS request_id,
    CASE WHEN coalesce($by, 'preemption') = 'preemption' THEN any_value(preempt_step) END AS preempt_step,
    count(*) AS preemptions,
    sum(tokens_lost)::BIGINT AS tokens_lost,
    count(*) FILTER (resumed) AS resumed,
    sum(local_hit_tokens)::BIGINT AS local_hit_tokens,
    sum(external_hit_tokens)::BIGINT AS external_hit_tokens,
    sum(recomputed_tokens)::BIGINT AS recomputed_tokens,
    sum(recompute_steps)::BIGINT AS recompute_steps,
    sum(recompute_ms) AS recompute_ms,
    sum(load_bytes)::BIGINT AS load_bytes,
    sum(load_ms) AS load_ms,
    sum(recompute_ms) + sum(load_ms) AS overhead_ms,
    CASE WHEN coalesce($by, 'preemption') = 'preemption' THEN any_value(wait_ms) ELSE avg(wait_ms) END AS wait_ms,
    CASE WHEN coalesce($by, 'preemption') = 'preemption' THEN any_value(catch_up_ms) ELSE avg(catch_up_ms) END
        AS catch_up_ms
FROM per
GROUP BY session, evicted_bin,
    CASE WHEN coalesce($by, 'preemption') = 'preemption' THEN request_id || '@' || preempt_step END
ORDER BY session, evicted_bin, min(preempt_step);
