"""A small agentic-style workload on a real vLLM engine: jobs of several turns sharing prefixes.

Used by `kvtrace demo`, the tests and the benchmarks (run it under `kvtrace record`, or not, to compare):

    python -m kvtrace.demo.workload --model DIR --jobs 6 --turns 3 --num-blocks 40 --metrics-out m.json

Every job's turns share a system prefix with all other jobs and their own history with each other, so the
prefix cache hits; a small KV pool (`--num-blocks`) forces preemptions. Request ids are `job<J>-turn<T>`
so per-turn latency and job completion queries have ids to parse (`--job-pattern` below). vLLM's own
counters (`llm.get_metrics()`) are written to `--metrics-out` for cross-checks.
"""

from __future__ import annotations

import argparse
import json
import os
import time

JOB_PATTERN = r"job(?P<job>\d+)-turn(?P<turn>\d+)"
SYSTEM_PROMPT = ("You are a careful agent working on a code base. Read the issue, plan, call tools, "
                 "and report. Keep answers short. ") * 4


def make_engine(model: str, num_blocks: int | None, max_num_seqs: int, max_batched_tokens: int,
                prefix_caching: bool = True, connector_dir: str | None = None, max_model_len: int = 1024,
                extra: dict | None = None):
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kwargs = dict(model=model, dtype="float32", max_model_len=max_model_len, enforce_eager=True,
                  block_size=32, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched_tokens,
                  enable_prefix_caching=prefix_caching, disable_log_stats=False, seed=0)
    if num_blocks:
        kwargs["num_gpu_blocks_override"] = num_blocks
    if connector_dir:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": connector_dir}}
    kwargs.update(extra or {})
    return LLM(**kwargs)


def run_jobs(llm, jobs: int, turns: int, max_tokens: int, marker: str = "") -> dict:
    """Run `jobs` x `turns` requests; turn t+1 of a job is submitted when turn t finishes."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    history = {j: f"{SYSTEM_PROMPT} Job {j} {marker}: fix issue number {j * 7 + 3} in module m{j}. "
               for j in range(jobs)}
    for j in range(jobs):
        engine.add_request(f"job{j}-turn0", history[j], params)
    finished, t0 = 0, time.monotonic()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            finished += 1
            job, turn = (int(x) for x in out.request_id[3:].split("-turn"))
            if turn + 1 < turns:
                history[job] += out.outputs[0].text + f" Tool output for turn {turn + 1}: ok. "
                engine.add_request(f"job{job}-turn{turn + 1}", history[job], params)
    return {"requests": finished, "seconds": time.monotonic() - t0}


def vllm_counters(llm) -> dict:
    """vLLM's own counters for the run (Prometheus names without the prefix)."""
    out = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is not None and m.name.startswith("vllm:"):
            out[m.name[5:]] = value
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=40, help="KV pool size in blocks (small = preemptions)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-batched-tokens", type=int, default=256)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--connector-dir", default=None, help="use ExampleConnector saving KV under this dir")
    ap.add_argument("--marker", default="", help="a string put into every prompt (privacy tests)")
    ap.add_argument("--repeat", type=int, default=1, help="run the job set this many times")
    ap.add_argument("--metrics-out", default=None)
    ap.add_argument("--engine-args", default=None,
                    help='more arguments for vLLM\'s LLM, as a JSON object (e.g. \'{"dtype": "bfloat16", '
                         '"enforce_eager": false}\' on a GPU); they override the defaults above')
    args = ap.parse_args(argv)
    extra = json.loads(args.engine_args) if args.engine_args else None
    model = args.model
    if model is None:
        from kvtrace.demo.model import ensure_tiny_model

        model = str(ensure_tiny_model())
    llm = make_engine(model, args.num_blocks, args.max_num_seqs, args.max_batched_tokens,
                      prefix_caching=not args.no_prefix_caching, connector_dir=args.connector_dir, extra=extra)
    results = [run_jobs(llm, args.jobs, args.turns, args.max_tokens, args.marker) for _ in range(args.repeat)]
    report = {"runs": results, "vllm": vllm_counters(llm)}
    if args.metrics_out:
        with open(args.metrics_out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({"requests": sum(r["requests"] for r in results),
                      "seconds": round(sum(r["seconds"] for r in results), 3),
                      "preemptions": report["vllm"].get("num_preemptions"),
                      "prefix_cache_queries": report["vllm"].get("prefix_cache_queries"),
                      "prefix_cache_hits": report["vllm"].get("prefix_cache_hits")}))


if __name__ == "__main__":
    main()
