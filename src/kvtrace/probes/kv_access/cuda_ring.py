"""The KV access ring on a CUDA device: CuPy kernels on PyTorch's stream, CUDA-graph safe, no host sync.

The API and the record semantics are those of `probes/kv_access/ring.py` (read its docstring first); this module
only adds the device side. Importing it needs neither CuPy nor a GPU: CuPy is imported when a ring is made.

Hot path (inference thread), per call:
  - `record_layer`: one `kv_record` launch with a prebuilt ctypes argument struct (rebuilt only when the
    layer's tensors, shapes or decision change) on the raw pointer of PyTorch's current stream. No CuPy
    array, no DLPack, no allocation, no sync. While a CUDA graph is captured with overlap=True (not the
    default) the launch goes to a side stream forked from the current one and joined at the next layer, so
    the replayed kernel runs beside attention rather than between two kernels.
  - `begin_step`: one 1-thread `kv_set_state` launch (step id and sampling flag into device memory, head
    snapshot), nothing else: the drains are the background thread's. Where `_drain.c` is built, one call
    (`state_launch`) writes the launch's argument struct and launches. The launch is deferred (`defer_state`)
    until just before the ring's next kernel in stream order: its next `record_layer`, or the next replay of
    a CUDA graph (`torch.cuda.CUDAGraph.replay`, wrapped like the capture hooks), or an explicit `drain`.
    At the top of a step the driver is cold (as the step's first CUDA call the launch took 20 us under the
    1B engine on an H200, 9 us just before the first graph replay, once vLLM's own calls have warmed it).
    A step whose forward pass ends with the launch still due ran its kernels past the replay hook
    (`state_missed`): its records may carry the step before's id, which the probe's status says, and the
    launch is made at `begin_step` from then on.
  - a graph replay: no launch at all for a graph captured with this ring's kernels. Its capture put a
    1-thread `kv_take_state` ahead of them (`_capture_take`), which reads the step id and sampling flag from
    a ticket in pinned host memory: the replay hook writes the replay's ticket (`_publish`, four stores)
    before the replay, and the device takes tickets in the order of the replays, so each replay gets its own
    step also while the host runs steps ahead of the GPU (async scheduling). A replay that found no ticket
    (replayed past the hook) keeps the step before's id and is counted (`tickets_lost`, said at close).
The engine thread's launches go through `_drain.c`'s `launch`, which keeps the GIL (CuPy's
`driver.launchKernel`, used where the module is not built, lets it go, and the engine's thread then waits for
whichever thread took it); other threads' (the clock anchors, `flush`) go through CuPy's, since a launch can
wait in the driver and, the GIL kept, would stop every thread meanwhile. Whether a
CUDA graph is being captured is asked of CUDA only while torch.cuda.CUDAGraph has a capture open
(`_install_capture_hooks` counts them): under a busy engine the query cost ~12 us a call.
Background thread: drains every 100 ms, or sooner when the records per second of the last drains would fill
a quarter of either ring first (`_learn_rate`). A drain copies the state words (the snapshot of the heads
the last `kv_set_state` took) into pinned memory on a copy stream and waits for it (asleep, without the GIL),
copies the records between the last drained position and the snapshot into pinned staging, reads the live
head again to find records overwritten meanwhile, and keeps the intact block and timing records; every
`anchor_interval_s` the thread takes a clock anchor (a 1-thread kernel reading %globaltimer on a
high-priority side stream, best of 5 round trips). An explicit `drain()` (`flush`, tests) instead snapshots
at the caller's point of the inference stream (an event, then the copy on a side stream) and asks for it.
Where `_drain.c` is built the drains run in its loop (`_drain.Drainer`, `_run_loop`), which never takes the
GIL: it writes the block records as frames itself, through the recorder's frame sink (format/kv_frames.py),
keeps the timing records and its counts, and comes back to Python only for the clock anchor, when it hands
them over (`_take_native`). Each time a thread takes the GIL back the engine's thread stops for it; one
native call a drain that came back to Python for the records (`_drain_native`, `{"kv_drain_loop": false}`)
took it three times a drain with Python work between, the Python path (`_drain_to`) a dozen.

The kernels are in `cuda_ring_kernels.cu` next to this file (package data: `*.cu`).
"""

from __future__ import annotations

import atexit
import ctypes
import queue
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from kvtrace.probes.kv_access import ring as ring_module
from kvtrace.probes.kv_access.ring import REC_DTYPE, TIM_DTYPE, KVAccessRing
from kvtrace.record.clocks import clock_pair

KERNEL_SOURCE = Path(__file__).with_name("cuda_ring_kernels.cu")
THREADS, WARPS = 256, 8  # must match THREADS in the .cu file
SMEM_QSL = 2048          # must match the .cu file: dynamic shared memory of emit launches (ints)
MAX_GRID = 1024          # per part; the kernel loops grid-stride past it

# Control block words (int64), mirrored from cuda_ring_kernels.cu.
ST_STEP, ST_ACTIVE, ST_SNAP_REC, ST_SNAP_TIM, ST_SNAP_SEQ = 0, 1, 2, 3, 4
ST_REC_HEAD, ST_TIM_HEAD, ST_COUNTS = 5, 6, 7
ST_TAKEN, ST_TAKE_LOST = 8, 9  # kv_take_state's, in the second line
STATE_WORDS = 16  # two 64-byte lines: the first every launch touches, the second kv_take_state's
TICKETS = 256     # step tickets in pinned host memory (kv_take_state): replays the host may run ahead
TICKET_WORDS = 4  # step, active, sequence number, unused
SNAP_WORDS = 8    # state[0:8]: what a drain copies (the snapshot words)
LIVE_WORDS = 8    # state[0:8] again, after the ring copy: the live heads
NSNAP = 64        # pinned snapshot slots (drains in flight)
DRAIN_LOOP = True  # rings made from now on drain in `_drain.Drainer`'s loop where it is built (tests switch it)
ANCHOR_TRIES = 5


def cupy_available() -> tuple[bool, str]:
    """(True, "") when CuPy imports; else (False, why)."""
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA library that does not load
        return False, f"cupy is not importable: {exc}"
    return True, ""


class _RecordArgs(ctypes.Structure):
    """Mirrors `struct RecordArgs` in cuda_ring_kernels.cu (same order, natural alignment)."""

    _fields_ = [
        ("state", ctypes.c_uint64), ("ring", ctypes.c_uint64), ("tring", ctypes.c_uint64),
        ("slot_mapping", ctypes.c_uint64), ("block_table", ctypes.c_uint64), ("seq_lens", ctypes.c_uint64),
        ("qsl", ctypes.c_uint64), ("bt_stride", ctypes.c_int64),
        ("num_tokens", ctypes.c_int32), ("num_reqs", ctypes.c_int32), ("max_blocks", ctypes.c_int32),
        ("block_size", ctypes.c_int32), ("layer", ctypes.c_int32), ("emit", ctypes.c_int32),
        ("sm_is_64", ctypes.c_int32), ("read_blocks", ctypes.c_int32),
        ("ring_mask", ctypes.c_uint32), ("ring_log2", ctypes.c_int32),
        ("tring_mask", ctypes.c_uint32), ("tring_log2", ctypes.c_int32),
    ]


class _StateArgs(ctypes.Structure):
    _fields_ = [("state", ctypes.c_uint64), ("step", ctypes.c_int64), ("active", ctypes.c_int32),
                ("set", ctypes.c_int32)]


class _TakeArgs(ctypes.Structure):
    _fields_ = [("state", ctypes.c_uint64), ("tickets", ctypes.c_uint64), ("mask", ctypes.c_int64)]


assert ctypes.sizeof(_RecordArgs) == 112 and ctypes.sizeof(_StateArgs) == 24 and ctypes.sizeof(_TakeArgs) == 24
# `_drain.state_launch` writes step, active and set at these offsets of the struct
assert (_StateArgs.step.offset, _StateArgs.active.offset, _StateArgs.set.offset) == (8, 16, 20)


class _Launch:
    """A prepared kernel launch: the argument struct and the kernelParams array pointing at it.

    cuLaunchKernel copies the arguments at launch (and at capture), so one struct serves every layer.
    `fn` (a CUfunction pointer; None where the caller names the function, as begin_step does for its state
    launch) and `threads` (per block) say what `record_layer` runs.
    """

    __slots__ = ("args", "params", "params_addr", "grid", "smem", "fn", "threads")

    def __init__(self, args: ctypes.Structure, grid: int, smem: int = 0, fn: int | None = None,
                 threads: int = THREADS):
        self.args, self.grid, self.smem, self.fn, self.threads = args, grid, smem, fn, threads
        self.params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
        self.params_addr = ctypes.addressof(self.params)


_MODULES: dict[int, Any] = {}  # device index -> (RawModule, kernels, {name: CUfunction}); once per process
_MODULES_LOCK = threading.Lock()


def _load_kernels(device_index: int) -> dict[str, int]:
    """Compile (NVRTC, cached on disk by CuPy) and load the kernels; returns CUfunction pointers."""
    import cupy as cp

    with _MODULES_LOCK:
        if device_index not in _MODULES:
            with cp.cuda.Device(device_index):  # CuPy loads per device: take the pointers inside
                mod = cp.RawModule(code=KERNEL_SOURCE.read_text(), options=("-std=c++17", "-lineinfo"))
                names = ("kv_record", "kv_time", "kv_set_state", "kv_take_state", "kv_read_timer", "kv_empty")
                kernels = {n: mod.get_function(n) for n in names}
                ptrs = {n: k.kernel.ptr for n, k in kernels.items()}  # compiles and loads now, never mid-capture
            _MODULES[device_index] = (mod, kernels, ptrs)  # kept: unloading would free the functions
        return _MODULES[device_index][2]


class CudaKVAccessRing(KVAccessRing):
    """The device ring (see the module docstrings). Construct through `kvtrace.probes.kv_access.make_ring`."""

    backend = "cuda"

    def __init__(self, device: Any = "cuda", anchor_interval_s: float = 10.0, **kw: Any):
        super().__init__(**kw)
        import cupy  # noqa: F401  (fail here, clearly, rather than at the first launch)
        import torch
        from cupy.cuda import driver

        self._torch = torch
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("make the KV access ring before capturing CUDA graphs (it allocates and syncs)")
        dev = torch.device(device)
        self.index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        self.source = f"cuda:{self.index}"
        self._launch_kernel = driver.launchKernel
        try:  # the raw cudaStream_t of the current stream without building a Stream object (~0.2 us)
            raw = torch._C._cuda_getCurrentRawStream
            self._current_stream = lambda: raw(self.index)
        except AttributeError:
            self._current_stream = lambda: torch.cuda.current_stream(self.device).cuda_stream
        self.anchor_interval_s = anchor_interval_s

        # Plain tensors, also when the ring is made inside vLLM's torch.inference_mode() (the eager
        # forward pass): the drain thread updates them in place, outside inference mode, and torch
        # refuses in-place updates of inference tensors there.
        with torch.cuda.device(self.index), torch.inference_mode(False):
            fn = _load_kernels(self.index)
            self._f_record, self._f_time = fn["kv_record"], fn["kv_time"]
            self._f_state, self._f_timer = fn["kv_set_state"], fn["kv_read_timer"]
            self._f_take = fn["kv_take_state"]
            # -1 everywhere: lap 0x7FFF, so a slot that was never written never passes for lap 0.
            self._ring = torch.full((self.capacity * 8,), -1, dtype=torch.int32, device=self.device)
            self._tring = torch.full((self.timing_capacity * 8,), -1, dtype=torch.int32, device=self.device)
            self._state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=self.device)
            self._timer = torch.zeros(1, dtype=torch.int64, device=self.device)
            pin = {"pin_memory": True}
            # NSNAP slots for explicit drains, and one more for the background thread's timed drains
            self._snap_host = torch.zeros((NSNAP + 1, SNAP_WORDS), dtype=torch.int64, **pin)
            self._live_host = torch.zeros(LIVE_WORDS, dtype=torch.int64, **pin)
            self._stage = torch.empty(self.capacity * 8, dtype=torch.int32, **pin)
            self._tstage = torch.empty(self.timing_capacity * 8, dtype=torch.int32, **pin)
            self._timer_host = torch.zeros(1, dtype=torch.int64, **pin)
            # Step tickets (`_publish`), then the count published: read by the GPU through the mapping
            self._tickets = torch.zeros(TICKETS * TICKET_WORDS + 1, dtype=torch.int64, **pin)
            self._snap_stream = torch.cuda.Stream(self.device)
            self._copy_stream = torch.cuda.Stream(self.device)
            self._anchor_stream = torch.cuda.Stream(self.device, priority=-1)
            self._snap_events = [torch.cuda.Event() for _ in range(NSNAP)]
            # The drain thread waits on these two kinds (`_wait`): blocking sync, so that it sleeps.
            self._done_events = [torch.cuda.Event(blocking=True) for _ in range(NSNAP + 1)]
            self._copy_event = torch.cuda.Event(blocking=True)
            self._anchor_event = torch.cuda.Event()
            self._side_stream = torch.cuda.Stream(self.device)  # overlap mode: record kernels in graphs
            self._fork_event, self._join_event = torch.cuda.Event(), torch.cuda.Event()
            for ev in self._snap_events + self._done_events + [self._fork_event, self._join_event, self._copy_event]:
                ev.record(self._snap_stream)  # creates the CUDA event, so its raw handle exists
            torch.cuda.synchronize(self.device)  # construction only: the fills above are done before use
        # The drain's hot path goes through CuPy's thin runtime bindings on raw handles (~0.5 us a call)
        # rather than torch's Python wrappers (~5 us each).
        from cupy.cuda import runtime

        self._rt = runtime
        self._snap_ev = [ev.cuda_event for ev in self._snap_events]
        self._done_ev = [ev.cuda_event for ev in self._done_events]
        self._snap_stream_ptr = self._snap_stream.cuda_stream
        self._state_ptr = self._state.data_ptr()
        self._snap_host_ptr = self._snap_host.data_ptr()
        self._side_ptr = self._side_stream.cuda_stream
        self._fork_ev, self._join_ev = self._fork_event.cuda_event, self._join_event.cuda_event
        self._fork_pending = False  # a record kernel forked onto the side stream during a capture, unjoined
        self._capture_hooked = _install_capture_hooks()
        self._replay_hooked = _install_replay_hook()
        if self.overlap:
            _OVERLAP_RINGS.add(self)

        # The drain in C where it is built and the driver's functions are found (`_drain_native`); the
        # Python one otherwise, or when the owner sets `native_drain` False (benchmarks compare them).
        self._native = ring_module.native_drain  # the module, as this ring was made (tests switch it)
        self._cu_fns = _driver_functions() if self._native is not None else None
        self.native_drain = self._cu_fns is not None
        self._cupy_launch = self._launch_kernel
        self.native_launch = self._cu_fns is not None and hasattr(self._native, "launch")
        # The timed drains in a loop in C that never takes the GIL (`_drain.Drainer`, `_run_loop`) where it
        # is built; False: the thread comes back to Python for every drain (`_run`; benchmarks compare them).
        self.drain_loop = DRAIN_LOOP and self.native_drain and hasattr(self._native, "Drainer")
        self._take_lock = threading.Lock()
        # NumPy views of the pinned memory the drain reads, made once: torch's indexing and NumPy's view
        # of a structured dtype cost the drain thread tens of microseconds under the GIL each time
        self._snap_np = self._snap_host.numpy()
        self._tstage_recs = self._tstage.numpy().view(TIM_DTYPE)
        self._native_ptrs = (self._ring.data_ptr(), self._stage.data_ptr(), self._tring.data_ptr(),
                             self._tstage.data_ptr(), self._live_host.data_ptr(), self._copy_stream.cuda_stream,
                             self._copy_event.cuda_event)
        self._state_args = _StateArgs(state=self._state.data_ptr())
        # The step tickets: the host's next one, a NumPy view to write them, and kv_take_state's launch,
        # captured once into each graph that holds this ring's kernels (`_capture_take`)
        self._ticket = 0
        self._tickets_np = self._tickets.numpy()
        # pinned memory is mapped for the device (unified addressing: at the same address)
        get_device_pointer = getattr(runtime, "hostGetDevicePointer", None)
        tickets_dev = (get_device_pointer(self._tickets.data_ptr(), 0) if get_device_pointer is not None
                       else self._tickets.data_ptr())
        self._take_args = _TakeArgs(state=self._state.data_ptr(), tickets=tickets_dev, mask=TICKETS - 1)
        self._take_launch = _Launch(self._take_args, 1)
        self._take_capture = -1  # the capture (`_CAPTURES[1]`) whose graph has this ring's take node
        self._state_args_addr = ctypes.addressof(self._state_args)
        self._state_launch = _Launch(self._state_args, 1)
        self._timer_arg = ctypes.c_uint64(self._timer.data_ptr())
        self._timer_params = (ctypes.c_void_p * 1)(ctypes.addressof(self._timer_arg))
        # The record kernel's two launches (block records with the grid they need, counts only: one block
        # and no dynamic shared memory, less for the SM to set aside between kernels) and kv_time's (the
        # timing record of a layer whose counts the launch before it made), fitted to the last set of
        # metadata tensors checked (`_checked_key`: their pointers and shapes); `_pass_tensors` holds
        # that set until the next one or the next step.
        self._emit_launch = _Launch(_RecordArgs(), 1, SMEM_QSL * 4, self._f_record)
        self._count_launch = _Launch(_RecordArgs(), 1, 0, self._f_record)
        self._time_launch = _Launch(_RecordArgs(), 1, 0, self._f_time, threads=1)
        self._checked_key: tuple | None = None
        self._pass_tensors: tuple | None = None
        # kv_time for a layer whose tensors are those of the launch just before it in the same pass
        # (False: every layer counts its own: benchmarks compare the two). `_counted` = (layer, capture
        # number) of that launch, None when the next launch must count (a new set, step or capture).
        self.count_once = True
        self._counted: tuple[int, int] | None = None
        self._snap_count = 0
        self._tail = self._ttail = 0
        self._anchors: list[tuple[int, int]] = []  # (device_ns, monotonic_ns)
        self._fit = (0, 0, 1.0)                    # (device ref, host ref, host ns per device ns)
        self._queue: queue.Queue = queue.Queue()
        self._fill_s = self.FIRST_DRAIN_S  # seconds the last drains' rate takes to fill a quarter of a ring
        self._rate_mark: tuple[float, int, int] | None = None  # (monotonic s, head, timing head) at the last drain
        self._thread: threading.Thread | None = None
        self._warned_capture = False
        self._take_anchor()
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- hot path ----------------------------------------------------------------------------------------
    def _capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (CUDA's answer: ~1 us idle, ~12 us a call
        under a busy engine)."""
        return self._torch.cuda.is_current_stream_capturing()

    # Defer begin_step's state launch to just before the ring's next kernel (see the module docstring);
    # False: launch it in begin_step (benchmarks compare the two; also where graph replays cannot be hooked).
    defer_state = True
    _state_due = False          # begin_step's launch not made yet (the ring is in _STATE_DUE)
    _deferred_error: BaseException | None = None  # a deferred launch failed in the replay hook: raised next step
    state_missed_steps = 0      # steps whose forward pass ended with the launch still due (state_missed)
    _kernels_made = False       # a record_layer has fitted launches (eagerly or into a captured graph)
    _drainer: Any = None        # the drain loop (`_drain.Drainer`), once the background thread runs it
    _due_thread = 0             # the thread whose begin_step left the launch due

    def _in_capture(self) -> bool:
        """Whether a graph is being captured, CUDA asked only while torch.cuda.CUDAGraph has a capture open
        (or where its captures could not be counted): vLLM captures through it, never mid-step."""
        return bool(_CAPTURES[0] or not self._capture_hooked) and self._capturing()

    def begin_step(self, step: int, record: bool = True) -> None:
        if self._deferred_error is not None:
            exc, self._deferred_error = self._deferred_error, None
            raise exc  # the attention probe's wrapper fails the probe: the engine runs on unrecorded
        self._set_step(step, record)
        if self._in_capture():
            if not self._warned_capture:
                self._warned_capture = True
                self._warn("KVAccessRing.begin_step called during CUDA graph capture: ignored (it would "
                           "freeze the step id into the graph); call it before each replay instead")
            return
        self._pass_tensors = None  # a forward pass's metadata tensors are held within that pass only
        self._counted = None
        if self.defer_state and self._replay_hooked:
            if not self._state_due:
                self._state_due = True
                self._due_thread = threading.get_ident()  # whose replays may make it (its current stream)
                _STATE_DUE.append(self)
        else:
            self._launch_state()
        if self._thread is None and self.auto_drain:
            self._start_thread()

    def _launch_due(self) -> None:
        """Make begin_step's deferred state launch now (before a kernel of this ring, in stream order);
        while a graph is being captured it stays due (in the graph it would freeze the step id)."""
        if self._in_capture():
            return
        self._forget_due()
        self._launch_state()

    def _forget_due(self) -> None:
        """No deferred launch pending any more (made, failed, or the ring closed)."""
        self._state_due = False
        if self in _STATE_DUE:
            _STATE_DUE.remove(self)

    def state_missed(self) -> None:
        """The step's forward pass is over and its state launch is still due: the pass ran none of this
        ring's kernels through a path the ring sees (record_layer, a hooked graph replay). Where it ran
        some (a graph replayed past the hook: captured before the hook was installed, or replayed through
        something else than torch.cuda.CUDAGraph.replay) they read the step before's id and sampling flag.
        Launch now, say so (the probe is degraded: those records may carry the wrong step) and launch at
        begin_step from now on."""
        self._launch_due()
        if not self._kernels_made:
            return  # no kernel of this ring yet (no attention layer read so far): nothing could be mislabeled
        self.state_missed_steps += 1
        if self.defer_state:
            self.defer_state = False
            self._say_degraded(f"KV access ring on {self.source}: step {self.step}'s forward pass ran no kernel "
                               "through a path kvtrace sees (a CUDA graph replayed past its replay hook?): that "
                               "step's KV records may carry the step before's id; the step id is now set at the "
                               "start of each step")

    def _say_degraded(self, why: str) -> None:
        set_status = getattr(self.recorder, "set_probe_status", None)
        if set_status is not None:
            set_status(self.probe, "degraded", why)

    def _launch_state(self) -> None:
        """The kv_set_state launch: this step's id and sampling flag into device memory, head snapshot."""
        state_launch = self._state_launch_native
        if state_launch is not None:  # the struct's fields and the launch in one call (`_drain.state_launch`)
            state_launch(self._f_state, self._current_stream(), self._state_launch.params_addr,
                         self._state_args_addr, self.step, self.active)
        else:
            a = self._state_args
            a.step, a.active, a.set = self.step, int(self.active), 1
            self._launch_kernel(self._f_state, 1, 1, 1, 32, 1, 1, 0, self._current_stream(),
                                self._state_launch.params_addr, 0)

    def _capture_take(self) -> None:
        """Put kv_take_state into the graph being captured, ahead of this ring's first kernel in it, and
        name the ring on the graph, whose replay hook then publishes a ticket for it (`_publish`) instead
        of launching the state: the step id comes from host memory, with no launch a step. Not where the
        graph object takes no attribute, or the capture was not begun through torch.cuda.CUDAGraph: the
        deferred launch before the replay sets the step then, as for any graph."""
        graph = _CAPTURE_GRAPH[0]
        if graph is None or not self._capturing():
            return
        self._take_capture = _CAPTURES[1]
        takes = getattr(graph, TAKES, None)
        if takes is None:
            try:
                setattr(graph, TAKES, [])
            except AttributeError:
                return
            takes = getattr(graph, TAKES)
        self._launch_kernel(self._f_take, 1, 1, 1, 32, 1, 1, 0, self._current_stream(),
                            self._take_launch.params_addr, 0)
        takes.append(self)

    def _publish(self) -> None:
        """The ticket of the next replay of a graph holding this ring's take node: this step's id and
        sampling flag in pinned host memory, then the count published (x86 keeps the stores in order; the
        replay's launch comes after them). Replaces the step's deferred state launch."""
        if self._state_due:
            self._forget_due()
        h = self._ticket
        self._ticket = h + 1
        t, i = self._tickets_np, (h & (TICKETS - 1)) * TICKET_WORDS
        t[i] = self.step
        t[i + 1] = self.active
        t[i + 2] = h
        t[TICKETS * TICKET_WORDS] = h + 1

    def _unpublish(self) -> None:
        """Take back the last ticket (its replay raised, so no take node will read it)."""
        if self._ticket:
            self._ticket -= 1
            self._tickets_np[TICKETS * TICKET_WORDS] = self._ticket

    def tickets_lost(self) -> int:
        """Graph replays whose take node found no ticket for it (replayed past the hook) or an overwritten
        one: their records carry the step before's id. Reads the device (a sync): at close."""
        return int(self._state[ST_TAKE_LOST].item()) if self._ticket or self._take_capture >= 0 else 0

    @property
    def native_launch(self) -> bool:
        """True: kernels are launched through `_drain.c` with the GIL kept; False: through CuPy (benchmarks
        compare them: {"kv_native_launch": false} in the recorder options)."""
        return self._launch_kernel is not self._cupy_launch

    @native_launch.setter
    def native_launch(self, on: bool) -> None:
        if on and self._cu_fns is not None and hasattr(self._native, "launch"):
            self._native.set_launcher(self._cu_fns[3])
            self._launch_kernel = self._native.launch
            # a module built before state_launch existed: begin_step sets the struct in Python instead
            self._state_launch_native = getattr(self._native, "state_launch", None)
        else:
            self._launch_kernel = self._cupy_launch
            self._state_launch_native = None

    # The background thread drains when this long has passed since its last drain, or sooner when the
    # records per second of the last two drains would fill a quarter of either ring first (the device head
    # is unknown on the host without a copy). Each drain has a fixed cost (copies, a record batch, GIL
    # hand-overs): a fast small model draining every step would pay it ~100 times a second.
    # {"kv_drain_interval_s": S} in the recorder options sets DRAIN_EVERY_S (at least MIN_DRAIN_S).
    DRAIN_EVERY_S = 0.1
    MIN_DRAIN_S = 0.001
    FIRST_DRAIN_S = 0.01  # until two drains have measured a rate

    def _drain_interval_s(self) -> float:
        return max(self.MIN_DRAIN_S, min(self.DRAIN_EVERY_S, self._fill_s))

    def _learn_rate(self, heads: tuple[int, int], now: float) -> None:
        """Seconds that fill a quarter of the record or timing ring at the rate since the last drain."""
        prev, self._rate_mark = self._rate_mark, (now, *heads)
        if prev is None or now <= prev[0]:
            return
        quarters = max((heads[0] - prev[1]) / (self.capacity // 4), (heads[1] - prev[2]) / (self.timing_capacity // 4))
        self._fill_s = (now - prev[0]) / quarters if quarters > 0 else float("inf")

    def record_layer(self, layer_idx: int, slot_mapping, block_table, seq_lens, query_start_loc=None) -> None:
        if self._state_due:  # begin_step's launch goes first, in stream order
            self._launch_due()
        if _CAPTURES[0] and self._take_capture != _CAPTURES[1]:  # a graph's first kernel of this ring
            self._capture_take()
        capturing = None
        if not self.active:
            capturing = self._capturing()
            if not capturing:
                return  # sampled out (in a graph the kernel reads the flag from device memory instead)
        emit = self._wants_blocks(layer_idx, block_table)
        # Every layer of a KV-cache group gets the same metadata tensor objects in a forward pass: only a
        # new set is read (its pointers and shapes, ~10 of torch's attribute reads, ~20 us a layer under a
        # busy engine); then the layer's launch is one field of a shared argument struct
        # (cuLaunchKernel copies the arguments at each launch and capture)
        held = self._pass_tensors
        if (held is None or held[0] is not slot_mapping or held[1] is not block_table or held[2] is not seq_lens
                or held[3] is not query_start_loc):
            self._prepare(slot_mapping, block_table, seq_lens, query_start_loc)
        # The layers of a KV-cache group read the same tensors one after the other: their counts are the
        # same, and only the first of them counts (the counts of the launch before, in stream order: the
        # same pass, on the same stream or its fork, which is joined before the next). A graph capture
        # starts a new pass (`_CAPTURES[1]`); where captures cannot be counted, every layer counts.
        counted, capture = self._counted, _CAPTURES[1]
        if emit:
            launch = self._emit_launch
        elif (counted is not None and counted[0] < layer_idx and counted[1] == capture and self.count_once
              and self._capture_hooked):
            launch = self._time_launch
        else:
            launch = self._count_launch
        self._counted = (layer_idx, capture)
        launch.args.layer = layer_idx
        stream = self._current_stream()
        if self.overlap and (capturing if capturing is not None else self._capturing()):
            stream = self._fork(stream)
        self._launch_kernel(launch.fn, launch.grid, 1, 1, launch.threads, 1, 1, launch.smem, stream,
                            launch.params_addr, 0)
        if stream == self._side_ptr:
            self._rt.eventRecord(self._join_ev, stream)
            self._fork_pending = True

    # ---- overlap mode (graph capture only) ------------------------------------------------------------
    def _fork(self, main: int) -> int:
        """Join the previous layer's side kernel into `main`, then fork the side stream from `main`.

        In the captured graph the record kernel of layer i runs beside layer i's attention and layer i+1
        depends on it only through an edge: nothing is added to the critical path. Only while capturing:
        an eager fork would need a host-side join before the next capture, which CUDA forbids then."""
        rt = self._rt
        if self._fork_pending:
            rt.streamWaitEvent(main, self._join_ev, 0)
        rt.eventRecord(self._fork_ev, main)
        rt.streamWaitEvent(self._side_ptr, self._fork_ev, 0)
        return self._side_ptr

    def join(self) -> None:
        """Make the current stream wait for a forked record kernel (called at capture end)."""
        if self._fork_pending:
            self._rt.streamWaitEvent(self._current_stream(), self._join_ev, 0)
            self._fork_pending = False

    def _prepare(self, slot_mapping, block_table, seq_lens, query_start_loc) -> None:
        """Fit the two launches (block records, counts only) to a new set of metadata tensors, held until
        the next set or step. The tensors are checked when their pointers or shapes changed: an eager
        pass's tensors are new objects each step, often over the same persistent buffers."""
        key = (slot_mapping.data_ptr(), slot_mapping.shape[0], slot_mapping.dtype, block_table.data_ptr(),
               block_table.shape[0], block_table.shape[1], block_table.stride(0), seq_lens.data_ptr(),
               seq_lens.shape[0], 0 if query_start_loc is None else query_start_loc.data_ptr())
        if key != self._checked_key:
            self._checked_key = None  # a set that fails its check leaves no launch fitted to it
            template = self._checked_args(slot_mapping, block_table, seq_lens, query_start_loc)
            # Block 0 counts and writes the timing record; with block records, then the read blocks, then
            # the write blocks
            read_blocks = min(-(-template.num_reqs // WARPS), MAX_GRID)
            size = ctypes.sizeof(_RecordArgs)
            for launch, emit in ((self._emit_launch, 1), (self._count_launch, 0), (self._time_launch, 0)):
                ctypes.memmove(ctypes.addressof(launch.args), ctypes.addressof(template), size)
                launch.args.emit, launch.args.read_blocks = emit, read_blocks if emit else 0
            self._emit_launch.grid = 1 + read_blocks + min(-(-template.num_tokens // THREADS), MAX_GRID)
            self._checked_key = key
        self._pass_tensors = (slot_mapping, block_table, seq_lens, query_start_loc)
        self._counted = None  # a new set: its first launch counts
        self._kernels_made = True

    def _checked_args(self, slot_mapping, block_table, seq_lens, query_start_loc) -> _RecordArgs:
        """The launch arguments these tensors give every layer (its own layer and emit flag aside), once
        they are checked (never converted: a copy would allocate on the hot path and break CUDA-graph
        buffer persistence)."""
        torch = self._torch
        T, R = slot_mapping.shape[0], seq_lens.shape[0]
        tensors = {"slot_mapping": slot_mapping, "block_table": block_table, "seq_lens": seq_lens}
        if query_start_loc is not None:
            tensors["query_start_loc"] = query_start_loc
        for name, t in tensors.items():
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the ring on {self.device}")
        if slot_mapping.dtype not in (torch.int64, torch.int32) or slot_mapping.dim() != 1:
            raise TypeError(f"slot_mapping must be 1-D int64/int32, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
        for name in ("block_table", "seq_lens", "query_start_loc"):
            t = tensors.get(name)
            if t is not None and t.dtype != torch.int32:
                raise TypeError(f"{name} must be int32, got {t.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] < R or (block_table.shape[1] > 1 and block_table.stride(1) != 1):
            raise ValueError(f"block_table must be [>= num_reqs, max_blocks] with unit column stride, got "
                             f"{tuple(block_table.shape)} strides {block_table.stride()}")
        for name, t in tensors.items():
            if name != "block_table" and t.numel() > 1 and t.stride(0) != 1:
                raise ValueError(f"{name} must be contiguous")
        if query_start_loc is not None and query_start_loc.shape[0] < R + 1:
            raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {R} requests")
        if max(T, R, block_table.shape[1]) >= 1 << 31:
            raise ValueError("metadata larger than 2^31 entries")
        return _RecordArgs(
            state=self._state.data_ptr(), ring=self._ring.data_ptr(), tring=self._tring.data_ptr(),
            slot_mapping=slot_mapping.data_ptr(), block_table=block_table.data_ptr(),
            seq_lens=seq_lens.data_ptr(), qsl=0 if query_start_loc is None else query_start_loc.data_ptr(),
            bt_stride=block_table.stride(0), num_tokens=T, num_reqs=R, max_blocks=block_table.shape[1],
            block_size=self.block_size, sm_is_64=int(slot_mapping.dtype == torch.int64),
            ring_mask=self.capacity - 1, ring_log2=self.log2cap,
            tring_mask=self.timing_capacity - 1, tring_log2=self.log2tcap,
        )

    def drain(self, _ack: threading.Event | None = None) -> int | None:
        if self.closed or self._capturing():
            return
        if self._state_due:  # the snapshot of the last begin_step comes before this point
            self._launch_due()
        self._start_thread()
        slot = self._snapshot()
        if self._drainer is not None:  # the loop drains it; `flush` waits for the ticket
            return self._drainer.request(slot, self._done_ev[slot])
        self._queue.put(("snap", slot, self._done_events[slot], _ack))
        return None

    def _snapshot(self) -> int:
        """Copy the state words (the heads) into a pinned snapshot slot once the inference stream gets
        here, on a side stream; the slot's done event marks the copy. Returns the slot."""
        rt, side = self._rt, self._snap_stream_ptr
        slot = self._snap_count % NSNAP
        self._snap_count += 1
        ev = self._snap_ev[slot]
        rt.eventRecord(ev, self._current_stream())  # everything up to here on the inference stream
        rt.streamWaitEvent(side, ev, 0)
        self._copy_state(slot, side)
        return slot

    def _copy_state(self, slot: int, stream: int) -> None:
        """Copy the state words into pinned snapshot `slot` on `stream` (pinned destination: asynchronous)
        and record the slot's done event after the copy."""
        rt = self._rt
        rt.memcpyAsync(self._snap_host_ptr + slot * SNAP_WORDS * 8, self._state_ptr, SNAP_WORDS * 8,
                       rt.memcpyDeviceToHost, stream)
        rt.eventRecord(self._done_ev[slot], stream)

    def flush(self, timeout_s: float = 30.0) -> None:
        if self.closed:
            return
        if self._capturing():
            raise RuntimeError("KVAccessRing.flush during CUDA graph capture")
        # The ring's own device current: a flush at exit (atexit, engine shutdown) may run in a thread
        # whose current device is another (a tensor-parallel worker on cuda:1 found cuda:0's context
        # there, and the launch failed with an invalid context).
        with self._torch.cuda.device(self.index):
            a = self._state_args
            a.set = 0  # snapshot only: the heads as of now, on the inference stream
            # CuPy's launch (the GIL let go): a flush may run on any thread (shutdown, atexit), off the
            # hot path, and must not stop the others should the launch wait in the driver
            self._cupy_launch(self._f_state, 1, 1, 1, 32, 1, 1, 0, self._current_stream(),
                              self._state_launch.params_addr, 0)
            ack = threading.Event()
            ticket = self.drain(_ack=ack)
        if ticket is not None:  # the drain loop's: wait for it, then take what it left for Python
            done = self._drainer.wait(ticket, timeout_s)
            self._take_native()
        else:
            done = ack.wait(timeout_s)
        if not done:
            self._warn(f"KVAccessRing.flush: background drain did not finish in {timeout_s} s")
            self._lost_uncounted(f"its flush did not finish in {timeout_s} s")

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
        except Exception as exc:  # at interpreter exit CUDA may already be gone
            self._warn(f"KVAccessRing.close: final flush failed: {exc}")
            self._lost_uncounted(f"its final flush failed ({str(exc)[:200]})")
        self.closed = True
        self.active = False
        self._forget_due()
        if self._thread is not None:
            if self._drainer is not None:
                self._drainer.stop()
            else:
                self._queue.put(("stop", None, None, None))
            self._thread.join(timeout=30.0)
        if self._drainer is not None:
            try:
                self._take_native()  # what the loop left since its last hand-over
            except Exception as exc:
                self._warn(f"KVAccessRing.close: records left by the drain loop not handed over: {exc!r}")
        try:
            self._take_anchor()
        except Exception:
            pass
        try:
            lost = self.tickets_lost()
        except Exception:  # at interpreter exit CUDA may already be gone
            lost = 0
        self.stats["step_tickets"] = self._ticket
        self.stats["step_tickets_lost"] = lost
        self.stats["state_missed_steps"] = self.state_missed_steps
        if lost:
            self._say_degraded(f"KV access ring on {self.source}: {lost} CUDA graph replays ran without a step "
                               "ticket (replayed past kvtrace's replay hook): their KV records may carry the "
                               "step before's id")
        set_info = getattr(self.recorder, "set_info", None)
        if set_info is not None:  # proc.json: what the ring kept, lost and spent (benchmarks read it)
            set_info(f"kv_ring_{self.source}", {k: round(v, 6) if isinstance(v, float) else v
                                               for k, v in self.stats.items()})

    # ---- background thread -----------------------------------------------------------------------------
    def _start_thread(self) -> None:
        if self._thread is None:
            loop = self.drain_loop and self.native_drain and self._cu_fns is not None
            if loop and self._drainer is None:
                self._drainer = self._make_drainer()
            self._thread = threading.Thread(target=self._run_loop if loop else self._run, name="kvtrace-kv-ring",
                                            daemon=True)
            self._thread.start()

    def _make_drainer(self) -> Any:
        """The drain loop (`_drain.Drainer`), writing its frames through the recorder's frame sink where
        it has one (else leaving the block records for `_take_native`), with this ring's state so far."""
        get_sink = getattr(self.recorder, "kv_frame_sink", None)
        sink = get_sink(self._native.FrameSink) if get_sink is not None else None
        ring, stage, tring, tstage, live, stream, event = self._native_ptrs
        d = self._native.Drainer(
            self._cu_fns[:3], self._snap_host_ptr, NSNAP, self._done_ev[NSNAP], (ST_SNAP_REC, ST_SNAP_TIM),
            (ST_REC_HEAD, ST_TIM_HEAD), (ring, stage, self.capacity), (tring, tstage, self.timing_capacity),
            self._state_ptr, live, stream, event, sink)
        d.set_clock(*self._fit)
        d.set_copies(self._copies)
        d.set_tails(self._tail, self._ttail)
        d.set_policy(self.DRAIN_EVERY_S, self.MIN_DRAIN_S, self._fill_s, self.auto_drain)
        return d

    def _copies_changed(self) -> None:
        if self._drainer is not None:
            self._drainer.set_copies(self._copies)

    # The drain loop comes back to Python this often to hand over its timing records, counts and drops
    # (one GIL hand-over a second, where one a drain was ten): what a kill loses that was drained, and how
    # late proc.json's counts are.
    HANDOVER_S = 1.0

    def _run_loop(self) -> None:
        """The background thread with the drain loop: in `Drainer.run`, without the GIL, but for a clock
        anchor every `anchor_interval_s` and the hand-over of what the drains left for Python then."""
        self._torch.cuda.set_device(self.index)  # the primary context current: the loop's CUDA calls use it
        _relax_capture_mode()
        self.stats["native_drain"] = self.stats["drain_loop"] = True  # proc.json: which drain ran
        next_anchor = time.monotonic() + self.anchor_interval_s
        while True:
            reason = self._drainer.run(min(next_anchor, time.monotonic() + self.HANDOVER_S))
            try:
                if time.monotonic() >= next_anchor:
                    self._take_anchor()
                    next_anchor = time.monotonic() + self.anchor_interval_s
                self._take_native()
            except Exception as exc:  # never take the process down; say what happened
                self._warn(f"KVAccessRing drain failed: {exc!r}")
            self.stats["thread_cpu_s"] = time.thread_time()  # this thread's CPU so far (proc.json)
            if reason == "stop":
                return

    def _take_native(self) -> None:
        """Hand over what the drain loop left for Python since the last time: block records it had no
        file for, timing records (decoded at the recorder's flush), its counts and drops, its errors."""
        with self._take_lock:  # one hand-over at a time, in the order the loop kept them
            blocks, timings, counts, error = self._drainer.take()
            for recs, clock, copies in blocks:
                self._hand_over(np.frombuffer(recs, REC_DTYPE), False, clock, copies, True)
            for recs, clock, _ in timings:
                self._hand_over(np.frombuffer(recs, TIM_DTYPE), True, clock, (), True)
            st = self.stats
            st["drains"] = st.get("drains", 0) + counts["drains"]
            st["drain_s"] += counts["drain_s"]
            st["kv_rows"] += counts["kv_rows"]
            st["timing_rows"] += counts["timing_rows"]
            self._tail, self._ttail = counts["tail"], counts["timing_tail"]
            for table, key, units in (("kv_access", "kv", self._drop_units), ("layer_timings", "timing", 1)):
                for cause, what in (("ring-wrap", "wrap"), ("drain-error", "error"), ("buffer-cap", "cap")):
                    n = counts[f"{key}_{what}"]
                    if n:
                        st[f"{key}_dropped"] += n
                        self.recorder.count_drop(table, n * units, cause)
            if error is not None:
                rc, where, failed = error
                self._warn(f"KVAccessRing drain failed: CUDA error {rc} {where} ({failed} drain"
                           f"{'s' if failed != 1 else ''} since the last report)")

    @staticmethod
    def _wait(event: Any) -> None:
        """Wait for a CUDA event made with `blocking=True` (cudaEventBlockingSync): the thread sleeps in
        the driver until the GPU gets there, with the GIL released (torch's `synchronize` lets it go),
        neither spinning a core (a default event's sync does) nor polling (each poll took the GIL from
        the engine's thread: ~200 hand-overs a second at one poll a millisecond)."""
        event.synchronize()

    def _run(self) -> None:
        self._torch.cuda.set_device(self.index)  # makes the primary context current for CuPy launches
        _relax_capture_mode()
        now = time.monotonic()
        next_anchor = now + self.anchor_interval_s
        next_drain = now + self._drain_interval_s() if self.auto_drain else float("inf")
        while True:
            try:
                items = [self._queue.get(timeout=max(0.0005, min(next_anchor, next_drain) - time.monotonic()))]
            except queue.Empty:
                items = []
            while True:  # take everything queued: only the newest snapshot matters
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            snaps = [it for it in items if it[0] == "snap"]
            timed = not snaps and not self.closed and time.monotonic() >= next_drain
            heads = None
            try:
                if snaps or timed:
                    # an explicit drain's snapshot slot, or the thread's own (a snapshot taken now)
                    slot = snaps[-1][1] if snaps else NSNAP
                    t0 = time.perf_counter()
                    native = self.native_drain and self._cu_fns is not None  # (the owner may set it True)
                    self.stats["native_drain"] = native  # proc.json: which drain ran
                    if native:
                        drained = self._drain_native(slot, take_snapshot=timed)
                        heads = drained[2]
                        self._learn_rate(heads, time.monotonic())
                        self._emit_native(drained)
                    else:
                        if timed:
                            # the state words as the device has them now: set by the last kv_set_state
                            # that ran, after every kernel before it had finished (all below is complete)
                            self._copy_state(slot, self._copy_stream.cuda_stream)
                        self._wait(self._done_events[slot])
                        snap = self._snap_np[slot]
                        heads = int(snap[ST_SNAP_REC]), int(snap[ST_SNAP_TIM])
                        self._learn_rate(heads, time.monotonic())
                        t0 = time.perf_counter()
                        self._drain_to(*heads)
                    self.stats["drain_s"] += time.perf_counter() - t0
                    self.stats["drains"] = self.stats.get("drains", 0) + 1
                    if self.auto_drain:
                        next_drain = time.monotonic() + self._drain_interval_s()
                if time.monotonic() >= next_anchor:
                    self._take_anchor()
                    next_anchor = time.monotonic() + self.anchor_interval_s
            except Exception as exc:  # never take the process down; say what happened, count what is lost
                self._warn(f"KVAccessRing drain failed: {exc!r}")
                if heads is not None:
                    self._lose_to(*heads, cause="drain-error")
            self.stats["thread_cpu_s"] = time.thread_time()  # this thread's CPU so far (proc.json)
            for it in items:
                if it[3] is not None:
                    it[3].set()
            if any(it[0] == "stop" for it in items):
                return

    def _lose_to(self, head: int, thead: int, cause: str) -> None:
        """Count the records not yet drained up to these heads as dropped (`cause`) and move past them:
        a drain that failed loses them, and says so."""
        for table, attr, hd in (("kv_access", "_tail", head), ("layer_timings", "_ttail", thead)):
            tail = getattr(self, attr)
            if hd > tail:
                n = hd - tail
                self.stats["kv_dropped" if table == "kv_access" else "timing_dropped"] += n
                self.recorder.count_drop(table, n * (self._drop_units if table == "kv_access" else 1), cause)
                setattr(self, attr, hd)

    def _drain_native(self, slot: int, take_snapshot: bool = False) -> tuple:
        """What `_wait` of the snapshot (or, with take_snapshot, `_copy_state` on the copy stream and the wait) and
        `_drain_to` do, in one native call without the GIL (_drain.c): (error, where, heads, (lo, n, timing
        lo, timing n), live heads, kept block records)."""
        ring, stage, tring, tstage, live, stream, event = self._native_ptrs
        drained = self._native.drain_device(
            self._cu_fns[:3], self._done_ev[slot], self._snap_host_ptr + slot * SNAP_WORDS * 8,
            (ST_SNAP_REC, ST_SNAP_TIM), (ST_REC_HEAD, ST_TIM_HEAD), (ring, stage, self._tail, self.capacity),
            (tring, tstage, self._ttail, self.timing_capacity), self._state_ptr, live, stream, event, self.log2cap,
            take_snapshot)
        if drained[2] is None:  # the snapshot was not read: nothing known to count
            raise RuntimeError(f"CUDA error {drained[0]} {drained[1]}")
        return drained

    def _emit_native(self, drained: tuple) -> None:
        """Emit a native drain's records: the kept block records as they are, the timing records decoded
        from their staging memory (a few per layer and step)."""
        err, where, (head, thead), (lo, n, tlo, tn), (live_head, live_thead), kept = drained
        if err:
            raise RuntimeError(f"CUDA error {err} {where}")
        if n:
            self._emit_window(np.frombuffer(kept, REC_DTYPE), self._tail, head, timing=False, owned=True)
            self._tail = head
        if tn:
            recs = self._tstage_recs[:tn]
            self._decode_window(recs, tlo, self._ttail, thead, self.log2tcap,
                                max(tlo, live_thead - self.timing_capacity), True)
            self._ttail = thead

    def _drain_to(self, head: int, thead: int) -> None:
        """Copy positions [tail, head) of both rings to pinned memory, check, decode, emit."""
        torch = self._torch
        plan = []
        for ring, stage, tail, hd, cap in ((self._ring, self._stage, self._tail, head, self.capacity),
                                           (self._tring, self._tstage, self._ttail, thead, self.timing_capacity)):
            if hd <= tail:
                plan.append(None)
                continue
            lo = max(tail, hd - cap)
            n = hd - lo
            a = lo & (cap - 1)
            n1 = min(n, cap - a)
            with torch.cuda.stream(self._copy_stream):
                stage[: n1 * 8].copy_(ring[a * 8:(a + n1) * 8], non_blocking=True)
                if n > n1:
                    stage[n1 * 8: n * 8].copy_(ring[: (n - n1) * 8], non_blocking=True)
            plan.append((stage, tail, hd, lo, n))
        if plan == [None, None]:
            return
        with torch.cuda.stream(self._copy_stream):
            # The live heads after the copy: a slot of position p may have been overwritten while we
            # copied only if position p + capacity was reserved by then, i.e. p < live head - capacity.
            self._live_host.copy_(self._state[:LIVE_WORDS], non_blocking=True)
        self._copy_event.record(self._copy_stream)
        self._wait(self._copy_event)
        live = self._live_host.numpy()
        for i, p in enumerate(plan):
            if p is None:
                continue
            stage, tail, hd, lo, n = p
            timing = i == 1
            cap, log2cap = (self.timing_capacity, self.log2tcap) if timing else (self.capacity, self.log2cap)
            live_head = int(live[ST_TIM_HEAD if timing else ST_REC_HEAD])
            recs = stage.numpy().view(TIM_DTYPE if timing else REC_DTYPE)[:n]
            self._decode_window(recs, lo, tail, hd, log2cap, max(lo, live_head - cap), timing)
            if timing:
                self._ttail = hd
            else:
                self._tail = hd

    # ---- clocks -------------------------------------------------------------------------------------------
    def _take_anchor(self) -> None:
        """Pair %globaltimer with CLOCK_MONOTONIC: best (shortest) of a few round trips, midpoint."""
        torch = self._torch
        best = None
        for _ in range(ANCHOR_TRIES):
            m0, u0 = clock_pair()
            with torch.cuda.stream(self._anchor_stream):
                # CuPy's launch, which lets the GIL go: this runs on the background thread, and a launch
                # can wait in the driver (40 ms once, beside a prefill-heavy engine on an H100), which with
                # the GIL kept would stop every thread of the process
                self._cupy_launch(self._f_timer, 1, 1, 1, 32, 1, 1, 0, self._anchor_stream.cuda_stream,
                                  ctypes.addressof(self._timer_params), 0)
                self._timer_host.copy_(self._timer, non_blocking=True)
                self._anchor_event.record(self._anchor_stream)
            self._anchor_event.synchronize()  # side stream only; a few microseconds
            rtt = time.monotonic_ns() - m0
            if best is None or rtt < best[3]:
                best = (m0 + rtt // 2, u0 + rtt // 2, int(self._timer_host[0]), rtt)
        mono, utc, dev_ns, _ = best
        self.recorder.buffer("clock_anchors").append((mono, utc, dev_ns, self.source))
        self._anchors = (self._anchors + [(dev_ns, mono)])[-32:]
        self._fit = self._fit_clock(self._anchors)
        if self._drainer is not None:
            self._drainer.set_clock(*self._fit)

    @staticmethod
    def _fit_clock(anchors: list[tuple[int, int]]) -> tuple[int, int, float]:
        """Least-squares line host = a + slope * (device - d_ref), d_ref = the last anchor's device time."""
        dev_ref, host_ref = anchors[-1]
        if len(anchors) < 2 or anchors[-1][0] - anchors[0][0] < 1_000_000_000:
            return dev_ref, host_ref, 1.0  # under a second of baseline: offset only
        x = np.array([d - dev_ref for d, _ in anchors], dtype=np.float64)
        y = np.array([h - host_ref for _, h in anchors], dtype=np.float64)
        slope, intercept = np.polyfit(x, y, 1)
        return dev_ref, host_ref + int(round(intercept)), float(slope)

    def _clock(self) -> tuple[int, int, float]:
        return self._fit


def _close_at_exit(ref: weakref.ref) -> None:
    ring = ref()
    if ring is not None:
        ring.close()


def _driver_functions() -> tuple[int, int, int, int] | None:
    """Addresses of cuEventSynchronize, cuEventRecord, cuMemcpyDtoHAsync_v2 (the native drain) and
    cuLaunchKernel (the native launch) in the CUDA driver torch loaded; None where they cannot be read
    (the Python drain and CuPy's launch are used)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                     for name in ("cuEventSynchronize", "cuEventRecord", "cuMemcpyDtoHAsync_v2", "cuLaunchKernel"))
    except (OSError, AttributeError):
        return None


def _relax_capture_mode() -> None:
    """Let the calling (background) thread query events and queue async copies on its own streams while
    another thread captures a CUDA graph in the default global mode (vLLM's and torch.cuda.graph's):
    otherwise CUDA refuses such calls from every thread for the length of the capture."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        mode = ctypes.c_int(2)  # CU_STREAM_CAPTURE_MODE_RELAXED
        libcuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
    except Exception:
        pass  # best effort: without it a drain racing a capture fails and is reported, never silent


def empty_kernel_launcher(device_index: int):
    """Benchmark helper: a callable that launches an empty kernel on the current stream (the floor of one
    extra kernel per layer inside a CUDA graph)."""
    import torch
    from cupy.cuda import driver

    fn = _load_kernels(device_index)["kv_empty"]
    raw = torch._C._cuda_getCurrentRawStream

    def launch() -> None:
        driver.launchKernel(fn, 1, 1, 1, 32, 1, 1, 0, raw(device_index), 0, 0)

    return launch


_OVERLAP_RINGS: weakref.WeakSet = weakref.WeakSet()
# Rings whose begin_step launch is deferred and not made yet: the replay hook makes them before a graph runs.
_STATE_DUE: list = []
# CUDA graph captures through torch.cuda.CUDAGraph in this process: [open now, begun so far]
_CAPTURES = [0, 0]
# The torch.cuda.CUDAGraph whose capture is open (capture_begin's), and the attribute naming the rings whose
# take node it holds (`_capture_take`; the replay hook publishes their tickets)
_CAPTURE_GRAPH: list[Any] = [None]
TAKES = "_kvtrace_takes"


def _install_capture_hooks() -> bool:
    """Wrap torch.cuda.CUDAGraph.capture_begin and capture_end (once): count the captures open
    (`_CAPTURES`, so that `begin_step` asks CUDA only while one is), make every overlap ring join its last
    forked record kernel into the capture stream before the capture ends (an unjoined fork fails the
    capture), and forget a fork left by an aborted capture. False where they cannot be wrapped."""
    import torch

    cls = getattr(torch.cuda, "CUDAGraph", None)
    if cls is None or not hasattr(cls, "capture_begin") or not hasattr(cls, "capture_end"):
        return False
    if getattr(cls.capture_end, "_kvtrace_joins", False):
        return True
    orig_begin, orig_end = cls.capture_begin, cls.capture_end

    def capture_begin(self, *args, **kwargs):
        for ring in list(_OVERLAP_RINGS):  # a fork left by an aborted capture must not be joined into this one
            ring._fork_pending = False
        _CAPTURES[0] += 1  # before the capture starts: a begin_step racing it asks CUDA
        _CAPTURES[1] += 1  # a new capture is a new forward pass (record_layer's kv_time launches)
        _CAPTURE_GRAPH[0] = self
        try:
            return orig_begin(self, *args, **kwargs)
        except BaseException:
            _CAPTURES[0] -= 1
            _CAPTURE_GRAPH[0] = None
            raise

    def capture_end(self, *args, **kwargs):
        try:
            for ring in list(_OVERLAP_RINGS):
                ring.join()
            return orig_end(self, *args, **kwargs)
        finally:
            _CAPTURES[0] = max(0, _CAPTURES[0] - 1)
            _CAPTURE_GRAPH[0] = None

    capture_begin._kvtrace_joins = capture_end._kvtrace_joins = True
    cls.capture_begin, cls.capture_end = capture_begin, capture_end
    return True


def _install_replay_hook() -> bool:
    """Wrap torch.cuda.CUDAGraph.replay (once): before a graph runs, the tickets of the rings whose take node
    it holds (`_publish`), then every other ring's deferred state launch (`_STATE_DUE`), since the graph may
    hold the ring's kernels. Installed when a ring is made, which the
    attention probe does before vLLM captures: a capture that keeps the bound `graph.replay` (vLLM's
    breakable graphs do) keeps the wrapper. A launch that fails is not raised into vLLM: the ring raises it
    at its next begin_step. False where replay cannot be wrapped (begin_step then launches at once)."""
    import torch

    cls = getattr(torch.cuda, "CUDAGraph", None)
    orig = getattr(cls, "replay", None)
    if orig is None:
        return False
    if getattr(orig, "_kvtrace_state", False):
        return True

    def launch_due() -> None:
        thread = threading.get_ident()
        for ring in list(_STATE_DUE):
            if ring._due_thread != thread:
                continue  # another thread's graph: not on the stream of the ring's step
            try:
                ring._launch_due()
            except Exception as exc:
                ring._forget_due()
                ring._deferred_error = exc

    def replay(self, *args, **kwargs):
        takes = getattr(self, TAKES, None)
        if takes is not None:  # its take nodes set the step from tickets: no launch for their rings
            for ring in takes:
                ring._publish()
        if _STATE_DUE:
            launch_due()
        try:
            return orig(self, *args, **kwargs)
        except BaseException:
            if takes is not None:  # not replayed: its tickets would go to the next replay
                for ring in takes:
                    ring._unpublish()
            raise

    replay._kvtrace_state = True
    replay.__wrapped__ = orig
    cls.replay = replay
    return True
