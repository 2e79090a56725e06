"""Synthetic sessions: N events of realistic shape in the real shard format, deterministic from a seed.

    python -m kvtrace.testing.synth -o /tmp/s10m --events 10000000 --seed 1

For benchmarks and tests of everything after the recorder (ingest, queries, export) at sizes a real
run on this machine cannot reach. The files are written by the recorder's own `ShardWriter` (one
batch per table per simulated 0.5 s flush, as a recording had until the recorder's default became
2 s; kept, so that the scale benchmarks read the same inputs as before), with a manifest from
`kvtrace.format.session.new_manifest` and a `proc.json` per process with the recorder's keys.

The model, simulated with NumPy a window of steps at a time (memory does not grow with N):
`max_num_seqs` lanes each run requests back to back. A request waits a few steps, prefills its
uncached prompt in chunks (its shared system-prompt blocks hit the prefix cache most of the time),
decodes one token per step, and a few are preempted mid-decode, wait, and recompute. Everything is
derived from that one timeline, so the tables agree with each other: the engine process writes
steps, step_requests, request_events, block_events (touch, evict, alloc, cache, free with block and
hash lists), prefix_lookups and preemptions; a worker process writes batch_slots, layer_timings and,
every `KV_EVERY` steps, one layer's kv_access block records (the default `timing` granularity).
Per-step noise comes from a counter-based hash, per-request draws from generators seeded by
(seed, lane, chunk), so the output does not depend on the window size. The event count is exact:
the last step is cut short if needed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kvtrace.format import schema
from kvtrace.format.session import MANIFEST, PROC_FILE, new_manifest, write_json_atomic
from kvtrace.format.shards import ShardWriter, rows_to_batch

BLOCK = 16  # tokens per KV block
LANES = 32  # max_num_seqs: requests running at once
LAYERS = 32
CHUNK = 256  # prefill tokens per request per step (chunked prefill)
LANE_BLOCKS = 288  # each lane owns a region of the pool big enough for its largest request
POOL = LANES * LANE_BLOCKS
GROUPS = 16  # shared system prompts
KV_EVERY = 32  # kv_access: one layer's block records every KV_EVERY steps
WINDOW = 2048  # steps simulated at once
FLUSH_NS = 500_000_000  # a simulated flush interval (the recorder's default was 0.5 s; now 2 s)
ANCHOR_NS = 10_000_000_000  # the recorder writes a clock anchor every 10 s
T0_NS = 1_000_000_000_000  # monotonic clock at the first step
UTC0_NS = 1_790_000_000_000_000_000  # its UTC
JOB_PATTERN = r"job(?P<job>\d+)-turn(?P<turn>\d+)"
TURNS = 4
ENGINE_TABLES = ("steps", "step_requests", "request_events", "block_events", "prefix_lookups", "preemptions")
WORKER_TABLES = ("batch_slots", "layer_timings", "kv_access")
# When the last step has to be cut short to hit N exactly, rows go from these tables first.
TRIM_ORDER = ("layer_timings", "kv_access", "batch_slots", "step_requests", "block_events")

_M1, _M2, _GOLD = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(*parts) -> np.ndarray:
    """splitmix64 of the parts combined: a counter-based random uint64 per element."""
    x = np.zeros(1, dtype=np.uint64)
    for p in parts:
        x = (x ^ np.asarray(p, dtype=np.int64).astype(np.uint64)) * _GOLD
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        x = x ^ (x >> np.uint64(31))
    return x


def _cdiv(a, b):
    return -(-a // b)


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For ranges of `counts` elements: (list offsets, owner of each element, index inside its range)."""
    offsets = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    owner = np.repeat(np.arange(len(counts)), counts)
    return offsets, owner, np.arange(offsets[-1]) - offsets[:-1][owner]


def _strings(values: list[str], codes: np.ndarray) -> pa.Array:
    return pa.array(values, pa.string()).take(pa.array(codes))


class _Lanes:
    """Per-lane request timelines, generated a chunk of requests at a time as the window advances."""

    SEGMENTS = ("gap", "npf", "d1", "g2", "nrc", "d2")  # wait, prefill, decode, preempted, recompute, decode

    def __init__(self, seed: int):
        self.seed = seed
        self.prefix_blocks = np.random.default_rng([seed, 1 << 20]).integers(2, 21, GROUPS)
        self.reqs: list[dict[str, np.ndarray]] = [self._chunk(lane, 0) for lane in range(LANES)]

    def _chunk(self, lane: int, chunk_no: int, n: int = 256) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, lane, chunk_no])
        k = chunk_no * n + np.arange(n)
        gid = lane + LANES * k
        group = rng.integers(0, GROUPS, n)
        prefix = self.prefix_blocks[group] * BLOCK
        P = prefix + np.clip(rng.lognormal(np.log(300), 0.8, n), 8, 3000).astype(np.int64)
        cached = np.where(rng.random(n) < 0.75, prefix, 0)
        cached = np.minimum(cached, (P - 1) // BLOCK * BLOCK)
        out_tokens = np.clip(rng.lognormal(np.log(120), 0.9, n), 1, 1024).astype(np.int64)
        d = out_tokens - 1
        preempt = (rng.random(n) < 0.03) & (d >= 2)
        d1 = np.where(preempt, 1 + (rng.random(n) * (d - 1)).astype(np.int64), d)
        R = P + d1
        hit2 = np.where(preempt, np.minimum(cached, (R - 1) // BLOCK * BLOCK), 0)
        r = {
            "gid": gid, "group": group, "P": P, "cached": cached, "O": out_tokens, "R": R, "hit2": hit2,
            "preempt": preempt, "rot": rng.integers(0, LANE_BLOCKS, n),
            "gap": rng.geometric(0.5, n) - 1, "npf": _cdiv(P - cached, CHUNK), "d1": d1,
            "g2": np.where(preempt, rng.integers(1, 20, n), 0),
            "nrc": np.where(preempt, _cdiv(R - hit2, CHUNK), 0), "d2": np.where(preempt, d - d1, 0),
        }
        bounds = np.cumsum([r[s] for s in self.SEGMENTS], axis=0)  # end of each segment, from start
        r["b"] = np.vstack([np.zeros(n, dtype=np.int64), bounds])  # b[i] = start of segment i; b[6] = end
        return r

    def _extend(self, lane: int) -> None:
        old = self.reqs[lane]
        new = self._chunk(lane, len(old["gid"]) // 256)
        self.reqs[lane] = {k: np.concatenate([old[k], new[k]], axis=-1) for k in old}

    def window(self, s0: int, s1: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """The requests alive in steps [s0, s1) as one table (with `start` and `lane`), and for every
        (step, lane) of the window, step-major, the index of its request in that table."""
        parts, idx = [], np.empty((s1 - s0, LANES), dtype=np.int64)
        steps = np.arange(s0, s1)
        base = 0
        for lane in range(LANES):
            while True:
                r = self.reqs[lane]
                starts = np.concatenate([[0], np.cumsum(r["b"][6])])
                if starts[-1] > s1:
                    break
                self._extend(lane)
            k = np.searchsorted(starts, steps, side="right") - 1
            lo, hi = k[0], k[-1] + 1
            part = {key: v[..., lo:hi] for key, v in r.items()}
            part["start"] = starts[lo:hi]
            part["lane"] = np.full(hi - lo, lane)
            parts.append(part)
            idx[:, lane] = base + k - lo
            base += hi - lo
        table = {key: np.concatenate([p[key] for p in parts], axis=-1) for key in parts[0]}
        return table, idx.ravel(), np.repeat(steps, LANES)


def _request_ids(seed: int, gid: np.ndarray) -> list[str]:
    tag = _mix(seed, 3, gid) >> np.uint64(32)
    job, turn = gid // TURNS, gid % TURNS
    return [f"job{j}-turn{t}-{h:08x}" for j, t, h in zip(job.tolist(), turn.tolist(), tag.tolist(), strict=True)]


def _list(offsets: np.ndarray, values: np.ndarray, type_: pa.DataType, valid: np.ndarray | None = None):
    mask = None if valid is None else pa.array(~valid)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, type_.value_type),
                                    type=type_, mask=mask)


def _batch(table: str, cols: dict[str, Any]) -> pa.RecordBatch:
    sch = schema.arrow_schema(table)
    arrays = [cols[f.name] if isinstance(cols[f.name], pa.Array) else pa.array(cols[f.name], f.type)
              for f in sch]
    return pa.RecordBatch.from_arrays(arrays, schema=sch)


class _Generator:
    def __init__(self, seed: int):
        self.seed = seed
        self.lanes = _Lanes(seed)
        self.t = T0_NS  # start of the next step

    def block_hash(self, group, gid, k, prefix_blocks) -> np.ndarray:
        shared = k < prefix_blocks
        h = np.where(shared, _mix(self.seed, 5, group, k), _mix(self.seed, 6, gid, k))
        return h.view(np.int64)

    def window(self, s0: int, s1: int) -> tuple[dict[str, pa.RecordBatch], np.ndarray, np.ndarray]:
        """All tables for steps [s0, s1): batches sorted by step, and per step its t_start (ns) and
        the number of rows of every table together."""
        W = s1 - s0
        R, ri, rstep = self.lanes.window(s0, s1)
        rlane = np.tile(np.arange(LANES), W)
        off = rstep - R["start"][ri]
        b = R["b"][:, ri]
        seg = sum((off >= b[i]).astype(np.int64) for i in range(1, 6))
        pos = off - b[seg, np.arange(len(off))]
        # Rows of requests scheduled this step: prefill (1), decode (2), recompute (4), decode (5).
        act = np.isin(seg, (1, 2, 4, 5))
        ri, rstep, rlane, seg, pos = ri[act], rstep[act], rlane[act], seg[act], pos[act]
        P, cached, Rt, hit2 = R["P"][ri], R["cached"][ri], R["R"][ri], R["hit2"][ri]
        prefill = (seg == 1) | (seg == 4)
        cb = np.select([seg == 1, seg == 2, seg == 4], [cached + pos * CHUNK, P + pos, hit2 + pos * CHUNK],
                       Rt + pos)
        tok = np.where(seg == 1, np.minimum(CHUNK, P - cb), np.where(seg == 4, np.minimum(CHUNK, Rt - cb), 1))
        blk_before, blk_after = _cdiv(cb, BLOCK), _cdiv(cb + tok, BLOCK)
        new_blocks = blk_after - blk_before
        kind = np.where(pos == 0, np.where(seg == 1, 1, np.where(seg == 4, 2, 0)), 0)  # running/new/resumed
        si = rstep - s0  # step index in the window
        slot = np.arange(len(si)) - np.searchsorted(si, si)  # rank among the step's rows (lane order)
        last = off[act] == R["b"][6][ri] - 1  # the request's final step

        # ---- request-level events of the window ----------------------------------------------
        start, bb = R["start"], R["b"]
        ev_step = {"arrival": start, "queued": start, "scheduled": start + bb[1],
                   "first_token": start + bb[2] - 1, "preempted": start + bb[3],
                   "resumed": start + bb[4], "finished": start + bb[6] - 1}
        pre = R["preempt"]

        def at(name, mask=None):
            m = (ev_step[name] >= s0) & (ev_step[name] < s1)
            return np.nonzero(m if mask is None else m & mask)[0]

        # ---- steps ---------------------------------------------------------------------------
        def per_step(weights=None):
            return np.bincount(si, weights, minlength=W).astype(np.int64)

        sched_tokens = per_step(tok)
        prefill_tokens = per_step(np.where(prefill, tok, 0))
        running = per_step()
        new_i, res_i, pre_i, fin_i = at("scheduled"), at("resumed", pre), at("preempted", pre), at("finished")

        def count_at(idx, name, weights=None):
            return np.bincount(ev_step[name][idx] - s0, weights, minlength=W).astype(np.int64)

        noise = _mix(self.seed, 1, np.arange(s0, s1))
        num_waiting = count_at(pre_i, "preempted") + (noise % np.uint64(4)).astype(np.int64)
        dur = 3_000_000 + 25_000 * sched_tokens + 40_000 * running + (noise % np.uint64(1_000_000)).astype(np.int64)
        t_start = self.t + np.concatenate([[0], np.cumsum(dur + 50_000)[:-1]])
        self.t = int(t_start[-1] + dur[-1] + 50_000)
        t_sched = t_start + 150_000 + 5_000 * running
        t_end = t_start + dur
        step_ids = np.arange(s0, s1) + 1  # vLLM's step ids start at 1
        out: dict[str, pa.RecordBatch] = {}
        stop_codes = np.where(num_waiting == 0, 0, np.where(running >= LANES, 1, 2))
        out["steps"] = _batch("steps", {
            "step": step_ids, "t_start_ns": t_start, "t_sched_end_ns": t_sched, "t_end_ns": t_end,
            "scheduled_tokens": sched_tokens, "prefill_tokens": prefill_tokens,
            "decode_tokens": sched_tokens - prefill_tokens, "num_prefill_reqs": per_step(prefill),
            "num_decode_reqs": running - per_step(prefill), "num_running": running, "num_waiting": num_waiting,
            "kv_blocks_used": per_step(blk_after), "kv_blocks_total": np.full(W, POOL),
            "token_budget": np.full(W, LANES * CHUNK), "max_num_seqs": np.full(W, LANES),
            "admission_stop": _strings(["none", "max-seqs", "kv-insuf"], stop_codes),
            "num_preempted": count_at(pre_i, "preempted"), "num_new_reqs": count_at(new_i, "scheduled"),
            "num_resumed_reqs": count_at(res_i, "resumed"), "num_finished": count_at(fin_i, "finished"),
            "prompt_tokens_new": count_at(new_i, "scheduled", R["P"][new_i]),
            "cached_tokens_new": count_at(new_i, "scheduled", R["cached"][new_i]),
        })
        ids = pa.array(_request_ids(self.seed, R["gid"]), pa.string())
        rid = ids.take(pa.array(ri))
        out["step_requests"] = _batch("step_requests", {
            "step": rstep + 1, "request_id": rid, "tokens": tok,
            "phase": _strings(["decode", "prefill"], prefill.astype(np.int8)),
            "chunk_index": np.where(prefill, pos, -1), "computed_before": cb, "new_blocks": new_blocks,
            "kind": _strings(["running", "new", "resumed"], kind),
        })
        out["batch_slots"] = _batch("batch_slots", {"step": rstep + 1, "slot": slot, "request_id": rid})

        # ---- request_events, prefix_lookups, preemptions ------------------------------------
        names = ["arrival", "queued", "scheduled", "first_token", "preempted", "resumed", "finished"]
        sel = [at("arrival"), at("queued"), new_i, at("first_token"), pre_i, res_i, fin_i]
        e_req = np.concatenate(sel)
        e_code = np.concatenate([np.full(len(s), c) for c, s in enumerate(sel)])
        e_step = np.concatenate([ev_step[n][s] for n, s in zip(names, sel, strict=True)]) - s0
        value = np.select([e_code <= 1, e_code == 2, e_code == 3, e_code == 6],
                          [R["P"][e_req], R["cached"][e_req], 1, R["O"][e_req]], R["R"][e_req])
        ts = np.select([e_code == 0, e_code == 1, e_code == 2, e_code == 4, e_code == 5],
                       [t_start[e_step] + 10_000, t_start[e_step] + 40_000, t_sched[e_step],
                        t_start[e_step] + 50_000, t_sched[e_step]], t_end[e_step])
        order = np.lexsort((R["lane"][e_req], e_code, e_step))
        e_req, e_code, e_step, value, ts = e_req[order], e_code[order], e_step[order], value[order], ts[order]
        fin = e_code == 6
        reason = np.where(R["O"][e_req] >= 1024, 1, 0)
        out["request_events"] = _batch("request_events", {
            "ts_ns": ts, "step": e_step + s0 + 1, "request_id": ids.take(pa.array(e_req)),
            "event": _strings(names, e_code), "value": value,
            "reason": pa.array(np.array(["stop", "length"], dtype=object)[reason], pa.string(), mask=~fin),
        })
        out["prefix_lookups"] = self._lookups(R, ids, new_i, res_i, ev_step, s0, t_start)
        pre_i = pre_i[np.lexsort((R["lane"][pre_i], ev_step["preempted"][pre_i]))]  # by step, then lane
        p_step = ev_step["preempted"][pre_i] - s0
        out["preemptions"] = _batch("preemptions", {
            "ts_ns": t_start[p_step] + 50_000, "step": p_step + s0 + 1, "request_id": ids.take(pa.array(pre_i)),
            "computed_tokens_lost": R["R"][pre_i], "blocks_freed": _cdiv(R["R"][pre_i], BLOCK),
            "output_tokens": R["d1"][pre_i] + 1,
        })

        # ---- block_events --------------------------------------------------------------------
        out["block_events"] = self._block_events(
            R, ids, ri, si, rlane, seg, pos, cb, tok, blk_before, blk_after, last, pre_i, ev_step, s0, t_start)

        # ---- worker: layer timings, kv_access ------------------------------------------------
        reads, writes = per_step(blk_before), per_step(blk_after - cb // BLOCK)
        lt_step = np.repeat(np.arange(W), LAYERS)
        lt_layer = np.tile(np.arange(LAYERS), W)
        lt_ts = t_sched[lt_step] + (lt_layer + 1) * ((t_end - t_sched)[lt_step] // (LAYERS + 1))
        out["layer_timings"] = _batch("layer_timings", {
            "step": lt_step + s0 + 1, "layer": lt_layer, "ts_ns": lt_ts, "reads": reads[lt_step],
            "writes": writes[lt_step]})
        phys = rlane * LANE_BLOCKS, R["rot"][ri]
        out["kv_access"] = self._kv_access(rstep, si, slot, cb, tok, phys, t_sched, t_end)
        per = np.zeros(W, dtype=np.int64)
        for _name, batch in out.items():
            per += np.bincount(batch.column("step").to_numpy() - s0 - 1, minlength=W)
        return out, t_start, per

    def _lookups(self, R, ids, new_i, res_i, ev_step, s0, t_start) -> pa.RecordBatch:
        li = np.concatenate([new_i, res_i])
        after = np.concatenate([np.zeros(len(new_i), np.int64), np.ones(len(res_i), np.int64)])
        l_step = np.concatenate([ev_step["scheduled"][new_i], ev_step["resumed"][res_i]]) - s0
        order = np.lexsort((R["lane"][li], l_step))
        li, after, l_step = li[order], after[order], l_step[order]
        query = np.where(after == 1, R["R"][li], R["P"][li])
        hit = np.where(after == 1, R["hit2"][li], R["cached"][li])
        full = query // BLOCK
        offsets, owner, j = _expand(full - hit // BLOCK)
        k = hit[owner] // BLOCK + j
        g = R["group"][li][owner]
        missed = self.block_hash(g, R["gid"][li][owner], k, self.lanes.prefix_blocks[g])
        return _batch("prefix_lookups", {
            "ts_ns": t_start[l_step] + 30_000, "step": l_step + s0 + 1, "request_id": ids.take(pa.array(li)),
            "query_tokens": query, "hit_tokens": hit, "hit_blocks": hit // BLOCK, "full_blocks": full,
            "tail_tokens": query - full * BLOCK,
            "missed_hashes": _list(offsets, missed, schema.i64_list),
            "external_hit_tokens": pa.nulls(len(li), pa.int32()), "after_preemption": after,
        })

    def _block_events(self, R, ids, ri, si, rlane, seg, pos, cb, tok, blk_before, blk_after, last,
                      pre_i, ev_step, s0, t_start) -> pa.RecordBatch:
        noise = _mix(self.seed, 2, si + s0, rlane)
        full_before, full_after = cb // BLOCK, (cb + tok) // BLOCK
        # (row mask, event code, first block, block count) per kind; codes order events in a step.
        touch = (pos == 0) & (((seg == 1) & (R["cached"][ri] > 0)) | ((seg == 4) & (R["hit2"][ri] > 0)))
        alloc = blk_after > blk_before
        evict = alloc & (noise % np.uint64(100) < np.uint64(4))
        cache = full_after > full_before
        kinds = [  # (rows, code, first block, count)
            (touch, 0, 0, blk_before), (evict, 1, 0, 1 + (noise >> np.uint64(8)) % np.uint64(3)),
            (alloc, 2, blk_before, blk_after - blk_before), (cache, 3, full_before, full_after - full_before),
            (last, 4, 0, blk_after)]
        rows, code, first, count = [], [], [], []
        for mask, c, f, n in kinds:
            m = np.nonzero(mask)[0]
            rows.append(m)
            code.append(np.full(len(m), c))
            first.append(np.broadcast_to(f, mask.shape)[m])
            count.append(np.broadcast_to(n, mask.shape)[m].astype(np.int64))
        # A preempted request frees all its blocks in the step it is preempted (not scheduled then).
        p_step = ev_step["preempted"][pre_i] - s0
        e_req = np.concatenate([ri[r] for r in rows] + [pre_i])
        e_si = np.concatenate([si[r] for r in rows] + [p_step])
        e_code = np.concatenate(code + [np.full(len(pre_i), -1)])
        e_first = np.concatenate(first + [np.zeros(len(pre_i), np.int64)])
        e_count = np.concatenate(count + [_cdiv(R["R"][pre_i], BLOCK)])
        lane = R["lane"][e_req]
        order = np.lexsort((e_code, lane, e_si))
        e_req, e_si, e_code, e_first, e_count, lane = (
            a[order] for a in (e_req, e_si, e_code, e_first, e_count, lane))
        offsets, owner, j = _expand(e_count)
        k = e_first[owner] + j
        block_ids = lane[owner] * LANE_BLOCKS + (k + R["rot"][e_req][owner]) % LANE_BLOCKS
        ev_el = e_code[owner] == 1
        rnd = _mix(self.seed, 4, e_si[owner] + s0, lane[owner], j)
        block_ids = np.where(ev_el, (rnd % np.uint64(POOL)).astype(np.int64), block_ids)
        hashed = (e_code == 1) | (e_code == 3)
        h_offsets, h_owner, h_j = _expand(np.where(hashed, e_count, 0))
        hk = e_first[h_owner] + h_j
        g = R["group"][e_req][h_owner]
        hashes = self.block_hash(g, R["gid"][e_req][h_owner], hk, self.lanes.prefix_blocks[g])
        hashes = np.where(e_code[h_owner] == 1, _mix(self.seed, 7, e_si[h_owner] + s0, h_j).view(np.int64),
                          hashes)
        names = ["free", "touch", "evict", "alloc", "cache", "free"]
        return _batch("block_events", {
            "ts_ns": t_start[e_si] + 20_000 + (e_code + 1) * 10_000 + lane * 2_000, "step": e_si + s0 + 1,
            "event": _strings(names, e_code + 1), "kv_group": np.zeros(len(e_req), np.int16),
            "request_id": ids.take(pa.array(e_req)),
            "block_ids": _list(offsets, block_ids, schema.i32_list),
            "block_hashes": _list(h_offsets, hashes, schema.i64_list, valid=hashed),
        })

    def _kv_access(self, rstep, si, slot, cb, tok, phys, t_sched, t_end) -> pa.RecordBatch:
        m = np.nonzero(rstep % KV_EVERY == 0)[0]
        n_read, w_first, w_last = _cdiv(cb[m], BLOCK), cb[m] // BLOCK, _cdiv(cb[m] + tok[m], BLOCK)
        _, r_owner, r_j = _expand(n_read)
        _, w_owner, w_j = _expand(w_last - w_first)
        owner = np.concatenate([r_owner, w_owner])
        op = np.concatenate([np.zeros(len(r_owner), np.int64), np.ones(len(w_owner), np.int64)])
        blk = np.concatenate([r_j, w_first[w_owner] + w_j])
        order = np.lexsort((blk, op, owner))
        owner, op, blk = owner[order], op[order], blk[order]
        row = m[owner]
        lo = np.where(op == 1, np.maximum(cb[row], blk * BLOCK), blk * BLOCK)
        hi = np.where(op == 1, np.minimum(cb[row] + tok[row], (blk + 1) * BLOCK),
                      np.minimum(cb[row], (blk + 1) * BLOCK))
        step_i = si[row]
        layer = (rstep[row] // KV_EVERY) % LAYERS
        return _batch("kv_access", {
            "step": rstep[row] + 1, "layer": layer,
            "ts_ns": t_sched[step_i] + (layer + 1) * ((t_end - t_sched)[step_i] // (LAYERS + 1)),
            "op": op, "slot": slot[row], "block_id": phys[0][row] + (blk + phys[1][row]) % LANE_BLOCKS,
            "token_offset": lo - blk * BLOCK,
            "token_count": hi - lo,
        })


ENGINE_CONFIG = {
    "block_size": BLOCK, "num_kv_blocks": POOL, "max_num_seqs": LANES, "max_num_batched_tokens": LANES * CHUNK,
    "max_num_scheduled_tokens": LANES * CHUNK, "enable_prefix_caching": True, "enable_chunked_prefill": True,
    "kv_connector": None, "kv_cache_groups": 1, "model": "synthetic", "max_model_len": 8192,
    "tensor_parallel_size": 1, "data_parallel_size": 1, "data_parallel_rank": 0,
}
PROBES = {"engine": ("scheduler", "kv_blocks", "prefix_cache"), "worker": ("kv_access",)}


def generate(out_dir: str | Path, events: int, seed: int = 0, *, rotate_bytes: int = 64 << 20,
             session_id: str | None = None, progress: bool = False) -> dict[str, Any]:
    """Write a synthetic session of exactly `events` shard rows to `out_dir` (created).

    Returns {"session_id", "dir", "events", "rows": {table: rows}, "bytes", "seconds"}.
    """
    t0 = time.monotonic()
    out = Path(out_dir)
    sid = session_id or f"synth-s{seed}-n{events}"
    pids = {"engine": 10_000 + 2 * (seed % 20_000), "worker": 10_001 + 2 * (seed % 20_000)}
    dirs = {role: out / "procs" / f"synth-{pid}" for role, pid in pids.items()}
    writers: dict[str, dict[str, ShardWriter]] = {}
    for role, tables in (("engine", ENGINE_TABLES), ("worker", WORKER_TABLES)):
        dirs[role].mkdir(parents=True, exist_ok=True)
        writers[role] = {t: ShardWriter(dirs[role], t, rotate_bytes, float("inf"))
                         for t in (*tables, "clock_anchors")}
    owner = {t: role for role, tables in (("engine", ENGINE_TABLES), ("worker", WORKER_TABLES)) for t in tables}
    rows = {t: 0 for t in schema.TABLES}
    gen = _Generator(seed)
    total, s0, next_anchor = 0, 0, T0_NS - 1_000_000
    window = min(WINDOW, max(64, events // 120))  # ~150 events a step: small sessions stay quick
    while total < events:
        batches, t_start, per = gen.window(s0, s0 + window)
        # Clock anchors (one per process every 10 s of simulated time) go with the step they fall in.
        anchor_t = np.arange(next_anchor, gen.t, ANCHOR_NS)
        anchor_si = np.maximum(np.searchsorted(t_start, anchor_t, side="right") - 1, 0)
        per += 2 * np.bincount(anchor_si, minlength=len(per))
        cum = total + np.cumsum(per)
        keep_steps, excess = len(per), 0
        if cum[-1] >= events:  # the last window: stop at the step that reaches `events`, cut it short
            keep_steps = int(np.searchsorted(cum, events)) + 1
            excess = int(cum[keep_steps - 1] - events)
        n_anchor = int(np.searchsorted(anchor_si, keep_steps))
        for table in (*TRIM_ORDER, *(t for t in batches if t not in TRIM_ORDER)):
            b = batches[table]
            steps = b.column("step").to_numpy()
            n = int(np.searchsorted(steps, s0 + keep_steps, side="right"))
            cut = min(excess, n - int(np.searchsorted(steps, s0 + keep_steps, side="left")))
            excess -= cut
            batches[table] = b.slice(0, n - cut)
        n_anchor -= min(excess // 2, n_anchor)
        flush_of_step = (t_start - T0_NS) // FLUSH_NS
        for table, b in batches.items():
            _write_flushes(writers[owner[table]][table], b, flush_of_step[b.column("step").to_numpy() - s0 - 1])
            rows[table] += b.num_rows
        for t in anchor_t[:n_anchor].tolist():
            for role in ("engine", "worker"):
                w = writers[role]["clock_anchors"]
                w.write(rows_to_batch("clock_anchors", [(t + (role == "worker"), UTC0_NS + t - T0_NS, None, "host")]))
                rows["clock_anchors"] += 1
        next_anchor = int(anchor_t[-1]) + ANCHOR_NS if len(anchor_t) else next_anchor
        total = sum(rows.values())
        s0 += window
        if progress:
            print(f"synth {sid}: {total:,}/{events:,} events", end="\r", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    for role, ws in writers.items():
        for w in ws.values():
            w.close()
        written = {t: (rows.get(t, 0) if owner.get(t) == role else 0) for t in schema.SHARD_TABLES}
        written["clock_anchors"] = rows["clock_anchors"] // 2
        write_json_atomic(dirs[role] / PROC_FILE, {
            "schema_version": schema.SCHEMA_VERSION, "role": role, "pid": pids[role], "host": "synth",
            "rank": 0, "status": "complete", "started_ns": T0_NS - 2_000_000_000, "last_flush_ns": gen.t,
            "rows_written": written, "dropped": {}, "stopped_reason": None,
            "probes": {p: {"status": "attached", "reason": ""} for p in PROBES[role]},
            "engine_config": ENGINE_CONFIG if role == "engine" else {},
        })
    _write_manifest(out, sid, events, seed, pids, gen.t)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"session_id": sid, "dir": str(out), "events": total, "rows": rows, "bytes": size,
            "seconds": time.monotonic() - t0}


def _write_flushes(writer: ShardWriter, batch: pa.RecordBatch, flush_ids: np.ndarray) -> None:
    """One write per simulated flush, as the recorder's writer thread does."""
    if batch.num_rows == 0:
        return
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(flush_ids)) + 1, [batch.num_rows]])
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        writer.write(batch.slice(a, b - a))


def _write_manifest(out: Path, sid: str, events: int, seed: int, pids: dict[str, int], end_ns: int) -> None:
    command = ["python", "-m", "kvtrace.testing.synth", "-o", str(out), "--events", str(events), "--seed", str(seed)]
    options = {"job_pattern": JOB_PATTERN, "kv_granularity": "timing", "flush_interval_s": FLUSH_NS / 1e9}
    manifest = new_manifest(command, options)
    manifest.update({
        "session_id": sid, "status": "complete", "exit_code": 0, "engine_config": ENGINE_CONFIG,
        "synthetic": {"events": events, "seed": seed, "generator": "kvtrace.testing.synth"},
        "clock": {"start_monotonic_ns": T0_NS - 2_000_000_000, "start_utc_ns": UTC0_NS - 2_000_000_000,
                  "end_monotonic_ns": end_ns, "end_utc_ns": UTC0_NS + end_ns - T0_NS},
        "procs": [{"pid": pid, "role": role, "rank": 0, "host": "synth", "status": "complete",
                   "stopped_reason": None} for role, pid in pids.items()],
        "dropped": {},
    })
    write_json_atomic(out / MANIFEST, manifest)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvtrace.testing.synth", description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", required=True, help="session directory to write")
    ap.add_argument("--events", type=int, default=1_000_000, help="shard rows to write (default 1000000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rotate-bytes", type=int, default=64 << 20, help="shard rotation size (bytes)")
    ap.add_argument("--session-id", default=None)
    args = ap.parse_args(argv)
    report = generate(args.output, args.events, args.seed, rotate_bytes=args.rotate_bytes,
                      session_id=args.session_id, progress=sys.stderr.isatty())
    print(json.dumps({k: v for k, v in report.items()}, indent=1))


if __name__ == "__main__":
    main()
