-- name: summary
-- description: Headline counts per session: steps, requests, preemptions, prefix-cache queries and hits, block events, lost rows, disabled probes, and what keeps the session from being complete.
-- params: session: restrict to one session id (default: all sessions)
-- columns: session, status, steps (count), requests (count), output_tokens (tokens the requests generated, vLLM's generation_tokens), preemptions (count), prefix_query_tokens (tokens, vLLM's prefix_cache_queries), prefix_hit_tokens (tokens, vLLM's prefix_cache_hits), prefix_hit_rate (fraction), block_allocs (blocks), block_frees (blocks), block_evictions (blocks), kv_access_records (count), dropped_events (rows lost, all causes), probes_disabled (names), duration_s (s), problems (text: why the status is not complete)
SELECT
    s.session,
    s.status,
    (SELECT count(*) FROM steps t WHERE t.session = s.session) AS steps,
    (SELECT count(*) FROM requests r WHERE r.session = s.session) AS requests,
    (SELECT coalesce(sum(output_tokens), 0) FROM requests r WHERE r.session = s.session) AS output_tokens,
    (SELECT count(*) FROM preemptions p WHERE p.session = s.session) AS preemptions,
    (SELECT coalesce(sum(query_tokens), 0) FROM prefix_lookups l
        WHERE l.session = s.session AND l.after_preemption = 0) AS prefix_query_tokens,
    (SELECT coalesce(sum(hit_tokens), 0) FROM prefix_lookups l
        WHERE l.session = s.session AND l.after_preemption = 0) AS prefix_hit_tokens,
    round((SELECT sum(hit_tokens) / nullif(sum(query_tokens), 0) FROM prefix_lookups l
        WHERE l.session = s.session AND l.after_preemption = 0), 4) AS prefix_hit_rate,
    (SELECT count(*) FROM block_events b WHERE b.session = s.session AND b.event = 'alloc') AS block_allocs,
    (SELECT count(*) FROM block_events b WHERE b.session = s.session AND b.event = 'free') AS block_frees,
    (SELECT count(*) FROM block_events b WHERE b.session = s.session AND b.event = 'evict') AS block_evictions,
    (SELECT count(*) FROM kv_access k WHERE k.session = s.session) AS kv_access_records,
    (SELECT coalesce(sum(dropped), 0) FROM drops d WHERE d.session = s.session) AS dropped_events,
    (SELECT string_agg(DISTINCT probe || ':' || status, ', ') FROM probes p
        WHERE p.session = s.session AND p.status NOT IN ('attached', 'off', 'unused')) AS probes_disabled,
    round((SELECT (max(t_end_ns) - min(t_start_ns)) / 1e9 FROM steps t WHERE t.session = s.session), 3)
        AS duration_s,
    (SELECT string_agg(problem, '; ' ORDER BY file, problem) FROM ingest_issues i WHERE i.session = s.session)
        AS problems
FROM sessions s
WHERE $session IS NULL OR s.session = $session
ORDER BY s.session;
