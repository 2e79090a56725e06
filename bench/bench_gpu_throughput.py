"""Throughput of a real vLLM run, plain and under `kvtrace record`, side by side in one run (issue 33).

For each model shape, each round starts three processes running the same offline workload: plain, under
`kvtrace record` at the default granularity (per-layer timing plus one layer's block lists per step),
and under `kvtrace record --kv-granularity blocks --kv-layers all`. The order rotates between rounds,
so drift on the machine hits every variant alike. Inside each process the engine is started and warmed
up once, then the workload runs `--reps` times and each repetition is timed on its own: engine start,
CUDA graph capture and the recorder's shutdown are outside the figures, which are

- output tokens per second of `LLM.generate` (vLLM's defaults: CUDA graphs FULL_AND_PIECEWISE, Model
  Runner V2, async scheduling, prefix caching; random weights from `load_format="dummy"`), and
- CPU seconds of the worker's child processes per engine step: the EngineCore, which at tensor parallel
  size 1 runs the scheduler, the host probes and the model runner. Steps are vLLM's own count (its
  `iteration_tokens_total` histogram).

Ratios are recorded / plain of the mean over all repetitions of each variant; the interval is a
bootstrap over repetitions (within-process noise), and the per-round ratios are printed so the spread
between processes shows too. Prompts are random token ids, different in every repetition and the same
in every process, so the prefix cache never hits and every variant does identical work.

With `--together`, a round starts every variant's process first (one after another, each with its
share of the GPU's memory) and then runs the repetitions in turns: repetition 1 of each variant (order
rotating), then repetition 2, and so on, each process waiting while the others run. Repetitions of the
variants are then minutes apart at most instead of whole processes apart, so slow drift of the machine
(which moves a host-bound small model's throughput by 25% between processes) hits every variant alike;
the ratio is then also given paired, from each turn's recorded / plain ratio.

With `--gpu-pairs` (two GPUs), every variant runs in two processes, one on each GPU and half of the
CPUs; each turn runs a recorded variant on one GPU and plain on the other *at the same time*, the sides
swapping from turn to turn. What slows the whole machine for a while (the CPUs' clock, a neighbour's load)
slows both runs of a pair alike, and the paired ratio cancels it; swapping the sides cancels what differs
between them. `plain-2` (plain once more) paired with plain gives the method's own noise and bias (A/A).

    python bench/bench_gpu_throughput.py --shapes 1b,8b --rounds 2 --out DIR
    python bench/bench_gpu_throughput.py --shapes 1b --together --rounds 2 --reps 15 --out DIR
    python bench/bench_gpu_throughput.py --shapes 1b --gpu-pairs --variants plain,default,plain-2 --reps 12 --out DIR
    python bench/bench_gpu_throughput.py --shapes tiny --num-prompts 16 --input-len 64 --output-len 16 \
        --rounds 1 --reps 2 --gpu-memory-utilization 0.5   # smoke test on vLLM's CPU build

Needs vLLM (its CUDA build for the real figures) and kvtrace importable in the same Python.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Llama shapes (Hugging Face config fields). Weights are never loaded: vLLM makes random ones.
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),  # Llama-3.1-8B
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),  # Llama-3.2-1B
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),  # smoke test on CPU
}
VARIANTS = {
    "plain": None,
    "plain-2": None,  # plain again: paired with plain, the measurement's own noise and bias
    "host-only": ["--kv-granularity", "off"],  # the host probes alone: no attention probe, no ring
    "default": [],
    "all-layers": ["--kv-granularity", "blocks", "--kv-layers", "all"],
    # the default granularity with the device ring drained every millisecond, instead of every 100 ms
    # (or sooner when it may be a quarter full)
    "default-drain-1ms": ["--options-json", '{"kv_drain_interval_s": 0.001}'],
    # ... and every second (or sooner when it may be a quarter full): a tenth of the drains, each ten times larger
    "default-drain-1s": ["--options-json", '{"kv_drain_interval_s": 1.0}'],
    # the default granularity with the shard writer's flush every 5 s instead of every 2 s
    "default-flush-5s": ["--flush-interval", "5"],
    # the default granularity with the ring's kernels launched through CuPy (which lets the GIL go around
    # each launch) instead of _drain.c's launch (which keeps it)
    "default-cupy-launch": ["--options-json", '{"kv_native_launch": false}'],
    # the default granularity with the per-step state launch made in begin_step, at the top of the step,
    # instead of just before the ring's first kernel or graph replay
    "default-eager-state": ["--options-json", '{"kv_defer_state": false}'],
    # the default granularity on one step in 64: the per-step hooks stay, the device records go
    "default-sample-64": ["--kv-sample-every", "64"],
    # the default granularity with the ring drained by Python (torch copies, NumPy) instead of _drain.c
    "default-python-drain": ["--options-json", '{"kv_native_drain": false}'],
    # the default granularity with each drain one native call from the ring's Python thread, which then
    # hands the records over in Python, instead of the drain loop in C that never takes the GIL
    "default-drain-calls": ["--options-json", '{"kv_drain_loop": false}'],
    # the per-step machinery without most records (one step in 64): drained every 30 s (or when a
    # quarter full) instead of every 100 ms
    "sample-64-rare-drains": ["--kv-sample-every", "64", "--options-json", '{"kv_drain_interval_s": 30}'],
    # record kernels forked beside attention in the CUDA graphs instead of inline (the default)
    "default-forked": ["--options-json", '{"kv_overlap": true}'],
    "all-layers-forked": ["--kv-granularity", "blocks", "--kv-layers", "all", "--options-json", '{"kv_overlap": true}'],
}


def write_model(folder: Path, shape: str) -> Path:
    """A config-only Llama folder (vLLM's `load_format="dummy"` fills the weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", **SHAPES[shape]}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


# ---------------------------------------------------------------------------------------------- worker


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's descendants (the EngineCore and its helpers)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def engine_steps(llm) -> int | None:
    for m in llm.get_metrics():
        if m.name == "vllm:iteration_tokens_total" and hasattr(m, "count"):
            return int(m.count)
    return None


def warm_engine(model: str, input_len: int, output_len: int, num_prompts: int, dtype: str = "bfloat16",
                memory: float = 0.85, engine_args: dict | None = None) -> tuple:
    """(LLM with random weights, its SamplingParams, prompts(rep) -> the repetition's prompts), warmed up
    once: the workload every process of both GPU benchmarks runs (profile_engine_thread.py too)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
              max_model_len=input_len + output_len + 16, seed=0, gpu_memory_utilization=memory,
              disable_log_stats=False, **(engine_args or {}))
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, detokenize=False, temperature=0.0)

    def prompts(rep: int) -> list:
        rng = random.Random(f"prompts-{rep}")
        return [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(input_len)])
                for _ in range(num_prompts)]

    llm.generate(prompts(-1)[: max(1, num_prompts // 4)], params, use_tqdm=False)  # warm-up
    return llm, params, prompts


def worker(args) -> None:
    llm, params, prompts = warm_engine(args.model, args.input_len, args.output_len, args.num_prompts, args.dtype,
                                       args.gpu_memory_utilization, json.loads(args.engine_args))
    turns = Path(args.turns) if args.turns else None
    if turns:
        (turns / "ready").touch()
    reps = []
    # --gpu-pairs names each repetition's prompt set (its turn's): both runs of a pair get the same prompts
    prompt_reps = [int(x) for x in args.prompt_reps.split(",")] if args.prompt_reps else range(args.reps)
    for rep in range(args.reps):
        batch = prompts(prompt_reps[rep])
        if turns:  # --together: wait for this process's turn (the driver names it), then say it is done
            while not (turns / f"go-{rep}").exists():
                time.sleep(0.005)
        cpu0, steps0, t0 = children_cpu_s(), engine_steps(llm), time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        cpu1, steps1 = children_cpu_s(), engine_steps(llm)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = steps1 - steps0 if steps0 is not None and steps1 is not None else None
        reps.append({"seconds": seconds, "output_tokens": tokens, "engine_cpu_s": cpu1 - cpu0, "steps": steps})
        Path(args.result).write_text(json.dumps({"reps": reps}))
        if turns:
            (turns / f"done-{rep}").touch()


# ----------------------------------------------------------------------------------------------- driver


def variant_cmd(args, model: Path, variant: str, result: Path, session: Path, memory: float,
                turns: Path | None = None) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", str(model), "--result", str(result),
           "--reps", str(args.reps), "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--dtype", args.dtype, "--engine-args", args.engine_args,
           "--gpu-memory-utilization", str(memory)]
    if turns is not None:
        cmd += ["--turns", str(turns)]
    if VARIANTS[variant] is not None:
        cmd = [sys.executable, "-m", "kvtrace", "record", "-o", str(session), *VARIANTS[variant], "--", *cmd]
    return cmd


def run_variant(args, shape: str, model: Path, variant: str, rnd: int, out: Path, scratch: Path) -> dict:
    result = scratch / f"{shape}-{variant}-{rnd}.json"
    session = scratch / f"session-{shape}-{variant}-{rnd}"
    cmd = variant_cmd(args, model, variant, result, session, args.gpu_memory_utilization)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    return finish_run(shape, variant, rnd, out, proc.returncode, proc.stdout, proc.stderr,
                      time.monotonic() - t0, result, session)


def run_round_together(args, shape: str, model: Path, order: list[str], rnd: int, out: Path,
                       scratch: Path) -> dict[str, dict]:
    """One process per variant, all alive at once; their repetitions run in turns (see --together)."""
    memory = args.gpu_memory_utilization / len(order)
    procs = {}
    t0 = time.monotonic()
    try:
        for v in order:  # one at a time: vLLM sizes its KV cache from the memory free when it starts
            turns = scratch / f"turns-{shape}-{v}-{rnd}"
            turns.mkdir()
            result, session = scratch / f"{shape}-{v}-{rnd}.json", scratch / f"session-{shape}-{v}-{rnd}"
            logs = open(scratch / f"{shape}-{v}-{rnd}.stdout", "w+"), open(scratch / f"{shape}-{v}-{rnd}.stderr", "w+")
            proc = subprocess.Popen(variant_cmd(args, model, v, result, session, memory, turns),
                                    stdout=logs[0], stderr=logs[1], text=True)
            procs[v] = (proc, turns, result, session, logs)
            wait_for(proc, turns / "ready", t0 + args.timeout, f"{shape} {v} round {rnd} to start", logs)
        for rep in range(args.reps):
            k = rep % len(order)
            for v in order[k:] + order[:k]:
                proc, turns, *_, logs = procs[v]
                (turns / f"go-{rep}").touch()
                wait_for(proc, turns / f"done-{rep}", t0 + args.timeout, f"{shape} {v} round {rnd} rep {rep}", logs)
        runs = {}
        for v, (proc, _turns, result, session, logs) in procs.items():
            code = proc.wait(timeout=max(1.0, t0 + args.timeout - time.monotonic()))
            logs[0].seek(0), logs[1].seek(0)
            runs[v] = finish_run(shape, v, rnd, out, code, logs[0].read(), logs[1].read(),
                                 time.monotonic() - t0, result, session)
        return runs
    finally:
        for proc, *_ in procs.values():
            if proc.poll() is None:
                proc.kill()


def pair_sides() -> list[list[int]]:
    """This process's CPUs in two halves, one per GPU (a process's engine and its helpers stay there)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    return [cpus[:half], cpus[half:] or cpus[:half]]


def pair_turns(variants: list[str], reps: int) -> list[tuple[int, str, int]]:
    """(turn, recorded variant, its side) in order: every non-plain variant against plain in each
    repetition, their order rotating, the sides swapping between repetitions."""
    others = [v for v in variants if v != "plain"]
    turns = []
    for rep in range(reps):
        k = rep % len(others)
        for v in others[k:] + others[:k]:
            turns.append((len(turns), v, rep % 2))
    return turns


def run_pairs(args, shape: str, model: Path, variants: list[str], out: Path, scratch: Path) -> dict:
    """--gpu-pairs: a process per (variant, GPU), all alive at once; each turn runs a variant on one GPU
    and plain on the other at the same time. Returns {"turns": [...], "runs": {"variant@side": run}}."""
    sides, memory = pair_sides(), args.gpu_memory_utilization / len(variants)
    turns = pair_turns(variants, args.reps)
    # each process's own repetitions, in the order of the turns it takes part in
    mine: dict[tuple[str, int], list[int]] = {(v, g): [] for v in variants for g in (0, 1)}
    for turn, v, side in turns:
        mine[(v, side)].append(turn)
        mine[("plain", 1 - side)].append(turn)
    procs = {}
    t0 = time.monotonic()

    def start(v: str, g: int):
        name = f"{shape}-{v}-gpu{g}"
        folder = scratch / f"turns-{name}"
        folder.mkdir()
        result, session = scratch / f"{name}.json", scratch / f"session-{name}"
        logs = open(scratch / f"{name}.stdout", "w+"), open(scratch / f"{name}.stderr", "w+")
        cmd = variant_cmd(args, model, v, result, session, memory, folder)
        cmd[cmd.index("--reps") + 1] = str(len(mine[(v, g)]))
        cmd += ["--prompt-reps", ",".join(map(str, mine[(v, g)]))]  # the worker's arguments end the command
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(g)} if args.gpus_visible else dict(os.environ)
        cpus = sides[g]
        proc = subprocess.Popen(cmd, stdout=logs[0], stderr=logs[1], text=True, env=env,
                                preexec_fn=lambda: os.sched_setaffinity(0, cpus))  # its children inherit it
        procs[(v, g)] = (proc, folder, result, session, logs)
        return proc, folder, logs, name

    try:
        for v in variants:  # one at a time on each GPU (vLLM sizes its KV cache from the memory free when
            started = [start(v, g) for g in (0, 1)]  # it starts); the two GPUs' starts together
            for proc, folder, logs, name in started:
                wait_for(proc, folder / "ready", t0 + args.timeout, f"{name} to start", logs)
        done = {key: 0 for key in procs}
        for turn, v, side in turns:
            pair = [(v, side), ("plain", 1 - side)]
            for key in pair:
                (procs[key][1] / f"go-{done[key]}").touch()
            for key in pair:
                proc, folder, *_, logs = procs[key]
                wait_for(proc, folder / f"done-{done[key]}", t0 + args.timeout, f"{key} turn {turn}", logs)
                done[key] += 1
            print(f"{shape} turn {turn}: {v} on GPU {side} beside plain", flush=True)
        runs = {}
        for (v, g), (proc, _folder, result, session, logs) in procs.items():
            code = proc.wait(timeout=max(1.0, t0 + args.timeout - time.monotonic()))
            logs[0].seek(0), logs[1].seek(0)
            run = finish_run(shape, f"{v}@gpu{g}", 0, out, code, logs[0].read(), logs[1].read(),
                             time.monotonic() - t0, result, session)
            for rep, turn in zip(run["reps"], mine[(v, g)]):
                rep["turn"] = turn
            runs[f"{v}@{g}"] = run
        return {"turns": turns, "runs": runs, "sides": sides}
    finally:
        for proc, *_ in procs.values():
            if proc.poll() is None:
                proc.kill()


def pairs_report(shape: str, pairs: dict, args) -> list[str]:
    """Per recorded variant: the paired ratio (geometric mean over turns, bootstrap interval), each side's
    apart, and how much the pairing removed: the spread of the paired log ratio against that of plain's
    throughput from one of its turns to the next."""
    import math

    by_turn: dict[tuple[int, str], dict] = {}
    for key, run in pairs["runs"].items():
        v, side = key.rsplit("@", 1)
        for rep in run["reps"]:
            by_turn[(rep["turn"], v)] = {**rep, "side": int(side)}
    lines = [f"\n{shape}: {SHAPES[shape]['num_hidden_layers']} layers, {args.num_prompts} prompts x "
             f"{args.input_len} in / {args.output_len} out, --gpu-pairs, {args.reps} reps; CPUs "
             f"{pairs['sides'][0][0]}-{pairs['sides'][0][-1]} with GPU 0, {pairs['sides'][1][0]}-{pairs['sides'][1][-1]} with GPU 1"]
    plain_series = [throughput(by_turn[(t, "plain")]) for t, _v, _s in pairs["turns"] if (t, "plain") in by_turn]
    steps = [math.log(b / a) for a, b in zip(plain_series, plain_series[1:])]
    drift = math.sqrt(statistics.fmean(x * x for x in steps)) if steps else float("nan")  # rms
    for v in dict.fromkeys(v for _t, v, _s in pairs["turns"]):
        rows = [(by_turn[(t, v)], by_turn[(t, "plain")]) for t, vv, _s in pairs["turns"]
                if vv == v and (t, v) in by_turn and (t, "plain") in by_turn]
        ratios = [throughput(r) / throughput(p) for r, p in rows]
        g = paired_ci(ratios)
        side = {k: [x for (r, _p), x in zip(rows, ratios) if r["side"] == k] for k in (0, 1)}
        sides = ", ".join(f"on GPU {k}: {math.exp(statistics.fmean(math.log(x) for x in xs)):.4f} ({len(xs)})"
                          for k, xs in side.items() if xs)
        spread = statistics.pstdev([math.log(x) for x in ratios]) if len(ratios) > 1 else float("nan")
        cpu = [(cpu_per_step_ms(r), cpu_per_step_ms(p)) for r, p in rows]
        cpu = [(a, b) for a, b in cpu if a and b]
        cpu_txt = (f"; EngineCore CPU per step {statistics.fmean(b for _a, b in cpu):.2f} -> "
                   f"{statistics.fmean(a for a, _b in cpu):.2f} ms" if cpu else "")
        lines.append(f"  {v} / plain at the same time, {len(ratios)} pairs: {g[0]:.4f} [{g[1]:.4f}, {g[2]:.4f}]; "
                     f"{sides}; spread of a pair's log ratio {100 * spread:.1f}% (plain's own from turn to turn "
                     f"{100 * drift:.1f}% rms){cpu_txt}; mean plain {statistics.fmean(throughput(p) for _r, p in rows):.0f} tok/s")
    for key, run in pairs["runs"].items():
        if run.get("record_says"):
            lines.append(f"  {key}: session {run.get('session_mb', 0):.1f} MB; " + " | ".join(run["record_says"])[:400])
    return lines


def wait_for(proc: subprocess.Popen, path: Path, deadline: float, what: str, logs) -> None:
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            logs[1].seek(0)
            raise SystemExit(f"bench: waiting for {what}: the process "
                             + (f"exited ({proc.returncode})" if proc.poll() is not None else "timed out")
                             + ":\n" + logs[1].read()[-3000:])
        time.sleep(0.005)


def finish_run(shape: str, variant: str, rnd: int, out: Path, code: int, stdout: str, stderr: str, wall: float,
               result: Path, session: Path) -> dict:
    with open(out / "logs.txt", "a") as log:  # one file for all runs: tails only
        log.write(f"=== {shape} {variant} round {rnd}: exit {code}, {wall:.0f} s\n"
                  f"{stdout[-3000:]}\n--- stderr ---\n{stderr[-8000:]}\n")
    if code != 0 or not result.exists():
        raise SystemExit(f"bench: {shape} {variant} round {rnd} failed (exit {code}); see "
                         f"{out / 'logs.txt'}:\n" + stderr[-3000:])
    run = json.loads(result.read_text())
    run["wall_s"] = wall
    # kvtrace record's closing lines: the session's status and what it lost, if anything; and what each
    # process's recorder said about itself (drops, the ring's drain time).
    said = [line for line in stderr.splitlines() if line.startswith("kvtrace:")]
    closing = [i for i, line in enumerate(said) if line.startswith("kvtrace: session")]
    run["record_says"] = said[closing[-1]:] if closing else said[-2:]
    if session.exists():
        run["session_mb"] = sum(f.stat().st_size for f in session.rglob("*") if f.is_file()) / 1e6
        run["procs"] = session_procs(session)
        shutil.rmtree(session, ignore_errors=True)
    return run


def session_procs(session: Path) -> list[dict]:
    """Each process's proc.json of a recorded session, in path order (those under 1 MiB: a real one is a
    few KB)."""
    return [json.loads(p.read_text()) for p in sorted(session.glob("procs/*/proc.json"))
            if p.stat().st_size < 1 << 20]


def ring_facts(procs: list[dict]) -> list[tuple[str, dict]]:
    """(key, facts) of every KV ring the processes' proc.json name (their `kv_ring_<source>` entries:
    rows kept and dropped, drains, step tickets)."""
    return [(key, val) for p in procs for key, val in sorted(p.items())
            if key.startswith("kv_ring_") and isinstance(val, dict)]


def throughput(rep: dict) -> float:
    return rep["output_tokens"] / rep["seconds"]


def cpu_per_step_ms(rep: dict) -> float | None:
    return 1e3 * rep["engine_cpu_s"] / rep["steps"] if rep.get("steps") else None


def ratio_ci(plain: list[float], other: list[float], n_boot: int = 4000) -> tuple[float, float, float]:
    """Ratio of means, with a 95% bootstrap interval resampling each list."""
    rng = random.Random(0)
    boots = []
    for _ in range(n_boot):
        p = [rng.choice(plain) for _ in plain]
        o = [rng.choice(other) for _ in other]
        boots.append(statistics.fmean(o) / statistics.fmean(p))
    boots.sort()
    return (statistics.fmean(other) / statistics.fmean(plain), boots[int(0.025 * n_boot)],
            boots[int(0.975 * n_boot) - 1])


def mean_ci(xs: list[float], n_boot: int = 4000) -> tuple[float, float, float]:
    """Mean of `xs`, with a 95% bootstrap interval."""
    rng = random.Random(0)
    boots = sorted(statistics.fmean(rng.choice(xs) for _ in xs) for _ in range(n_boot))
    return statistics.fmean(xs), boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]


def paired_ci(ratios: list[float], n_boot: int = 4000) -> tuple[float, float, float]:
    """Geometric mean of paired ratios, with a 95% bootstrap interval over the pairs."""
    import math

    return tuple(math.exp(x) for x in mean_ci([math.log(r) for r in ratios], n_boot))


def report(shape: str, runs: dict[str, list[dict]], args) -> list[str]:
    lines = [f"\n{shape}: {SHAPES[shape]['num_hidden_layers']} layers, {args.num_prompts} prompts x "
             f"{args.input_len} in / {args.output_len} out, {args.rounds} rounds x {args.reps} reps"]
    thr = {v: [throughput(r) for run in rs for r in run["reps"]] for v, rs in runs.items()}
    cpu = {v: [c for run in rs for r in run["reps"] if (c := cpu_per_step_ms(r)) is not None] for v, rs in runs.items()}
    steps = {v: sorted({r["steps"] for run in rs for r in run["reps"]}, key=str) for v, rs in runs.items()}
    lines.append(f"  {'variant':<11s} {'tok/s (mean)':>13s} {'ratio [95%]':>24s} {'per round':>20s} "
                 f"{'CPU ms/step':>12s} {'ratio [95%]':>24s}  steps/rep")
    for v in runs:
        per_round = [statistics.fmean(throughput(r) for r in run["reps"]) for run in runs[v]]
        plain_round = [statistics.fmean(throughput(r) for r in run["reps"]) for run in runs["plain"]]
        rounds = " ".join(f"{a / b:.4f}" for a, b in zip(per_round, plain_round))
        t = ratio_ci(thr["plain"], thr[v])
        c = ratio_ci(cpu["plain"], cpu[v]) if cpu[v] and cpu["plain"] else None
        cpu_txt = f"{statistics.fmean(cpu[v]):12.3f}" if cpu[v] else f"{'n/a':>12s}"
        c_txt = f"{c[0]:.4f} [{c[1]:.4f}, {c[2]:.4f}]" if c else "n/a"
        lines.append(f"  {v:<11s} {statistics.fmean(thr[v]):13.1f} {t[0]:.4f} [{t[1]:.4f}, {t[2]:.4f}] "
                     f"{rounds:>20s} {cpu_txt} {c_txt:>24s}  {steps[v]}")
    if args.together:  # each repetition beside the plain one of its turn
        for v in runs:
            if v != "plain":
                pairs = [throughput(r) / throughput(p) for run, base in zip(runs[v], runs["plain"])
                         for r, p in zip(run["reps"], base["reps"])]
                g = paired_ci(pairs)
                lines.append(f"  {v} / plain, paired by turn ({len(pairs)} turns): {g[0]:.4f} [{g[1]:.4f}, {g[2]:.4f}]")
    for v, rs in runs.items():
        for i, run in enumerate(rs):
            if run.get("record_says"):
                procs = run.get("procs", [])
                hot = ",".join(sorted({str(p.get("hot_path")) for p in procs}))
                rings = [val for _, val in ring_facts(procs)]
                kv = sum(r.get("kv_rows", 0) for r in rings)
                lost = sum(r.get("kv_dropped", 0) for r in rings)
                drains = sum(r.get("drains", 0) for r in rings)
                drain_s = sum(r.get("drain_s", 0.0) for r in rings)
                lines.append(f"  {v} round {i}: session {run.get('session_mb', 0):.1f} MB, {kv} KV access records "
                             f"kept, {lost} lost, {drains} drains ({drain_s:.2f} s); row logs {hot}; "
                             + " | ".join(run["record_says"])[:600])
    return lines


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    except Exception as exc:  # pragma: no cover - reported, not fatal
        return f"unknown ({exc})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--shapes", default="1b,8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--variants", default="plain,default,all-layers", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=4, help="timed repetitions of the workload per process")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=256, help="output tokens per request")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--engine-args", default="{}", help="JSON of extra vLLM engine arguments")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per process")
    ap.add_argument("--out", default="bench-gpu-throughput", help="folder for results, logs and sessions")
    ap.add_argument("--together", action="store_true",
                    help="keep every variant's process alive and run their repetitions in turns (see above)")
    ap.add_argument("--gpu-pairs", action="store_true",
                    help="two GPUs: each variant beside plain at the same time, one on each GPU (see above)")
    ap.add_argument("--no-gpus-visible", dest="gpus_visible", action="store_false",
                    help=argparse.SUPPRESS)  # --gpu-pairs on vLLM's CPU build (smoke test): no CUDA_VISIBLE_DEVICES
    ap.add_argument("--turns", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-reps", help=argparse.SUPPRESS)  # worker: each repetition's prompt set
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    shapes = [s for s in args.shapes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    bad = [s for s in shapes if s not in SHAPES] + [v for v in variants if v not in VARIANTS]
    if bad or "plain" not in variants:
        raise SystemExit(f"bench: unknown shape or variant {bad}, or no 'plain' to compare with")
    if args.gpu_pairs and (args.together or len(variants) < 2):
        raise SystemExit("bench: --gpu-pairs runs its own turns (not with --together) and needs a variant besides plain")
    if args.gpu_pairs and args.gpus_visible:
        import torch

        if torch.cuda.device_count() < 2:
            raise SystemExit(f"bench: --gpu-pairs needs two GPUs, this machine has {torch.cuda.device_count()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))  # models, sessions, per-process results
    lines = [f"device: {device_name()}"]
    try:
        import vllm

        lines.append(f"vLLM {vllm.__version__}")
    except Exception as exc:
        raise SystemExit(f"bench: vLLM is not importable: {exc}") from None
    print("\n".join(lines), flush=True)
    everything = {}
    for shape in shapes:
        model = write_model(scratch / "models" / shape, shape)
        if args.gpu_pairs:
            pairs = run_pairs(args, shape, model, variants, out, scratch)
            everything[shape] = pairs
            (out / "results.json").write_text(json.dumps({"device": lines[0], "args": vars(args), "runs": everything},
                                                         indent=1))
            block = pairs_report(shape, pairs, args)
            lines += block
            print("\n".join(block), flush=True)
            continue
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for rnd in range(args.rounds):
            order = variants[rnd % len(variants):] + variants[: rnd % len(variants)]
            # sequential processes: each kept as it ends; together: all at the end of the round
            done = (run_round_together(args, shape, model, order, rnd, out, scratch).items() if args.together
                    else ((v, run_variant(args, shape, model, v, rnd, out, scratch)) for v in order))
            for v, run in done:
                runs[v].append(run)
                thr = statistics.fmean(throughput(r) for r in run["reps"])
                print(f"{shape} round {rnd} {v:<11s}: {thr:10.1f} output tok/s over {len(run['reps'])} reps, "
                      f"process {run['wall_s']:.0f} s", flush=True)
                everything[shape] = runs  # after every process: a run cut short keeps what it measured
                (out / "results.json").write_text(json.dumps({"device": lines[0], "args": vars(args),
                                                              "runs": everything}, indent=1))
        block = report(shape, runs, args)
        lines += block
        print("\n".join(block), flush=True)
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
