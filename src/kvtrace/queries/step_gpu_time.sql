-- name: step_gpu_time
-- description: Per engine step and GPU, step wall time against GPU busy time (kernels, memcpys, memsets) and the idle gaps, from an aligned Nsight Systems export.
-- params: session: restrict to one session id (default all)
-- columns: session, rank, step (engine step id), nsys_file (export), device_id (CUDA device), wall_ns (ns, the step's duration), window_ns (ns, the part of the step before the next one starts: the time measured), busy_ns (ns, GPU busy in the window), idle_ns (ns, window_ns - busy_ns), busy_pct (busy_ns / window_ns x 100), max_gap_ns (ns, longest idle stretch in the window)
-- empty: needs an Nsight Systems export of the same run: kvtrace ingest SESSION --nsys REPORT.sqlite
SELECT
    session,
    rank,
    step,
    nsys_file,
    device_id,
    wall_ns,
    window_ns,
    busy_ns,
    idle_ns,
    round(100.0 * busy_ns / nullif(window_ns, 0), 1) AS busy_pct,
    max_gap_ns
FROM nsys_step_gpu_gaps
WHERE $session IS NULL OR session = $session
ORDER BY session, rank, step, nsys_file, device_id;
