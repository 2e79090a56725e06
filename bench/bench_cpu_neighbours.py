"""Whether work on another core slows a Python thread's own work on this one, and which kind of work does.

On an H200 host (bench/profile_engine_thread.py --ab-pause all-writer) the shard writer's work made the
engine thread's steps use more CPU time for the same work, on its own core: the engine thread was not
waiting, it ran slower. Writing fewer bytes (zstd) made it worse, because compressing costs the writer
more CPU than the bytes it saves. This asks, with no GPU and no vLLM, what another core's work does to a
pinned Python thread: one process runs the same pure-Python chunk over and over on `--core`; another,
pinned to `--load-core`, is switched on and off in blocks of `--block-ms`, in pairs whose order
alternates, and does one kind of work while on:

- `spin`: an integer loop (no memory traffic: only the package's clock and a shared core would feel it);
- `copy`: NumPy copies of 3.4 MB buffers (a drain's records), through the caches;
- `write`: the same buffers written to a file under `--dir` (the page cache), as the shard writer does;
- `recorder`: kvtrace's own background work, on a thread of the measured process (the GIL shared, as in
  an engine): every 100 ms a drain's records (`--records`, copied as the native drain copies them) and its
  timing records handed to a real `Recorder` (one frame written), and every 2 s its flush, the drain and
  the flush timed on the neighbour thread's own clock (printed: its CPU share of the on blocks).

`--release-every N` makes the measured thread more like vLLM's engine thread on a GPU: every N turns of
its loop it calls C code that lets the GIL go for a few microseconds (a SHA-1 of 16 KB, as each torch op
lets it go around its dispatch: a CUDA engine's step makes hundreds). A thread waiting for the GIL takes it
there instead of at the 5 ms switch interval, and the measured thread then waits for it back: kvtrace's
threads' hand-overs cost a thread like that what they do not cost a pure-Python loop (0 = never).

Printed per kind: the chunk's mean time with the load on over off, paired over the blocks, with a 95%
bootstrap interval over the pairs. A ratio above 1 for `spin` means the cores share their speed
(frequency, or hardware threads of one core); for `copy` or `write` alone, that they share caches or
memory.

    python bench/bench_cpu_neighbours.py --core 2 --load-core 9 --seconds 20
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_throughput import paired_ci  # noqa: E402
from cpu_speed_probe import chunk  # noqa: E402  (fixed pure-Python work)
from profile_engine_thread import block_records  # noqa: E402  (which block of a pair is on)

KINDS = ("spin", "copy", "write", "recorder")
BUFFER_BYTES = 3_360_000  # a 1B-class model's 100 ms drain of KV records (105k records of 32 bytes)


def load(core: int, kind: str, on, stop, path: str) -> None:
    """The neighbour: `kind`'s work on `core` while `on` is set, idle (waiting on the flag) otherwise."""
    os.sched_setaffinity(0, {core})
    src = np.random.default_rng(0).integers(0, 1 << 62, BUFFER_BYTES // 8, dtype=np.int64)
    dst = np.empty_like(src)
    f = open(path, "wb", buffering=0) if kind == "write" else None
    written = 0
    while not stop.is_set():
        if not on.wait(0.05):
            continue
        if kind == "spin":
            x = 0
            for i in range(200_000):
                x += i * i
        elif kind == "copy":
            np.copyto(dst, src)
        else:
            f.write(memoryview(src))
            written += BUFFER_BYTES
            if written > 1 << 30:  # keep the file at most 1 GiB: start it again
                f.seek(0)
                f.truncate()
                written = 0
    if f is not None:
        f.close()


DRAIN_S, FLUSH_S = 0.1, 2.0  # the ring's drain and the recorder's flush intervals (kvtrace's defaults)


RECORDER_PARTS = ("copy", "frame", "timings", "flush")


def recorder_load(core: int, on, stop, folder: str, records: int, cpu: list, parts=RECORDER_PARTS,
                  ready=None) -> None:
    """`recorder`: kvtrace's drain-thread and writer work, on this thread, while `on` is set (`parts`: the
    drain's copy of its records, their frame, the timing records, the flush; each left out to tell what of
    it costs); `cpu`: this thread's CPU seconds while on, appended at the end; `ready`: set once warm."""
    from bench_kv_drain import device_records

    from kvtrace.format.kv_records import TIM_DTYPE
    from kvtrace.record.recorder import Recorder

    os.sched_setaffinity(0, {core})  # this thread only
    rec = Recorder(os.path.join(folder, "session"), "neighbour", {"flush_interval_s": 1e9})  # flushed here
    staged = device_records(records, 30)
    timings = np.zeros(16 * 10, TIM_DTYPE)
    rec.append_kv_records(staged, (0, 0, 1.0), (1, 0))  # warm, untimed: the first flush's imports (~0.5 s)
    rec.append_timing_records(timings, (0, 0, 1.0), owned=True)
    rec.flush()
    if ready is not None:
        ready.set()
    busy, next_flush = 0.0, time.monotonic() + FLUSH_S
    while not stop.wait(DRAIN_S):  # its own cadence, not the blocks': the work falls anywhere in a block
        if not on.is_set():
            continue
        t0 = time.thread_time()
        drained = staged.copy() if "copy" in parts else staged  # the native drain's copy of its records
        if "frame" in parts:
            rec.append_kv_records(drained, (0, 0, 1.0), (1, 0))
        if "timings" in parts:
            rec.append_timing_records(timings, (0, 0, 1.0), owned=True)
        if "flush" in parts and time.monotonic() >= next_flush:
            rec.flush()
            next_flush = time.monotonic() + FLUSH_S
        busy += time.thread_time() - t0
    rec.close()
    cpu.append(busy)


RELEASE_BYTES = bytes(16384)  # hashlib lets the GIL go for data of 2 KB and more


def released_chunk(n: int, every: int) -> int:
    """cpu_speed_probe's chunk of `n` turns in pieces of `every`, the GIL let go between them."""
    acc = 0
    for _ in range(max(1, n // every)):
        acc += chunk(every)
        hashlib.sha1(RELEASE_BYTES).digest()
    return acc


def measure(core: int, kind: str, load_core: int, seconds: float, block_ms: float, n: int, folder: str,
            records: int = 50_000, parts=RECORDER_PARTS, release_every: int = 0) -> tuple[list[float], float | None]:
    """Ratios (mean chunk time, load on / off) over the pairs of blocks; for `recorder`, its thread's CPU
    share of the on blocks."""
    cpu: list[float] = []
    ready = None
    if kind == "recorder":
        on, stop, ready = threading.Event(), threading.Event(), threading.Event()
        proc = threading.Thread(target=recorder_load, args=(load_core, on, stop, folder, records, cpu, parts, ready),
                                daemon=True)
    else:
        on, stop = mp.Event(), mp.Event()
        path = os.path.join(folder, f"neighbour-{kind}.bin")
        proc = mp.Process(target=load, args=(load_core, kind, on, stop, path), daemon=True)
    proc.start()
    if ready is not None and not ready.wait(60):  # its warm-up (imports, first files) is not measured
        raise SystemExit("bench_cpu_neighbours: the recorder thread did not start")
    os.sched_setaffinity(0, {core})
    blocks: list[tuple[bool, list[int]]] = []
    end = time.monotonic() + seconds
    block = 0
    while time.monotonic() < end:
        loaded = block_records(block)  # the order alternates between pairs
        (on.set if loaded else on.clear)()
        time.sleep(0.005)  # the neighbour starts or stops: not timed
        times, t_end = [], time.monotonic() + block_ms / 1e3
        while time.monotonic() < t_end:
            t0 = time.perf_counter_ns()
            released_chunk(n, release_every) if release_every else chunk(n)
            times.append(time.perf_counter_ns() - t0)
        blocks.append((loaded, times))
        block += 1
    stop.set()
    on.set()
    proc.join(5)
    if kind != "recorder" and os.path.exists(path):
        os.unlink(path)
    ratios = []
    for i in range(0, len(blocks) - 1, 2):
        (a_on, a), (_, b) = blocks[i], blocks[i + 1]
        on_t, off_t = (a, b) if a_on else (b, a)
        ratios.append(statistics.fmean(on_t) / statistics.fmean(off_t))
    on_s = sum(block_ms / 1e3 for loaded, _ in blocks if loaded)
    return ratios, (cpu[0] / on_s if cpu and on_s else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core", type=int, default=2, help="the measured thread's CPU")
    ap.add_argument("--load-core", type=int, default=None, help="the neighbour's CPU (default: the last one allowed)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--seconds", type=float, default=20.0, help="per kind")
    ap.add_argument("--block-ms", type=float, default=100.0)
    ap.add_argument("--chunk", type=int, default=2000, help="loop turns per timed chunk (cpu_speed_probe.py's; ~0.5 ms on a 2-vCPU VM)")
    ap.add_argument("--dir", default=None, help="where `write` writes its file (default: a temporary folder)")
    ap.add_argument("--records", type=int, default=50_000,
                    help="`recorder`: KV records a drain (the 1B default's ~100 ms on an H200: ~50,000)")
    ap.add_argument("--recorder-parts", default=",".join(RECORDER_PARTS),
                    help=f"`recorder`: which of its work it does, comma-separated, of {', '.join(RECORDER_PARTS)}")
    ap.add_argument("--release-every", type=int, default=0, metavar="N",
                    help="let the GIL go every N turns of the measured loop, as an engine's torch ops do (0: never)")
    args = ap.parse_args()
    parts = [x for x in args.recorder_parts.split(",") if x]
    if any(x not in RECORDER_PARTS for x in parts):
        raise SystemExit(f"bench_cpu_neighbours: unknown part in {parts} (of {', '.join(RECORDER_PARTS)})")
    allowed = sorted(os.sched_getaffinity(0))
    load_core = allowed[-1] if args.load_core is None else args.load_core
    if args.core not in allowed or load_core not in allowed or load_core == args.core:
        raise SystemExit(f"bench_cpu_neighbours: --core {args.core} and --load-core {load_core} must be two "
                         f"different CPUs of {allowed}")
    kinds = [k for k in args.kinds.split(",") if k]
    if any(k not in KINDS for k in kinds):
        raise SystemExit(f"bench_cpu_neighbours: unknown kind in {kinds} (of {', '.join(KINDS)})")
    with tempfile.TemporaryDirectory(prefix="kvtrace-neighbours-", dir=args.dir) as folder:
        for kind in kinds:
            ratios, share = measure(args.core, kind, load_core, args.seconds, args.block_ms, args.chunk, folder,
                                    args.records, parts, args.release_every)
            if not ratios:
                print(f"{kind}: no complete pair of blocks (raise --seconds)")
                continue
            mean, lo, hi = paired_ci(ratios)
            print(f"{kind}: chunk time on CPU {args.core} with CPU {load_core} loaded / idle: {mean:.4f} "
                  f"[{lo:.4f}, {hi:.4f}] over {len(ratios)} pairs of {args.block_ms:.0f} ms blocks"
                  + (f", the GIL let go every {args.release_every} turns" if args.release_every else "")
                  + (f"; the recorder thread ({','.join(parts)}): its CPU {100 * share:.2f}% of the on blocks"
                     if share is not None else ""),
                  flush=True)


if __name__ == "__main__":
    main()
