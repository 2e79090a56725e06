-- name: step_kernels
-- description: Per engine step, the GPU kernels it launched, from an Nsight Systems export aligned to the session: count, GPU time, top kernels.
-- params: session: restrict to one session id (default all)
-- columns: session, rank, step (engine step id), nsys_file (export), wall_ns (ns, the step's duration), kernels (count), gpu_ns (ns, summed kernel durations), gpu_pct (gpu_ns / wall_ns x 100; above 100 with several GPUs), top_kernels (the 3 kernel names with the most GPU time, ' | '-separated)
-- empty: needs an Nsight Systems export of the same run: kvtrace ingest SESSION --nsys REPORT.sqlite
SELECT
    session,
    rank,
    step,
    nsys_file,
    wall_ns,
    kernels,
    gpu_ns,
    round(100.0 * gpu_ns / nullif(wall_ns, 0), 1) AS gpu_pct,
    array_to_string(top_names, ' | ') AS top_kernels
FROM nsys_step_kernels
WHERE $session IS NULL OR session = $session
ORDER BY session, rank, step, nsys_file;
