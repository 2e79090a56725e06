"""Where a sampling profiler puts vLLM's time under kvtrace's wrappers: once a wrapped function returns,
its frame's locals are freed with the wrapper's frame on top, so the samples of that teardown show the
wrapper's line that called it. `exact_wrapper` records those lines, and the engine-thread profile
(bench/profile_engine_thread.py) counts such samples as vLLM's, not kvtrace's."""

from __future__ import annotations

import re
import sys

from kvtrace.probes.base import WRAPPER_CALL_LINES, before_call, exact_wrapper
from tests.helpers.run import bench_module


def schedule(self, budget, *, throttle=False):
    return [budget] * 3


def test_each_wrapper_records_the_lines_that_call_its_original():
    calls = []
    wrapper = exact_wrapper(schedule, before_call("calls.append(budget)"), {"probe": type("P", (), {"enabled": True})(),
                                                                          "calls": calls})
    assert wrapper(None, 2, throttle=True) == [2, 2, 2] and calls == [2]
    filename = wrapper.__code__.co_filename
    assert filename == "<kvtrace wrapper of schedule>"
    lines = WRAPPER_CALL_LINES[filename]
    assert len(lines) == 1
    # the line that calls the original is where the wrapper's frame stands while the original runs
    frame_lines = []

    def spy(self, budget, *, throttle=False):
        frame_lines.append(sys._getframe(1).f_lineno)
        return schedule(self, budget, throttle=throttle)

    spied = exact_wrapper(spy, before_call("calls.append(budget)"), {"probe": type("P", (), {"enabled": True})(),
                                                                     "calls": calls})
    spied(None, 1)
    assert frame_lines == WRAPPER_CALL_LINES[spied.__code__.co_filename]


def test_the_profile_counts_samples_on_those_lines_as_vllms(tmp_path):
    profile = bench_module("profile_engine_thread")
    w = "<kvtrace wrapper of Scheduler.schedule>"
    raw = tmp_path / "gil.raw"
    raw.write_text("\n".join([  # py-spy's raw format with --threads: thread;frames (outermost first) count
        f"thread (630): MainThread;step (/v/vllm/engine.py:10);wrapper ({w}:18) 30",
        f"thread (630): MainThread;step (/v/vllm/engine.py:10);wrapper ({w}:7) 10",
        "thread (630): MainThread;step (/v/vllm/engine.py:10);on_schedule (/s/kvtrace/probes/vllm/scheduler.py:505) 5",
        "thread (630): MainThread;schedule (/v/vllm/scheduler.py:400) 50",
        "thread (631): kvtrace-writer;flush (/s/kvtrace/record/recorder.py:300) 5",
    ]) + "\n")
    text = profile.gil_summary(raw, 5.0, {w: [18]})  # 1,000 ticks at 200 Hz
    shares = dict(re.findall(r"(.+?) (\d+\.\d+%)(?:, |$)", text.removeprefix("GIL held by: ")))
    assert shares["engine thread, in kvtrace code"] == "1.50%"  # 10 + 5 samples
    assert shares["engine thread, vLLM's call returning through a kvtrace wrapper"] == "3.00%"
    assert shares["engine thread, other"] == "5.00%" and shares["kvtrace-writer"] == "0.50%"
    # without the call lines, every wrapper sample is kvtrace's (as the profile counted before)
    assert "engine thread, in kvtrace code 4.50%" in profile.gil_summary(raw, 5.0)
