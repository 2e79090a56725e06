"""Probe hooks (probes/base.py): the first variant whose targets exist is used; a missing optional hook
degrades the probe and says what is lost; a missing required hook disables only that probe, with nothing
left patched."""

from __future__ import annotations

import sys
import types

import pytest

from kvtrace.probes.base import Hook, Probe

MOD = "kvtrace_test_fake_engine"


class StatusRecorder:
    """What a probe needs of the recorder here: its status and warnings."""

    def __init__(self) -> None:
        self.status: dict[str, tuple[str, str]] = {}
        self.warnings: list[str] = []

    def set_probe_status(self, name: str, status: str, reason: str = "") -> None:
        self.status[name] = (status, reason)

    def warn(self, message: str) -> None:
        self.warnings.append(message)


@pytest.fixture
def engine():
    """A stand-in engine module: the newer release renamed `Sched.admit(req)` to `Sched.consider(request)`."""
    mod = types.ModuleType(MOD)

    class Sched:
        def consider(self, request):
            return "considered"

        def step(self):
            return "stepped"

    mod.Sched = Sched
    sys.modules[MOD] = mod
    yield mod
    del sys.modules[MOD]


def make_probe(hooks: list[Hook]):
    class FakeProbe(Probe):
        name = "fake"

        @classmethod
        def hooks(cls):
            return hooks

        def install_patches(self):
            self.used = dict(self.variants)
            if self.variant("admission") == 1:
                self.patch(sys.modules[MOD].Sched, "consider", lambda orig: lambda s, request: "seen " + orig(s, request))

    return FakeProbe(StatusRecorder(), {})


ADMISSION = Hook("admission", (((MOD, "Sched.admit", ("req",)),), ((MOD, "Sched.consider", ("request",)),)))


def test_the_first_variant_present_is_used(engine):
    probe = make_probe([ADMISSION])
    assert probe.install()
    assert probe.variant("admission") == 1 and probe.rec.status["fake"] == ("attached", "")
    assert engine.Sched().consider(1) == "seen considered"
    probe.uninstall()
    assert engine.Sched().consider(1) == "considered"


def test_a_missing_optional_hook_degrades_and_says_what_is_lost(engine):
    optional = Hook("watch", (((MOD, "Sched.watch", ()),),), required=False, lost="why admission stopped")
    probe = make_probe([ADMISSION, optional])
    assert probe.install() and probe.enabled
    status, reason = probe.rec.status["fake"]
    assert status == "degraded"
    assert reason.startswith("not recorded: why admission stopped (")
    assert "Sched.watch not found" in reason
    assert probe.variant("watch") is None and probe.variant("admission") == 1


def test_a_missing_required_hook_disables_the_probe_and_patches_nothing(engine):
    gone = Hook("stepping", (((MOD, "Sched.step", ("batch",)),), ((MOD, "Sched.run", ()),)))
    probe = make_probe([ADMISSION, gone])
    assert not probe.install() and not probe.enabled
    status, reason = probe.rec.status["fake"]
    assert status == "disabled"
    assert "missing parameter(s) batch" in reason and "Sched.run not found" in reason
    assert engine.Sched().consider(1) == "considered"


def test_the_vllm_probes_declare_their_hooks():
    from kvtrace.probes.vllm.kv_blocks import PrefixCacheProbe
    from kvtrace.probes.vllm.scheduler import ADMISSION_HOOK, SchedulerProbe

    # From the classes, as kvtrace doctor reads them (probes/vllm/doctor.py probe_hooks says why).
    assert ADMISSION_HOOK in SchedulerProbe.hooks() and not ADMISSION_HOOK.required
    (lookup,) = PrefixCacheProbe.hooks()
    assert lookup.required and len(lookup.variants) == 2
