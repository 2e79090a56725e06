"""The device ring's launch arguments, built on the host (no GPU needed: CPU tensors stand in for the
device's, and the ring for its host side). In an eager forward pass every layer gets the same metadata
tensors: they are checked once per set, and each layer's launch is its own all the same."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvtrace.probes.kv_access import cuda_ring
from kvtrace.probes.kv_access.cuda_ring import MAX_GRID, SMEM_QSL, THREADS, WARPS, CudaKVAccessRing

BLOCK_SIZE = 16


def host_ring() -> CudaKVAccessRing:
    ring = object.__new__(CudaKVAccessRing)  # the host side only: no device, no CuPy
    ring._torch, ring.device, ring.block_size = torch, torch.device("cpu"), BLOCK_SIZE
    ring._state = torch.zeros(8, dtype=torch.int64)
    ring._ring, ring._tring = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    ring.capacity, ring.log2cap, ring.timing_capacity, ring.log2tcap = 1 << 20, 20, 1 << 14, 14
    ring._launches, ring._checked_key, ring._template = {}, None, None
    return ring


def metadata(tokens: int, reqs: int, slot_dtype=torch.int64):
    return (torch.arange(tokens, dtype=slot_dtype), torch.zeros((reqs + 2, 40), dtype=torch.int32),
            torch.full((reqs,), 100, dtype=torch.int32), torch.arange(reqs + 1, dtype=torch.int32))


def key(emit: bool, sm, bt, sl, q) -> tuple:  # as record_layer makes it
    return (emit, sm.data_ptr(), sm.shape[0], sm.dtype, bt.data_ptr(), bt.shape[0], bt.shape[1], bt.stride(0),
            sl.data_ptr(), sl.shape[0], q.data_ptr())


def fields(args) -> dict:
    return {name: getattr(args, name) for name, _ in args._fields_}


def expected(ring, layer: int, emit: bool, sm, bt, sl, q) -> tuple[dict, int, int]:
    """The struct, grid and shared memory of one layer's launch, field by field from the tensors."""
    T, R = sm.shape[0], sl.shape[0]
    read_blocks = min(-(-R // WARPS), MAX_GRID) if emit else 0
    grid = 1 + read_blocks + (min(-(-T // THREADS), MAX_GRID) if emit else 0)
    args = dict(state=ring._state.data_ptr(), ring=ring._ring.data_ptr(), tring=ring._tring.data_ptr(),
                slot_mapping=sm.data_ptr(), block_table=bt.data_ptr(), seq_lens=sl.data_ptr(), qsl=q.data_ptr(),
                bt_stride=bt.stride(0), num_tokens=T, num_reqs=R, max_blocks=bt.shape[1], block_size=BLOCK_SIZE,
                layer=layer, emit=int(emit), sm_is_64=int(sm.dtype == torch.int64), read_blocks=read_blocks,
                ring_mask=ring.capacity - 1, ring_log2=20, tring_mask=ring.timing_capacity - 1, tring_log2=14)
    return args, grid, SMEM_QSL * 4 if emit else 0


def test_each_layer_gets_its_own_launch_from_one_check_per_set_of_tensors(monkeypatch):
    ring = host_ring()
    checks = []
    real = CudaKVAccessRing._checked_args
    monkeypatch.setattr(CudaKVAccessRing, "_checked_args", lambda self, *t: checks.append(1) or real(self, *t))
    for step, (tokens, reqs, dtype) in enumerate(((300, 7, torch.int64), (9, 9, torch.int32), (5000, 256, torch.int64))):
        meta = metadata(tokens, reqs, dtype)
        launches = [ring._prepare(layer, layer == 3, key(layer == 3, *meta), *meta) for layer in range(8)]
        assert len(checks) == step + 1  # one check for the pass's eight layers
        assert len({id(launch.args) for launch in launches}) == 8  # a struct each, reused from step to step
        for layer, launch in enumerate(launches):
            args, grid, smem = expected(ring, layer, layer == 3, *meta)
            assert (fields(launch.args), launch.grid, launch.smem) == (args, grid, smem)
            assert launch.key == key(layer == 3, *meta)
            assert ctypes.cast(launch.params, ctypes.POINTER(ctypes.c_void_p))[0] == ctypes.addressof(launch.args)
        # the same tensors again (another layer call of the pass): no new check
        ring._prepare(0, False, key(False, *meta), *meta)
        assert len(checks) == step + 1


def test_a_new_set_of_tensors_is_checked_again():
    ring = host_ring()
    good = metadata(64, 4)
    ring._prepare(0, True, key(True, *good), *good)
    sm, bt, sl, q = good
    bad = (sm, bt, sl.to(torch.int64), q)  # same shapes, another seq_lens tensor of the wrong type
    with pytest.raises(TypeError, match="seq_lens must be int32"):
        ring._prepare(1, False, key(False, *bad), *bad)
    short = (sm, bt, sl, torch.arange(2, dtype=torch.int32))  # a query_start_loc too short for 4 requests
    with pytest.raises(ValueError, match="query_start_loc has 2 entries for 4 requests"):
        ring._prepare(0, True, key(True, *short), *short)
    launch = ring._prepare(0, True, key(True, *good), *good)  # the good set still launches as it did
    assert fields(launch.args) == expected(ring, 0, True, *good)[0]


def test_the_argument_struct_mirrors_the_kernel_source():
    assert ctypes.sizeof(cuda_ring._RecordArgs) == 112
    source = cuda_ring.KERNEL_SOURCE.read_text()
    struct = source[source.index("struct RecordArgs"):source.index("};", source.index("struct RecordArgs"))]
    names = [line.split(";")[0].split()[-1].lstrip("*") for line in struct.splitlines()[1:] if ";" in line]
    assert names == [name for name, _ in cuda_ring._RecordArgs._fields_]
