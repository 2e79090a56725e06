"""The workload of a recording, as a replay needs it: each request's arrival (the engine step it was
queued after), prompt and output lengths, and the block-hash chain of its sequence, which says which
requests shared which prefix blocks. No prompt text or token ids: the chain is made of the block
hashes kvtrace recorded (their first 8 bytes), and a replay gives each distinct hash its own tokens.

Where a request's chain comes from, position by position (block k covers tokens [k*B, (k+1)*B)):
- its prefix-cache lookups: `missed_hashes` are the hashes of the full prompt blocks after the hit,
  from position `hit_blocks` on;
- the blocks it hit (its `touch` rows at admission): the hash each block id held then (the block
  events' cache and evict rows say which hash a block id holds when);
- the blocks it cached itself (`cache` rows), prompt and output blocks alike, from the position its
  computation started at (the lookup's `hit_blocks`; again after a preemption).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace.errors import KvtraceError
from kvtrace.replay.clock import StepTime, fit_step_time


@dataclass
class ReplayRequest:
    request_id: str
    queued_step: int  # the engine step it was queued after (0: before the first)
    prompt_tokens: int
    output_tokens: int
    chain: dict[int, int] = field(default_factory=dict)  # block position -> hash (int64 prefix)
    queued_ns: int = 0  # when it was queued, after the recording's start (its first step or request)


@dataclass
class Workload:
    requests: list[ReplayRequest]
    engine: dict  # the recording's engine config (block size, pool, budgets)
    session_id: str
    skipped: dict[str, str] = field(default_factory=dict)  # request -> why it is not replayed
    step_time: StepTime | None = None  # the recording's step-time model (--clock timed)


def _rows(session_dir: Path, table: str) -> list[dict]:
    """Every row of `table` in recording order (the engine's processes; ingest's own reader)."""
    from kvtrace.format.session import SessionDir
    from kvtrace.format.shards import ShardRead, list_shards, loaded_batch, loads_into, read_shard

    out: list[dict] = []
    engines = 0
    for proc in SessionDir(session_dir).procs:
        shards = [sh for sh in list_shards(proc.path, proc.status) if loads_into(sh.table) == table]
        engines += bool(shards)
        if engines > 1:
            raise KvtraceError(f"{session_dir}: {table} from more than one engine process (data parallel, or "
                               "several engines in one recording): a replay runs one engine")
        for shard in shards:
            if loads_into(shard.table) == table:
                for batch in read_shard(shard, ShardRead()):
                    out.extend(loaded_batch(shard.table, batch).to_pylist())
    return out


def read_workload(session_dir: str | Path) -> Workload:
    from kvtrace.format.session import SessionDir

    session_dir = Path(session_dir)
    session = SessionDir(session_dir)
    engine = dict(session.manifest.get("engine_config") or {})
    for proc in session.procs:
        engine.update({k: v for k, v in (proc.doc.get("engine_config") or {}).items() if v is not None})
    if engine.get("block_size") is None or engine.get("num_kv_blocks") is None:
        raise KvtraceError(f"{session_dir}: no engine config (block size, KV blocks) recorded: the scheduler "
                           "probe did not run; nothing to replay")
    events = sorted(_rows(session_dir, "request_events"), key=lambda r: r["ts_ns"])
    lookups = sorted(_rows(session_dir, "prefix_lookups"), key=lambda r: r["ts_ns"])
    blocks = _rows(session_dir, "block_events")  # recording order: the order vLLM made the calls
    reqs: dict[str, ReplayRequest] = {}
    skipped: dict[str, str] = {}
    steps = _rows(session_dir, "steps")
    starts = [r["t_start_ns"] for r in steps if r.get("t_start_ns") is not None]
    queued = [e["ts_ns"] for e in events if e["event"] == "queued"]
    t0 = min(starts + queued, default=0)
    for e in events:
        rid = e["request_id"]
        if e["event"] == "queued" and rid not in reqs:
            reqs[rid] = ReplayRequest(rid, int(e["step"]), int(e["value"] or 0), -1, queued_ns=int(e["ts_ns"]) - t0)
        elif e["event"] == "finished" and rid in reqs:
            reqs[rid].output_tokens = int(e["value"] or 0)
    for rid, r in list(reqs.items()):
        if r.output_tokens < 0:
            skipped[rid] = "never finished in the recording (output length unknown)"
        elif r.prompt_tokens < 1:
            skipped[rid] = f"a prompt of {r.prompt_tokens} tokens"
        else:
            continue
        del reqs[rid]
    _chains(reqs, lookups, blocks)
    # The order vLLM queued them in (dicts keep insertion order: the first `queued` row of each).
    ordered = sorted(reqs.values(), key=lambda r: r.queued_step)
    return Workload(ordered, engine, str(session.manifest.get("session_id") or session_dir.name), skipped,
                    fit_step_time(steps))


def _chains(reqs: dict[str, ReplayRequest], lookups: list[dict], blocks: list[dict]) -> None:
    """Fill each request's chain from its block events (in the order vLLM made the calls) and lookups.

    A request's block table is the blocks it hit (its `touch` rows at admission) followed by the blocks
    allocated for it (`alloc` rows), until it frees them all (finished or preempted); a `cache` row's
    block sits at its index in that table, which is its position in the sequence."""
    held: dict[int, int] = {}  # block id -> the hash it holds now
    table: dict[str, dict[int, int]] = {}  # request -> block id -> position
    for row in blocks:
        event, rid = row["event"], row.get("request_id")
        req = reqs.get(rid) if rid is not None else None
        ids = row["block_ids"] or ()
        if event == "evict":
            for bid in ids:
                held.pop(bid, None)
            continue
        if event == "cache":
            for bid, h in zip(ids, row["block_hashes"] or ()):
                held[bid] = h
        if req is None:
            continue
        mine = table.setdefault(rid, {})
        if event in ("touch", "alloc"):
            for bid in ids:
                if event == "touch" and bid in held:
                    req.chain.setdefault(len(mine), held[bid])
                mine.setdefault(bid, len(mine))
        elif event == "cache":
            for bid, h in zip(ids, row["block_hashes"] or ()):
                if bid in mine:
                    req.chain.setdefault(mine[bid], h)
        elif event == "free" and set(ids) >= set(mine):  # all of them: finished or preempted
            mine.clear()
    for row in lookups:  # the prompt's full blocks after the hit, as the lookup hashed them
        req = reqs.get(row["request_id"])
        if req is not None:
            for k, h in enumerate(row["missed_hashes"] or ()):
                req.chain.setdefault(int(row["hit_blocks"] or 0) + k, h)


def sequence(req: ReplayRequest, block_size: int, vocab: int, seed: int = 0) -> list[int]:
    """Token ids for the request's whole sequence (prompt then output): each block of its chain gets the
    tokens its hash stands for (the same in every request that has it), every other position tokens of
    its own."""
    n = req.prompt_tokens + req.output_tokens
    out: list[int] = []
    own = random.Random(f"{seed}:{req.request_id}")
    for k in range((n + block_size - 1) // block_size):
        h = req.chain.get(k)
        rng = random.Random(f"{seed}:h{h}") if h is not None else own
        out.extend(rng.randrange(vocab) for _ in range(block_size))
    return out[:n]
