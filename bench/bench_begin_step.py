"""Host cost of the CUDA ring's per-step `begin_step` and of the ways its one-thread kernel can be launched.

    python bench/bench_begin_step.py            # on a machine with CUDA and CuPy

`begin_step` runs on the engine's thread before every step: it sets the step id and the sampling flag in
device memory with a one-thread kernel, stream-ordered so that a replayed CUDA graph reads its own step's
id. Variants, each timed over batches of launches (the stream synchronized between batches, outside the
timing, so the launch queue never fills), alternating over rounds in one process: wall and thread CPU per
call, medians over rounds.

- `begin_step + its launch`: the ring's own (auto drain off: the drain is measured by bench_kv_drain.py),
  then its deferred state launch (made in a step just before the ring's first kernel or graph replay);
- `begin_step (launch deferred)`: begin_step alone;
- `native state launch`: `_drain.c`'s `state_launch` alone (what begin_step calls where it is built: the
  argument struct's fields written and the launch, in one call that keeps the GIL);
- `native launch`: `_drain.c`'s `launch` alone (the record kernels' launch where it is built);
- `cupy launch`: CuPy's `driver.launchKernel` alone (what begin_step calls otherwise; it lets the GIL go);
- `ctypes launch (GIL let go)` and `ctypes launch (GIL kept)`: cuLaunchKernel through ctypes' CDLL and PyDLL;
- `host part`: begin_step's Python without the launch (`_set_step`, the capture check, the argument struct).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from kvtrace.probes.kv_access import make_ring


def timed(fn, calls: int, batch: int) -> tuple[float, float]:
    """(wall us, thread CPU us) per call of fn(i), over `calls` calls in batches of `batch`."""
    wall = cpu = 0.0
    for lo in range(0, calls, batch):
        torch.cuda.synchronize()
        w0, c0 = time.perf_counter(), time.thread_time()
        for i in range(lo, lo + batch):
            fn(i)
        wall += time.perf_counter() - w0
        cpu += time.thread_time() - c0
    torch.cuda.synchronize()
    return 1e6 * wall / calls, 1e6 * cpu / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=100, help="launches between synchronizations")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    ring = make_ring("cuda", auto_drain=False, granularity="blocks")
    stream = ring._current_stream
    fn, params = ring._f_state, ring._state_launch.params_addr
    cupy_launch = ring._cupy_launch
    native_launch = ring._native.launch if ring.native_launch else None
    argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    released = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    kept = ctypes.PyDLL("libcuda.so.1").cuLaunchKernel
    for f in (released, kept):
        f.argtypes, f.restype = argtypes, ctypes.c_int
    a = ring._state_args

    def host_part(i: int) -> None:
        ring._set_step(i, True)
        ring._capturing()
        a.step, a.active, a.set = ring.step, int(ring.active), 1

    variants = {
        "begin_step + its launch": lambda i: ring.begin_step(i) or ring._launch_due(),
        "begin_step (launch deferred)": lambda i: ring.begin_step(i),
        "cupy launch": lambda i: cupy_launch(fn, 1, 1, 1, 32, 1, 1, 0, stream(), params, 0),
        "ctypes launch (GIL let go)": lambda i: released(fn, 1, 1, 1, 32, 1, 1, 0, stream(), params, None),
        "ctypes launch (GIL kept)": lambda i: kept(fn, 1, 1, 1, 32, 1, 1, 0, stream(), params, None),
        "host part": host_part,
    }
    if native_launch is not None:
        variants["native launch"] = lambda i: native_launch(fn, 1, 1, 1, 32, 1, 1, 0, stream(), params, 0)
    state_launch = getattr(ring._native, "state_launch", None) if native_launch is not None else None
    if state_launch is not None:  # what begin_step calls where _drain.c is built: the struct and the launch
        addr = ring._state_args_addr
        variants["native state launch"] = lambda i: state_launch(fn, stream(), params, addr, i, True)
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for f in variants.values():  # warm-up
        timed(f, args.batch, args.batch)
    for rnd in range(args.rounds):
        order = list(variants) if rnd % 2 == 0 else list(reversed(variants))
        for name in order:
            results[name].append(timed(variants[name], args.calls, args.batch))
    print(f"device: {torch.cuda.get_device_name()}; {args.calls} calls x {args.rounds} rounds, "
          f"synchronized every {args.batch}")
    print(f"{'variant':<28} {'wall us/call':>13} {'CPU us/call':>12}")
    for name, rs in results.items():
        print(f"{name:<28} {statistics.median(r[0] for r in rs):13.2f} {statistics.median(r[1] for r in rs):12.2f}")
    ring.close()


if __name__ == "__main__":
    main()
