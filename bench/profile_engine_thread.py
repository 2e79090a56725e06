"""Where the engine thread's time goes, plain and under `kvtrace record`: a profile of one process.

The GPU throughput benchmark (bench_gpu_throughput.py) measures what recording costs a host-bound
model; this one says where. Each variant runs in its own process with vLLM's engine core in process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the scheduler, the host probes and the model runner on the one
thread that calls `LLM.generate`), the same offline workload as the throughput benchmark (random token
ids, `ignore_eos`, random weights), warmed up once, then `--reps` repetitions under cProfile. For each
variant it prints the wall time per engine step, the profiled thread's own time in kvtrace's code
(functions in files under `kvtrace/`, their self time: what the probes cost on the engine thread
directly) and the functions that take the most self time. Python 3.12's cProfile sees every thread,
so the recorder's background threads (ring drain, shard writer) are in those figures too; what they
make the engine thread wait (GIL hand-overs) is not, and shows only in its wall time.

    python bench/profile_engine_thread.py --shape 1b --variants plain,default --out DIR   # on the GPU machine

cProfile slows Python code by itself (every call is counted), so the figures compare variants with each
other, not with the throughput benchmark. `--threads` runs without it and reports, per engine step, the
wall time and CPU time: the engine thread's (its own clock), kvtrace's ring drain and shard writer
threads' (each reads its own clock at every turn of its loop) and the rest of the process's (vLLM's and CUDA's
other threads). A variant's extra wall time is then work on the engine thread itself, or time that
thread waits (for the GIL while kvtrace's threads run, or for the GPU). `--rounds N` runs the variants'
processes N times in turns.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu_throughput as bgt  # noqa: E402  (its shapes, variants and model folders)


def kvtrace_threads_cpu_s() -> tuple[float, float]:
    """CPU seconds so far of this process's KV ring drain thread and shard writer thread (0 when not
    recording). Each reads its own clock at every turn of its loop (every drain, every flush), so a
    window's difference is exact to one turn at each end."""
    from kvtrace.probes import lifecycle
    from kvtrace.record.recorder import current_recorder

    rec = current_recorder()
    ring = next((p.ring for p in lifecycle.installed() if getattr(p, "ring", None) is not None), None)
    return (ring.stats.get("thread_cpu_s", 0.0) if ring is not None else 0.0,
            rec.writer_cpu_s if rec is not None else 0.0)


def worker(args) -> None:
    """The timed repetitions under cProfile (a report), or with `--threads` without it (wall, and the CPU
    of the engine thread, kvtrace's two threads and the whole process over them, as JSON)."""
    llm, params, prompts = bgt.warm_engine(args.model, args.input_len, args.output_len, args.num_prompts)
    batches = [prompts(rep) for rep in range(args.reps)]
    prof = None if args.threads else cProfile.Profile()
    steps0, t0 = bgt.engine_steps(llm), time.perf_counter()
    main0, proc0, ours0 = time.thread_time(), time.process_time(), kvtrace_threads_cpu_s()
    if prof is not None:
        prof.enable()
    for batch in batches:
        llm.generate(batch, params, use_tqdm=False)
    if prof is not None:
        prof.disable()
    seconds = time.perf_counter() - t0
    main_s, proc_s = time.thread_time() - main0, time.process_time() - proc0
    ring_s, writer_s = (b - a for a, b in zip(ours0, kvtrace_threads_cpu_s()))
    steps = (bgt.engine_steps(llm) or 0) - (steps0 or 0)
    if prof is None:
        Path(args.result).write_text(json.dumps({"steps": max(steps, 1), "wall_s": seconds, "engine_thread_cpu_s": main_s,
                                                 "ring_cpu_s": ring_s, "writer_cpu_s": writer_s,
                                                 "process_cpu_s": proc_s}))
        return
    stats = pstats.Stats(prof)
    total = sum(v[2] for v in stats.stats.values())  # self time of every function
    # kvtrace's Python functions, and its C ones (the native row logs' methods name their type's module)
    ours = {k: v for k, v in stats.stats.items() if f"{os.sep}kvtrace{os.sep}" in k[0] or "kvtrace" in k[2]}
    ours_s = sum(v[2] for v in ours.values())
    lines = [f"wall {seconds:.3f} s for {steps} engine steps: {1e3 * seconds / max(steps, 1):.3f} ms a step; "
             f"profiled self time {total:.3f} s, of which kvtrace's functions {ours_s:.3f} s "
             f"({1e3 * ours_s / max(steps, 1):.3f} ms a step)",
             "kvtrace functions by self time (s, calls, file:line function):"]
    for (path, line, name), v in sorted(ours.items(), key=lambda kv: -kv[1][2])[:25]:
        lines.append(f"  {v[2]:8.3f} {v[1]:9d}  {path.split(os.sep + 'kvtrace' + os.sep)[-1]}:{line} {name}")
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(30)
    lines += ["all functions by self time:", out.getvalue()[-12000:]]
    Path(args.result).write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="1b", choices=sorted(bgt.SHAPES))
    ap.add_argument("--variants", default="plain,default", help=f"comma-separated, of {', '.join(bgt.VARIANTS)}")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", action="store_true", help="no profiler: wall and CPU time per step by thread")
    ap.add_argument("--rounds", type=int, default=1, help="processes per variant, in turns (--threads)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per process")
    ap.add_argument("--out", default="profile-engine-thread", help="folder for the reports")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    variants = [v for v in args.variants.split(",") if v]
    if [v for v in variants if v not in bgt.VARIANTS]:
        raise SystemExit(f"profile: unknown variant in {variants}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtrace-profile-") as scratch:
        model = bgt.write_model(Path(scratch) / "model", args.shape)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        for i, v in enumerate([v for _ in range(args.rounds) for v in variants]):
            result = out / f"{args.shape}-{v}.txt"
            session = Path(scratch) / f"session-{v}-{i}"
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", str(model), "--result",
                   str(result), "--reps", str(args.reps), "--num-prompts", str(args.num_prompts),
                   "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                   *(["--threads"] if args.threads else [])]
            if bgt.VARIANTS[v] is not None:
                cmd = [sys.executable, "-m", "kvtrace", "record", "-o", str(session),
                       *bgt.VARIANTS[v], "--", *cmd]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            if proc.returncode != 0 or not result.exists():
                raise SystemExit(f"profile: {v} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            said = [line for line in proc.stderr.splitlines() if line.startswith("kvtrace:")]
            if args.threads:
                print(thread_row(v, json.loads(result.read_text())), *said[-1:], sep="\n", flush=True)
                shutil.rmtree(session, ignore_errors=True)
                continue
            print(f"== {args.shape} {v}\n" + result.read_text().split("all functions by self time:")[0]
                  + "\n".join(said[-3:]), flush=True)


def thread_row(variant: str, r: dict) -> str:
    """One line of ms a step over the timed repetitions: wall, the engine thread's CPU, kvtrace's ring
    drain and shard writer threads' CPU, and the rest of the process's CPU (vLLM's and CUDA's threads)."""
    n = r["steps"] / 1e3
    rest = r["process_cpu_s"] - r["engine_thread_cpu_s"] - r["ring_cpu_s"] - r["writer_cpu_s"]
    return (f"{variant:>18}: {r['steps']} steps, wall {r['wall_s'] / n:.3f} ms a step; CPU ms a step: engine "
            f"thread {r['engine_thread_cpu_s'] / n:.3f}, kvtrace-kv-ring {r['ring_cpu_s'] / n:.3f}, "
            f"kvtrace-writer {r['writer_cpu_s'] / n:.3f}, other threads {rest / n:.3f}")


if __name__ == "__main__":
    main()
