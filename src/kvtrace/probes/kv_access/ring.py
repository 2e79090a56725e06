"""KV access rings: per-layer KV reads and writes, recorded from the attention metadata, CPU or GPU.

One small API, two implementations with identical record semantics: `CPUKVAccessRing` (NumPy, here) and
`CudaKVAccessRing` (CuPy kernels on PyTorch's stream, `probes/kv_access/cuda_ring.py`). No vLLM imports: the caller
(the worker's attention patch point) hands over the metadata tensors as the kernels see them.

API
---
    ring = make_ring(device, capacity=1 << 20, block_size=16, granularity="timing", layers=None,
                     sample_every=1, recorder=None, timing_capacity=1 << 14, auto_drain=True, overlap=False)

`device`: a torch.device / "cuda:N" / "cpu" (or a tensor: its device). CUDA device and CuPy importable ->
`CudaKVAccessRing`; otherwise `CPUKVAccessRing` (a CUDA device without CuPy raises: CPU tensors would be
needed). Arguments:
  capacity         records the ring holds (power of two; 32 bytes each on the device).
  block_size       KV block size in tokens (vLLM `cache_config.block_size`).
  granularity      "timing" (default): one `layer_timings` row per layer call (step, layer, ts, reads,
                   writes), and block records (`kv_access` rows) only for `layers`, by default "auto" = the
                   first layer of each KV-cache group in each forward pass (a group = a distinct
                   `block_table` tensor; all layers of a group read the same blocks in a step).
                   "blocks": block records for `layers`, by default "all"; timing rows for every layer too.
  layers           "auto", "all", "none", "0,15,31", or an iterable of layer indices.
  sample_every     record only steps with `step % sample_every == 0` (others cost one early-exit launch
                   inside CUDA graphs, nothing in eager mode). Sampled-out steps are not drops.
  recorder         where rows go: a recorder sink (kvtrace.record.recorder: `Recorder`, `MemoryRecorder`);
                   decoded rows go to its `append_columns(table, {column: numpy array})`, without
                   per-row Python tuples. None: the process's `get_recorder()`; if that is None too,
                   rows are decoded, counted in `stats` and discarded (`NullRecorder`).
  timing_capacity  timing records the device keeps between drains (power of two).
  auto_drain       drained without `drain()` calls, every 100 ms or sooner when a ring may be a quarter full (a
                   drain has a fixed cost per call): by `begin_step` on the CPU; on the GPU by the ring's
                   background thread (started by the first `begin_step`), which estimates the fill from
                   the records per second of its last drains, off the engine's thread.
  share_layers     with layers "all" (default True): a layer that reads the block table an earlier layer
                   of the same forward pass read (the layers of one KV-cache group read the same blocks)
                   writes only its timing row; its block records are the earlier layer's, and the
                   shards say so (`kv_access_records.layer_copies`), so ingest writes its kv_access rows
                   (with the earlier layer's timestamps). 1/N of the records for N layers in a group.
                   False: every layer's records from its own metadata (the GPU suite checks both).
  overlap          GPU, CUDA graphs (default False: each record kernel inline, between two kernels of the
                   step). True: while a graph is captured, each layer's record kernel is forked onto a side
                   stream and joined at the next layer, so in the graph it runs beside attention. That wins
                   on an attention-only step (H100: +0.38% -> +0.01%) and loses in a real engine, where the
                   forked kernels run beside the GEMMs (8B on an H100: 0.989 of plain throughput forked,
                   0.996 inline; docs/performance.md). The last fork is joined by a wrapper around
                   torch.cuda.CUDAGraph.capture_end (installed once, with capture_begin resetting it); a
                   capture through anything but torch.cuda.CUDAGraph needs overlap=False. Eager calls always
                   launch inline on the current stream.

    ring.begin_step(step: int, record: bool = True) -> None
        Call once per engine step, before the forward pass (and before `graph.replay()`), on the inference
        stream, never while a CUDA graph is being captured. Sets the step id in device memory (a tiny
        kernel: nothing per-step is frozen into a captured graph), decides sampling, snapshots the ring
        head (everything recorded before this call becomes drainable); CPU: drains when due (`auto_drain`).
        GPU: the kernel is launched just before the ring's next kernel in stream order (its next
        record_layer, the next torch.cuda.CUDAGraph.replay, or drain), where the step's first CUDA call
        would cost more. After the forward pass, `state_missed()` when `_state_due` is still set (a graph
        replayed past the hook: said in the probe's status, and the launch is made here from then on).
    ring.record_layer(layer_idx: int, slot_mapping, block_table, seq_lens, query_start_loc=None) -> None
        Call once per attention layer per forward pass (eagerly, or while capturing a CUDA graph: the
        launch is captured and replays read the step from device memory). Tensors as vLLM's attention
        metadata has them, on the ring's device:
          slot_mapping     int64 (or int32) [num_tokens]; slot = block_id * block_size + offset; < 0 = pad.
          block_table      int32 [>= num_reqs, max_blocks], unit column stride.
          seq_lens         int32 [num_reqs]: context length including this step's tokens.
          query_start_loc  int32 [num_reqs + 1], or None (then every write has slot -1).
        Records: a write per run of consecutive tokens of one request landing in one block (token_offset =
        first offset, token_count = run length); a read per (request, block) covering [0, seq_len)
        (token_offset 0, token_count = the context's tokens in that block, blocks past max_blocks are not
        read). `slot` = the request's row; a token outside every request (padding) has slot -1.
        GPU: no host sync, nothing allocated; one kernel launch.
    ring.drain() -> None
        GPU: non-blocking. Copies the records up to the last `begin_step` snapshot before this point of the
        inference stream to pinned host memory on a side stream ordered by an event, decodes them on a background thread and appends the rows to
        the recorder (with `auto_drain` that thread also drains by itself). CPU: decodes synchronously. Records overwritten before they were copied (ring wrapped) are
        counted exactly: `recorder.count_drop("kv_access" | "layer_timings", n, "ring-wrap")`.
    ring.flush(timeout_s: float = 30.0) -> None
        Snapshot now, drain, and wait until every recorded row reached the recorder (tests, shutdown).
        Blocks the calling thread until the inference stream gets there: never on the hot path.
    ring.close() -> None
        flush, stop the background thread, final clock anchor. Idempotent.
    ring.stats -> dict: kv_rows, timing_rows, kv_dropped, timing_dropped, drain_s (cumulative).

Rows (kvtrace.format.schema): `kv_access` (step, layer, ts_ns, op, slot, block_id, token_offset, token_count),
`layer_timings` (step, layer, ts_ns, reads, writes), `clock_anchors` (monotonic_ns, utc_ns, device_ns,
"cuda:N") from the GPU ring. ts_ns is host CLOCK_MONOTONIC: the device ring stamps %globaltimer once per
CUDA block and maps it through a linear fit of the anchor pairs.

Ring semantics (both implementations): a record at position p (p counts every record ever reserved) lives in
slot p mod capacity, tagged with its lap p >> log2(capacity). Draining [tail, head): when head - tail >
capacity, the oldest head - tail - capacity records were overwritten and are counted as dropped; a record
whose lap tag does not match (overwritten while being copied) is dropped too. Records keep this shape on
both sides (REC_DTYPE) so the CPU ring and the GPU ring are compared record for record.

Use one ring per process and stream: the launches of one ring are assumed to run in stream order (the
head snapshots rely on it). Create the ring before any CUDA graph is captured (it allocates and syncs once).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvtrace.format.kv_records import (  # noqa: F401  (REC_DTYPE, TIM_DTYPE: the ring's record layouts)
    IDENTITY_CLOCK,
    REC_DTYPE,
    TIM_DTYPE,
    copy_layers,
    to_host_ns,
    unpack_records,
    unpack_timings,
)
from kvtrace.record.buffers import import_native

# the drain's lap check and copy without the GIL (_drain.c); NumPy where it is not built or KVTRACE_NATIVE=0
native_drain, _ = import_native("kvtrace.probes.kv_access._drain")

OP_READ, OP_WRITE = 0, 1
LAP_BITS = 15
LAP_MASK = (1 << LAP_BITS) - 1

KV_COLUMNS = ("step", "layer", "ts_ns", "op", "slot", "block_id", "token_offset", "token_count")
TIMING_COLUMNS = ("step", "layer", "ts_ns", "reads", "writes")

ALL, AUTO, NONE = "all", "auto", "none"


# ---- the record semantics, vectorised (the CPU ring; the reference the GPU ring is checked against) ------
def _as_numpy(x: Any) -> np.ndarray:
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        return x
    return x.detach().cpu().numpy()  # torch tensor; zero-copy for CPU tensors


def write_runs(slot_mapping: np.ndarray, query_start_loc: np.ndarray | None, num_reqs: int,
               block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Write runs of one layer call: (first token index, run length, slot) per run, in token order.

    A run = consecutive tokens of one request whose slots are consecutive inside one KV block.
    """
    sm = np.asarray(slot_mapping).astype(np.int64, copy=False)
    T = sm.shape[0]
    if T == 0:
        e = np.zeros(0, np.int64)
        return e, e, e
    if query_start_loc is not None and T == num_reqs:
        qsl = np.asarray(query_start_loc)[: num_reqs + 1]
        if np.array_equal(qsl, np.arange(num_reqs + 1)):  # pure decode: one token, one run per request
            starts = np.flatnonzero(sm >= 0)
            return starts, np.ones(starts.size, np.int64), starts
    t = np.arange(T)
    if query_start_loc is None:
        zone = np.full(T, num_reqs)
    else:  # the last request start <= t: -1 before the first request, num_reqs after the last
        zone = np.searchsorted(np.asarray(query_start_loc)[: num_reqs + 1], t, side="right") - 1
    valid = sm >= 0
    cont = np.zeros(T, bool)
    cont[1:] = valid[1:] & (sm[1:] % block_size != 0) & (sm[:-1] == sm[1:] - 1) & (zone[1:] == zone[:-1])
    start = valid & ~cont
    starts = np.flatnonzero(start)
    boundary = np.flatnonzero(start | ~valid)  # a run ends at the next start or padding token
    nxt = np.searchsorted(boundary, starts, side="right")
    end = np.where(nxt < boundary.size, boundary[np.minimum(nxt, boundary.size - 1)], T)
    z = zone[starts]
    slot = np.where((z >= 0) & (z < num_reqs), z, -1)
    return starts, end - starts, slot


def read_blocks(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Read records of one layer call: (request row, block column, token count) per (request, block)."""
    sl = np.asarray(seq_lens).astype(np.int64)
    max_blocks = block_table.shape[1]
    n = np.where(sl > 0, (sl - 1) // block_size + 1, 0)
    n = np.minimum(n, max_blocks)
    r = np.repeat(np.arange(sl.shape[0]), n)
    j = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    count = np.minimum(block_size, sl[r] - j * block_size)
    return r, j, count


def layer_records(step: int, layer: int, ts: int, slot_mapping, block_table, seq_lens, query_start_loc,
                  block_size: int) -> np.ndarray:
    """The records of one layer call (writes in token order, then reads by request and block), REC_DTYPE."""
    sm, bt, sl = _as_numpy(slot_mapping), _as_numpy(block_table), _as_numpy(seq_lens)
    qsl = _as_numpy(query_start_loc)
    R = sl.shape[0]
    ws, wlen, wslot = write_runs(sm, qsl, R, block_size)
    rr, rj, rcount = read_blocks(bt, sl, block_size)
    out = np.empty(ws.size + rr.size, REC_DTYPE)
    out["step"], out["ts"] = step, ts
    w, r = out[: ws.size], out[ws.size:]
    s = sm[ws].astype(np.int64)
    w["block_id"] = s // block_size
    w["slot"] = wslot
    w["meta"] = (layer & 0xFFFF) | (OP_WRITE << 16)
    w["tok"] = (s % block_size) | (wlen.astype(np.uint32) << 16)
    r["block_id"] = bt[rr, rj] if rr.size else 0
    r["slot"] = rr
    r["meta"] = (layer & 0xFFFF) | (OP_READ << 16)
    r["tok"] = rcount.astype(np.uint32) << 16
    return out


def layer_counts(slot_mapping, block_table, seq_lens, query_start_loc, block_size: int) -> tuple[int, int]:
    """(reads, writes): the records `layer_records` would produce."""
    sm, bt, sl = _as_numpy(slot_mapping), _as_numpy(block_table), _as_numpy(seq_lens)
    R = sl.shape[0]
    sl64 = sl.astype(np.int64)
    reads = int(np.minimum(np.where(sl64 > 0, (sl64 - 1) // block_size + 1, 0), bt.shape[1]).sum())
    writes = int(write_runs(sm, _as_numpy(query_start_loc), R, block_size)[0].size)
    return reads, writes


# ---- ring positions, laps, decoding --------------------------------------------------------------------
def set_laps(recs: np.ndarray, first_pos: int, log2cap: int) -> None:
    """Tag records stored at positions first_pos.. with their lap (in place)."""
    pos = np.arange(first_pos, first_pos + recs.size, dtype=np.uint64)
    lap = ((pos >> np.uint64(log2cap)) & np.uint64(LAP_MASK)).astype(np.uint32)
    recs["meta"] = (recs["meta"] & np.uint32(0x1FFFF)) | (lap << np.uint32(17))


def lap_ok(recs: np.ndarray, first_pos: int, log2cap: int) -> np.ndarray:
    """Whether each record, stored at positions first_pos.., carries the lap of its position. The lap
    is constant between two multiples of the capacity (a drained window spans at most two laps), so
    each such run compares against one number: no per-record position arrays (this is most of a big
    drain's CPU otherwise)."""
    got = recs["meta"] >> np.uint32(17)
    out = np.empty(recs.size, dtype=bool)
    cap, i, pos = 1 << log2cap, 0, first_pos
    while i < recs.size:
        run = min(recs.size - i, cap - (pos & (cap - 1)))  # positions left before the next lap starts
        np.equal(got[i:i + run], np.uint32((pos >> log2cap) & LAP_MASK), out=out[i:i + run])
        i, pos = i + run, pos + run
    return out


def parse_layers(spec: str | Iterable[int] | None, granularity: str) -> str | frozenset[int]:
    if spec is None:
        return AUTO if granularity == "timing" else ALL
    if isinstance(spec, str):
        s = spec.strip().lower()
        if s in (ALL, AUTO, NONE):
            return s
        return frozenset(int(x) for x in s.split(",") if x.strip())
    return frozenset(int(x) for x in spec)






# ---- the shared part of both rings -----------------------------------------------------------------------
class KVAccessRing:
    """Configuration, sampling, layer selection and row emission shared by the CPU and GPU rings."""

    backend = "base"
    source = "host"
    _state_due = False  # the device ring's deferred begin_step launch (the CPU ring has none)

    def state_missed(self) -> None:
        """After a forward pass that left begin_step's work undone (the device ring's; nothing here)."""

    def __init__(self, capacity: int = 1 << 20, block_size: int = 16, granularity: str = "timing",
                 layers: str | Iterable[int] | None = None, sample_every: int = 1, recorder: Any = None,
                 timing_capacity: int = 1 << 14, auto_drain: bool = True, overlap: bool = False,
                 share_layers: bool = True):
        for name, v in (("capacity", capacity), ("timing_capacity", timing_capacity)):
            if v < 2 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 2, got {v}")
        if granularity not in ("timing", "blocks"):
            raise ValueError(f"granularity must be 'timing' or 'blocks', got {granularity!r}")
        if block_size < 1 or block_size > 0xFFFF:
            raise ValueError(f"block_size must be in [1, 65535], got {block_size}")
        if sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        self.capacity, self.log2cap = capacity, capacity.bit_length() - 1
        self.timing_capacity, self.log2tcap = timing_capacity, timing_capacity.bit_length() - 1
        self.block_size = block_size
        self.granularity = granularity
        self.layers = parse_layers(layers, granularity)
        self.sample_every = sample_every
        self.auto_drain = auto_drain
        self.overlap = overlap  # GPU only (see CudaKVAccessRing); nothing to overlap on the CPU
        # layers "all": a layer that reads the block table an earlier layer of the same forward pass read
        # (one KV-cache group) is recorded as that layer's copy, not again (see `share_layers` above)
        self.share_layers = share_layers
        self.layer_copies: dict[int, int] = {}  # layer -> the layer whose records stand for its own
        self._copies: tuple[int, ...] = ()      # the same, flattened (layer, source, ...), for the shards
        self._sources: set[int] = set()          # layers whose block records are recorded (layers "all")
        self._drop_units = 1                    # rows a lost device record stands for (_count_units)
        if recorder is None:  # the process's recorder, or one that discards when no session is active
            from kvtrace.record.recorder import NullRecorder, get_recorder

            recorder = get_recorder()
            if recorder is None:
                recorder = NullRecorder()
        self.recorder = recorder
        self._append_columns = self.recorder.append_columns
        # A recorder that writes shards takes block records packed (kv_access_records) and timing records
        # as they are (decoded at its flush); one that keeps rows in memory gets them decoded.
        self._append_records = getattr(self.recorder, "append_kv_records", None)
        self._append_timings = getattr(self.recorder, "append_timing_records", None)
        # Cumulative; drain_s = host seconds spent copying out and decoding (the background thread's CPU).
        self.stats = {"kv_rows": 0, "timing_rows": 0, "kv_dropped": 0, "timing_dropped": 0, "drain_s": 0.0}
        self.step = -1
        self.active = False
        self._seen_tables: dict[tuple, tuple] = {}  # block table -> (first layer that read it this pass, it)
        self._last_layer = -1
        self.closed = False

    # -- decisions made on the host, per call -------------------------------------------------------------
    def _set_step(self, step: int, record: bool) -> None:
        self.step = int(step)
        self.active = bool(record) and self.step % self.sample_every == 0
        self._seen_tables.clear()
        self._last_layer = -1

    def _wants_blocks(self, layer_idx: int, block_table: Any) -> bool:
        """Block records for this layer call? (fixed per layer, so it is safe to freeze into a graph)"""
        spec = self.layers
        if spec == ALL and not self.share_layers:
            return True
        if spec == NONE:
            return False
        if spec in (AUTO, ALL):
            if layer_idx <= self._last_layer:  # a new forward pass (also between graph captures)
                self._seen_tables.clear()
            self._last_layer = layer_idx
            # The table's memory and shape; the value holds the table itself until the pass ends, so
            # its memory cannot be freed and handed to another table meanwhile (a false match).
            addr = block_table.data_ptr() if hasattr(block_table, "data_ptr") else id(block_table)
            key = (addr, tuple(block_table.shape))
            first = self._seen_tables.setdefault(key, (layer_idx, block_table))[0]
            if first == layer_idx:
                if spec == ALL and layer_idx not in self._sources:
                    self._sources.add(layer_idx)
                    self._count_units()
                return True
            if spec == ALL:  # the same blocks as `first` read: recorded as its copy
                self._note_copy(layer_idx, first)
            return False
        return layer_idx in spec

    def _note_copy(self, layer: int, source: int) -> None:
        known = self.layer_copies.get(layer)
        if known == source:
            return
        if known is not None:  # a layer grouped otherwise than before: keep the first, say so once
            if not getattr(self, "_regrouped", False):
                self._regrouped = True
                self._warn(f"KV access ring: layer {layer} read layer {source}'s block table after layer {known}'s; "
                           f"its rows are copied from layer {known}'s")
            return
        self.layer_copies[layer] = source
        self._copies = tuple(v for pair in sorted(self.layer_copies.items()) for v in pair)
        self._count_units()
        self._copies_changed()

    def _copies_changed(self) -> None:
        """`_copies` changed (the device ring's drain loop writes them into its frames)."""

    def _count_units(self) -> None:
        """A lost device record stands for its copies' rows too: drops count that many rows per record,
        exact when every recorded layer has as many copies (one KV-cache group, or equal groups);
        otherwise they count device records (1)."""
        sizes = dict.fromkeys(self._sources, 1)
        for src in self.layer_copies.values():
            sizes[src] = sizes.get(src, 1) + 1
        self._drop_units = next(iter(sizes.values())) if len(set(sizes.values())) == 1 else 1

    # -- row emission (drain side) -------------------------------------------------------------------------
    def _clock(self) -> tuple[int, int, float]:
        """How this ring's timestamps map to host ns (format/kv_records.py to_host_ns)."""
        return IDENTITY_CLOCK

    def _emit(self, table: str, cols: dict[str, np.ndarray]) -> None:
        n = len(next(iter(cols.values())))
        if n == 0:
            return
        self._append_columns(table, cols)

    def _decode_window(self, recs: np.ndarray, first_pos: int, tail: int, head: int, log2cap: int,
                       min_valid: int, timing: bool) -> None:
        """Emit the records of positions [first_pos, head) held in `recs` that are intact; count the rest.

        Every position in [tail, head) is either emitted or counted as dropped: positions below
        `min_valid` (overwritten before or while they were copied) and records whose lap tag is wrong.
        """
        skip = max(0, min_valid - first_pos)
        recs = recs[skip:]
        packed = self._append_timings if timing else self._append_records
        if native_drain is not None and packed is not None and recs.flags.c_contiguous:
            # kept in memory of their own by one native call (_drain.c)
            kept = np.frombuffer(native_drain.keep_intact(recs, first_pos + skip, log2cap), recs.dtype)
            return self._emit_window(kept, tail, head, timing, owned=True)
        ok = lap_ok(recs, first_pos + skip, log2cap)
        self._emit_window(recs if ok.all() else recs[ok], tail, head, timing)

    def _emit_window(self, good: np.ndarray, tail: int, head: int, timing: bool, owned: bool = False) -> None:
        """Emit a window's intact records (`good`) and count the rest of positions [tail, head) as
        dropped. `owned`: `good` is in memory of its own (not the ring's or its staging memory)."""
        table = "layer_timings" if timing else "kv_access"
        dropped = (head - tail) - good.size
        if good.size:
            self._hand_over(good, timing, self._clock(), self._copies, owned)
        self.stats["timing_rows" if timing else "kv_rows"] += int(good.size)
        if dropped:
            self.stats["timing_dropped" if timing else "kv_dropped"] += int(dropped)
            self.recorder.count_drop(table, int(dropped) * (1 if timing else self._drop_units), "ring-wrap")

    def _hand_over(self, good: np.ndarray, timing: bool, clock: tuple[int, int, float], copies: tuple[int, ...],
                   owned: bool) -> None:
        """Intact records to the recorder: packed as they are where it takes them (block records written as
        frames and decoded by ingest, timing records decoded at its flush), else decoded into rows here;
        `clock` maps their timestamps, `copies` are the layers recorded as their sources'."""
        if not timing and self._append_records is not None:
            self._append_records(good, clock, copies, owned)
        elif timing and self._append_timings is not None:
            self._append_timings(good, clock, owned)
        else:
            ts = to_host_ns(good["ts"], clock)
            self._emit("layer_timings" if timing else "kv_access",
                       unpack_timings(good, ts) if timing else copy_layers(unpack_records(good, ts), copies))

    # The probe whose status says when records were lost without a count (kvtrace's attention probe).
    probe = "attention"

    def _lost_uncounted(self, why: str) -> None:
        """Records recorded on the device but never drained, how many unknown: not a countable drop, so
        the probe is `degraded` with the reason (a session that lost them is never `complete`)."""
        set_status = getattr(self.recorder, "set_probe_status", None)
        if set_status is not None:
            set_status(self.probe, "degraded", f"KV access ring on {self.source}: {why}; records made "
                       "since its last drain are lost and not counted")

    def _warn(self, message: str) -> None:
        warn = getattr(self.recorder, "warn", None)
        if warn is not None:
            warn(message)
        else:
            print(f"kvtrace: warning: {message}", file=sys.stderr, flush=True)

    # -- the API (implemented by the subclasses) ----------------------------------------------------------
    def begin_step(self, step: int, record: bool = True) -> None:
        raise NotImplementedError

    def record_layer(self, layer_idx: int, slot_mapping, block_table, seq_lens, query_start_loc=None) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        raise NotImplementedError

    def flush(self, timeout_s: float = 30.0) -> None:
        self.drain()

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.closed = True

    def __enter__(self) -> KVAccessRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CPUKVAccessRing(KVAccessRing):
    """The ring in host memory, filled with NumPy (vLLM's CPU backend; the GPU ring's reference)."""

    backend = "cpu"

    # Drained at a step boundary once this long has passed since the last drain (monotonic ns), or
    # sooner when a ring is a quarter full: decoding costs tens of microseconds per call, whatever
    # the number of records, so draining every step would cost more than recording.
    DRAIN_EVERY_NS = 100_000_000

    def __init__(self, **kw: Any):
        super().__init__(**kw)
        self._drained_ns = time.monotonic_ns()
        # The records of the current forward pass, by metadata tensors: the layers of one KV-cache
        # group read one block table, slot mapping and seq_lens, so later layers reuse the first's.
        self._memo: dict[tuple, tuple[np.ndarray | None, int, int]] = {}
        self._memo_layer = -1
        self._ring = np.zeros(self.capacity, REC_DTYPE)
        self._ring["meta"] = np.uint32(0xFFFFFFFF)  # lap 0x7FFF: an unwritten slot never passes as lap 0
        self._tring = np.zeros(self.timing_capacity, TIM_DTYPE)
        self._tring["meta"] = np.uint32(0xFFFFFFFF)
        self._head = self._tail = 0
        self._thead = self._ttail = 0

    def begin_step(self, step: int, record: bool = True) -> None:
        self._set_step(step, record)
        self._memo.clear()
        if self.auto_drain:
            now = time.monotonic_ns()
            if (now - self._drained_ns >= self.DRAIN_EVERY_NS or (self._head - self._tail) * 4 >= self.capacity
                    or (self._thead - self._ttail) * 4 >= self.timing_capacity):
                self._drained_ns = now
                self.drain()

    def record_layer(self, layer_idx: int, slot_mapping, block_table, seq_lens, query_start_loc=None) -> None:
        if not self.active:
            return
        ts = time.monotonic_ns()
        if layer_idx <= self._memo_layer:  # a new forward pass: new metadata in the same buffers
            self._memo.clear()
        self._memo_layer = layer_idx
        key = (_buffer_key(slot_mapping), _buffer_key(block_table), _buffer_key(seq_lens),
               _buffer_key(query_start_loc))
        memo = self._memo.get(key)
        if self._wants_blocks(layer_idx, block_table):
            if memo is not None and memo[0] is not None:  # the same records, another layer
                recs = memo[0].copy()
                recs["ts"] = ts
                recs["meta"] = (recs["meta"] & np.uint32(0xFFFF0000)) | np.uint32(layer_idx & 0xFFFF)
                reads, writes = memo[1], memo[2]
            else:
                recs = layer_records(self.step, layer_idx, ts, slot_mapping, block_table, seq_lens,
                                     query_start_loc, self.block_size)
                writes = int(((recs["meta"] >> 16) & 1).sum())
                reads = recs.size - writes
                self._memo[key] = (recs, reads, writes)
            self._head = self._push(self._ring, self.log2cap, self._head, recs)
        elif memo is not None:
            reads, writes = memo[1], memo[2]
        else:
            reads, writes = layer_counts(slot_mapping, block_table, seq_lens, query_start_loc, self.block_size)
            self._memo[key] = (None, reads, writes)
        # One timing record, stored in place (what `_push` does for many, without its array set-up).
        pos = self._thead
        lap = (pos >> self.log2tcap) & LAP_MASK
        self._tring[pos & (self.timing_capacity - 1)] = (self.step, ts, reads, writes,
                                                         (layer_idx & 0xFFFF) | (lap << 17), 0)
        self._thead = pos + 1

    @staticmethod
    def _push(ring: np.ndarray, log2cap: int, head: int, recs: np.ndarray) -> int:
        """Store recs at positions head.. (only the last `capacity` survive, as on the device)."""
        n, cap = recs.size, ring.size
        first = head
        if n > cap:
            recs, first = recs[n - cap:], head + n - cap
        recs = recs.copy()
        set_laps(recs, first, log2cap)
        idx = np.arange(first, first + recs.size, dtype=np.int64) & (cap - 1)
        ring[idx] = recs
        return head + n

    def drain(self) -> None:
        t0 = time.perf_counter()
        self._drain_all()
        self.stats["drain_s"] += time.perf_counter() - t0

    def _drain_all(self) -> None:
        self._tail = self._drain_one(self._ring, self.log2cap, self._tail, self._head, timing=False)
        self._ttail = self._drain_one(self._tring, self.log2tcap, self._ttail, self._thead, timing=True)

    def _drain_one(self, ring: np.ndarray, log2cap: int, tail: int, head: int, timing: bool) -> int:
        if head == tail:
            return tail
        lo = max(tail, head - ring.size)
        recs = ring[np.arange(lo, head, dtype=np.int64) & (ring.size - 1)]
        self._decode_window(recs, lo, tail, head, log2cap, lo, timing)
        return head


def _buffer_key(x: Any) -> tuple:
    """Identifies a metadata tensor's buffer and shape (its contents are fixed within a forward pass)."""
    if x is None:
        return ()
    ptr = x.data_ptr() if hasattr(x, "data_ptr") else x.__array_interface__["data"][0]
    return (ptr, tuple(x.shape))


