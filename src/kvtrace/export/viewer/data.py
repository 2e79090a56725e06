"""DuckDB -> the viewer's data: one dict of columnar arrays, sized for a browser tab.

Runs in the exporting process (`kvtrace export`), read-only on the database. Everything the viewer shows
is computed here in SQL; the browser only decodes and draws. Shared with the Perfetto exporter: the
session pick (`open_session`), the step and request numbering (`make_index_tables`) and the request
lane segments (`SEGMENTS_SQL`).

Units in the output: times are integer µs since the session start (`sessions.start_monotonic_ns`, host
CLOCK_MONOTONIC; the first step's start when the manifest has none); tokens and blocks as recorded.
Columns are plain JSON arrays, or `{"d": [first, delta, delta, ...]}` for sorted columns (a third of
the size); `viewer.js` decodes both.

Size: `max_events` bounds the rows embedded. The heatmap (`kv_access` cells per step x block x layer x
op, or block events when there is no `kv_access`), the block-state intervals and the per-step details
each get a share; past it the heatmap and the states are binned coarser (in time, and in block ids for
pools of more than 2,048 blocks) and the step details drop block ids, then keep every k-th step. Each
reduction adds a line to `notices`, which the viewer shows on screen. Steps, requests and their lane
segments are always complete.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from kvtrace.errors import KvtraceError
from kvtrace.format.schema import PROBE_FINE_SQL

DATA_VERSION = 1
STOPS = ["none", "tok-budget", "kv-insuf", "max-seqs", "blocked", "lora", "preempted", "prefill-throttle",
         "prefill-cadence", "skipped"]
PHASES = ["prefill", "decode"]
KINDS = ["new", "resumed", "running"]
BLOCK_EVENTS = ["alloc", "touch", "free", "cache", "evict", "pin", "unpin", "expire"]
SEGMENT_KINDS = ["queued", "prefill", "decode", "preempted"]
STATES = ["free", "in use", "cached", "held"]
MAX_BLOCK_ROWS = 2048  # heatmap rows: pools larger than this are binned in block ids


def open_session(db_path: str | Path, session: str | None) -> tuple[duckdb.DuckDBPyConnection, str]:
    """Open the database read-only and pick the session: the given one, or the only one."""
    from kvtrace.store.db import open_db

    con = open_db(db_path, read_only=True)
    try:
        if not _has_table(con, "sessions") or not _has_table(con, "steps"):
            raise KvtraceError(f"{db_path}: no kvtrace sessions in this database (only Nsight data?)")
        # A row without a session id is no session (a database edited by hand): left out.
        ids = [r[0] for r in con.execute("SELECT session FROM sessions WHERE session IS NOT NULL "
                                         "ORDER BY session").fetchall()]
        if session is not None:
            if session not in ids:
                raise KvtraceError(f"{db_path}: no session {session!r} (it has: {', '.join(ids) or 'none'})")
            return con, session
        if not ids:
            raise KvtraceError(f"{db_path}: no sessions in this database")
        if len(ids) > 1:
            raise KvtraceError(f"{db_path} holds {len(ids)} sessions; pick one with --session: {', '.join(ids)}")
        return con, ids[0]
    except BaseException:
        con.close()
        raise


def _has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    return bool(con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?",
                            [name]).fetchall()[0][0])


def session_origin_ns(con: duckdb.DuckDBPyConnection, sid: str) -> int:
    """The session's time origin on the host monotonic clock (ns): manifest start, else the first step."""
    row = con.execute("""SELECT coalesce((SELECT start_monotonic_ns FROM sessions WHERE session = $s),
        (SELECT min(t_start_ns) FROM steps WHERE session = $s), 0)""", {"s": sid}).fetchall()[0]
    return int(row[0])


def first_step_ns(con: duckdb.DuckDBPyConnection, sid: str) -> int | None:
    """When the session's first engine step started (host monotonic ns): the origin of the canned
    queries' `t_s` columns. None without steps."""
    value = con.execute("SELECT min(t_start_ns) FROM steps WHERE session = $s", {"s": sid}).fetchall()[0][0]
    return None if value is None else int(value)


def make_index_tables(con: duckdb.DuckDBPyConnection, sid: str) -> None:
    """Temp tables `v_steps` and `v_req`: the session's steps and requests with a dense 0-based `idx`.

    Steps are numbered in start-time order; requests by job, turn and arrival (the lane order), so a
    request's lanes of one job sit together. A request seen in `step_requests` but without lifecycle
    events (probe off) still gets a row.
    """
    con.execute("""CREATE OR REPLACE TEMP TABLE v_steps AS
        SELECT (row_number() OVER (ORDER BY t_start_ns, rank, step) - 1)::INTEGER AS idx, *
        FROM steps WHERE session = $s""", {"s": sid})
    con.execute("""CREATE OR REPLACE TEMP TABLE v_req AS
        WITH ids AS (
            SELECT rank, request_id FROM requests WHERE session = $s
            UNION SELECT rank, request_id FROM step_requests WHERE session = $s
        )
        SELECT (row_number() OVER (ORDER BY TRY_CAST(r.job_id AS BIGINT) NULLS LAST, r.job_id NULLS LAST,
                    r.turn NULLS LAST, coalesce(r.arrival_ns, r.queued_ns, r.first_scheduled_ns) NULLS LAST,
                    ids.request_id) - 1)::INTEGER AS idx,
               ids.rank, ids.request_id, r.* EXCLUDE (session, rank, request_id)
        FROM ids LEFT JOIN requests r
            ON r.session = $s AND r.rank = ids.rank AND r.request_id = ids.request_id""", {"s": sid})


# Request lane segments (ns, absolute): queued (arrival -> first scheduled), one per prefill chunk (its
# step's execute part), decode runs over consecutive steps, preempted (preempted -> resumed). Execute
# parts are used so that a lane's segments do not overlap: a request is queued until its first step's
# schedule() returns, and preempted/resumed happen inside schedule().
SEGMENTS_SQL = """
WITH sr AS (
    SELECT r.idx AS req, s.idx AS sidx, s.step, x.phase, x.chunk_index, s.t_sched_end_ns AS t0,
           coalesce(s.t_end_ns, s.t_sched_end_ns) AS t1
    FROM step_requests x JOIN v_steps s ON s.rank = x.rank AND s.step = x.step
    JOIN v_req r ON r.rank = x.rank AND r.request_id = x.request_id
    WHERE x.session = $s
), dec AS (
    SELECT *, sidx - row_number() OVER (PARTITION BY req ORDER BY sidx) AS run FROM sr WHERE phase = 'decode'
), pre AS (
    SELECT rank, request_id, ts_ns FROM request_events WHERE session = $s AND event = 'preempted'
), res AS (
    SELECT rank, request_id, ts_ns FROM request_events WHERE session = $s AND event = 'resumed'
), seg AS (
    SELECT idx AS req, 0 AS kind, coalesce(arrival_ns, queued_ns) AS t0,
           coalesce(first_scheduled_ns, finish_ns) AS t1, NULL::BIGINT AS step0, NULL::BIGINT AS step1,
           NULL::INTEGER AS chunk
    FROM v_req WHERE coalesce(arrival_ns, queued_ns) IS NOT NULL
    UNION ALL
    SELECT req, 1, t0, t1, step, step, chunk_index FROM sr WHERE phase = 'prefill'
    UNION ALL
    SELECT req, 2, min(t0), max(t1), min(step), max(step), NULL FROM dec GROUP BY req, run
    UNION ALL
    SELECT r.idx, 3, p.ts_ns, coalesce(x.ts_ns, r.finish_ns), NULL, NULL, NULL
    FROM pre p ASOF LEFT JOIN res x ON x.rank = p.rank AND x.request_id = p.request_id AND x.ts_ns >= p.ts_ns
    JOIN v_req r ON r.rank = p.rank AND r.request_id = p.request_id
)
SELECT req, kind, t0, greatest(coalesce(t1, t0), t0) AS t1, step0, step1, chunk FROM seg ORDER BY req, t0, kind
"""


def _used(sql: str, params: dict | list | None) -> dict | list:
    """The named parameters the SQL uses (DuckDB refuses extra ones)."""
    if not isinstance(params, dict):
        return params or []
    return {k: v for k, v in params.items() if re.search(rf"\${re.escape(k)}\b", sql)}


def _cols(con: duckdb.DuckDBPyConnection, sql: str, params: dict | None = None) -> dict[str, list]:
    """Run SQL; the result as {column: list} (nulls as None)."""
    used = _used(sql, params)
    rel = con.sql(sql, params=used) if used else con.sql(sql)
    tbl = rel.to_arrow_table()
    out = {}
    for name in tbl.column_names:
        col = tbl.column(name)
        if col.null_count == 0 and (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            out[name] = col.to_numpy().tolist()  # much faster than to_pylist for big numeric columns
        else:
            out[name] = col.to_pylist()
    return out


def _one(con: duckdb.DuckDBPyConnection, sql: str, params: dict | list | None = None) -> Any:
    rows = con.execute(sql, _used(sql, params)).fetchall()
    return rows[0][0] if rows else None


def delta(values: list) -> dict | list:
    """A sorted integer column as {"d": [first, differences...]}; columns with nulls stay plain."""
    if not values or any(v is None for v in values):
        return values
    out = [values[0]]
    out += [b - a for a, b in zip(values[:-1], values[1:], strict=True)]
    return {"d": out}


def _codes(values: list, names: list[str]) -> list[int]:
    """Strings as indexes into `names` (unknown strings are appended to it)."""
    index = {n: i for i, n in enumerate(names)}
    out = []
    for v in values:
        if v not in index:
            index[v] = len(names)
            names.append(v)
        out.append(index[v])
    return out


def build(con: duckdb.DuckDBPyConnection, sid: str, max_events: int = 1_000_000) -> dict[str, Any]:
    """Everything the viewer embeds for session `sid` (see the module docstring for units and sizes)."""
    if max_events < 100:
        raise KvtraceError(f"--max-events {max_events}: too small (at least 100)")
    t0 = session_origin_ns(con, sid)
    p = {"s": sid, "t0": t0}
    make_index_tables(con, sid)
    notices: list[dict[str, str]] = []
    data: dict[str, Any] = {"version": DATA_VERSION, "notices": notices}
    data["meta"] = _meta(con, sid, t0, notices)
    data["steps"] = _steps(con, p)
    data["requests"] = _requests(con, p)
    data["segments"] = _segments(con, p)
    data["details"] = _details(con, p, max_events // 2, notices)
    data["preemptions"] = _cols(con, """
        SELECT s.idx AS step, r.idx AS req, round((x.ts_ns - $t0) / 1000)::BIGINT AS ts,
               x.computed_tokens_lost AS lost, x.blocks_freed AS blocks, x.output_tokens AS out
        FROM preemptions x LEFT JOIN v_steps s ON s.rank = x.rank AND s.step = x.step
        LEFT JOIN v_req r ON r.rank = x.rank AND r.request_id = x.request_id
        WHERE x.session = $s ORDER BY x.ts_ns""", p)
    data["pins"] = _cols(con, """
        SELECT s.idx AS step, r.idx AS req, x.request_id AS rid, round((x.ts_ns - $t0) / 1000)::BIGINT AS ts,
               x.event, len(x.block_ids) AS blocks, x.ttl_ns, x.reason
        FROM pins x LEFT JOIN v_steps s ON s.rank = x.rank AND s.step = x.step
        LEFT JOIN v_req r ON r.rank = x.rank AND r.request_id = x.request_id
        WHERE x.session = $s ORDER BY x.ts_ns""", p)
    data["kernels"] = _kernels(con, p, notices)
    used = make_used_blocks(con, sid)  # the KV blocks view's rows, for the heatmap and the block states
    data["heat"] = _heat(con, p, max_events // 4, data["meta"], notices, used)
    data["states"] = _states(con, p, max_events // 4, data["meta"], notices)
    return data


def _meta(con, sid: str, t0: int, notices: list) -> dict[str, Any]:
    row = con.execute("""SELECT status, model, vllm_version, kvtrace_version, command, block_size,
        num_kv_blocks, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill,
        kv_connector, start_utc_ns, job_pattern FROM sessions WHERE session = ?""", [sid]).fetchall()[0]
    keys = ["status", "model", "vllm_version", "kvtrace_version", "command", "block_size", "num_kv_blocks",
            "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill",
            "kv_connector", "start_utc_ns", "job_pattern"]
    meta: dict[str, Any] = dict(zip(keys, row, strict=True))
    meta["session"] = sid
    meta["origin_monotonic_ns"] = t0
    # The viewer counts from session start; kvtrace query's t_s from the first engine step: say where.
    first = first_step_ns(con, sid)
    meta["first_step_s"] = None if first is None else round((first - t0) / 1e9, 6)
    meta["usable_blocks"] = _one(con, "SELECT max(kv_blocks_total) FROM steps WHERE session = $s", {"s": sid})
    counts = {}
    for table in ("steps", "step_requests", "request_events", "block_events", "prefix_lookups", "preemptions",
                  "pins", "kv_access", "transfers"):
        counts[table] = int(_one(con, f"SELECT count(*) FROM {table} WHERE session = $s", {"s": sid}))
    counts["requests"] = int(_one(con, "SELECT count(*) FROM v_req"))
    meta["counts"] = counts
    meta["events"] = sum(v for k, v in counts.items() if k != "requests")
    meta["ranks"] = [r[0] for r in con.execute("SELECT DISTINCT rank FROM v_steps ORDER BY 1").fetchall()]
    # The pool size: the engine's config, else what the steps report, else the largest block id seen.
    meta["pool_blocks"] = int(_one(con, """SELECT greatest(
        coalesce((SELECT max(kv_blocks_total) + 1 FROM steps WHERE session = $s), 0),
        coalesce((SELECT max(block_id) + 1 FROM block_events WHERE session = $s), 0),
        coalesce((SELECT max(block_id) + 1 FROM kv_access WHERE session = $s), 0),
        coalesce((SELECT num_kv_blocks FROM sessions WHERE session = $s), 0))""", {"s": sid}))
    if meta["status"] != "complete":
        notices.append({"kind": "warn", "text": f"Session status is {meta['status']!s}: a process did not "
                        "finish recording cleanly; the last rows may be missing."})
    for problem, n in con.execute("""SELECT problem, count(*) FROM ingest_issues WHERE session = ?
                                     GROUP BY ALL ORDER BY 2 DESC LIMIT 5""", [sid]).fetchall():
        notices.append({"kind": "warn", "text": f"Ingest: {problem} ({n} file(s))."})
    lost = _one(con, "SELECT coalesce(sum(dropped), 0) FROM drops WHERE session = ?", [sid]) if _has_table(
        con, "drops") else 0
    if lost:
        notices.append({"kind": "warn", "text": f"{int(lost):,} rows were lost while recording (see the drops table)."})
    for probe, role, status, reason in con.execute(f"""SELECT DISTINCT probe, role, status, reason FROM probes
            WHERE session = ? AND status NOT IN {PROBE_FINE_SQL} ORDER BY 1, 2""", [sid]).fetchall():
        notices.append({"kind": "warn", "text": f"Probe {probe} ({role}) {status}: {reason}"})
    return meta


def _steps(con, p: dict) -> dict[str, Any]:
    c = _cols(con, """
        WITH lk AS (
            SELECT rank, step, sum(query_tokens)::BIGINT AS q, sum(hit_tokens)::BIGINT AS h,
                   sum(external_hit_tokens)::BIGINT AS e,
                   count(*) AS n
            FROM prefix_lookups WHERE session = $s GROUP BY ALL
        ), pr AS (SELECT rank, step, count(*) AS n FROM preemptions WHERE session = $s GROUP BY ALL),
        pn AS (SELECT rank, step, count(*) AS n FROM pins WHERE session = $s GROUP BY ALL)
        SELECT s.rank, s.step,
            round((s.t_start_ns - $t0) / 1000)::BIGINT AS ts,
            round((s.t_sched_end_ns - s.t_start_ns) / 1000)::BIGINT AS sched,
            round((s.t_end_ns - s.t_sched_end_ns) / 1000)::BIGINT AS exec,
            s.scheduled_tokens AS fwd, s.prefill_tokens AS pt, s.decode_tokens AS dt,
            s.num_prefill_reqs AS np, s.num_decode_reqs AS nd, s.num_running AS run, s.num_waiting AS wait,
            s.kv_blocks_used AS kv, s.kv_blocks_total AS kvt, s.token_budget AS budget, s.max_num_seqs AS seqs,
            coalesce(s.admission_stop, 'none') AS stop, s.num_preempted AS npre, s.num_new_reqs AS new,
            s.num_resumed_reqs AS res, s.num_finished AS fin, s.prompt_tokens_new AS prompt,
            s.cached_tokens_new AS cached,
            coalesce(lk.q, 0) AS lq, coalesce(lk.h, 0) AS lh, lk.e AS le, coalesce(lk.n, 0) AS ln,
            coalesce(pr.n, 0) AS preempts, coalesce(pn.n, 0) AS pins
        FROM v_steps s LEFT JOIN lk USING (rank, step) LEFT JOIN pr USING (rank, step)
        LEFT JOIN pn USING (rank, step)
        ORDER BY s.idx""", p)
    stops = list(STOPS)
    c["stop"] = _codes(c["stop"], stops)
    c["ts"], c["step"] = delta(c["ts"]), delta(c["step"])
    c["stop_names"] = stops
    c["external"] = any(v is not None for v in c["le"])
    return c


def _requests(con, p: dict) -> dict[str, Any]:
    c = _cols(con, """
        SELECT request_id AS id, rank, job_id AS job, turn,
            round((coalesce(arrival_ns, queued_ns) - $t0) / 1000)::BIGINT AS arr,
            round((first_scheduled_ns - $t0) / 1000)::BIGINT AS sched,
            round((first_token_ns - $t0) / 1000)::BIGINT AS first,
            round((finish_ns - $t0) / 1000)::BIGINT AS fin,
            finish_reason AS reason, prompt_tokens AS prompt, output_tokens AS out, cached_tokens AS cached,
            num_preemptions AS npre
        FROM v_req ORDER BY idx""", p)
    c["grouped"] = any(j is not None for j in c["job"])
    return c


def _segments(con, p: dict) -> dict[str, Any]:
    c = _cols(con, f"""
        SELECT req, kind, round((t0 - $t0) / 1000)::BIGINT AS t0, round((t1 - t0) / 1000)::BIGINT AS dur
        FROM ({SEGMENTS_SQL})""", p)
    c["req"] = delta(c["req"])
    c["kind_names"] = SEGMENT_KINDS
    return c


def _details(con, p: dict, cap: int, notices: list) -> dict[str, Any]:
    """Per step: its requests (step_requests) and its block events grouped by (request, event)."""
    n_sr = int(_one(con, "SELECT count(*) FROM step_requests WHERE session = $s", p))
    n_groups, n_blocks = con.execute("""SELECT count(DISTINCT (rank, step, request_id, event)), count(*)
        FROM block_events WHERE session = $s""", {"s": p["s"]}).fetchall()[0]
    with_ids, every = True, 1
    if n_sr + n_groups + n_blocks > cap:
        with_ids = False
        if n_sr + n_groups > cap:
            every = math.ceil((n_sr + n_groups) / cap)
            notices.append({"kind": "sampled", "text": (
                f"Step details (requests and block events of a step) are kept for 1 step in {every}: "
                f"{n_sr:,} step-request rows and {n_groups:,} block-event groups are more than the "
                f"{cap:,} this export embeds (raise --max-events to keep more).")})
        else:
            notices.append({"kind": "aggregated", "text": (
                f"Block events in step details are counts per request and event; the {n_blocks:,} "
                f"block ids are left out (raise --max-events to keep them).")})
    pe = {**p, "every": every}
    sr = _cols(con, """
        SELECT s.idx AS step, r.idx AS req, x.tokens, x.phase, x.kind, x.chunk_index AS chunk,
               x.computed_before AS before, x.new_blocks AS blocks
        FROM step_requests x JOIN v_steps s ON s.rank = x.rank AND s.step = x.step
        JOIN v_req r ON r.rank = x.rank AND r.request_id = x.request_id
        WHERE x.session = $s AND s.idx % $every = 0
        ORDER BY s.idx, r.idx""", pe)
    phases, kinds = list(PHASES), list(KINDS)
    sr["phase"], sr["kind"] = _codes(sr["phase"], phases), _codes(sr["kind"], kinds)
    sr["step"], sr["phase_names"], sr["kind_names"] = delta(sr["step"]), phases, kinds
    ids = "list(x.block_id ORDER BY x.block_id)" if with_ids else "NULL::INTEGER[]"
    be = _cols(con, f"""
        SELECT s.idx AS step, coalesce(r.idx, -1) AS req, x.event, count(*)::INTEGER AS n, {ids} AS ids
        FROM block_events x JOIN v_steps s ON s.rank = x.rank AND s.step = x.step
        LEFT JOIN v_req r ON r.rank = x.rank AND r.request_id = x.request_id
        WHERE x.session = $s AND s.idx % $every = 0
        GROUP BY ALL ORDER BY s.idx, x.event, req""", pe)
    names = list(BLOCK_EVENTS)
    be["event"], be["step"], be["event_names"] = _codes(be["event"], names), delta(be["step"]), names
    if not with_ids:
        del be["ids"]
    return {"every": every, "with_ids": with_ids, "requests": sr, "blocks": be}


def _kernels(con, p: dict, notices: list) -> dict[str, Any] | None:
    """Kernels per step from an aligned Nsight export (the `nsys_step_kernels` view), when there is one."""
    if not _has_table(con, "nsys_step_kernels"):
        return None
    try:
        k = _cols(con, """
            SELECT s.idx AS step, sum(k.kernels)::BIGINT AS kernels, sum(k.gpu_ns)::BIGINT AS gpu_ns,
                   any_value(k.top_names) AS top
            FROM nsys_step_kernels k JOIN v_steps s ON s.rank = k.rank AND s.step = k.step
            WHERE k.session = $s GROUP BY ALL ORDER BY 1""", p)
    except duckdb.Error as exc:
        notices.append({"kind": "warn", "text": f"Nsight kernels per step could not be read: "
                        f"{str(exc).splitlines()[0][:160]}"})
        return None
    return k if k["step"] else None


def _block_bin(rows: int) -> int:
    m = 1
    while rows / m > MAX_BLOCK_ROWS:
        m *= 2
    return m


def make_used_blocks(con: duckdb.DuckDBPyConnection, sid: str) -> list[int]:
    """Temp table `v_used`: the blocks the session used (read or written, allocated, cached, pinned), each
    with its row in the KV blocks view (`r`, in block id order): a default `vllm serve` pool of 32,768
    blocks with 200 in use is 200 rows, not a strip of one pixel at the top of 32,768. Made once (it
    scans kv_access); the heatmap and the block states join it. Returns the block ids in row order."""
    con.execute("""CREATE OR REPLACE TEMP TABLE v_used AS
        SELECT block_id, (row_number() OVER (ORDER BY block_id) - 1)::INTEGER AS r FROM (
            SELECT block_id FROM kv_access WHERE session = $s
            UNION SELECT block_id FROM block_events WHERE session = $s AND block_id IS NOT NULL
            UNION SELECT unnest(block_ids) AS block_id FROM pins WHERE session = $s AND block_ids IS NOT NULL)""",
                {"s": sid})
    return [r[0] for r in con.execute("SELECT block_id FROM v_used ORDER BY r").fetchall()]


def _heat(con, p: dict, cap: int, meta: dict, notices: list, used: list[int]) -> dict[str, Any]:
    """The block x time heatmap: per-layer reads/writes from kv_access, else block events, per step bin;
    a row per used block (`used`, from `make_used_blocks`), rows binned beyond MAX_BLOCK_ROWS."""
    n_access = meta["counts"]["kv_access"]
    n_rows = max(1, len(used))
    m = m_rows = _block_bin(n_rows)  # m_rows: what the view's row cap alone asks for
    if n_access:
        source, names = "kv_access", ["read", "write"]
        rows = """SELECT s.idx, a.block_id, a.layer, a.op::INTEGER AS op
            FROM kv_access a JOIN v_steps s ON s.rank // 1000 = a.rank // 1000 AND s.step = a.step
            WHERE a.session = $s"""
        layers = [r[0] for r in con.execute(
            "SELECT DISTINCT layer FROM kv_access WHERE session = $s ORDER BY 1", {"s": p["s"]}).fetchall()]
    else:
        source, names = "block_events", list(BLOCK_EVENTS[:5])
        rows = """SELECT s.idx, b.block_id, 0 AS layer, CASE b.event WHEN 'alloc' THEN 0 WHEN 'touch' THEN 1
                WHEN 'free' THEN 2 WHEN 'cache' THEN 3 ELSE 4 END AS op
            FROM block_events b JOIN v_steps s ON s.rank = b.rank AND s.step = b.step
            WHERE b.session = $s AND b.event IN ('alloc', 'touch', 'free', 'cache', 'evict')"""
        layers = [0]
        notices.append({"kind": "info", "text": (
            "No per-layer KV access records (kv_access) in this session: the KV heatmap shows block "
            "events (alloc, touch = prefix hit, free, cache, evict) per block and step instead.")})
    rows = f"SELECT x.idx, u.r AS row, x.layer, x.op FROM ({rows}) x JOIN v_used u USING (block_id)"
    if len(used) < meta["pool_blocks"]:
        notices.append({"kind": "info", "text": (
            f"KV blocks view: a row for each of the {len(used):,} blocks this session used, of the pool's "
            f"{meta['pool_blocks']:,}, in block id order (the others were never used). Alt + wheel over it, "
            "or its + and - buttons, zoom the block axis.")})
    # Smallest power-of-two step bin whose cell count fits the cap (estimated in one pass for all bins,
    # then counted exactly); when even one bin for all steps is too many, bin block rows coarser.
    n_steps = max(1, meta["counts"]["steps"])
    shifts = list(range(0, max(1, n_steps).bit_length() + 1))
    est = con.execute("SELECT " + ", ".join(
        f"approx_count_distinct(hash(idx >> {j}, row // {m}, layer, op))" for j in shifts)
        + f" FROM ({rows})", {"s": p["s"]}).fetchall()[0]
    j = next((j for j, n in zip(shifts, est, strict=True) if n <= cap * 0.9), shifts[-1])
    while True:
        cells = _cols(con, f"""
            SELECT idx >> {j} AS bin, row // {m} AS blk, layer, op, count(*)::INTEGER AS n
            FROM ({rows}) GROUP BY ALL ORDER BY bin, blk, layer, op""", p)
        if len(cells["bin"]) <= cap:
            break
        if (n_steps - 1) >> j:
            j += 1
        elif m < n_rows:
            m *= 2
        else:
            break  # one cell per layer and op: cannot shrink further
    k = 1 << j
    if k > 1 or m > 1:
        what = "KV accesses" if n_access else "block events"
        # Say what decided the cells: the export's budget (which --max-events raises) for step bins and
        # blocks binned beyond the row cap; the view's MAX_BLOCK_ROWS rows otherwise.
        why = []
        if m_rows > 1:
            why.append(f"the view draws at most {MAX_BLOCK_ROWS:,} block rows ({len(used):,} blocks used)")
        if k > 1 or m > m_rows:
            why.append(f"{len(cells['bin']):,} cells fit the export's budget of {cap:,} "
                       "(raise --max-events for finer cells)")
        notices.append({"kind": "aggregated", "text": (
            f"KV heatmap: {what} are summed per {k} step(s) x {m} block(s): " + "; ".join(why) + ".")})
    layer_index = {lay: i for i, lay in enumerate(layers)}
    cells["layer"] = [layer_index[v] for v in cells["layer"]]
    cells["bin"], cells["blk"] = delta(cells["bin"]), cells["blk"]
    # blocks: the block id of each used-block row (rows of the view bin `block_bin` of them).
    return {"source": source, "op_names": names, "layers": layers, "step_bin": k, "block_bin": m,
            "rows": math.ceil(n_rows / m), "blocks": delta(used), **cells}


# Block states from block events (+ pins): references count alloc/touch minus free; a block with no
# reference is cached while it has a hash (cache .. evict), held while a pin/hold is open.
STATES_SQL = """
WITH pins_ids AS (  -- an unpin/expire/release without block ids releases the owner's last pinned blocks
    SELECT x.rowid AS ord, x.ts_ns, x.event, coalesce(x.block_ids, q.block_ids) AS block_ids
    FROM pins x ASOF LEFT JOIN (SELECT request_id, ts_ns, block_ids FROM pins
                                WHERE session = $s AND block_ids IS NOT NULL) q
        ON q.request_id = x.request_id AND x.ts_ns >= q.ts_ns
    WHERE x.session = $s
), ev AS (
    SELECT block_id, ts_ns, seq AS ord, event FROM block_events
    WHERE session = $s AND block_id IS NOT NULL AND rank // 1000 = $rank // 1000
    UNION ALL
    SELECT unnest(block_ids) AS block_id, ts_ns, ord, event FROM pins_ids
), d AS (
    SELECT block_id, ts_ns, ord,
        sum(CASE WHEN event IN ('alloc', 'touch') THEN 1 WHEN event = 'free' THEN -1 ELSE 0 END) OVER w AS refs,
        coalesce(last_value(CASE WHEN event = 'cache' THEN 1 WHEN event = 'evict' THEN 0 END IGNORE NULLS)
            OVER w, 0) AS hashed,
        sum(CASE WHEN event IN ('pin', 'hold') THEN 1 WHEN event IN ('unpin', 'expire', 'release') THEN -1
            ELSE 0 END) OVER w AS pinned
    FROM ev WINDOW w AS (PARTITION BY block_id ORDER BY ts_ns, ord ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
), q AS (  -- the state at the end of each time quantum ($q µs; 0 = exact)
    SELECT block_id,
        CASE WHEN $q > 0 THEN (floor((ts_ns - $t0) / 1000 / $q) * $q)::BIGINT
             ELSE round((ts_ns - $t0) / 1000)::BIGINT END AS t,
        last(CASE WHEN pinned > 0 THEN 3 WHEN refs > 0 THEN 1 WHEN hashed = 1 THEN 2 ELSE 0 END
             ORDER BY ts_ns, ord) AS state
    FROM d GROUP BY ALL
), changes AS (
    SELECT *, lag(state) OVER (PARTITION BY block_id ORDER BY t) AS prev FROM q
), runs AS (
    SELECT block_id, t, state, lead(t) OVER (PARTITION BY block_id ORDER BY t) AS t_next
    FROM changes WHERE prev IS NULL OR prev <> state
)
"""


def _states(con, p: dict, cap: int, meta: dict, notices: list) -> dict[str, Any]:
    """Intervals of non-free block states (µs) per used-block row: in use, cached, held; open intervals
    run to the end."""
    rank = meta["ranks"][0] if meta["ranks"] else 0
    if len({r // 1000 for r in meta["ranks"]}) > 1:
        notices.append({"kind": "info", "text": f"Several data-parallel ranks: the KV blocks view shows rank {rank}'s pool."})
    span_us = max(1, int(_one(con, """SELECT coalesce(max(coalesce(t_end_ns, t_sched_end_ns)) - min(t_start_ns), 0)
        / 1000 FROM v_steps""") or 1))
    q = 0
    while True:
        pq = {**p, "rank": rank, "q": q}
        n = int(_one(con, STATES_SQL + "SELECT count(*) FROM runs WHERE state <> 0", pq))
        if n <= cap or q >= span_us:
            break
        q = max(1, span_us // 65536) if q == 0 else q * 2
    # blk: the block's row in the KV blocks view (`v_used`), as the heatmap's cells have it.
    c = _cols(con, STATES_SQL + """
        SELECT u.r AS blk, t AS t0, t_next - t AS dur, state FROM runs JOIN v_used u USING (block_id)
        WHERE state <> 0 ORDER BY u.r, t""", pq)
    if q:
        notices.append({"kind": "aggregated", "text": (
            f"Block states are sampled every {q / 1000:.3g} ms (the state at the end of each interval) so "
            f"that {len(c['blk']):,} intervals fit the export's budget of {cap:,}.")})
    c["blk"] = delta(c["blk"])
    c["state_names"], c["quantum_us"] = STATES, q
    return c
