-- name: prefix_hits
-- description: Prefix-cache hit rate, local and external (connector), per step, per request, per turn index or per job.
-- params: session: restrict to one session id (default: all sessions); by: step, request (default), turn or job
-- columns: session, step (by=step; by=request: its first lookup's step), request_id (by=request), job_id (by=request or job), turn (by=request or turn), lookups (count), query_tokens (tokens, vLLM's prefix_cache_queries), hit_tokens (tokens found locally, vLLM's prefix_cache_hits), external_hit_tokens (tokens a connector could load), hit_rate (fraction, hit / query), external_hit_rate (fraction, external / query), total_hit_rate (fraction, (hit + external) / query), resumed_lookups (count, lookups of requests resumed after preemption), resumed_query_tokens (tokens), resumed_hit_tokens (tokens)
-- The main columns count the lookups vLLM counts as prefix_cache_queries/hits (first admission);
-- lookups after a preemption (vLLM's preempted queries) are in the resumed_* columns only.
-- by=turn and by=job need job/turn ids (`kvtrace ingest --job-pattern`); requests without one are left out.
WITH l AS (
    SELECT l.session, l.step, l.ts_ns, l.request_id, r.job_id, r.turn, l.query_tokens, l.hit_tokens,
        l.external_hit_tokens, l.after_preemption = 1 AS resumed,
        CASE coalesce($by, 'request')
            WHEN 'step' THEN l.step::VARCHAR WHEN 'request' THEN l.request_id
            WHEN 'turn' THEN r.turn::VARCHAR WHEN 'job' THEN r.job_id
            ELSE error('prefix_hits: by must be step, request, turn or job') END AS k
    FROM prefix_lookups l
    LEFT JOIN requests r ON r.session = l.session AND r.request_id = l.request_id
    WHERE $session IS NULL OR l.session = $session
)
SELECT
    session,
    CASE WHEN coalesce($by, 'request') IN ('step', 'request') THEN min(step) END AS step,
    CASE WHEN coalesce($by, 'request') = 'request' THEN any_value(request_id) END AS request_id,
    CASE WHEN coalesce($by, 'request') IN ('request', 'job') THEN any_value(job_id) END AS job_id,
    CASE WHEN coalesce($by, 'request') IN ('request', 'turn') THEN any_value(turn) END AS turn,
    count(*) FILTER (NOT resumed) AS lookups,
    coalesce(sum(query_tokens) FILTER (NOT resumed), 0)::BIGINT AS query_tokens,
    coalesce(sum(hit_tokens) FILTER (NOT resumed), 0)::BIGINT AS hit_tokens,
    coalesce(sum(external_hit_tokens) FILTER (NOT resumed), 0)::BIGINT AS external_hit_tokens,
    sum(hit_tokens) FILTER (NOT resumed) / nullif(sum(query_tokens) FILTER (NOT resumed), 0) AS hit_rate,
    coalesce(sum(external_hit_tokens) FILTER (NOT resumed), 0)
        / nullif(sum(query_tokens) FILTER (NOT resumed), 0) AS external_hit_rate,
    (sum(hit_tokens) FILTER (NOT resumed) + coalesce(sum(external_hit_tokens) FILTER (NOT resumed), 0))
        / nullif(sum(query_tokens) FILTER (NOT resumed), 0) AS total_hit_rate,
    count(*) FILTER (resumed) AS resumed_lookups,
    coalesce(sum(query_tokens) FILTER (resumed), 0)::BIGINT AS resumed_query_tokens,
    coalesce(sum(hit_tokens) FILTER (resumed), 0)::BIGINT AS resumed_hit_tokens
FROM l
WHERE k IS NOT NULL
GROUP BY session, k
ORDER BY session,
    CASE coalesce($by, 'request') WHEN 'turn' THEN min(turn) WHEN 'job' THEN min(TRY_CAST(job_id AS BIGINT)) END,
    min(step), k;
