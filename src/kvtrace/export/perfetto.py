"""Chrome / Perfetto trace-event JSON for one session (open it in ui.perfetto.dev or chrome://tracing).

    from kvtrace.export.perfetto import export_perfetto
    export_perfetto("run1.duckdb", "run1.json")

Runs in the exporting process. Layout, per engine rank (rank = dp x 1000 + tp):

- process "vLLM engine rank R": thread "steps" with one complete ("X") slice per engine step, and two
  nested slices for its phases, `schedule` (t_start_ns .. t_sched_end_ns) and `execute+update`
  (t_sched_end_ns .. t_end_ns); a step that overlaps the previous one (async scheduling) goes to a second
  thread so slices on a thread always nest. Our step id is in every step slice's args (`step`).
  Counters ("C"): `KV blocks` {used, free}, `KV usage %`, `queues` {running, waiting},
  `scheduled tokens` {prefill, decode}, sampled after each schedule(). Instants ("i") on thread
  "preemptions & pins", one per preemption and per pin event.
- process "requests rank R": one async track per request (nestable "b"/"e", category `request`, id =
  the request's lane number), named by request id, with nested `queued`, `prefill` (one per chunk),
  `decode` and `preempted` slices (the viewer's lane segments, data.SEGMENTS_SQL).

Timestamps ("ts", "dur") are µs (with ns decimals) since the session start: the host CLOCK_MONOTONIC
value `sessions.start_monotonic_ns`, stated in a "clock" metadata event and in `otherData`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kvtrace.errors import KvtraceError
from kvtrace.export.viewer import data as view_data

STEP_ARGS = ["scheduled_tokens", "prefill_tokens", "decode_tokens", "num_prefill_reqs", "num_decode_reqs",
             "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "token_budget",
             "admission_stop", "num_preempted", "num_new_reqs", "num_resumed_reqs", "num_finished",
             "prompt_tokens_new", "cached_tokens_new"]
STEPS_TID, OVERLAP_TID, EVENTS_TID = 1, 2, 3


def export_perfetto(db_path: str | Path, out_path: str | Path, session: str | None = None) -> str:
    """Write the session's trace-event JSON to `out_path`; returns a one-line summary."""
    t_start = time.monotonic()
    con, sid = view_data.open_session(db_path, session)
    try:
        trace = build_trace(con, sid)
    finally:
        con.close()
    out = Path(out_path)
    if out.parent and not out.parent.exists():
        raise KvtraceError(f"{out}: directory {out.parent} does not exist")
    with out.open("w", encoding="utf-8") as f:
        # One event per line: diff-able, and a reader can stream it.
        f.write('{"displayTimeUnit":"ms","otherData":' + json.dumps(trace["otherData"]) + ',"traceEvents":[\n')
        events = trace["traceEvents"]
        for i, ev in enumerate(events):
            f.write(json.dumps(ev, separators=(",", ":"), allow_nan=False))
            f.write(",\n" if i + 1 < len(events) else "\n")
        f.write("]}\n")
    return (f"session {sid}: {len(trace['traceEvents']):,} trace events, "
            f"{out.stat().st_size / 1e6:.1f} MB in {time.monotonic() - t_start:.1f} s")


def _us(ns: int | None, t0: int) -> float | None:
    """ns on the host clock -> µs since the session start, ns precision kept."""
    return None if ns is None else round((ns - t0) / 1000.0, 3)


def _dur(a: int, b: int) -> float:
    return round(max(0, b - a) / 1000.0, 3)


def build_trace(con, sid: str) -> dict[str, Any]:
    """The trace as a dict: {"traceEvents": [...], "otherData": {...}} (see the module docstring)."""
    t0 = view_data.session_origin_ns(con, sid)
    view_data.make_index_tables(con, sid)
    start_utc = con.execute("SELECT start_utc_ns FROM sessions WHERE session = ?", [sid]).fetchall()[0][0]
    ranks = [r[0] for r in con.execute("SELECT DISTINCT rank FROM v_steps UNION SELECT DISTINCT rank FROM v_req "
                                       "ORDER BY 1").fetchall()]
    pid_of = {rank: 2 * i + 1 for i, rank in enumerate(ranks)}  # engine; its requests get pid + 1
    first = view_data.first_step_ns(con, sid)
    clock = {"clock": "host CLOCK_MONOTONIC", "unit": "us", "origin": "session start",
             "origin_monotonic_ns": t0, "origin_utc_ns": start_utc, "session": sid,
             # kvtrace query's t_s counts from here: the same moment is ts = first_engine_step_us + 1e6 * t_s
             "first_engine_step_us": None if first is None else _us(first, t0)}
    meta: list[dict] = []
    for i, rank in enumerate(ranks):
        pid = pid_of[rank]
        meta += [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"vLLM engine rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": 2 * i}},
            {"name": "process_labels", "ph": "M", "pid": pid, "tid": 0,
             "args": {"labels": f"kvtrace session {sid}; ts = µs since session start"}},
            {"name": "clock", "ph": "M", "pid": pid, "tid": 0, "args": clock},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": STEPS_TID, "args": {"name": "steps"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": OVERLAP_TID,
             "args": {"name": "steps (overlapping the previous)"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": EVENTS_TID,
             "args": {"name": "preemptions & pins"}},
            {"name": "process_name", "ph": "M", "pid": pid + 1, "tid": 0, "args": {"name": f"requests rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": pid + 1, "tid": 0, "args": {"sort_index": 2 * i + 1}},
        ]
    marks = [] if first is None else [  # a global marker where kvtrace query's t_s = 0
        {"name": "first engine step (t_s = 0 in kvtrace query)", "cat": "origin", "ph": "i", "s": "g",
         "pid": pid_of[ranks[0]], "tid": STEPS_TID, "ts": _us(first, t0)}]
    events = (meta + marks + _steps(con, t0, pid_of) + _instants(con, sid, t0, pid_of)
              + _requests(con, sid, t0, pid_of))
    return {"traceEvents": events, "otherData": {"kvtrace_session": sid, **clock}}


def _steps(con, t0: int, pid_of: dict[int, int]) -> list[dict]:
    cols = ", ".join(STEP_ARGS)
    rows = con.execute(f"""SELECT rank, step, t_start_ns, t_sched_end_ns, t_end_ns, {cols}
        FROM v_steps ORDER BY rank, t_start_ns, step""").fetchall()
    slices: list[dict] = []
    counters: list[dict] = []
    lane_end: dict[tuple[int, int], int] = {}
    for row in rows:
        rank, step, ts, se, te = row[:5]
        args = dict(zip(STEP_ARGS, row[5:], strict=True))
        pid = pid_of[rank]
        end = te if te is not None else se
        tid = STEPS_TID if ts >= lane_end.get((pid, STEPS_TID), ts) else OVERLAP_TID
        if tid == OVERLAP_TID and ts < lane_end.get((pid, OVERLAP_TID), ts):
            tid = STEPS_TID  # both lanes busy (should not happen): keep the order, Perfetto clips
        lane_end[(pid, tid)] = max(lane_end.get((pid, tid), end), end)
        slices.append({"name": f"step {step}", "cat": "step", "ph": "X", "ts": _us(ts, t0), "dur": _dur(ts, end),
                       "pid": pid, "tid": tid, "args": {"step": step, "rank": rank, "finished": te is not None, **args}})
        slices.append({"name": "schedule", "cat": "step_phase", "ph": "X", "ts": _us(ts, t0), "dur": _dur(ts, se),
                       "pid": pid, "tid": tid, "args": {"step": step}})
        if te is not None:
            slices.append({"name": "execute+update", "cat": "step_phase", "ph": "X", "ts": _us(se, t0),
                           "dur": _dur(se, te), "pid": pid, "tid": tid, "args": {"step": step}})
        used, total = args["kv_blocks_used"], args["kv_blocks_total"]
        at = _us(se, t0)
        if used is not None and total is not None:
            counters.append({"name": "KV blocks", "ph": "C", "ts": at, "pid": pid,
                             "args": {"used": used, "free": max(0, total - used)}})
            counters.append({"name": "KV usage %", "ph": "C", "ts": at, "pid": pid,
                             "args": {"percent": round(100.0 * used / total, 2) if total else 0.0}})
        counters.append({"name": "queues", "ph": "C", "ts": at, "pid": pid,
                         "args": {"running": args["num_running"] or 0, "waiting": args["num_waiting"] or 0}})
        counters.append({"name": "scheduled tokens", "ph": "C", "ts": at, "pid": pid,
                         "args": {"prefill": args["prefill_tokens"] or 0, "decode": args["decode_tokens"] or 0}})
    counters.sort(key=lambda e: (e["pid"], e["name"], e["ts"]))
    return slices + counters


def _instants(con, sid: str, t0: int, pid_of: dict[int, int]) -> list[dict]:
    rows = con.execute("""
        SELECT rank, ts_ns, 'preempt' AS kind, step, request_id, computed_tokens_lost, blocks_freed,
               output_tokens, NULL AS n_blocks, NULL AS ttl_ns, NULL AS reason
        FROM preemptions WHERE session = $s
        UNION ALL
        SELECT rank, ts_ns, event, step, request_id, NULL, NULL, NULL, len(block_ids), ttl_ns, reason
        FROM pins WHERE session = $s
        ORDER BY rank, ts_ns""", {"s": sid}).fetchall()
    out = []
    for rank, ts, kind, step, rid, lost, freed, outputs, n_blocks, ttl, reason in rows:
        pid = pid_of.get(rank, min(pid_of.values(), default=1))
        if kind == "preempt":
            args = {"step": step, "request_id": rid, "computed_tokens_lost": lost, "blocks_freed": freed,
                    "output_tokens": outputs}
        else:
            args = {"step": step, "request_id": rid, "blocks": n_blocks, "ttl_ns": ttl, "reason": reason}
        out.append({"name": f"{kind} {rid}", "cat": "preemption" if kind == "preempt" else "pin", "ph": "i",
                    "s": "t", "ts": _us(ts, t0), "pid": pid, "tid": EVENTS_TID, "args": args})
    return out


def _requests(con, sid: str, t0: int, pid_of: dict[int, int]) -> list[dict]:
    reqs = con.execute("""SELECT idx, rank, request_id, job_id, turn, coalesce(arrival_ns, queued_ns),
            first_token_ns, finish_ns, finish_reason, prompt_tokens, output_tokens, cached_tokens,
            num_preemptions FROM v_req ORDER BY idx""").fetchall()
    segs: dict[int, list[tuple]] = {}
    for req, kind, a, b, step0, step1, chunk in con.execute(view_data.SEGMENTS_SQL, {"s": sid}).fetchall():
        segs.setdefault(req, []).append((kind, a, b, step0, step1, chunk))
    out: list[dict] = []
    for idx, rank, rid, job, turn, arrival, first_tok, finish, reason, prompt, outputs, cached, npre in reqs:
        mine = segs.get(idx, [])
        starts = [a for _, a, _, _, _, _ in mine] + ([arrival] if arrival is not None else [])
        if not starts:
            continue
        begin = min(starts)
        end = max([b for _, _, b, _, _, _ in mine] + [x for x in (finish, begin) if x is not None])
        common = {"cat": "request", "id": hex(idx), "pid": pid_of.get(rank, 1) + 1, "tid": 0}
        out.append({"name": rid, "ph": "b", "ts": _us(begin, t0), **common, "args": {
            "request_id": rid, "job": job, "turn": turn, "prompt_tokens": prompt, "output_tokens": outputs,
            "cached_tokens": cached, "preemptions": npre, "finish_reason": reason,
            "first_token_us": _us(first_tok, t0)}})
        cursor = begin
        for kind, a, b, step0, step1, chunk in mine:
            a = max(a, cursor)  # keep nested slices in order and inside the request
            b = min(max(b, a), end)
            name = view_data.SEGMENT_KINDS[kind]
            args: dict[str, Any] = {}
            if step0 is not None:
                args = {"step": step0} if step0 == step1 else {"first_step": step0, "last_step": step1}
            if chunk is not None:
                args["chunk"] = chunk
            out.append({"name": name, "ph": "b", "ts": _us(a, t0), **common, "args": args})
            out.append({"name": name, "ph": "e", "ts": _us(b, t0), **common})
            cursor = b
        out.append({"name": rid, "ph": "e", "ts": _us(end, t0), **common})
    return out
