"""A TTL-pinning scheduler (test helper), in the spirit of Continuum: keep a finished turn's KV until the
same job's next turn arrives, or until a TTL runs out, reporting pin / reuse / unpin / expire to kvtrace.

`PinningScheduler` subclasses vLLM 0.32's `Scheduler` and is loaded with vLLM's supported hook,
`LLM(..., scheduler_cls="pinning_scheduler.PinningScheduler")` (a dotted path, resolved in EngineCore).
When a request finishes it takes a reference on the request's full, hashed blocks (`BlockPool.touch`,
which is what a prefix hit does), so they can be neither freed nor evicted; the blocks stay in the prefix
cache, so the next turn hits them. After each `schedule()` it checks its pins: a newly scheduled request
of the same job holding a pinned block is a reuse (reported, then the pin is dropped: the next turn owns
the blocks now); a pin older than its TTL expires (`BlockPool.free_blocks`, reported).

Settings (environment, read in EngineCore): KVTRACE_TEST_PIN_TTL_S (default 1.0),
KVTRACE_TEST_PIN_JOB (regex whose group 1 is the job, default `job(\\d+)-turn`).

Run as a script it is the workload driver of tests/integration/test_pins.py: kvtrace.demo.workload's jobs, with a tool call
of `--tool-s` seconds between a job's turns, on an engine with this scheduler and
tests/helpers/delay_free_connector.py (a connector holding every finished request's KV for a few steps).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from kvtrace.probes import pins

REASON = "ttl-pin"


class PinningScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pin_ttl_ns = int(float(os.environ.get("KVTRACE_TEST_PIN_TTL_S", "1.0")) * 1e9)
        self.job_re = re.compile(os.environ.get("KVTRACE_TEST_PIN_JOB", r"job(\d+)-turn"))
        self.pins: dict[str, tuple[list, int, str | None]] = {}  # request -> (blocks, deadline_ns, job)

    def _job(self, request_id: str) -> str | None:
        m = self.job_re.search(request_id)
        return m.group(1) if m else None

    def _free_request(self, request: Any, delay_free_blocks: bool = False):
        rid = request.request_id
        blocks = [b for b in self.kv_cache_manager.get_blocks(rid).blocks[0]
                  if not b.is_null and b.block_hash is not None]
        if blocks:
            self.kv_cache_manager.block_pool.touch(blocks)  # our reference: not freeable, not evictable
            self.pins[rid] = (blocks, time.monotonic_ns() + self.pin_ttl_ns, self._job(rid))
            pins.report_pin(rid, [b.block_id for b in blocks], self.pin_ttl_ns, REASON,
                            step=self.current_step)
        return super()._free_request(request, delay_free_blocks)

    def schedule(self, *args: Any, **kwargs: Any):
        out = super().schedule(*args, **kwargs)
        if self.pins:
            self._check_pins(out)
            if self.get_num_unfinished_requests() == 0:
                time.sleep(0.005)  # only pins keep the engine stepping (has_requests): do not spin
        return out

    def _check_pins(self, out: Any) -> None:
        holders: dict[int, set[str]] = {}  # block -> jobs of the newly scheduled requests holding it
        for new in out.scheduled_new_reqs:
            for b in new.block_ids[0]:
                holders.setdefault(b, set()).add(self._job(new.req_id))
        cached = out.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if rid in cached.resumed_req_ids and ids:
                for b in ids[0]:
                    holders.setdefault(b, set()).add(self._job(rid))
        now = time.monotonic_ns()
        for rid, (blocks, deadline, job) in list(self.pins.items()):
            hit = [b.block_id for b in blocks if job is not None and job in holders.get(b.block_id, ())]
            if hit:  # the job's next turn got these blocks from the prefix cache
                pins.report_reuse(rid, hit, REASON, step=self.current_step)
                self._release(rid, "unpin")
            elif now >= deadline:
                self._release(rid, "expire")

    def _release(self, rid: str, event: str) -> None:
        blocks, _, _ = self.pins.pop(rid)
        self.kv_cache_manager.block_pool.free_blocks(blocks)
        ids = [b.block_id for b in blocks]
        if event == "expire":
            pins.report_expire(rid, ids, self.pin_ttl_ns, REASON, step=self.current_step)
        else:
            pins.report_unpin(rid, ids, REASON, step=self.current_step)

    def has_requests(self) -> bool:
        # Pins must expire even when no request is left: keep the engine loop stepping meanwhile.
        return super().has_requests() or bool(self.pins)


def run_jobs_with_tool_calls(llm: Any, jobs: int, turns: int, max_tokens: int, tool_s: float) -> dict:
    """kvtrace.demo.workload's jobs, except that a job's next turn is submitted `tool_s` seconds after its
    previous turn finished (the tool call an agent makes in between, the gap a pin has to bridge)."""
    from vllm import SamplingParams

    from kvtrace.demo.workload import SYSTEM_PROMPT

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    history = {j: f"{SYSTEM_PROMPT} Job {j}: fix issue number {j * 7 + 3} in module m{j}. " for j in range(jobs)}
    due: list[tuple[float, str, str]] = [(0.0, f"job{j}-turn0", history[j]) for j in range(jobs)]
    finished, t0 = 0, time.monotonic()
    while due or engine.has_unfinished_requests():
        now = time.monotonic()
        for item in [d for d in due if d[0] <= now]:
            due.remove(item)
            engine.add_request(item[1], item[2], params)
        if not engine.has_unfinished_requests():
            time.sleep(0.01)
            continue
        for out in engine.step():
            if not out.finished:
                continue
            finished += 1
            job, turn = (int(x) for x in out.request_id[3:].split("-turn"))
            if turn + 1 < turns:
                history[job] += out.outputs[0].text + f" Tool output for turn {turn + 1}: ok. "
                due.append((time.monotonic() + tool_s, f"job{job}-turn{turn + 1}", history[job]))
    return {"requests": finished, "seconds": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    from kvtrace.demo.workload import make_engine, vllm_counters

    ap = argparse.ArgumentParser(description="jobs on an engine with PinningScheduler + DelayFreeConnector")
    ap.add_argument("--model", required=True)
    ap.add_argument("--connector-dir", required=True)
    ap.add_argument("--metrics-out", required=True)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tool-s", type=float, default=0.3, help="seconds between a turn and the next")
    ap.add_argument("--delay-steps", type=int, default=3, help="steps the connector holds finished KV")
    ap.add_argument("--num-blocks", type=int, default=80)
    args = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    extra = {
        "scheduler_cls": "pinning_scheduler.PinningScheduler",
        "kv_transfer_config": {
            "kv_connector": "DelayFreeConnector", "kv_connector_module_path": "delay_free_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": args.connector_dir,
                                          "delay_steps": args.delay_steps}},
    }
    llm = make_engine(args.model, args.num_blocks, 8, 1024, prefix_caching=True, extra=extra)
    result = run_jobs_with_tool_calls(llm, args.jobs, args.turns, 16, args.tool_s)
    # The last turns' pins expire a TTL after they finished: keep the engine (and its recorder) alive.
    time.sleep(float(os.environ.get("KVTRACE_TEST_PIN_TTL_S", "1.0")) + 1.0)
    with open(args.metrics_out, "w") as f:
        json.dump({"runs": [result], "vllm": vllm_counters(llm)}, f, indent=1)


if __name__ == "__main__":
    main()
