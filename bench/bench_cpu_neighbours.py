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
- `write`: the same buffers written to a file under `--dir` (the page cache), as the shard writer does.

Printed per kind: the chunk's mean time with the load on over off, paired over the blocks, with a 95%
bootstrap interval over the pairs. A ratio above 1 for `spin` means the cores share their speed
(frequency, or hardware threads of one core); for `copy` or `write` alone, that they share caches or
memory.

    python bench/bench_cpu_neighbours.py --core 2 --load-core 9 --seconds 20
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_throughput import paired_ci  # noqa: E402
from cpu_speed_probe import chunk  # noqa: E402  (fixed pure-Python work)
from profile_engine_thread import block_records  # noqa: E402  (which block of a pair is on)

KINDS = ("spin", "copy", "write")
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


def measure(core: int, kind: str, load_core: int, seconds: float, block_ms: float, n: int, folder: str) -> list[float]:
    """Ratios (mean chunk time, load on / off) over the pairs of blocks."""
    on, stop = mp.Event(), mp.Event()
    path = os.path.join(folder, f"neighbour-{kind}.bin")
    proc = mp.Process(target=load, args=(load_core, kind, on, stop, path), daemon=True)
    proc.start()
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
            chunk(n)
            times.append(time.perf_counter_ns() - t0)
        blocks.append((loaded, times))
        block += 1
    stop.set()
    on.set()
    proc.join(5)
    if os.path.exists(path):
        os.unlink(path)
    ratios = []
    for i in range(0, len(blocks) - 1, 2):
        (a_on, a), (_, b) = blocks[i], blocks[i + 1]
        on_t, off_t = (a, b) if a_on else (b, a)
        ratios.append(statistics.fmean(on_t) / statistics.fmean(off_t))
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core", type=int, default=2, help="the measured thread's CPU")
    ap.add_argument("--load-core", type=int, default=None, help="the neighbour's CPU (default: the last one allowed)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--seconds", type=float, default=20.0, help="per kind")
    ap.add_argument("--block-ms", type=float, default=100.0)
    ap.add_argument("--chunk", type=int, default=2000, help="loop turns per timed chunk (cpu_speed_probe.py's; ~0.5 ms on a 2-vCPU VM)")
    ap.add_argument("--dir", default=None, help="where `write` writes its file (default: a temporary folder)")
    args = ap.parse_args()
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
            ratios = measure(args.core, kind, load_core, args.seconds, args.block_ms, args.chunk, folder)
            if not ratios:
                print(f"{kind}: no complete pair of blocks (raise --seconds)")
                continue
            mean, lo, hi = paired_ci(ratios)
            print(f"{kind}: chunk time on CPU {args.core} with CPU {load_core} loaded / idle: {mean:.4f} "
                  f"[{lo:.4f}, {hi:.4f}] over {len(ratios)} pairs of {args.block_ms:.0f} ms blocks", flush=True)


if __name__ == "__main__":
    main()
