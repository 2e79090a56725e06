"""bench/bench_host_steps.py on a small workload: only the probed scheduler's events are recorded (the
other two run vLLM's own methods), and its patches go on and off vLLM's classes as the turns change.
Timings are not checked here (docs/performance.md has them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("vllm")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_host_steps.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_host_steps", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_patches_go_on_and_off_vllms_classes(tmp_path):
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtrace.record.recorder import Recorder
    from tests.helpers.driven_scheduler import install_probes, uninstall_probes

    bench = load_bench()
    vllm_schedule, vllm_touch = Scheduler.__dict__["schedule"], BlockPool.__dict__["touch"]
    rec = Recorder(tmp_path / "session", "engine", {})
    probes = install_probes(rec, ("scheduler", "kv_blocks"))
    try:
        wrapped_schedule, hooked_touch = Scheduler.__dict__["schedule"], BlockPool.__dict__["touch"]
        assert wrapped_schedule is not vllm_schedule and hooked_touch is not vllm_touch
        patches = bench.Patches(probes)
        patches.set(False)
        assert Scheduler.__dict__["schedule"] is vllm_schedule and BlockPool.__dict__["touch"] is vllm_touch
        patches.set(True)
        assert Scheduler.__dict__["schedule"] is wrapped_schedule and BlockPool.__dict__["touch"] is hooked_touch
        # Every turn writes the classes, changed or not (a write changes a class's version whatever the value),
        # so vLLM's code re-specialises as often for each scheduler.
        writes = []
        bench.setattr = lambda owner, attr, value: (writes.append((owner, attr)), setattr(owner, attr, value))
        try:
            patches.set(True)
            patches.set(True)
            patches.set(False)
            patches.set(False)
        finally:
            del bench.setattr
        assert len(writes) == 4 * len(patches.patched) and (Scheduler, "schedule") in writes
        # --null-patches: `on` steps with vLLM's own methods, written back the same way (the method's own bias).
        null = bench.Patches(probes, null=True)
        null.set(True)
        assert Scheduler.__dict__["schedule"] is vllm_schedule and BlockPool.__dict__["touch"] is vllm_touch
        patches.set(True)
    finally:
        uninstall_probes(probes)
        rec.close()
    assert Scheduler.__dict__["schedule"] is vllm_schedule and BlockPool.__dict__["touch"] is vllm_touch


def test_only_the_probed_scheduler_is_recorded(capsys):
    bench = load_bench()
    # A small pool for 8 requests in flight, so that some are preempted; 1 measured round + a warm-up.
    bench.main(["--rounds", "1", "--requests", "24", "--concurrency", "8", "--prefix-tokens", "64",
                "--suffix-tokens", "16", "--max-tokens", "24", "--num-blocks", "24", "--block", "2",
                "--thrash-mb", "1"])
    out = capsys.readouterr().out
    assert "(caches cold: 1 MB written before each step)" in out, out
    checks = {line.split()[0]: line.split() for line in out.splitlines()
              if line.strip().split(" ")[0] in ("steps", "step_requests", "preemptions", "prefix_lookups")}
    assert set(checks) == {"steps", "step_requests", "preemptions", "prefix_lookups"}
    for words in checks.values():
        # "name  <recorded>  vLLM <counted>  ok": the `on` scheduler's rows, all rounds, equal vLLM's count for
        # it alone; the other two schedulers' events (as many again, twice) would have been recorded too if
        # any probe ran for them.
        assert words[-1] == "ok", out
        assert int(words[1]) == int(words[3]) > 0, out
    assert "drops: 0" in out
    assert "A/A, off2 against off" in out
    assert int(checks["preemptions"][1]) > 0, "the small pool preempts"
    # The intervals it stretched for its three schedulers are as they were.
    from kvtrace.record import buffers, recorder

    assert (buffers.FLUSH_NS, recorder.PROC_REFRESH_S) == (1_000_000_000, 2.0)


def test_disabled_probes_record_nothing(capsys):
    bench = load_bench()
    # --disabled: the probes installed and switched off (what the engine A/B's off blocks keep of them)
    bench.main(["--rounds", "1", "--requests", "24", "--concurrency", "8", "--prefix-tokens", "64",
                "--suffix-tokens", "16", "--max-tokens", "24", "--num-blocks", "24", "--block", "2", "--disabled"])
    out = capsys.readouterr().out
    checks = {line.split()[0]: line.split() for line in out.splitlines()
              if line.strip().split(" ")[0] in ("steps", "step_requests", "preemptions", "prefix_lookups")}
    assert set(checks) == {"steps", "step_requests", "preemptions", "prefix_lookups"}, out
    assert all(words[1] == "0" and words[-1] == "ok" for words in checks.values()), out
    assert "--disabled: the figure above" in out and "target <=" not in out
