"""The device ring counts the CUDA graph captures open through torch.cuda.CUDAGraph (so that `begin_step`
asks CUDA whether its stream captures only while one is): a capture that fails to begin or to end leaves
the count as it was, and overlap rings still join their last fork at the end. No GPU needed: a stand-in
class takes torch.cuda.CUDAGraph's place."""

from __future__ import annotations

import pytest
import torch

from kvtrace.probes.kv_access import cuda_ring


class FakeGraph:
    """torch.cuda.CUDAGraph's two methods the hooks wrap; `fail` makes one of them raise."""

    fail: str | None = None

    def capture_begin(self, *args, **kwargs):
        if self.fail == "begin":
            raise RuntimeError("capture could not begin")
        self.began = (args, kwargs)

    def capture_end(self):
        if self.fail == "end":
            raise RuntimeError("capture failed")


class FakeRing:
    def __init__(self):
        self._fork_pending, self.joined = True, 0

    def join(self):
        self.joined += 1


@pytest.fixture()
def hooked(monkeypatch):
    cls = type("CUDAGraph", (FakeGraph,), {})
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cls)
    monkeypatch.setattr(cuda_ring, "_CAPTURES", [0, 0])
    assert cuda_ring._install_capture_hooks() and cuda_ring._install_capture_hooks()  # once, then a no-op
    return cls


def test_captures_are_counted_while_open(hooked):
    g = hooked()
    g.capture_begin("pool", capture_error_mode="global")
    assert g.began == (("pool",), {"capture_error_mode": "global"}) and cuda_ring._CAPTURES[0] == 1
    h = hooked()
    h.capture_begin()
    assert cuda_ring._CAPTURES[0] == 2
    h.capture_end()
    g.capture_end()
    assert cuda_ring._CAPTURES == [0, 2]  # none open, two begun (each a new forward pass for the ring)


def test_a_failed_begin_or_end_leaves_no_capture_counted(hooked):
    g = hooked()
    g.fail = "begin"
    with pytest.raises(RuntimeError, match="could not begin"):
        g.capture_begin()
    assert cuda_ring._CAPTURES[0] == 0
    g.fail = "end"
    g.capture_begin()
    assert cuda_ring._CAPTURES[0] == 1
    with pytest.raises(RuntimeError, match="capture failed"):
        g.capture_end()
    assert cuda_ring._CAPTURES[0] == 0


def test_overlap_rings_join_at_the_end_and_forget_an_aborted_fork(hooked, monkeypatch):
    ring = FakeRing()
    monkeypatch.setattr(cuda_ring, "_OVERLAP_RINGS", {ring})
    g = hooked()
    g.capture_begin()
    assert ring._fork_pending is False  # a fork left by an aborted capture is not joined into this one
    g.capture_end()
    assert ring.joined == 1


def test_no_class_to_wrap_means_asking_cuda_every_step(monkeypatch):
    monkeypatch.delattr(torch.cuda, "CUDAGraph")
    assert cuda_ring._install_capture_hooks() is False
