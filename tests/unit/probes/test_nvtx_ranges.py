"""NVTX ranges and marks (probes/nvtx_ranges.py) without a GPU or a profiler.

With no profiler listening, nvtx hands out a disabled domain, so the on path is exercised through a
real `nvtx.Domain` built by hand (its C calls go to NVTX's no-op stubs) that also records what it is
asked to emit.
"""

from __future__ import annotations

import re
import sys
import timeit

import pytest

from kvtrace.ingest.nsys_align import MARK_PATTERN
from kvtrace.probes import nvtx_ranges

nvtx = pytest.importorskip("nvtx")
from nvtx._lib.lib import DomainHandle  # noqa: E402


class RecordingDomain(nvtx.Domain):
    """A real NVTX domain object, made without a profiler, that records (call, message) pairs."""

    def __new__(cls, name: str):
        obj = object.__new__(cls)
        obj.handle = DomainHandle(name)
        return obj

    def __init__(self, name: str):
        super().__init__(name)
        self.calls: list[tuple[str, str | None]] = []

    def mark(self, attributes=None, **kw):
        self.calls.append(("mark", attributes.message.string))
        super().mark(attributes, **kw)

    def push_range(self, attributes=None, **kw):
        self.calls.append(("push", attributes.message.string))
        super().push_range(attributes, **kw)

    def pop_range(self):
        self.calls.append(("pop", None))
        super().pop_range()


@pytest.fixture
def recorder():
    domain = RecordingDomain(nvtx_ranges.DOMAIN)
    assert nvtx_ranges.configure(enabled=True, layers=True, domain=domain)
    yield domain
    nvtx_ranges.configure()


def test_mark_message_format_matches_ingest():
    assert nvtx_ranges.mark_message(1234, 987654321) == "kvtrace:step=1234:mono_ns=987654321"
    m = re.match(MARK_PATTERN, nvtx_ranges.mark_message(-1, 5))
    assert m and m.groups() == ("-1", "5")


def test_off_without_profiler(monkeypatch):
    monkeypatch.delenv("KVTRACE_NVTX", raising=False)
    assert nvtx_ranges.configure() is False  # nvtx installed, nobody listening: disabled domain
    assert not nvtx_ranges.enabled()
    nvtx_ranges.push_step(1)
    nvtx_ranges.push_phase("schedule")
    nvtx_ranges.pop()
    with nvtx_ranges.step(2), nvtx_ranges.phase("execute"), nvtx_ranges.layer(3):
        pass


def test_off_by_env_and_without_nvtx(monkeypatch):
    domain = RecordingDomain(nvtx_ranges.DOMAIN)
    monkeypatch.setenv("KVTRACE_NVTX", "0")
    assert nvtx_ranges.configure(domain=domain) is False
    with nvtx_ranges.step(1):
        nvtx_ranges.push_phase("update")
        nvtx_ranges.pop()
    assert domain.calls == []
    monkeypatch.delenv("KVTRACE_NVTX")
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    assert nvtx_ranges.configure(domain=domain) is False
    nvtx_ranges.configure()


def test_step_phases_layers_emitted(recorder, monkeypatch):
    monkeypatch.setattr(nvtx_ranges.time, "monotonic_ns", lambda: 42_000)
    with nvtx_ranges.step(7):
        for name in nvtx_ranges.PHASES:
            with nvtx_ranges.phase(name):
                if name == "execute":
                    for i in range(2):
                        with nvtx_ranges.layer(i):
                            pass
    assert recorder.calls == [
        ("mark", "kvtrace:step=7:mono_ns=42000"), ("push", "kvtrace step 7"),
        ("push", "kvtrace schedule"), ("pop", None),
        ("push", "kvtrace execute"),
        ("push", "kvtrace layer 0"), ("pop", None), ("push", "kvtrace layer 1"), ("pop", None),
        ("pop", None),
        ("push", "kvtrace update"), ("pop", None),
        ("pop", None),
    ]


def test_push_pop_pairs_and_layers_off(monkeypatch):
    domain = RecordingDomain(nvtx_ranges.DOMAIN)
    nvtx_ranges.configure(enabled=True, layers=False, domain=domain)
    try:
        nvtx_ranges.push_step(3)
        with nvtx_ranges.layer(0):  # layer ranges off: nothing
            pass
        nvtx_ranges.pop()
        assert [c for c, _m in domain.calls] == ["mark", "push", "pop"]
        assert domain.calls[0][1].startswith("kvtrace:step=3:mono_ns=")
    finally:
        nvtx_ranges.configure()


def test_cheap(recorder):
    """Off: a branch (well under 1 µs); on: a few µs per step even on this small machine."""
    n = 20_000
    on = timeit.timeit("push_step(5); pop()", globals=vars(nvtx_ranges), number=n) / n
    nvtx_ranges.configure(enabled=False)
    off = timeit.timeit("push_step(5); pop()", globals=vars(nvtx_ranges), number=n) / n
    assert off < 1e-6
    assert on < 50e-6  # the recorder's Python bookkeeping included
