-- name: nvtx_summary
-- description: Time spent in NVTX ranges (CPU side), per domain and range name (like nsys stats nvtx_sum); our per-step ranges count as one name, kvtrace step.
-- params: session: restrict to one session id (default all, exports loaded without a session included)
-- columns: time_pct (% of all range time), total_ns (ns), instances (count), avg_ns (ns), med_ns (ns), min_ns (ns), max_ns (ns), stddev_ns (ns, sample standard deviation), style (PushPop or StartEnd), domain (NVTX domain, empty for the default domain), range (range name)
-- empty: needs an Nsight Systems export: kvtrace ingest SESSION --nsys REPORT.sqlite
SELECT
    round(100.0 * sum(duration_ns) / sum(sum(duration_ns)) OVER (), 2) AS time_pct,
    sum(duration_ns) AS total_ns,
    count(*) AS instances,
    round(avg(duration_ns), 1) AS avg_ns,
    median(duration_ns) AS med_ns,
    min(duration_ns) AS min_ns,
    max(duration_ns) AS max_ns,
    round(coalesce(stddev_samp(duration_ns), 0), 1) AS stddev_ns,
    CASE kind WHEN 'push_pop' THEN 'PushPop' ELSE 'StartEnd' END AS style,
    coalesce(domain, '') AS domain,
    regexp_replace(label, '^kvtrace step [0-9]+$', 'kvtrace step') AS range
FROM nsys_nvtx
WHERE kind IN ('push_pop', 'start_end') AND end_ns IS NOT NULL
    AND ($session IS NULL OR session = $session)
GROUP BY ALL
ORDER BY total_ns DESC, domain, range;
