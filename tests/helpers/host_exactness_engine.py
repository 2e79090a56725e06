"""A real vLLM engine run that also collects what vLLM itself reports about its KV cache, for
tests/integration/test_host_exactness.py (run it under `kvtrace record`):

    python tests/helpers/host_exactness_engine.py --model DIR --out vllm.json --port PORT

- KV residency metrics (`kv_cache_metrics=True, kv_cache_metrics_sample=1.0`, log stats on): the raw
  `KVCacheEvictionEvent`s (lifetime, idle before eviction) as the front end receives them in
  `SchedulerStats.kv_cache_eviction_events`, through a custom stat logger (the supported
  `LLMEngine(stat_loggers=...)` API), and the Prometheus histograms they feed (`llm.get_metrics()`:
  count, sum and buckets of vllm:kv_block_lifetime_seconds / vllm:kv_block_idle_before_evict_seconds).
- KV events (`kv_events_config` with the zmq publisher): every KVEventBatch, received by a SUB socket
  in this process (BlockStored / BlockRemoved hashes). Run with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
  for the hashes as bytes; vLLM's default (1) publishes int(hash, big-endian) & (2**64-1), the *last*
  8 bytes of the 32-byte hash, which cannot be mapped onto our first-8-bytes `block_hash`.

The workload is kvtrace.demo.workload's (jobs of turns sharing prefixes) on a small pool, so blocks are
cached, hit, evicted and reallocated.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time


class EvictionEventLogger:
    """Keeps every KVCacheEvictionEvent the front end receives (a vLLM StatLoggerBase)."""

    events: list[tuple[float, float, list[float]]] = []

    def __init__(self, vllm_config, engine_index: int = 0):
        self.engine_index = engine_index

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is not None:
            for e in scheduler_stats.kv_cache_eviction_events:
                EvictionEventLogger.events.append(
                    (e.lifetime_seconds, e.idle_seconds, list(e.reuse_gaps_seconds)))

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, is_awake: int, level: int):
        pass


def subscribe(port: int, batches: list, stop: threading.Event, ready: threading.Event) -> None:
    """Receive KV event batches from vLLM's zmq publisher until `stop`, then drain what is left."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    ready.set()
    idle_since = None
    while True:
        if sock.poll(100):
            _topic, seq, payload = sock.recv_multipart()
            batches.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
            idle_since = None
        elif stop.is_set():
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 1.0:
                break
    sock.close(linger=0)


def as_json(value):
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    return value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--num-blocks", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=6)
    ap.add_argument("--turns", type=int, default=2)
    args = ap.parse_args()

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from kvtrace.demo.workload import run_jobs, vllm_counters

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine_args = EngineArgs(
        model=args.model, dtype="float32", max_model_len=512, enforce_eager=True, block_size=32,
        max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=True, disable_log_stats=False,
        seed=0, num_gpu_blocks_override=args.num_blocks, kv_cache_metrics=True, kv_cache_metrics_sample=1.0,
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                          "endpoint": f"tcp://*:{args.port}", "topic": "kv"})
    engine = LLMEngine.from_engine_args(engine_args, stat_loggers=[EvictionEventLogger])

    batches: list = []
    stop, ready = threading.Event(), threading.Event()
    sub = threading.Thread(target=subscribe, args=(args.port, batches, stop, ready), daemon=True)
    sub.start()
    ready.wait(10)
    time.sleep(1.0)  # zmq's slow joiner: let the subscription reach the publisher before any event

    class _LLM:  # what kvtrace.demo.workload's helpers need of an LLM
        llm_engine = engine

        def get_metrics(self):
            return engine.get_metrics()

    run = run_jobs(_LLM(), args.jobs, args.turns, max_tokens=24)
    stop.set()
    sub.join(30)
    histograms = {}
    for m in engine.get_metrics():
        if m.name in ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds"):
            histograms[m.name] = {"count": m.count, "sum": m.sum, "buckets": dict(m.buckets)}
    events = []
    for seq, batch in sorted(batches, key=lambda b: b[0]):
        for ev in batch.events:
            kind = type(ev).__name__
            events.append({"seq": seq, "kind": kind,
                           "hashes": [as_json(h) for h in getattr(ev, "block_hashes", None) or []]})
    with open(args.out, "w") as f:
        json.dump({"run": run, "vllm": vllm_counters(_LLM()), "eviction_events": EvictionEventLogger.events,
                   "histograms": histograms, "kv_events": events, "kv_batches": len(batches)}, f)
    print(json.dumps({"requests": run["requests"], "eviction_events": len(EvictionEventLogger.events),
                      "kv_batches": len(batches)}))


if __name__ == "__main__":
    main()
