"""Two vLLM engines, one after the other, in one command recorded by tests/reliability/test_drift.py.

    RELIABILITY_MARKER=S python tests/helpers/reliability_two_engines.py --model DIR --out result.json [--api-key X]

Engine 1 runs with every probe and a fault injected into one (`inject_fault`: the prefix_cache probe
raises at its first event). Engine 2 runs against deliberately drifted vLLM targets: KVTRACE_TEST_DRIFT
makes tests/data/drift/sitecustomize.py change BlockPool.touch's signature in its processes, and
`extra_targets` makes the prefix_cache probe require a method vLLM does not have. Each engine's options
reach its EngineCore through the environment it is spawned with (KVTRACE_OPTIONS), as `kvtrace record`
passes them. Request ids are `e<engine>-job<j>-turn0`. Every prompt carries the marker in
RELIABILITY_MARKER (privacy test; from the environment, as the command line is recorded as given,
secrets apart); `--api-key` is accepted and ignored, so the command line holds a secret-looking option.
The result file lists, per engine, the requests finished, their output text and token ids, and the
prompts' token ids, for the test to look for in the recorded files.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

from kvtrace.demo.workload import SYSTEM_PROMPT, make_engine

KVM = "vllm.v1.core.kv_cache_manager"
ENGINES = {
    1: {"options": {"inject_fault": "prefix_cache"}, "env": {}},
    2: {"options": {"extra_targets": {"prefix_cache": [[KVM, "KVCacheManager.no_such_method", []]]}},
        "env": {"KVTRACE_TEST_DRIFT": "touch-signature"}},
}


def run_engine(k: int, model: str, marker: str, jobs: int, max_tokens: int) -> dict:
    from vllm import SamplingParams

    base = json.loads(os.environ.get("KVTRACE_OPTIONS", "{}") or "{}")
    saved = {key: os.environ.get(key) for key in ("KVTRACE_OPTIONS", *ENGINES[k]["env"])}
    os.environ["KVTRACE_OPTIONS"] = json.dumps({**base, **ENGINES[k]["options"]})
    os.environ.update(ENGINES[k]["env"])
    try:
        llm = make_engine(model, num_blocks=64, max_num_seqs=4, max_batched_tokens=256)
    finally:  # the EngineCore has been spawned with them; this process goes back to what it was given
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    prompts = {f"e{k}-job{j}-turn0": f"{SYSTEM_PROMPT} Job {j} {marker}: fix issue {j * 7 + 3}." for j in range(jobs)}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = {"text": out.outputs[0].text,
                                           "token_ids": list(out.outputs[0].token_ids)}
    result = {"requests": sorted(outputs), "outputs": outputs,
              "prompt_token_ids": {rid: tokenizer.encode(p) for rid, p in prompts.items()}}
    engine.engine_core.shutdown()
    del engine, llm
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default=None, help="ignored (a secret-looking option for the privacy test)")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    marker = os.environ.get("RELIABILITY_MARKER", "")
    result = {str(k): run_engine(k, args.model, marker, args.jobs, args.max_tokens) for k in ENGINES}
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: len(v["requests"]) for k, v in result.items()}))


if __name__ == "__main__":
    main()
