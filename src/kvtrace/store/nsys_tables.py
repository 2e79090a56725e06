"""The Nsight Systems tables (`nsys_*`) and the views over them: their layout, for every database.

ingest/nsys.py fills the tables from an export; ingest/nsys_align.py puts them on the session clock. The
views read only the tables, so every database has them (empty without an export) and the nsys queries
run anywhere. docs/nsys.md explains each column.

Times: `start_ns`/`end_ns` are the export's own (ns on nsys's clock); `t_start_ns`/`t_end_ns` are ours
(host CLOCK_MONOTONIC ns), NULL while the export is not aligned.
"""

from __future__ import annotations

import duckdb

_KEY = "session VARCHAR, nsys_file VARCHAR"
_TIMES = "start_ns BIGINT, end_ns BIGINT, duration_ns BIGINT, t_start_ns BIGINT, t_end_ns BIGINT"
_LAUNCH = "launch_name VARCHAR, launch_tid INTEGER, launch_start_ns BIGINT, t_launch_ns BIGINT"
_DEVICE = "device_id INTEGER, stream_id INTEGER, correlation_id BIGINT, global_pid BIGINT, pid INTEGER"


# Our tables (columns in DuckDB's CREATE TABLE syntax). docs/nsys.md explains each column.
TABLES = {
    "nsys_exports": f"{_KEY}, path VARCHAR, nsys_version VARCHAR, schema_version VARCHAR, utc_epoch_ns BIGINT, "
                    "system_clock_ns BIGINT, start_ns BIGINT, end_ns BIGINT, alignment VARCHAR, offset_ns BIGINT, "
                    "align_marks BIGINT, align_spread_ns BIGINT, reader VARCHAR",
    "nsys_kernels": f"{_KEY}, {_TIMES}, {_DEVICE}, context_id INTEGER, name VARCHAR, demangled_name VARCHAR, "
                    "grid_x INTEGER, grid_y INTEGER, grid_z INTEGER, block_x INTEGER, block_y INTEGER, "
                    "block_z INTEGER, registers_per_thread INTEGER, static_shared_bytes INTEGER, "
                    f"dynamic_shared_bytes INTEGER, graph_node_id BIGINT, {_LAUNCH}",
    "nsys_memcpy": f"{_KEY}, {_TIMES}, {_DEVICE}, bytes BIGINT, copy_kind VARCHAR, src_kind VARCHAR, "
                   f"dst_kind VARCHAR, {_LAUNCH}",
    "nsys_memset": f"{_KEY}, {_TIMES}, {_DEVICE}, bytes BIGINT, value INTEGER, mem_kind VARCHAR, {_LAUNCH}",
    "nsys_runtime": f"{_KEY}, {_TIMES}, global_tid BIGINT, pid INTEGER, tid INTEGER, correlation_id BIGINT, "
                    "name VARCHAR, event_class INTEGER, return_value BIGINT",
    "nsys_nvtx": f"{_KEY}, {_TIMES}, event_type INTEGER, kind VARCHAR, label VARCHAR, domain_id BIGINT, "
                 "domain VARCHAR, category INTEGER, global_tid BIGINT, pid INTEGER, tid INTEGER, "
                 "payload_int64 BIGINT, payload_uint64 UBIGINT, payload_double DOUBLE",
    "nsys_threads": f"{_KEY}, global_tid BIGINT, pid INTEGER, tid INTEGER, name VARCHAR, priority INTEGER",
    "nsys_processes": f"{_KEY}, global_pid BIGINT, pid INTEGER, name VARCHAR",
    "nsys_gpus": f"{_KEY}, gpu_id INTEGER, cuda_device INTEGER, name VARCHAR, chip_name VARCHAR, "
                 "bus_location VARCHAR, uuid VARCHAR, total_memory_bytes BIGINT, memory_bandwidth_bytes_s BIGINT, "
                 "clock_rate_hz BIGINT, sm_count INTEGER, compute_capability VARCHAR",
}


# Tables with nsys times and their our-clock copies -> whether they also carry the launching call's time.
TIMED_TABLES = {"nsys_kernels": True, "nsys_memcpy": True, "nsys_memset": True,
                "nsys_runtime": False, "nsys_nvtx": False}


def table_exists(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = $name",
                       {"name": name}).fetchone()[0] > 0


def create_views(con: duckdb.DuckDBPyConnection) -> None:
    """The views over the nsys tables; the per-step ones only once a `steps` table exists."""
    for sql in NSYS_VIEWS + (STEP_VIEWS if table_exists(con, "steps") else []):
        con.execute(sql)


# GPU time inside `kvtrace layer N` ranges: kernels launched on the range's thread while it was open.
LAYER_VIEW = """
CREATE OR REPLACE VIEW nsys_layer_gpu_time AS
WITH r AS (
    SELECT hash(session, nsys_file, pid, tid) AS tkey, session, nsys_file, start_ns, end_ns,
           CAST(regexp_extract(label, '^kvtrace layer ([0-9]+)$', 1) AS INTEGER) AS layer
    FROM nsys_nvtx WHERE label LIKE 'kvtrace layer %' AND end_ns IS NOT NULL
), k AS (
    SELECT hash(session, nsys_file, pid, launch_tid) AS tkey, launch_start_ns, duration_ns
    FROM nsys_kernels WHERE launch_start_ns IS NOT NULL
), per_layer AS (
    SELECT hash(r.session, r.nsys_file) AS fkey, r.layer, count(*) AS kernels, sum(k.duration_ns) AS gpu_ns
    FROM k ASOF JOIN r ON k.tkey = r.tkey AND k.launch_start_ns >= r.start_ns
    WHERE k.launch_start_ns < r.end_ns
    GROUP BY ALL
)
SELECT any_value(r.session) AS session, any_value(r.nsys_file) AS nsys_file, r.layer, count(*) AS ranges,
       sum(r.end_ns - r.start_ns) AS cpu_ns, coalesce(any_value(p.kernels), 0) AS kernels,
       coalesce(any_value(p.gpu_ns), 0) AS gpu_ns
FROM r LEFT JOIN per_layer p ON p.fkey = hash(r.session, r.nsys_file) AND p.layer = r.layer
GROUP BY hash(r.session, r.nsys_file), r.layer
"""


# Merged busy intervals per GPU on our clock (kernels, memcpys, memsets), with the busy time before each.
BUSY_VIEW = """
CREATE OR REPLACE VIEW nsys_gpu_busy AS
WITH ev AS (
    SELECT session, nsys_file, device_id, t_start_ns AS s, t_end_ns AS e FROM nsys_kernels
    WHERE t_start_ns IS NOT NULL
    UNION ALL SELECT session, nsys_file, device_id, t_start_ns, t_end_ns FROM nsys_memcpy
    WHERE t_start_ns IS NOT NULL
    UNION ALL SELECT session, nsys_file, device_id, t_start_ns, t_end_ns FROM nsys_memset
    WHERE t_start_ns IS NOT NULL
), o AS (
    SELECT *, hash(session, nsys_file, device_id) AS dkey,
           max(e) OVER (PARTITION BY hash(session, nsys_file, device_id) ORDER BY s, e
                        ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_e
    FROM ev
), i AS (
    SELECT *, sum(CASE WHEN prev_e IS NULL OR s > prev_e THEN 1 ELSE 0 END)
              OVER (PARTITION BY dkey ORDER BY s, e ROWS UNBOUNDED PRECEDING) AS island
    FROM o
), b AS (
    SELECT dkey, island, any_value(session) AS session, any_value(nsys_file) AS nsys_file,
           any_value(device_id) AS device_id, min(s) AS t_start_ns, max(e) AS t_end_ns
    FROM i GROUP BY dkey, island
)
SELECT session, nsys_file, device_id, t_start_ns, t_end_ns, dkey,
       CAST(coalesce(sum(t_end_ns - t_start_ns) OVER (PARTITION BY dkey ORDER BY t_start_ns
            ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS BIGINT) AS busy_before_ns,
       lead(t_start_ns) OVER (PARTITION BY dkey ORDER BY t_start_ns) AS next_start_ns
FROM b
"""


NSYS_VIEWS = [LAYER_VIEW, BUSY_VIEW]


# Engine steps inside an aligned export of their session. A step's window is [t_start_ns, the earlier of
# t_end_ns and the next step's t_start_ns): with async scheduling steps overlap, and a kernel must count
# in one step only. wall_ns is the step's own duration.
WINDOWS_VIEW = """
CREATE OR REPLACE VIEW nsys_step_windows AS
WITH s AS (
    SELECT session, rank, step, t_start_ns, t_end_ns,
           lead(t_start_ns) OVER (PARTITION BY session, rank ORDER BY t_start_ns, step) AS next_start_ns
    FROM steps WHERE t_end_ns IS NOT NULL
)
SELECT s.session, s.rank, s.step, e.nsys_file, hash(s.session, e.nsys_file, s.rank) AS wkey, s.t_start_ns,
       least(s.t_end_ns, coalesce(s.next_start_ns, s.t_end_ns)) AS t_end_ns,
       s.t_end_ns - s.t_start_ns AS wall_ns
FROM s JOIN nsys_exports e ON e.session = s.session AND e.offset_ns IS NOT NULL
    AND s.t_start_ns < e.end_ns + e.offset_ns AND s.t_end_ns > e.start_ns + e.offset_ns
"""


# Kernels (and memcpys) per step: an op belongs to the step whose window holds its launch (the CUDA
# runtime call, on our clock), or its GPU start when the launch is unknown.
_OPS_IN_STEPS = """
WITH ranks AS (SELECT DISTINCT session, nsys_file, rank FROM nsys_step_windows),
op AS (
    SELECT o.*, r.rank, hash(o.session, o.nsys_file, r.rank) AS wkey, coalesce(o.t_launch_ns, o.t_start_ns) AS t_ns
    FROM {table} o JOIN ranks r ON r.session = o.session AND r.nsys_file = o.nsys_file
    WHERE o.t_start_ns IS NOT NULL
), per_step AS (
    SELECT w.session, w.rank, w.step, w.nsys_file, {keys}
    FROM op ASOF JOIN nsys_step_windows w ON op.wkey = w.wkey AND op.t_ns >= w.t_start_ns
    WHERE op.t_ns < w.t_end_ns
    GROUP BY ALL
)"""


STEP_KERNELS_VIEW = "CREATE OR REPLACE VIEW nsys_step_kernels AS" + _OPS_IN_STEPS.format(
    table="nsys_kernels", keys="op.name, count(*) AS kernels, sum(op.duration_ns) AS gpu_ns") + """
SELECT w.session, w.rank, w.step, w.nsys_file, w.wall_ns,
       CAST(coalesce(sum(p.kernels), 0) AS BIGINT) AS kernels, CAST(coalesce(sum(p.gpu_ns), 0) AS BIGINT) AS gpu_ns,
       max_by(p.name, p.gpu_ns, 3) AS top_names
FROM nsys_step_windows w LEFT JOIN per_step p USING (session, rank, step, nsys_file)
GROUP BY ALL
"""


STEP_MEMCPY_VIEW = "CREATE OR REPLACE VIEW nsys_step_memcpy AS" + _OPS_IN_STEPS.format(
    table="nsys_memcpy",
    keys="op.copy_kind, count(*) AS copies, sum(op.bytes) AS bytes, sum(op.duration_ns) AS gpu_ns") + """
SELECT * FROM per_step
"""


# Per step and GPU: busy time inside the window, idle time, and the longest idle stretch. Busy time up to
# t is B(t) = busy_before_ns + min(t, end) - start of the latest busy interval starting at or before t.
STEP_GAPS_VIEW = """
CREATE OR REPLACE VIEW nsys_step_gpu_gaps AS
WITH busy AS MATERIALIZED (
    SELECT * FROM nsys_gpu_busy
), dev AS (
    SELECT session, nsys_file, device_id, min(t_start_ns) AS first_start_ns FROM busy GROUP BY ALL
), w AS (
    SELECT w.*, d.device_id, hash(w.session, w.nsys_file, d.device_id) AS dkey, d.first_start_ns
    FROM nsys_step_windows w JOIN dev d USING (session, nsys_file)
), at_start AS (
    SELECT w.*, b.t_start_ns AS b_start, b.t_end_ns AS b_end, b.next_start_ns AS b_next,
           coalesce(b.busy_before_ns + least(w.t_start_ns, b.t_end_ns) - b.t_start_ns, 0) AS busy_at_start
    FROM w ASOF LEFT JOIN busy b ON w.dkey = b.dkey AND w.t_start_ns >= b.t_start_ns
), at_end AS (
    SELECT a.*, coalesce(b.busy_before_ns + least(a.t_end_ns, b.t_end_ns) - b.t_start_ns, 0) AS busy_at_end
    FROM at_start a ASOF LEFT JOIN busy b ON a.dkey = b.dkey AND a.t_end_ns >= b.t_start_ns
), gaps AS (  -- idle stretches starting after a busy interval, assigned to the window they start in
    SELECT b.device_id, hash(b.session, b.nsys_file, r.rank) AS wkey, b.t_end_ns AS g_start,
           b.next_start_ns AS g_end
    FROM busy b JOIN (SELECT DISTINCT session, nsys_file, rank FROM nsys_step_windows) r
        USING (session, nsys_file)
), inner_gaps AS (
    SELECT w.session, w.rank, w.step, w.nsys_file, g.device_id,
           max(least(coalesce(g.g_end, w.t_end_ns), w.t_end_ns) - g.g_start) AS max_inner_ns
    FROM gaps g ASOF JOIN nsys_step_windows w ON g.wkey = w.wkey AND g.g_start >= w.t_start_ns
    WHERE g.g_start < w.t_end_ns
    GROUP BY ALL
)
SELECT a.session, a.rank, a.step, a.nsys_file, a.device_id, a.wall_ns,
       a.t_end_ns - a.t_start_ns AS window_ns,
       a.busy_at_end - a.busy_at_start AS busy_ns,
       (a.t_end_ns - a.t_start_ns) - (a.busy_at_end - a.busy_at_start) AS idle_ns,
       greatest(coalesce(g.max_inner_ns, 0), CASE
           WHEN a.b_start IS NULL THEN least(a.first_start_ns, a.t_end_ns) - a.t_start_ns
           WHEN a.t_start_ns < a.b_end THEN 0
           ELSE least(coalesce(a.b_next, a.t_end_ns), a.t_end_ns) - a.t_start_ns END) AS max_gap_ns
FROM at_end a LEFT JOIN inner_gaps g USING (session, rank, step, nsys_file, device_id)
"""


STEP_VIEWS = [WINDOWS_VIEW, STEP_KERNELS_VIEW, STEP_MEMCPY_VIEW, STEP_GAPS_VIEW]


def create_nsys_tables(con: duckdb.DuckDBPyConnection) -> None:
    """The `nsys_*` tables (empty when missing) and their views, so the nsys queries run on any database."""
    for table, columns in TABLES.items():
        con.execute(f"CREATE TABLE IF NOT EXISTS {table} ({columns})")
    create_views(con)
