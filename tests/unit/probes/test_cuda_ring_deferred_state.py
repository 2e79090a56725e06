"""The device ring's per-step state launch (`kv_set_state`: step id, sampling flag, head snapshot) is made
just before the ring's next kernel in stream order rather than in begin_step: before its next record_layer,
before the next CUDA graph replay (the graph may hold its kernels: torch.cuda.CUDAGraph.replay is wrapped),
or before an explicit drain. A forward pass that ends with the launch still due ran its kernels past the
hook: the probe says so and the launch is made in begin_step from then on. A graph captured with the
ring's kernels holds a take node instead (`kv_take_state`), and its replays publish a step ticket in host
memory rather than launching. No GPU needed: the ring's host side, a recording function for the driver's
launch and a stand-in for torch.cuda.CUDAGraph."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtrace.probes.kv_access import cuda_ring
from kvtrace.probes.kv_access.cuda_ring import CudaKVAccessRing
from kvtrace.record.recorder import MemoryRecorder

STATE, RECORD, TAKE = 4321, 1234, 5678  # stand-ins for the kv_set_state, kv_record, kv_take_state CUfunctions


class FakeGraph:
    def __init__(self, log):
        self.log = log

    def replay(self):
        self.log.append("replay")
        if getattr(self, "fail", None):
            raise self.fail.pop()


@pytest.fixture()
def graphs(monkeypatch):
    """torch.cuda.CUDAGraph replaced by a stand-in whose replay the ring's hook wraps; no capture open."""
    cls = type("CUDAGraph", (FakeGraph,), {})
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cls)
    monkeypatch.setattr(cuda_ring, "_CAPTURES", [0, 0])
    monkeypatch.setattr(cuda_ring, "_STATE_DUE", [])
    monkeypatch.setattr(cuda_ring, "_CAPTURE_GRAPH", [None])
    assert cuda_ring._install_replay_hook() and cuda_ring._install_replay_hook()  # once, then a no-op
    return cls


def host_ring(log: list, fail: list | None = None) -> CudaKVAccessRing:
    """The ring's host side (CPU tensors for the device's); its launches go to `log`: ("state", step,
    active) for kv_set_state, ("layer", layer) for a record launch. `fail`: raise on the next state launch."""
    ring = object.__new__(CudaKVAccessRing)
    ring._torch, ring.device, ring.block_size = torch, torch.device("cpu"), 16
    ring.recorder = MemoryRecorder()
    ring.source, ring.sample_every, ring.auto_drain, ring._thread = "cuda:0", 1, False, None
    ring.step, ring.active, ring._seen_tables, ring._last_layer = -1, False, {}, -1
    ring._state = torch.zeros(8, dtype=torch.int64)
    ring._ring, ring._tring = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    ring.capacity, ring.log2cap, ring.timing_capacity, ring.log2tcap = 1 << 20, 20, 1 << 14, 14
    ring._emit_launch = cuda_ring._Launch(cuda_ring._RecordArgs(), 1, 0, RECORD)
    ring._count_launch = cuda_ring._Launch(cuda_ring._RecordArgs(), 1, 0, RECORD)
    ring._time_launch = cuda_ring._Launch(cuda_ring._RecordArgs(), 1, 0, RECORD, threads=1)
    ring._state_args = cuda_ring._StateArgs(state=ring._state.data_ptr())
    ring._state_launch = cuda_ring._Launch(ring._state_args, 1)
    ring._f_state, ring._state_launch_native = STATE, None
    ring._f_take, ring._take_capture, ring._ticket = TAKE, -1, 0
    ring._tickets_np = torch.zeros(cuda_ring.TICKETS * cuda_ring.TICKET_WORDS + 1, dtype=torch.int64).numpy()
    ring._take_launch = cuda_ring._Launch(cuda_ring._StateArgs(), 1)
    ring._checked_key = ring._pass_tensors = ring._counted = None
    ring.count_once, ring._capture_hooked, ring._replay_hooked = True, True, cuda_ring._install_replay_hook()
    ring.overlap, ring._side_ptr, ring._warned_capture = False, -1, False
    ring._current_stream = lambda: 7
    ring._wants_blocks = lambda layer, block_table: False

    def launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params_addr, extra):
        struct = ctypes.cast(params_addr, ctypes.POINTER(ctypes.c_void_p))[0]
        if fn == TAKE:
            log.append(("take",))
        elif fn == STATE:
            if fail:
                raise fail.pop()
            args = ctypes.cast(struct, ctypes.POINTER(cuda_ring._StateArgs)).contents
            log.append(("state", args.step, args.active))
        else:
            log.append(("layer", ctypes.cast(struct, ctypes.POINTER(cuda_ring._RecordArgs)).contents.layer))
    ring._launch_kernel = launch
    return ring


def metadata():
    return (torch.arange(8, dtype=torch.int64), torch.zeros((4, 4), dtype=torch.int32),
            torch.full((2,), 8, dtype=torch.int32), torch.arange(3, dtype=torch.int32))


def test_begin_step_launches_nothing_and_the_next_layer_launches_the_state_first(graphs):
    log = []
    ring = host_ring(log)
    ring.begin_step(5)
    assert log == [] and cuda_ring._STATE_DUE == [ring]
    meta = metadata()
    for layer in range(3):
        ring.record_layer(layer, *meta)
    assert log == [("state", 5, 1), ("layer", 0), ("layer", 1), ("layer", 2)]
    assert cuda_ring._STATE_DUE == [] and not ring._state_due


def test_a_graph_replay_launches_the_due_state_first_and_only_once(graphs):
    log = []
    ring = host_ring(log)
    ring.begin_step(5)
    ring.record_layer(0, *metadata())  # e.g. captured: the ring has kernels in graphs from now on
    log.clear()
    ring.begin_step(6)
    ring.begin_step(7, record=False)  # steps without a kernel in between: one launch, the last step's
    assert cuda_ring._STATE_DUE == [ring]
    g = graphs(log)
    g.replay()
    g.replay()
    assert log == [("state", 7, 0), "replay", "replay"]


def test_a_pass_that_leaves_the_launch_due_is_said_and_later_steps_launch_at_once(graphs):
    log = []
    ring = host_ring(log)
    ring.begin_step(1)
    ring.state_missed()  # no kernel of the ring yet (nothing read): launched, nothing said
    assert log == [("state", 1, 1)] and ring.defer_state and ring.recorder.status == {}
    ring.record_layer(0, *metadata())  # active: step 1 records
    log.clear()
    ring.begin_step(2)
    ring.state_missed()  # kernels exist, and the pass ran past the hook (e.g. a graph replayed elsewhere)
    assert log == [("state", 2, 1)] and ring.state_missed_steps == 1 and not ring.defer_state
    status, detail = ring.recorder.status["attention"]
    assert status == "degraded" and "step 2" in detail
    ring.begin_step(3)
    assert log[-1] == ("state", 3, 1) and not ring._state_due


def test_an_explicit_drain_launches_the_due_state_before_its_snapshot(graphs, monkeypatch):
    log = []
    ring = host_ring(log)
    ring.closed = False
    monkeypatch.setattr(ring, "_capturing", lambda: False, raising=False)
    monkeypatch.setattr(ring, "_start_thread", lambda: None, raising=False)
    monkeypatch.setattr(ring, "_snapshot", lambda: log.append("snapshot") or 0, raising=False)
    monkeypatch.setattr(ring, "_queue", type("Q", (), {"put": lambda self, item: None})(), raising=False)
    monkeypatch.setattr(ring, "_done_events", [None], raising=False)
    ring.begin_step(4)
    ring.drain()
    assert log == [("state", 4, 1), "snapshot"]


def test_no_state_launch_goes_into_a_graph_being_captured(graphs, monkeypatch):
    log = []
    ring = host_ring(log)
    ring.begin_step(8)
    cuda_ring._CAPTURES[0] = 1  # a capture opened after begin_step (vLLM never does; a caller might)
    monkeypatch.setattr(ring, "_capturing", lambda: True, raising=False)
    ring.record_layer(0, *metadata())
    assert log == [("layer", 0)] and ring._state_due  # still due, for the first launch outside the capture
    cuda_ring._CAPTURES[0] = 0
    monkeypatch.setattr(ring, "_capturing", lambda: False, raising=False)
    graphs(log).replay()
    assert log[1:] == [("state", 8, 1), "replay"]


def test_a_launch_that_fails_in_the_replay_hook_never_reaches_the_replay_and_fails_the_next_step(graphs):
    log = []
    ring = host_ring(log, fail=[RuntimeError("launch failed")])
    ring.begin_step(9)
    graphs(log).replay()  # vLLM's replay runs on
    assert log == ["replay"] and cuda_ring._STATE_DUE == []
    with pytest.raises(RuntimeError, match="launch failed"):
        ring.begin_step(10)  # the attention probe's wrapper fails the probe with it
    ring.begin_step(10)
    assert ring._state_due


def test_where_replay_cannot_be_hooked_begin_step_launches_at_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", type("CUDAGraph", (), {}))
    assert not cuda_ring._install_replay_hook()
    log = []
    ring = host_ring(log)
    assert not ring._replay_hooked
    ring.begin_step(3)
    assert log == [("state", 3, 1)]


def test_another_threads_replay_leaves_the_launch_due(graphs):
    import threading

    log = []
    ring = host_ring(log)
    ring.begin_step(11)
    other = threading.Thread(target=graphs(log).replay)
    other.start()
    other.join()
    assert log == ["replay"] and ring._state_due  # its stream is not the step's
    graphs(log).replay()
    assert log[1:] == [("state", 11, 1), "replay"]


def capture(ring, graph, monkeypatch, layers=2):
    """Capture `layers` record launches into `graph` as torch.cuda.CUDAGraph's hooked capture_begin would."""
    cuda_ring._CAPTURES[0] += 1
    cuda_ring._CAPTURES[1] += 1
    cuda_ring._CAPTURE_GRAPH[0] = graph
    monkeypatch.setattr(ring, "_capturing", lambda: True, raising=False)
    for layer in range(layers):
        ring.record_layer(layer, *metadata())
    cuda_ring._CAPTURES[0] -= 1
    cuda_ring._CAPTURE_GRAPH[0] = None
    monkeypatch.setattr(ring, "_capturing", lambda: False, raising=False)


def tickets(ring):
    """The tickets published so far, (step, active, number) each, and the count published."""
    t, words = ring._tickets_np, cuda_ring.TICKET_WORDS
    n = int(t[cuda_ring.TICKETS * words])
    return [tuple(int(v) for v in t[i * words:i * words + 3]) for i in range(n)], n


def test_a_captured_graph_holds_a_take_node_and_its_replays_publish_tickets_not_launches(graphs, monkeypatch):
    log = []
    ring = host_ring(log)
    ring.begin_step(4)
    g = graphs(log)
    capture(ring, g, monkeypatch)
    # one take node, ahead of the graph's first kernel of the ring; the step launch stays due (not captured)
    assert log == [("take",), ("layer", 0), ("layer", 1)] and getattr(g, cuda_ring.TAKES) == [ring]
    log.clear()
    ring.begin_step(5)
    g.replay()
    ring.begin_step(6, record=False)
    g.replay()
    assert log == ["replay", "replay"]  # no kv_set_state launch for either step
    assert tickets(ring) == ([(5, 1, 0), (6, 0, 1)], 2) and cuda_ring._STATE_DUE == [] and not ring._state_due


def test_each_graph_captured_gets_its_own_take_node_and_every_replay_a_ticket(graphs, monkeypatch):
    log = []
    ring = host_ring(log)
    a, b = graphs(log), graphs(log)
    capture(ring, a, monkeypatch)
    capture(ring, b, monkeypatch, layers=1)
    assert [e for e in log if e == ("take",)] == [("take",), ("take",)]
    ring.begin_step(1)
    a.replay()
    b.replay()  # e.g. a drafter's graph in the same step: its own ticket, the same step
    ring.begin_step(2)
    b.replay()
    assert tickets(ring)[0] == [(1, 1, 0), (1, 1, 1), (2, 1, 2)]


def test_a_replay_that_raises_takes_its_ticket_back(graphs, monkeypatch):
    log = []
    ring = host_ring(log)
    g = graphs(log)
    capture(ring, g, monkeypatch)
    ring.begin_step(1)
    g.fail = [RuntimeError("replay failed")]
    with pytest.raises(RuntimeError, match="replay failed"):
        g.replay()
    assert tickets(ring) == ([], 0) and ring._ticket == 0  # the next replay's ticket is number 0 again
    g.replay()
    assert tickets(ring) == ([(1, 1, 0)], 1)


def test_a_capture_not_begun_through_the_hook_gets_no_take_node(graphs, monkeypatch):
    log = []
    ring = host_ring(log)
    ring.begin_step(3)
    cuda_ring._CAPTURES[0] = cuda_ring._CAPTURES[1] = 1  # counted, but no graph object known
    monkeypatch.setattr(ring, "_capturing", lambda: True, raising=False)
    ring.record_layer(0, *metadata())
    assert log == [("layer", 0)] and ring._state_due  # the replay's deferred launch sets the step then
