"""How steady this machine's CPUs run identical work, and whether cores slow down together (issue 33).

A host-bound engine's throughput (the 1B shape) moves by 14% between blocks of steps 0.2 s apart and by
25% between processes, for identical work. This probe asks where such noise could come from, with no GPU
and no vLLM: one process per listed core, pinned to it, runs the same pure-Python chunk of work over and
over for `--seconds`, timing each chunk (and, where the kernel lets this process count them, the chunk's
CPU cycles and instructions). It prints

- per core: the median chunk time, and the spread of 100 ms windows' mean chunk time (coefficient of
  variation, 5th-95th percentile ratio);
- per pair of cores: the correlation of their windows' mean chunk times, and the spread of their ratio.
  A ratio much steadier than either core means they slow down together (frequency set for the whole
  package, a neighbour's load): then two runs measured at the same time on those cores (one recorded,
  one plain) cancel it, where runs taken in turns cannot;
- with counters: the spread of cycles and instructions per chunk. Steady cycles under unsteady time
  means the clock moves; unsteady cycles, that the work itself meets other tenants (caches, memory).

    python bench/cpu_speed_probe.py --cores 0,8 --seconds 20
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import multiprocessing as mp
import os
import statistics
import struct
import time

WINDOW_NS = 100_000_000
_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}.get(os.uname().machine)
_HW_CYCLES, _HW_INSTRUCTIONS = 0, 1


def perf_counter_fd(config: int) -> int | None:
    """A hardware counter of this thread (user and kernel), or None where the kernel or the VM has none."""
    if _PERF_EVENT_OPEN is None:
        return None
    attr = bytearray(128)  # struct perf_event_attr, version 7 size
    struct.pack_into("IIQ", attr, 0, 0, len(attr), config)  # type PERF_TYPE_HARDWARE, size, config
    struct.pack_into("Q", attr, 40, 1 << 6)  # flags: exclude_hv (a VM has no hypervisor counts to give)
    libc = ctypes.CDLL(None, use_errno=True)
    buf = (ctypes.c_char * len(attr)).from_buffer(attr)
    fd = libc.syscall(_PERF_EVENT_OPEN, buf, 0, -1, -1, 0)  # this thread, any CPU, no group, no flags
    return fd if fd >= 0 else None


def read_counter(fd: int | None) -> int:
    return struct.unpack("Q", os.read(fd, 8))[0] if fd is not None else 0


def chunk(n: int) -> int:
    """Fixed work: integer arithmetic, a dict and a list, as an interpreter loop does."""
    acc, d, xs = 0, {}, []
    for i in range(n):
        acc = (acc * 31 + i) & 0xFFFFFFFF
        d[i & 255] = acc
        if i & 15 == 0:
            xs.append(acc)
    return acc + len(d) + len(xs)


def worker(core: int, seconds: float, n: int, start_ns: int, out) -> None:
    os.sched_setaffinity(0, {core})
    fds = perf_counter_fd(_HW_CYCLES), perf_counter_fd(_HW_INSTRUCTIONS)
    chunk(n)  # warm
    while time.monotonic_ns() < start_ns:
        pass
    rows = []
    end = start_ns + int(seconds * 1e9)
    t = time.monotonic_ns()
    c, i = read_counter(fds[0]), read_counter(fds[1])
    while t < end:
        chunk(n)
        t2, c2, i2 = time.monotonic_ns(), read_counter(fds[0]), read_counter(fds[1])
        rows.append((t2, t2 - t, c2 - c, i2 - i))
        t, c, i = t2, c2, i2
    out.put((core, fds[0] is not None, rows))


def spread(xs: list[float]) -> str:
    xs = sorted(xs)
    cv = statistics.pstdev(xs) / statistics.fmean(xs)
    return f"cv {100 * cv:.1f}%, p95/p5 {xs[int(0.95 * (len(xs) - 1))] / xs[int(0.05 * (len(xs) - 1))]:.3f}"


def windows(rows: list[tuple], t0: int) -> dict[int, float]:
    """Mean chunk time (ns) per 100 ms window, by the chunk's end."""
    acc: dict[int, list[int]] = {}
    for t, dt, _c, _i in rows:
        acc.setdefault((t - t0) // WINDOW_NS, []).append(dt)
    return {w: statistics.fmean(v) for w, v in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", default="0,1", help="comma-separated CPU numbers, one process each")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--chunk", type=int, default=20000, help="loop iterations a chunk (~2 ms)")
    ap.add_argument("--json", help="also write the per-window figures here")
    args = ap.parse_args()
    cores = [int(c) for c in args.cores.split(",") if c.strip()]
    out: mp.Queue = mp.Queue()
    start = time.monotonic_ns() + 1_000_000_000
    procs = [mp.Process(target=worker, args=(c, args.seconds, args.chunk, start, out)) for c in cores]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        core, counted, rows = out.get()
        results[core] = (counted, rows)
    for p in procs:
        p.join()
    print(f"{os.cpu_count()} CPUs; {len(cores)} pinned processes, {args.seconds:.0f} s, chunks of {args.chunk} iterations")
    win = {}
    for core in cores:
        counted, rows = results[core]
        rows = rows[5:]  # the first chunks after the start line
        win[core] = windows(rows, start)
        line = (f"core {core}: {len(rows)} chunks, median {statistics.median(r[1] for r in rows) / 1e6:.3f} ms; "
                f"chunk time {spread([r[1] for r in rows])}; 100 ms windows {spread(list(win[core].values()))}")
        if counted:
            line += (f"; cycles a chunk {spread([r[2] for r in rows])}, instructions {spread([r[3] for r in rows])}, "
                     f"GHz median {statistics.median(r[2] / r[1] for r in rows):.2f}")
        else:
            line += "; no hardware counters here"
        print(line)
    for a_i, a in enumerate(cores):
        for b in cores[a_i + 1:]:
            common = sorted(set(win[a]) & set(win[b]))
            xa, xb = [win[a][w] for w in common], [win[b][w] for w in common]
            if len(common) < 3:
                continue
            ma, mb = statistics.fmean(xa), statistics.fmean(xb)
            cov = sum((p - ma) * (q - mb) for p, q in zip(xa, xb))
            corr = cov / math.sqrt(sum((p - ma) ** 2 for p in xa) * sum((q - mb) ** 2 for q in xb) or 1)
            print(f"cores {a} and {b}: {len(common)} windows, correlation {corr:.2f}; ratio {spread([p / q for p, q in zip(xa, xb)])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(c): win[c] for c in cores}, f)


if __name__ == "__main__":
    main()
