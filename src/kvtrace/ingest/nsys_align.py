"""Putting an Nsight Systems export on our session clock (the views that join it to engine steps are in
store/nsys_tables.py).

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

from kvtrace.store.nsys_tables import TIMED_TABLES, create_views, table_exists

MARK_PATTERN = r"^kvtrace:step=(-?[0-9]+):mono_ns=([0-9]+)$"
MARK_LIKE = "kvtrace:step=%:mono_ns=%"  # cheap prefilter before the regex


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
    if session is None or utc_epoch_ns is None or not table_exists(con, "sessions"):
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
    if not table_exists(con, "nsys_exports"):  # no export loaded yet: nothing to align, no tables to view
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














