"""The connector probe reads metadata that lists whole blocks to copy (SimpleCPUOffloadConnector's) into
one transfer row per direction, and leaves every other metadata to the per-request plan."""

from __future__ import annotations

from types import SimpleNamespace

from kvtrace.probes.vllm.connector import block_lists


def meta(**kw):
    base = dict(store_gpu_blocks=[], store_cpu_blocks=[], load_gpu_blocks=[], load_cpu_blocks=[],
                load_event=-1, load_event_to_reqs={}, store_event=-1)
    return SimpleNamespace(**{**base, **kw})


def test_stores_and_loads_are_counted_in_blocks():
    m = meta(store_gpu_blocks=[4, 5, 6], store_event=0, load_gpu_blocks=[7, 8], load_event=3,
             load_event_to_reqs={3: ["req-a"], 2: ["req-b"]})
    assert block_lists(m) == [("save", None, 3), ("load", "req-a", 2)]


def test_a_load_of_several_requests_names_none():
    m = meta(load_gpu_blocks=[1, 2, 3], load_event=1, load_event_to_reqs={1: ["a", "b"]})
    assert block_lists(m) == [("load", None, 3)]


def test_nothing_to_copy_and_other_metadata():
    assert block_lists(meta()) == []
    assert block_lists(SimpleNamespace(requests=[])) is None  # ExampleConnector-style: per-request plan
    assert block_lists(object()) is None
