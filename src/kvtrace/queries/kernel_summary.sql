-- name: kernel_summary
-- description: Which GPU kernels take the most GPU time, per kernel name (like nsys stats cuda_gpu_kern_sum).
-- params: session: restrict to one session id (default all, exports loaded without a session included)
-- columns: time_pct (% of all kernel time), total_ns (ns), instances (count), avg_ns (ns), med_ns (ns), min_ns (ns), max_ns (ns), stddev_ns (ns, sample standard deviation), name (kernel short name)
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
    name
FROM nsys_kernels
WHERE $session IS NULL OR session = $session
GROUP BY name
ORDER BY total_ns DESC, name;
