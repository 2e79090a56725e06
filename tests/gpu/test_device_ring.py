"""The device KV access ring (CuPy kernels) against the CPU ring, record for record, on vLLM-shaped
attention metadata: eager, under CUDA graph capture and replay, with wraps, sampling and clock anchors.

Needs CUDA and CuPy; skipped otherwise. Run on a GPU machine: `python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

import gc
import random
import time
from collections import Counter

import pytest

try:
    import torch
except Exception as exc:  # pragma: no cover
    pytest.skip(f"torch is not importable: {exc}", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip("no CUDA device (the device ring tests need a GPU)", allow_module_level=True)
try:
    import cupy  # noqa: F401
except Exception as exc:
    pytest.skip(f"CuPy is not importable ({exc}); install cupy-cuda12x/13x for the device ring",
                allow_module_level=True)

from kvtrace.probes.kv_access import make_ring
from kvtrace.probes.kv_access.ring import CPUKVAccessRing  # noqa: E402
from kvtrace.record.recorder import MemoryRecorder
from tests.helpers.ring_metadata import (  # noqa: E402
    chaotic_metadata,
    expected_rows,
    make_metadata,
    strip_ts,
)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(autouse=True, params=["loop", "native", "python"])
def drain_path(request, monkeypatch):
    """Every test through the three drains: the loop in C that never takes the GIL (_drain.c's Drainer,
    used where it builds), one native call a drain from the ring's Python thread (waits, copies and lap
    check without the GIL, the records handed over in Python), and the Python one (torch copies, NumPy)."""
    from kvtrace.probes.kv_access import cuda_ring
    from kvtrace.probes.kv_access import ring as ring_module

    if request.param in ("loop", "native") and ring_module.native_drain is None:
        pytest.skip("the native drain (_drain.c) is not built here")
    if request.param == "loop" and not hasattr(ring_module.native_drain, "Drainer"):
        pytest.skip("this _drain.c build has no drain loop")
    if request.param == "native":
        monkeypatch.setattr(cuda_ring, "DRAIN_LOOP", False)
    if request.param == "python":
        monkeypatch.setattr(ring_module, "native_drain", None)
    return request.param


def rings(**kw):
    """A GPU ring and a CPU ring with the same settings, each with its own MemoryRecorder."""
    rg, rc = MemoryRecorder(), MemoryRecorder()
    return make_ring(DEV, recorder=rg, **kw), rg, CPUKVAccessRing(recorder=rc, **kw), rc


def on_dev(meta):
    return tuple(t.to(DEV) for t in meta)


def kv(rec):
    return sorted(strip_ts(rec.buffers.get("kv_access", [])))


def timings(rec):
    return sorted((r[0], r[1], r[3], r[4]) for r in rec.buffers.get("layer_timings", []))


@pytest.mark.parametrize("seed", range(6))
def test_eager_records_equal_cpu_ring(seed):
    rng = random.Random(seed)
    bs = [16, 1, 32, 16, 4, 16][seed]
    slot_dtype = torch.int32 if seed == 3 else torch.int64
    g, rg, c, rc = rings(capacity=1 << 16, block_size=bs, granularity="blocks", layers="all")
    expected = []
    for step in range(3):
        meta = make_metadata(rng, num_reqs=rng.randrange(1, 40), block_size=bs, slot_dtype=slot_dtype)
        dmeta = on_dev(meta)
        g.begin_step(step)
        c.begin_step(step)
        for layer in range(4):
            g.record_layer(layer, *dmeta)
            c.record_layer(layer, *meta)
            expected += expected_rows(step, layer, meta, bs)
    g.close()
    c.close()
    assert kv(rg) == kv(rc) == sorted(expected)
    assert timings(rg) == timings(rc)
    assert rg.dropped == {} and g.stats["kv_dropped"] == 0


def test_arbitrary_slots_equal_reference():
    rng = random.Random(77)
    g, rg, c, rc = rings(capacity=1 << 16, block_size=4, granularity="blocks")
    for step in range(300):
        meta = chaotic_metadata(rng)
        g.begin_step(step)
        c.begin_step(step)
        g.record_layer(1, *on_dev(meta))
        c.record_layer(1, *meta)
    g.close()
    c.close()
    assert kv(rg) == kv(rc)
    assert timings(rg) == timings(rc)


def test_large_batches_use_the_grid_stride_loops():
    """More requests and tokens than one launch has CUDA blocks for (1024 per part)."""
    rng = random.Random(5)
    meta = make_metadata(rng, num_reqs=9000, max_blocks=4, pad_tokens=200_000, pad_reqs=50)
    g, rg, c, rc = rings(capacity=1 << 18, granularity="blocks", timing_capacity=16)
    g.begin_step(0)
    c.begin_step(0)
    g.record_layer(0, *on_dev(meta))
    c.record_layer(0, *meta)
    g.close()
    c.close()
    assert kv(rg) == kv(rc)
    assert timings(rg) == timings(rc)


def test_decode_shape_and_timing_granularity():
    """Llama-like decode batch; default granularity: block records for the first layer of each KV group."""
    rng = random.Random(6)
    a = make_metadata(rng, num_reqs=256, max_blocks=192, pad_tokens=0, pad_reqs=0)
    b = make_metadata(rng, num_reqs=31, max_blocks=16)  # a second KV group
    da, db = on_dev(a), on_dev(b)
    g, rg, c, rc = rings(capacity=1 << 18)
    for step in range(3):
        g.begin_step(step)
        c.begin_step(step)
        for layer in range(8):
            g.record_layer(layer, *(db if layer % 4 == 3 else da))
            c.record_layer(layer, *(b if layer % 4 == 3 else a))
    g.close()
    c.close()
    assert kv(rg) == kv(rc)
    assert {(r[0], r[1]) for r in kv(rg)} == {(s, lay) for s in range(3) for lay in (0, 3)}
    assert timings(rg) == timings(rc) and len(timings(rg)) == 24


def _pad_to(meta, num_tokens):
    sm = torch.full((num_tokens,), -1, dtype=meta[0].dtype)
    sm[: meta[0].shape[0]] = meta[0]
    return (sm, *meta[1:])


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graph_capture_and_replay_exact_per_step(overlap):
    """Captured once; each replay reads new metadata from the same buffers and the step id from device
    memory: every replay's records carry its own step. overlap: record kernels on a forked side stream."""
    rng = random.Random(9)
    T = 1200
    static = on_dev(_pad_to(make_metadata(rng, num_reqs=20, pad_tokens=0), T))
    g, rg, c, rc = rings(capacity=1 << 16, granularity="blocks", layers="0,2", sample_every=1, overlap=overlap)
    g.begin_step(0, record=False)  # starts the drain thread: it must not disturb the capture
    c.begin_step(0, record=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(4):
            g.record_layer(layer, *static)
            if overlap:  # some main-stream work between the layers, as attention would be
                static[2].add_(0)
    assert not g._fork_pending  # joined at capture end
    for step in range(1, 7):
        meta = _pad_to(make_metadata(rng, num_reqs=20, pad_tokens=0), T)
        for dst, src in zip(static, meta, strict=True):
            dst.copy_(src)
        record = step != 4  # a step the caller switches off: the replay must record nothing
        g.begin_step(step, record=record)
        c.begin_step(step, record=record)
        graph.replay()
        for layer in range(4):
            c.record_layer(layer, *meta)
    g.close()
    c.close()
    assert kv(rg) == kv(rc)
    assert {r[0] for r in kv(rg)} == {1, 2, 3, 5, 6}
    assert {r[1] for r in kv(rg)} == {0, 2}
    assert timings(rg) == timings(rc) and len(timings(rg)) == 5 * 4


def test_begin_step_during_a_capture_is_refused_and_said():
    """begin_step while the current stream captures (through torch.cuda.CUDAGraph, whose captures the ring
    counts instead of asking CUDA every step) launches nothing into the graph, and says so once."""
    from kvtrace.probes.kv_access import cuda_ring

    g, rg, _, _ = rings(capacity=1 << 12, granularity="blocks")
    static = on_dev(make_metadata(random.Random(3), num_reqs=4))
    g.begin_step(0)
    assert cuda_ring._CAPTURES[0] == 0 and g._capture_hooked
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert cuda_ring._CAPTURES[0] == 1
        g.begin_step(99)
        g.record_layer(0, *static)
    assert cuda_ring._CAPTURES[0] == 0
    g.begin_step(1)
    graph.replay()
    g.close()
    assert {r[0] for r in kv(rg)} == {1}  # the replay carries the step set before it, not 99
    assert sum("during CUDA graph capture" in w for w in rg.warnings) == 1


def test_a_replay_past_the_hook_is_said_and_the_step_id_is_set_at_begin_step_after():
    """begin_step's state launch waits for the ring's next kernel or graph replay (torch.cuda.CUDAGraph.replay,
    wrapped). A graph replayed past the wrapper runs with the step before's id: the forward pass ends with the
    launch still due, which the ring says (its probe degraded) before launching at begin_step from then on."""
    g, rg, _, _ = rings(capacity=1 << 12, granularity="blocks")
    static = on_dev(make_metadata(random.Random(4), num_reqs=4))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.record_layer(0, *static)
    unhooked = torch.cuda.CUDAGraph.replay.__wrapped__
    g.begin_step(1)
    graph.replay()  # through the wrapper: the state launch goes first
    assert not g._state_due and g.defer_state
    g.begin_step(2)
    unhooked(graph)  # past it: the kernel reads step 1's id
    assert g._state_due
    g.state_missed()
    assert g.state_missed_steps == 1 and not g.defer_state and rg.status["attention"][0] == "degraded"
    g.begin_step(3)  # launched here now
    assert not g._state_due
    unhooked(graph)
    g.close()
    steps = [r[0] for r in kv(rg)]
    assert set(steps) == {1, 3} and steps.count(1) == 2 * steps.count(3) > 0
    # the graph's take node found no ticket in the two replays past the hook: counted, and said
    assert (g.stats["step_tickets"], g.stats["step_tickets_lost"]) == (1, 2)
    assert "without a step ticket" in rg.status["attention"][1]


def test_graph_replays_take_their_step_from_tickets_while_the_host_runs_ahead():
    """A graph captured with the ring's kernels sets its step itself, from the ticket that the replay hook
    writes into pinned host memory before each replay: no state launch a step, and every replay records
    under its own step and sampling flag while the host queues replays far ahead of the GPU (behind a
    0.1 s kernel, no sync between them), as under vLLM's async scheduling."""
    rng = random.Random(12)
    meta = make_metadata(rng, num_reqs=8)
    static = on_dev(meta)
    g, rg, c, rc = rings(capacity=1 << 16, granularity="blocks")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.record_layer(0, *static)
        g.record_layer(1, *static)
    launches = []
    real = g._launch_state
    g._launch_state = lambda: (launches.append(g.step), real())
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: every replay below queues behind it
    for step in range(1, 41):
        record = step % 5 != 0
        g.begin_step(step, record=record)
        c.begin_step(step, record=record)
        graph.replay()
        c.record_layer(0, *meta)
        c.record_layer(1, *meta)
    assert launches == []  # the replays set their steps: no kv_set_state launch for any step
    g.close()
    c.close()
    assert kv(rg) == kv(rc) and {r[0] for r in kv(rg)} == {s for s in range(1, 41) if s % 5}
    assert timings(rg) == timings(rc)
    assert (g.stats["step_tickets"], g.stats["step_tickets_lost"]) == (40, 0)


def test_tickets_overwritten_before_the_gpu_took_them_are_counted(monkeypatch):
    """The host writes TICKETS tickets ahead at most: a replay whose ticket was overwritten by one
    TICKETS replays later (the GPU that far behind) keeps the step before's id, and is counted."""
    from kvtrace.probes.kv_access import cuda_ring

    monkeypatch.setattr(cuda_ring, "TICKETS", 16)
    static = on_dev(make_metadata(random.Random(13), num_reqs=4))
    g, rg, _, _ = rings(capacity=1 << 16, granularity="blocks")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.record_layer(0, *static)
    torch.cuda._sleep(200_000_000)  # the 40 replays' tickets are all written before the first is taken
    for step in range(1, 41):
        g.begin_step(step)
        graph.replay()
    g.close()
    assert (g.stats["step_tickets"], g.stats["step_tickets_lost"]) == (40, 24)
    assert rg.status["attention"][0] == "degraded"
    assert {r[0] for r in kv(rg)} == set(range(25, 41))  # the last 16 replays' own steps (earlier: no step set)


@pytest.mark.parametrize("launch", ["native", "cupy"])
def test_the_background_thread_drains_by_itself(launch):
    """auto_drain: rows reach the recorder while the ring runs, with no drain() or flush() call, from
    drains the background thread times (every 100 ms, sooner when the ring may fill: a 4,096-record ring
    filled at ~100 records a step is drained before it wraps). Both launch paths give the same records."""
    rng = random.Random(21)
    g, rg, c, rc = rings(capacity=1 << 12, granularity="blocks", timing_capacity=1 << 10)
    g.native_launch = launch == "native"
    if launch == "native" and not g.native_launch:
        pytest.skip("the native launch is _drain.c's: with the Python drain (this case) or where it is not built, "
                    "CuPy's launch only")
    assert g.native_launch == (launch == "native")
    for step in range(200):
        meta = make_metadata(rng, num_reqs=rng.randrange(1, 6))
        g.begin_step(step)
        c.begin_step(step)
        g.record_layer(0, *on_dev(meta))
        c.record_layer(0, *meta)
        time.sleep(0.002)
    torch.cuda.synchronize()
    deadline = time.monotonic() + 5
    while g.stats.get("drains", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert g.stats.get("drains", 0) >= 3 and rg.buffers.get("kv_access")  # drained before any flush
    g.close()
    c.close()
    assert kv(rg) == kv(rc) and rg.dropped == {}
    assert timings(rg) == timings(rc)


def test_sampling_inside_a_graph():
    rng = random.Random(10)
    static = on_dev(make_metadata(rng, num_reqs=8))
    g, rg, _, _ = rings(capacity=1 << 14, granularity="blocks", sample_every=3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.record_layer(0, *static)
    for step in range(10):
        g.begin_step(step)
        graph.replay()
    g.close()
    assert {r[0] for r in kv(rg)} == {0, 3, 6, 9}
    assert [r[0] for r in sorted(rg.buffers["layer_timings"])] == [0, 3, 6, 9]


def test_wrap_drops_are_exact():
    """Sequential launches between drains: exactly head - tail - capacity records are lost."""
    rng = random.Random(11)
    cap = 64
    g, rg, _, _ = rings(capacity=cap, timing_capacity=4, granularity="blocks", auto_drain=False)
    g.begin_step(0)
    expected = []
    for layer in range(30):
        meta = make_metadata(rng, num_reqs=rng.randrange(1, 3), max_blocks=3)
        g.record_layer(layer, *on_dev(meta))
        expected += expected_rows(0, layer, meta, 16)
    assert len(expected) > cap
    g.flush()
    rows = strip_ts(rg.buffers["kv_access"])
    assert len(rows) == cap
    assert rg.dropped["kv_access"] == {"ring-wrap": len(expected) - cap}
    assert not Counter(rows) - Counter(expected)  # every surviving record is a real one
    assert len(rg.buffers["layer_timings"]) == 4
    assert rg.dropped["layer_timings"] == {"ring-wrap": 30 - 4}
    # the ring goes on exactly after a wrap
    g.begin_step(1)
    meta = make_metadata(rng, num_reqs=1, max_blocks=2)
    g.record_layer(0, *on_dev(meta))
    g.close()
    assert sorted(strip_ts(rg.buffers["kv_access"])[cap:]) == sorted(expected_rows(1, 0, meta, 16))
    assert rg.dropped["kv_access"] == {"ring-wrap": len(expected) - cap}


def test_one_launch_larger_than_the_ring_loses_nothing_silently():
    meta = make_metadata(random.Random(12), num_reqs=30)
    expected = expected_rows(0, 0, meta, 16)
    g, rg, _, _ = rings(capacity=32, granularity="blocks")
    g.begin_step(0)
    g.record_layer(0, *on_dev(meta))
    g.close()
    rows = strip_ts(rg.buffers.get("kv_access", []))
    dropped = rg.dropped["kv_access"]["ring-wrap"]
    assert len(rows) + dropped == len(expected)
    assert len(rows) <= 32 and dropped >= len(expected) - 32
    assert not Counter(rows) - Counter(expected)


def test_a_ring_made_in_inference_mode_drains():
    """vLLM runs the eager forward pass under torch.inference_mode(), where the ring is made on the first
    step: its tensors must still take the drain thread's in-place updates (outside inference mode)."""
    meta = make_metadata(random.Random(13), num_reqs=4)
    rec = MemoryRecorder()
    with torch.inference_mode():
        g = make_ring(DEV, recorder=rec, granularity="blocks")
        g.begin_step(0)
        g.record_layer(0, *on_dev(meta))
    g.close()
    assert sorted(strip_ts(rec.buffers["kv_access"])) == sorted(expected_rows(0, 0, meta, 16))
    assert rec.dropped == {} and not rec.warnings


def test_the_drain_waits_for_the_gpu_asleep_and_without_the_gil(drain_path):
    """The drain thread waits for the GPU (a snapshot, a copy) on its blocking-sync events: asleep (its
    own CPU clock hardly moves while the GPU is busy for 300 ms), without the GIL (a Python loop on this
    thread runs meanwhile as much of the time as with no wait going on), and without coming back for it to poll
    (a handful of calls in the wait, where polling every millisecond made hundreds). Native: the whole
    drain of a snapshot taken behind the busy GPU is that one wait."""
    import sys
    import threading

    from kvtrace.probes.kv_access.cuda_ring import CudaKVAccessRing

    g = make_ring(DEV, recorder=MemoryRecorder())
    waiter_cpu, calls = [], []

    def spin(seconds):
        """The share of `seconds` this thread ran (on its CPU clock): waiting for the GIL is off it. A
        count of loop turns would read the machine's speed too, which varies by a third on a lent VM."""
        c0, t0 = time.thread_time(), time.perf_counter()
        while time.perf_counter() < t0 + seconds:
            pass
        return (time.thread_time() - c0) / (time.perf_counter() - t0)

    def wait():
        sys.setprofile(lambda frame, event, arg: calls.append(event) if event in ("call", "c_call") else None)
        t0 = time.thread_time()
        if drain_path in ("loop", "native"):  # the loop's drain is this call's work, in C
            g._drain_native(slot)
        else:
            CudaKVAccessRing._wait(g._copy_event)
        waiter_cpu.append(time.thread_time() - t0)
        sys.setprofile(None)

    alone = spin(0.2)
    torch.cuda._sleep(int(1.98e9 * 0.3 * 2))  # ~0.3 s or more of GPU time (cycles at up to ~2 GHz)
    g._copy_event.record()
    slot = g._snapshot()  # behind the sleep on the inference stream
    t = threading.Thread(target=wait)
    t.start()
    beside = spin(0.2)
    t.join()
    assert g._copy_event.query() and g._done_events[slot].query()  # returned once the GPU got there
    assert waiter_cpu[0] < 0.05, waiter_cpu  # slept (a spinning wait burns its whole length)
    assert len(calls) < 10, len(calls)
    assert beside > 0.9 * alone, (alone, beside)  # the GIL was free for this thread meanwhile
    g.close()


def test_a_drain_that_fails_counts_what_it_loses(drain_path):
    """A drain that raises never takes the process down, and the records it could not hand over are
    counted as dropped (cause drain-error): rows + drops = records made."""
    rng = random.Random(14)
    g, rg, _, _ = rings(granularity="blocks", auto_drain=False)
    g.begin_step(0)
    expected = []
    for layer in range(3):
        meta = make_metadata(rng, num_reqs=3)
        g.record_layer(layer, *on_dev(meta))
        expected += expected_rows(0, layer, meta, 16)
    # fails once the heads are known: after the copy (Python), the native call, or in the loop the copy
    # of the ring itself (the driver's copy, wrapped before the loop starts at the flush)
    assert (g._cu_fns is not None) == (drain_path != "python")
    if drain_path == "loop":
        import ctypes

        proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
        real_copy, failing = proto(g._cu_fns[2]), [True]
        rings_at = [(t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in (g._ring, g._tring)]

        def copy(dst, src, n, stream):
            if failing[0] and any(lo <= src < hi for lo, hi in rings_at):
                return 700  # CUDA_ERROR_ILLEGAL_ADDRESS
            return real_copy(dst, src, n, stream)

        g._copy_fn = proto(copy)  # kept alive as long as the ring
        g._cu_fns = (g._cu_fns[0], g._cu_fns[1], ctypes.cast(g._copy_fn, ctypes.c_void_p).value, g._cu_fns[3])
        g.flush()
        failing[0] = False
    else:
        name = "_emit_native" if drain_path == "native" else "_drain_to"
        real = getattr(g, name)
        setattr(g, name, lambda *a: (_ for _ in ()).throw(RuntimeError("injected drain failure")))
        g.flush()
        setattr(g, name, real)
    assert rg.dropped["kv_access"] == {"drain-error": len(expected)}
    assert rg.dropped["layer_timings"] == {"drain-error": 3}
    assert any("drain failed" in w for w in rg.warnings)
    g.begin_step(1)  # the ring goes on after the failure
    meta = make_metadata(rng, num_reqs=2)
    g.record_layer(0, *on_dev(meta))
    g.close()
    assert sorted(strip_ts(rg.buffers["kv_access"])) == sorted(expected_rows(1, 0, meta, 16))


def test_clock_anchors_and_timestamps():
    meta = on_dev(make_metadata(random.Random(13)))
    g, rg, _, _ = rings(capacity=1 << 14, granularity="blocks")
    torch.cuda.synchronize()
    t0 = time.monotonic_ns()
    g.begin_step(0)
    g.record_layer(0, *meta)
    torch.cuda.synchronize()
    t1 = time.monotonic_ns()
    g.close()
    anchors = rg.buffers["clock_anchors"]
    assert len(anchors) >= 2 and all(a[3] == f"cuda:{DEV.index}" and a[2] > 0 for a in anchors)
    slack = 2_000_000  # 2 ms: anchor error is a round trip (~tens of us)
    for row in rg.buffers["kv_access"] + rg.buffers["layer_timings"]:
        assert t0 - slack <= row[2] <= t1 + slack


def test_hot_path_never_syncs_or_allocates():
    meta = on_dev(make_metadata(random.Random(14)))
    g, rg, _, _ = rings(capacity=1 << 14, granularity="blocks")
    g.begin_step(0)
    g.record_layer(0, *meta)  # first call per layer builds its launch
    g.flush()
    gc.collect()  # rings of earlier tests, freed now rather than during the loop below
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 20):
            g.begin_step(step)
            for layer in range(3):
                g.record_layer(layer, *meta)
            g.drain()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.cuda.memory_allocated() == before
    g.close()
    assert len({r[0] for r in rg.buffers["kv_access"]}) == 20


def test_eager_call_is_cheap():
    """A loose bound here (shared CI-like load); bench/bench_device_ring.py reports the real figure."""
    meta = on_dev(make_metadata(random.Random(15), num_reqs=64))
    g, _, _, _ = rings(capacity=1 << 16, granularity="timing", layers="none")
    g.begin_step(0)
    for i in range(100):
        g.record_layer(i % 32, *meta)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 2000
    for i in range(n):
        g.record_layer(i % 32, *meta)
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    g.close()
    assert per_call_us < 50, per_call_us


def test_rejects_wrong_metadata_clearly():
    g, _, _, _ = rings(capacity=1 << 10)
    sm, bt, sl, qsl = on_dev(make_metadata(random.Random(16)))
    g.begin_step(0)
    with pytest.raises(TypeError, match="block_table"):
        g.record_layer(0, sm, bt.long(), sl, qsl)
    with pytest.raises(ValueError, match="on cpu"):
        g.record_layer(0, sm.cpu(), bt, sl, qsl)
    g.close()
