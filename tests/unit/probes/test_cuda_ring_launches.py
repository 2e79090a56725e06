"""The device ring's launch arguments, built on the host (no GPU needed: CPU tensors stand in for the
device's, the ring for its host side, a recording function for the driver's launch). In an eager forward
pass every layer gets the same metadata tensors: they are read and checked once per set, and each layer's
launch carries its own layer all the same. Only the first launch of a set in a pass counts the records
(kv_record); the layers after it that record no blocks copy its counts (kv_time)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtrace.probes.kv_access import cuda_ring
from kvtrace.probes.kv_access.cuda_ring import MAX_GRID, SMEM_QSL, THREADS, WARPS, CudaKVAccessRing

BLOCK_SIZE = 16
RECORD, TIME = 1234, 5678  # stand-ins for the kv_record and kv_time CUfunctions


def host_ring() -> tuple[CudaKVAccessRing, list]:
    """The ring's host side (no device, no CuPy) and the launches it makes: (kernel, grid, threads, shared
    memory, the argument struct's fields as they were at the launch)."""
    ring = object.__new__(CudaKVAccessRing)
    ring._torch, ring.device, ring.block_size = torch, torch.device("cpu"), BLOCK_SIZE
    ring._state = torch.zeros(8, dtype=torch.int64)
    ring._ring, ring._tring = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    ring.capacity, ring.log2cap, ring.timing_capacity, ring.log2tcap = 1 << 20, 20, 1 << 14, 14
    ring._emit_launch = cuda_ring._Launch(cuda_ring._RecordArgs(), 1, SMEM_QSL * 4, RECORD)
    ring._count_launch = cuda_ring._Launch(cuda_ring._RecordArgs(), 1, 0, RECORD)
    ring._time_launch = cuda_ring._Launch(cuda_ring._RecordArgs(), 1, 0, TIME, threads=1)
    ring._checked_key = ring._pass_tensors = ring._counted = None
    ring.count_once, ring._capture_hooked = True, True
    ring.active, ring.overlap, ring._side_ptr = True, False, -1
    ring._current_stream = lambda: 7
    ring._wants_blocks = lambda layer, block_table: layer == 3  # block records from layer 3 only
    launches = []

    def launch(fn, gx, gy, gz, bx, by, bz, smem, stream, params_addr, extra):
        assert (gy, gz, by, bz, stream, extra) == (1, 1, 1, 1, 7, 0)
        struct = ctypes.cast(ctypes.cast(params_addr, ctypes.POINTER(ctypes.c_void_p))[0],
                             ctypes.POINTER(cuda_ring._RecordArgs)).contents
        launches.append((fn, gx, bx, smem, fields(struct)))  # copied now, as cuLaunchKernel copies them
    ring._launch_kernel = launch
    return ring, launches


def metadata(tokens: int, reqs: int, slot_dtype=torch.int64):
    return (torch.arange(tokens, dtype=slot_dtype), torch.zeros((reqs + 2, 40), dtype=torch.int32),
            torch.full((reqs,), 100, dtype=torch.int32), torch.arange(reqs + 1, dtype=torch.int32))


def fields(args) -> dict:
    return {name: getattr(args, name) for name, _ in args._fields_}


def expected(ring, layer: int, emit: bool, sm, bt, sl, q, counts: bool = True) -> tuple:
    """The kernel, grid, threads, shared memory and struct of one layer's launch, field by field from the
    tensors. `counts` False: kv_time (the layer copies the counts of the launch before it)."""
    T, R = sm.shape[0], sl.shape[0]
    read_blocks = min(-(-R // WARPS), MAX_GRID) if emit else 0
    grid = 1 + read_blocks + (min(-(-T // THREADS), MAX_GRID) if emit else 0)
    args = dict(state=ring._state.data_ptr(), ring=ring._ring.data_ptr(), tring=ring._tring.data_ptr(),
                slot_mapping=sm.data_ptr(), block_table=bt.data_ptr(), seq_lens=sl.data_ptr(), qsl=q.data_ptr(),
                bt_stride=bt.stride(0), num_tokens=T, num_reqs=R, max_blocks=bt.shape[1], block_size=BLOCK_SIZE,
                layer=layer, emit=int(emit), sm_is_64=int(sm.dtype == torch.int64), read_blocks=read_blocks,
                ring_mask=ring.capacity - 1, ring_log2=20, tring_mask=ring.timing_capacity - 1, tring_log2=14)
    if not emit and not counts:
        return TIME, 1, 1, 0, args
    return RECORD, grid, THREADS, SMEM_QSL * 4 if emit else 0, args


def pass_launches(ring, meta, layers=range(8), emitting=(3,)) -> list:
    """A pass's launches as expected: the first counts, an emitting layer counts, the others copy."""
    first = min(layers)
    return [expected(ring, layer, layer in emitting, *meta, counts=layer == first) for layer in layers]


def test_each_layer_launches_its_own_arguments_from_one_check_per_set_of_tensors(monkeypatch):
    ring, launches = host_ring()
    checks, reads = [], []
    real = CudaKVAccessRing._checked_args
    monkeypatch.setattr(CudaKVAccessRing, "_checked_args", lambda self, *t: checks.append(1) or real(self, *t))
    real_prepare = CudaKVAccessRing._prepare
    monkeypatch.setattr(CudaKVAccessRing, "_prepare", lambda self, *t: reads.append(1) or real_prepare(self, *t))
    for step, (tokens, reqs, dtype) in enumerate(((300, 7, torch.int64), (9, 9, torch.int32), (5000, 256, torch.int64))):
        meta = metadata(tokens, reqs, dtype)
        launches.clear()
        for layer in range(8):
            ring.record_layer(layer, *meta)
        assert len(checks) == len(reads) == step + 1  # the pass's eight layers: one read, one check
        assert launches == pass_launches(ring, meta)
        ring._pass_tensors = ring._counted = None  # the next step (begin_step)
    # New tensor objects over the same memory and shapes (the next step's views of persistent buffers):
    # read again, not checked again
    again = tuple(t.view(t.shape) for t in meta)
    launches.clear()
    ring.record_layer(3, *again)
    assert (len(reads), len(checks)) == (4, 3)
    assert launches == [expected(ring, 3, True, *meta)]


def test_a_layer_counts_its_records_itself_unless_the_launch_before_it_in_the_pass_counted_the_same_tensors():
    ring, launches = host_ring()
    a, b = metadata(64, 4), metadata(32, 2)
    # two KV-cache groups interleaved: every launch follows another set's, so every one counts
    for layer in range(4):
        ring.record_layer(layer, *(a if layer % 2 == 0 else b))
    assert [fn for fn, *_ in launches] == [RECORD] * 4
    # a new pass (the layer index goes back) with the same tensors: its first layer counts again
    launches.clear()
    for layer in (0, 1, 2):
        ring.record_layer(layer, *a)
    assert launches == pass_launches(ring, a, layers=(0, 1, 2))
    # a graph capture begun in between starts a new pass too
    launches.clear()
    cuda_ring._CAPTURES[1] += 1
    ring.record_layer(5, *a)
    ring.record_layer(6, *a)
    assert launches == pass_launches(ring, a, layers=(5, 6))
    # where captures cannot be counted, or count_once is off, every layer counts
    for attr in ("_capture_hooked", "count_once"):
        ring, launches = host_ring()
        setattr(ring, attr, False)
        for layer in range(3):
            ring.record_layer(layer, *a)
        assert launches == [expected(ring, layer, layer == 3, *a) for layer in range(3)]


def test_a_new_set_of_tensors_is_checked_and_a_bad_one_launches_nothing():
    ring, launches = host_ring()
    good = metadata(64, 4)
    ring.record_layer(0, *good)
    sm, bt, sl, q = good
    bad = (sm, bt, sl.to(torch.int64), q)  # same shapes, another seq_lens tensor of the wrong type
    with pytest.raises(TypeError, match="seq_lens must be int32"):
        ring.record_layer(1, *bad)
    with pytest.raises(TypeError, match="seq_lens must be int32"):  # checked again, not taken as read
        ring.record_layer(2, *bad)
    short = (sm, bt, sl, torch.arange(2, dtype=torch.int32))  # a query_start_loc too short for 4 requests
    with pytest.raises(ValueError, match="query_start_loc has 2 entries for 4 requests"):
        ring.record_layer(3, *short)
    ring.record_layer(3, *good)  # the good set still launches as it did
    assert launches == [expected(ring, 0, False, *good), expected(ring, 3, True, *good)]
    ring.record_layer(4, *good)  # and the layer after it copies its counts
    assert launches[-1] == expected(ring, 4, False, *good, counts=False)


def test_the_argument_struct_mirrors_the_kernel_source():
    assert ctypes.sizeof(cuda_ring._RecordArgs) == 112
    source = cuda_ring.KERNEL_SOURCE.read_text()
    struct = source[source.index("struct RecordArgs"):source.index("};", source.index("struct RecordArgs"))]
    names = [line.split(";")[0].split()[-1].lstrip("*") for line in struct.splitlines()[1:] if ";" in line]
    assert names == [name for name, _ in cuda_ring._RecordArgs._fields_]
