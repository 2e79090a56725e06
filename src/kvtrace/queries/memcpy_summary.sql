-- name: memcpy_summary
-- description: GPU memory operations (memcpy by direction, memset): time and bytes (like nsys stats cuda_gpu_mem_time_sum and cuda_gpu_mem_size_sum).
-- params: session: restrict to one session id (default all, exports loaded without a session included)
-- columns: time_pct (% of all memory-operation time), total_ns (ns), count (operations), avg_ns (ns), med_ns (ns), min_ns (ns), max_ns (ns), stddev_ns (ns, sample standard deviation), total_bytes (bytes), avg_bytes (bytes), max_bytes (bytes), gb_per_s (GB/s: total_bytes / total_ns), operation ([CUDA memcpy HtoD], [CUDA memcpy DtoD], ..., [CUDA memset])
-- empty: needs an Nsight Systems export: kvtrace ingest SESSION --nsys REPORT.sqlite
WITH ops AS (
    SELECT '[CUDA memcpy ' || copy_kind || ']' AS operation, duration_ns, bytes
    FROM nsys_memcpy WHERE $session IS NULL OR session = $session
    UNION ALL
    SELECT '[CUDA memset]', duration_ns, bytes
    FROM nsys_memset WHERE $session IS NULL OR session = $session
)
SELECT
    round(100.0 * sum(duration_ns) / sum(sum(duration_ns)) OVER (), 2) AS time_pct,
    sum(duration_ns) AS total_ns,
    count(*) AS count,
    round(avg(duration_ns), 1) AS avg_ns,
    median(duration_ns) AS med_ns,
    min(duration_ns) AS min_ns,
    max(duration_ns) AS max_ns,
    round(coalesce(stddev_samp(duration_ns), 0), 1) AS stddev_ns,
    sum(bytes) AS total_bytes,
    round(avg(bytes), 1) AS avg_bytes,
    max(bytes) AS max_bytes,
    round(sum(bytes) / nullif(sum(duration_ns), 0), 3) AS gb_per_s,
    operation
FROM ops
GROUP BY operation
ORDER BY total_ns DESC, operation;
