"""Putting an Nsight Systems export on our session clock, and the views that join it to engine steps.

Runs in the `kvtrace ingest` process. Our clock is the host's CLOCK_MONOTONIC (ns); an export's clock is
nsys's own (ns since its origin). `offset_ns` in `nsys_exports` maps one onto the other:
`t_*_ns = *_ns + offset_ns`. It comes from, best first:

- `nvtx-mark`: the marks `kvtrace:step=<step>:mono_ns=<ns>` our probes emit (probes/nvtx_ranges.py);
  each gives `mono_ns - start`, exact up to the µs between reading the clock and the mark; the median
  over all marks is used and their spread is kept (`align_spread_ns`: clock drift shows there);
- `utc-approx`: the UTC session starts on both sides, nsys's `TARGET_INFO_SESSION_START_TIME.utcEpochNs`
  (at nsys time `systemClockNs`, 0 before 2026) and our manifest's (`start_utc_ns`, `start_monotonic_ns`)
  pair; off by the two hosts' UTC disagreement and NTP steps, so ms at best;
- `none`: no marks and no session to compare with; `t_*_ns` stay NULL and the step views skip the export.

Step attribution uses ASOF joins (each kernel to the latest window starting at or before it): a range
join with an equality key becomes a hash join with a residual filter in DuckDB, quadratic in steps. The
ASOF keys are 64-bit hashes of (session, file, rank or device): DuckDB's ASOF join partitions 5x faster
on one integer than on several string columns.
"""

from __future__ import annotations

import duckdb

MARK_PATTERN = r"^kvtrace:step=(-?[0-9]+):mono_ns=([0-9]+)$"
MARK_LIKE = "kvtrace:step=%:mono_ns=%"  # cheap prefilter before the regex
# Tables with nsys times and their our-clock copies -> whether they also carry the launching call's time.
TIMED_TABLES = {"nsys_kernels": True, "nsys_memcpy": True, "nsys_memset": True,
                "nsys_runtime": False, "nsys_nvtx": False}


def mark_offset(con: duckdb.DuckDBPyConnection, relation: str, params: dict) -> tuple[int, int, int] | None:
    """(offset_ns, marks, spread_ns) from our step marks in `relation` (a FROM item with columns label and
    start_ns), or None when it holds no mark."""
    row = con.execute(f"""
        SELECT quantile_disc(off, 0.5), count(*), max(off) - min(off) FROM (
            SELECT CAST(regexp_extract(label, '{MARK_PATTERN}', 2) AS BIGINT) - start_ns AS off
            FROM {relation} WHERE label LIKE '{MARK_LIKE}' AND regexp_matches(label, '{MARK_PATTERN}'))
    """, params).fetchone()
    return (row[0], row[1], row[2]) if row[1] else None


def utc_offset(con: duckdb.DuckDBPyConnection, session: str | None, utc_epoch_ns: int | None,
               system_clock_ns: int | None) -> int | None:
    """offset_ns from the UTC session starts (nsys's and ours), or None without both."""
    if session is None or utc_epoch_ns is None or not _exists(con, "sessions"):
        return None
    row = con.execute("SELECT any_value(start_utc_ns - start_monotonic_ns) FROM sessions "
                      "WHERE session = $session AND start_utc_ns IS NOT NULL", {"session": session}).fetchone()
    if row[0] is None:
        return None
    return utc_epoch_ns - (system_clock_ns or 0) - row[0]


def align_nsys(con: duckdb.DuckDBPyConnection, session: str) -> dict:
    """Align every export loaded for `session` to its clock and (re)create the views.

    Call after both the session's tables (`steps`, `sessions`) and its exports are loaded; loading
    already aligns when it can, so this only changes exports whose offset is new (e.g. the session was
    ingested after the export). Returns {nsys_file: {alignment, offset_ns, marks}}.
    """
    if not _exists(con, "nsys_exports"):  # no export loaded yet: nothing to align, no tables to view
        return {}
    out = {}
    exports = con.execute("SELECT nsys_file, utc_epoch_ns, system_clock_ns, offset_ns FROM nsys_exports "
                          "WHERE session = $session", {"session": session}).fetchall()
    for nsys_file, utc_epoch_ns, system_clock_ns, old_offset in exports:
        key = {"file": nsys_file, "session": session}
        marks = mark_offset(con, "(SELECT label, start_ns FROM nsys_nvtx WHERE nsys_file = $file "
                                 "AND session = $session)", key)
        if marks:
            method, (offset, count, spread) = "nvtx-mark", marks
        else:
            offset, count, spread = utc_offset(con, session, utc_epoch_ns, system_clock_ns), 0, None
            method = "utc-approx" if offset is not None else "none"
        con.execute("UPDATE nsys_exports SET alignment = $method, offset_ns = $offset, align_marks = $count, "
                    "align_spread_ns = $spread WHERE nsys_file = $file AND session = $session",
                    {**key, "method": method, "offset": offset, "count": count, "spread": spread})
        if offset != old_offset:
            for table, launch in TIMED_TABLES.items():
                extra = ", t_launch_ns = launch_start_ns + $offset" if launch else ""
                con.execute(f"UPDATE {table} SET t_start_ns = start_ns + $offset, t_end_ns = end_ns + $offset"
                            f"{extra} WHERE nsys_file = $file AND session = $session", {**key, "offset": offset})
        out[nsys_file] = {"alignment": method, "offset_ns": offset, "marks": count}
    create_views(con)
    return out


def _exists(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = $name",
                       {"name": name}).fetchone()[0] > 0


def create_views(con: duckdb.DuckDBPyConnection) -> None:
    """The views over the nsys tables; the per-step ones only once a `steps` table exists."""
    for sql in NSYS_VIEWS + (STEP_VIEWS if _exists(con, "steps") else []):
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
